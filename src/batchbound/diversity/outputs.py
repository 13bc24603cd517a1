"""``watch``'s exact fallback: per-example gradients of the parameters no layer rule can take,
from the gradients the user's own backward pass left on the model's outputs.

``watch`` never sees the user's loss function, only its backward pass. For a loss that is a
sum (or mean) of per-example terms, L = Σ_i f_i(out_i), the gradient G = ∂L/∂out that reaches
the model's outputs has row i = ∂f_i/∂out_i, so f̃_i(w) = ⟨out_i(w), G_i⟩ (G held fixed) has
the same gradient as f_i: ∇f̃_i = J_iᵀ G_i = ∇f_i. The engines' exact fallback (torch.func
vmap, or the per-example loop where vmap cannot run the model) then computes ‖∇f_i‖² for
the parameters left over, on the same examples, under the same autocast, in the same step.

G is read on views of the outputs that the model hands back (``OutputGrads``), so it is the
loss's own partial derivative. Each output that receives one must hold the examples along
dim 0; one that does not (a loss over the batch computed inside the model) makes the
fallback impossible, and the parameters are refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import fields, is_dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from batchbound.diversity.calls import Inputs, flatten
from batchbound.diversity.engines import VmapUnsupported, fallback_sq_norms
from batchbound.diversity.rule_check import buffers_kept
from batchbound.errors import BatchboundError

DEVICE_TYPES = ("cpu", "cuda")


def autocast_state() -> list[tuple[str, torch.dtype]]:
    """The autocast contexts active now, to run the fallback's forward under them again."""
    return [(d, torch.get_autocast_dtype(d)) for d in DEVICE_TYPES
            if torch.is_autocast_enabled(d)]


@contextmanager
def autocast_as(state: list[tuple[str, torch.dtype]]) -> Iterator[None]:
    with ExitStack() as stack:
        for device, dtype in state:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


class OutputGrads:
    """The model's output, each tensor in it handed back as a view of itself with a hook:
    the gradient that reaches a view is the loss's own partial derivative ∂L/∂out_k, none
    of it from the model's internal uses of that tensor (a Hugging Face model's logits feed
    its returned cache and loss too), so Σ_k ⟨out_k, G_k⟩ has exactly the loss's gradient."""

    def __init__(self, output: Any, n: int) -> None:
        self.n = n
        self.grads: dict[int, Tensor] = {}  # flatten position -> ∂L/∂out_k
        self._shapes: dict[int, tuple[int, ...]] = {}
        self._handles: list[RemovableHandle] = []
        self._count = 0
        self.output = self._wrap(output)

    def _wrap(self, value: Any) -> Any:
        if isinstance(value, Tensor):
            k = self._count
            self._count += 1
            if not (value.requires_grad and value.is_floating_point()):
                return value
            view = value.view_as(value)
            self._shapes[k] = tuple(value.shape)
            self._handles.append(view.register_hook(self._store(k)))
            return view
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return type(value)(*(self._wrap(v) for v in value))
        if isinstance(value, (tuple, list)):
            return type(value)(self._wrap(v) for v in value)
        if isinstance(value, dict):  # in place: a ModelOutput keeps its attributes in step
            for key in list(value):
                value[key] = self._wrap(value[key])
            return value
        if is_dataclass(value) and not isinstance(value, type):
            wrapped = {f.name: self._wrap(getattr(value, f.name)) for f in fields(value)}
            return replace(value, **{f.name: wrapped[f.name] for f in fields(value) if f.init})
        return value

    def _store(self, k: int):  # type: ignore[no-untyped-def]
        def hook(grad: Tensor) -> None:
            self.grads[k] = grad.detach()

        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def targets(self) -> Inputs:
        """The outputs' gradients, as the fallback's per-example targets (an ``Inputs``)."""
        if not self.grads:
            raise BatchboundError("no tensor among the model's outputs (in tuples, lists, dicts "
                                  "and dataclasses) received a gradient from the loss")
        for k in self.grads:
            shape = self._shapes[k]
            if not shape or shape[0] != self.n:
                raise BatchboundError(
                    f"output {k} of the model, shape {shape}, receives a gradient but does not "
                    f"hold the {self.n} examples along dim 0 (a loss over the whole batch "
                    "computed inside the model?), so the examples' own gradients cannot be read "
                    "off it; compute the loss outside the model")
        return Inputs((dict(self.grads),), {}, self.n)


def stand_in_loss():  # type: ignore[no-untyped-def]
    """f̃_i = Σ_k ⟨out_k[i], G_k[i]⟩ over the outputs that received a gradient G_k (see the
    module docstring); k counts the tensors of the output in ``flatten``'s order."""

    def loss(outputs: Any, targets: Inputs) -> Tensor:
        leaves = [t for t in flatten(outputs) if isinstance(t, Tensor)]
        grads = targets.args[0]
        total = None
        for k, g in grads.items():
            term = (leaves[k].to(g.dtype) * g).reshape(g.shape[0], -1).sum(dim=1)
            total = term if total is None else total + term
        assert total is not None  # targets() holds at least one gradient
        return total

    return loss


def fallback_from_outputs(
    model: nn.Module,
    inputs: Tensor | Inputs,
    captured: OutputGrads,
    names: list[str],
    state: list[tuple[str, torch.dtype]],
) -> tuple[dict[str, Tensor], dict[str, Tensor], str, float]:
    """Per-example squared norms and gradient sums of ``names`` (the user's loss's scale),
    the method used and its seconds."""
    targets = captured.targets()
    loss = stand_in_loss()
    start = time.perf_counter()
    with torch.enable_grad(), autocast_as(state), buffers_kept(model):
        try:
            sq, sums, _ = fallback_sq_norms(model, inputs, targets, loss, names, "vmap")
            method = "torch.func vmap"
        except VmapUnsupported as exc:
            sq, sums, _ = fallback_sq_norms(model, inputs, targets, loss, names, "loop")
            method = f"the per-example loop, one forward and backward per example ({exc})"
    return sq, sums, method, time.perf_counter() - start
