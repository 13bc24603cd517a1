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
import warnings
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import fields, is_dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from batchbound.diversity.calls import Inputs, call_model, flatten
from batchbound.diversity.engines import VmapUnsupported, fallback_sq_norms
from batchbound.diversity.rule_check import buffers_kept
from batchbound.diversity.stats import norm_dtype
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
    its returned cache and loss too), so Σ_k ⟨out_k, G_k⟩ has exactly the loss's gradient.
    ``fixed``: the outputs whose shape does not follow the number of examples
    (``rule_check.output_kinds``), whose rows are no examples even where they number n."""

    def __init__(self, output: Any, n: int, fixed: frozenset[int] = frozenset()) -> None:
        self.n, self.fixed = n, fixed
        self.grads: dict[int, Tensor] = {}  # flatten position -> ∂L/∂out_k
        self._shapes: dict[int, tuple[int, ...]] = {}
        self.values: dict[int, Tensor] = {}
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
            self.values[k] = value.detach()  # what a replayed forward must give again
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
            if not shape or shape[0] != self.n or k in self.fixed:
                raise BatchboundError(
                    f"output {k} of the model, shape {shape}, receives a gradient but does not "
                    f"hold the {self.n} examples along dim 0, so the examples' own gradients "
                    "cannot be read off it: a loss over the whole batch computed inside the "
                    "model (compute it outside), or an output of the parameters alone, a learned "
                    "temperature (apply it inside the model)")
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


class RandomState:
    """torch's random state (CPU, and the CUDA devices given) and the model's buffers as they
    were when the user's forward began: a forward replayed from them draws the same dropout
    masks and reads the same buffers (spectral norm's power iteration updates its vectors in
    every train-mode forward)."""

    def __init__(self, devices: list[int], buffers: Iterable[Tensor] = ()) -> None:
        self.devices = devices
        self.cpu = torch.get_rng_state()
        self.cuda = [torch.cuda.get_rng_state(d) for d in devices]
        self.buffers = [(b, b.detach().clone()) for b in buffers]  # the model's

    @contextmanager
    def replaying(self) -> Iterator[None]:
        """Inside: the state as it was; after: the caller's random state, untouched (the
        caller keeps the buffers: ``buffers_kept``)."""
        with torch.random.fork_rng(devices=self.devices):
            torch.set_rng_state(self.cpu)
            for device, state in zip(self.devices, self.cuda, strict=True):
                torch.cuda.set_rng_state(state, device)
            with torch.no_grad():
                for buffer, value in self.buffers:
                    buffer.copy_(value)
            yield


REPLAY_ROWS = 8  # examples per batched backward of the replay (memory: rows × the graph's)


def replayed_from_outputs(
    model: nn.Module,
    inputs: Tensor | Inputs,
    captured: OutputGrads,
    names: list[str],
    state: list[tuple[str, torch.dtype]],
    random: RandomState,
    rtol: float,
) -> tuple[dict[str, Tensor], dict[str, Tensor], str, float]:
    """The fallback for a model that draws random numbers (dropout in train mode): a second
    forward of one example at a time, or under vmap, draws masks of its own, so its norms
    would be of another step's gradients. Instead the whole batch's forward is replayed from
    the random state the user's call began with (the same masks), its outputs must equal the
    user's (else refused), and f̃_i = ⟨out_i, G_i⟩ is differentiated per example on that one
    graph (examples do not interact: the self-check saw to it), a few rows per batched
    backward."""
    targets = captured.targets()
    params = dict(model.named_parameters())
    tensors = [params[k] for k in names]
    start = time.perf_counter()
    with buffers_kept(model), random.replaying(), torch.enable_grad(), autocast_as(state):
        output = call_model(model, inputs)
        leaves = [t for t in flatten(output) if isinstance(t, Tensor)]
        for k, value in captured.values.items():
            if k in captured.grads and not (
                    k < len(leaves) and leaves[k].shape == value.shape
                    and torch.allclose(leaves[k].detach(), value, rtol=rtol, atol=0.0)):
                raise BatchboundError(
                    "the model draws random numbers (dropout) and its forward, replayed from "
                    "the random state its call began with, gave other outputs (random numbers "
                    "from outside torch's generator?), so the per-example gradients of this "
                    "step cannot be read")
        losses = stand_in_loss()(output, targets)
        sq, sums = replayed_rows(losses, names, tensors)
    method = "the batch's forward replayed with its own random numbers (dropout masks)"
    return sq, sums, method, time.perf_counter() - start


def replayed_rows(losses: Tensor, names: list[str], tensors: list[nn.Parameter]
                  ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Each example's squared gradient norm per parameter (float64) and the gradients' sum,
    from one replayed graph of per-example ``losses``, REPLAY_ROWS rows per batched backward."""
    n = losses.shape[0]
    sq = {k: torch.zeros(n, dtype=torch.float64, device=p.device)
          for k, p in zip(names, tensors, strict=True)}
    sums = {k: torch.zeros_like(p, dtype=norm_dtype(p.dtype))
            for k, p in zip(names, tensors, strict=True)}
    for first in range(0, n, REPLAY_ROWS):
        rows = torch.arange(first, min(n, first + REPLAY_ROWS), device=losses.device)
        for i, grads in rows_gradients(losses, tensors, rows):
            for k, g in zip(names, grads, strict=True):
                if g is not None:
                    g = g.to_dense() if g.is_sparse else g
                    sq[k][i] = torch.linalg.vector_norm(g, dtype=torch.float64).square()
                    sums[k] += g
    return sq, sums


def rows_gradients(losses: Tensor, tensors: list[nn.Parameter], rows: Tensor
                    ) -> Iterator[tuple[int, list[Tensor | None]]]:
    """(row, its gradients) for ``rows`` of ``losses``: one batched backward, or one backward
    per row where the graph holds an operation vmap cannot batch."""
    picks = torch.zeros(len(rows), losses.shape[0], dtype=losses.dtype, device=losses.device)
    picks[torch.arange(len(rows)), rows] = 1.0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on a slow batching fallback
            batched = torch.autograd.grad(losses, tensors, grad_outputs=picks,
                                          is_grads_batched=True, retain_graph=True,
                                          allow_unused=True)
    except RuntimeError:
        for j, i in enumerate(rows.tolist()):
            yield i, list(torch.autograd.grad(losses, tensors, grad_outputs=picks[j],
                                              retain_graph=True, allow_unused=True))
        return
    for j, i in enumerate(rows.tolist()):
        yield i, [None if g is None else g[j] for g in batched]
