"""``watch``'s exact fallback: per-example gradients of the parameters no layer rule can take,
from the gradients the user's own backward pass left on the model's outputs.

``watch`` never sees the user's loss function, only its backward pass. For a loss that is a
sum (or mean) of per-example terms, L = Σ_i f_i(out_i), the gradient G = ∂L/∂out that reaches
the model's outputs has row i = ∂f_i/∂out_i, so f̃_i(w) = ⟨out_i(w), G_i⟩ (G held fixed) has
the same gradient as f_i: ∇f̃_i = J_iᵀ G_i = ∇f_i. The engines' exact fallback (torch.func
vmap, or the per-example loop where vmap cannot run the model) then computes ‖∇f_i‖² for
the parameters left over, on the same examples, under the same autocast, in the same step.

Which outputs: those not computed from another output (a Hugging Face model's ``loss``,
computed from its ``logits``, is left out: the logits' gradient already holds its part). Each
kept output that received a gradient must hold the examples along dim 0; one that does not
(a scalar over the batch) makes the fallback impossible, and the parameters are refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from batchbound.diversity.calls import Inputs, flatten
from batchbound.diversity.engines import VmapUnsupported, fallback_sq_norms
from batchbound.diversity.graph import walk
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
    """Tensor hooks on the model's outputs, set before the backward pass: their gradients."""

    def __init__(self, output: Any, n: int) -> None:
        leaves = [t for t in flatten(output) if isinstance(t, Tensor)]
        self.n = n
        self.kept: list[int] = []  # flatten positions of the outputs the fallback uses
        self.grads: dict[int, Tensor] = {}
        self.problem: str | None = None
        self._handles: list[RemovableHandle] = []
        live = {k: t for k, t in enumerate(leaves) if t.requires_grad and t.is_floating_point()}
        nodes = {t.grad_fn for t in live.values() if t.grad_fn is not None}
        for k, t in live.items():
            if t.grad_fn is not None and _computed_from(t.grad_fn, nodes - {t.grad_fn}):
                continue  # its gradient reaches the outputs it is computed from
            self.kept.append(k)
            self._handles.append(t.register_hook(self._store(k)))
        self._shapes = {k: tuple(live[k].shape) for k in self.kept}

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
        for k in self.grads:
            shape = self._shapes[k]
            if not shape or shape[0] != self.n:
                raise BatchboundError(
                    f"output {k} of the model, shape {shape}, receives a gradient but does not "
                    f"hold the {self.n} examples along dim 0 (a loss over the whole batch "
                    "computed inside the model?), so the examples' own gradients cannot be read "
                    "off it")
        return Inputs((dict(self.grads),), {}, self.n)


def _computed_from(start: Any, others: set[Any]) -> bool:
    """Whether the node ``start`` lies downstream of one of ``others`` (strictly)."""
    if not others:
        return False
    nodes, _ = walk([child for child, _ in start.next_functions if child is not None])
    return not others.isdisjoint(nodes)


def stand_in_loss(kept: list[int]):  # type: ignore[no-untyped-def]
    """f̃_i = Σ_k ⟨out_k[i], G_k[i]⟩ over the kept outputs (see the module docstring)."""

    def loss(outputs: Any, targets: Inputs) -> Tensor:
        leaves = [t for t in flatten(outputs) if isinstance(t, Tensor)]
        grads = targets.args[0]
        total = None
        for k, g in grads.items():
            term = (leaves[k].to(g.dtype) * g).reshape(g.shape[0], -1).sum(dim=1)
            total = term if total is None else total + term
        if total is None:  # no output received a gradient
            return leaves[kept[0]].reshape(targets.n, -1).sum(dim=1) * 0
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
    loss = stand_in_loss(captured.kept)
    start = time.perf_counter()
    with torch.enable_grad(), autocast_as(state), buffers_kept(model):
        try:
            sq, sums, _ = fallback_sq_norms(model, inputs, targets, loss, names, "vmap")
            method = "torch.func vmap"
        except VmapUnsupported as exc:
            sq, sums, _ = fallback_sq_norms(model, inputs, targets, loss, names, "loop")
            method = f"the per-example loop, one forward and backward per example ({exc})"
    return sq, sums, method, time.perf_counter() - start
