"""The reference engines: a per-example loop, and torch.func vmap.

``loop_stats`` runs one forward and backward per example: slow and obviously correct, the
reference every fast path is tested against. ``vmap_stats`` vectorises the same computation
with torch.func (functional_call + vmap + grad) and reduces each per-example gradient to its
squared norm straight away, in sub-chunks small enough to bound memory.

Both also serve the hooks engine as its exact fallback for the parameters no layer rule
covers (``fallback_sq_norms``): vmap first, and the loop where torch.func cannot run the model
(recurrent layers, nested tensors, checkpointing raise inside vmap).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from batchbound.diversity.calls import (
    Inputs,
    call_model,
    one_example,
    split_failure,
    vmap_parts,
)
from batchbound.diversity.graph import parameter_users, walk
from batchbound.diversity.losses import PerExampleLoss, check_finite, check_losses
from batchbound.diversity.precision import Casts, GradientPrecision
from batchbound.diversity.stats import (
    PerExampleStats,
    gradients,
    norm_dtype,
    trainable_parameters,
)
from batchbound.errors import BatchboundError

# Per-example gradients held at once by vmap: examples × parameters ≤ this many numbers.
VMAP_BUDGET = 2**25

SqNorms = dict[str, Tensor]
GradSums = dict[str, Tensor]


class VmapUnsupported(BatchboundError):
    """torch.func cannot run this model (the message names torch's reason)."""


def run_alone(model: nn.Module, x: Tensor, i: int, offset: int = 0) -> Any:
    """The model on example ``i`` of ``x`` alone. A model that cannot run on one example (a
    statistic of the batch in train mode: batch normalisation written with ``F.batch_norm``,
    which ``check_model_mode`` cannot see) is refused in one line, naming the example; for a
    call of several arguments, naming the tensors split (``split_failure``)."""
    try:
        return call_model(model, x[i : i + 1])
    except BatchboundError:
        raise
    except Exception as exc:  # any: the user's model, on one of the user's examples
        if isinstance(x, Inputs):  # split from a call of several arguments: said so
            raise BatchboundError(split_failure(x, exc)) from exc
        said = " ".join(str(exc).split())
        raise BatchboundError(
            f"the model raised on example {offset + i} run alone ({type(exc).__name__}: "
            f"{said}); per-example gradients run each example alone, which a statistic of "
            "the batch in train mode cannot (batch normalisation written with F.batch_norm?): "
            "measure in eval mode") from exc


def loop_sq_norms(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss_fn: PerExampleLoss,
    names: Sequence[str],
    *,
    offset: int = 0,
    sums: bool = True,
    seen: GradientPrecision | None = None,
) -> tuple[SqNorms, GradSums, Tensor]:
    """One backward per example: squared norms and (with ``sums``) gradient sums of the
    parameters ``names``, and the losses. ``seen``: notes the casts below the parameters'
    precision on the gradient's path (``precision.Casts``), for the precision stated."""
    params = dict(model.named_parameters())
    tensors = [params[name] for name in names]
    n = x.shape[0]
    sq_norms = {name: p.new_zeros(n, dtype=norm_dtype(p.dtype))
                for name, p in zip(names, tensors, strict=True)}
    grad_sum = {name: torch.zeros_like(p, dtype=norm_dtype(p.dtype))
                for name, p in zip(names, tensors, strict=True)} if sums else {}
    losses = []
    for i in range(n):
        with Casts(seen) if seen is not None else nullcontext():
            value = loss_fn(run_alone(model, x, i, offset), y[i : i + 1])
        check_losses(value, 1, offset + i)
        grads = gradients(value.sum(), tensors)
        for name, g in zip(names, grads, strict=True):
            if g is not None:
                g = g.to_dense() if g.is_sparse else g
                sq_norms[name][i] = torch.linalg.vector_norm(g, dtype=torch.float64).square()
                if sums:
                    grad_sum[name] += g
        losses.append(value.detach())
    return sq_norms, grad_sum, torch.cat(losses)


def loop_stats(
    model: nn.Module, x: Tensor, y: Tensor, loss_fn: PerExampleLoss, *, offset: int = 0,
    seen: GradientPrecision | None = None,
) -> PerExampleStats:
    names = list(trainable_parameters(model))
    sq_norms, grad_sum, losses = loop_sq_norms(model, x, y, loss_fn, names, offset=offset,
                                               seen=seen)
    return PerExampleStats(losses, sq_norms, grad_sum)


def loop_gradients(
    model: nn.Module, x: Tensor, y: Tensor, loss_fn: PerExampleLoss, names: Sequence[str]
) -> dict[str, Tensor]:
    """Materialised per-example gradients, one backward per example."""
    params = dict(model.named_parameters())
    tensors = [params[name] for name in names]
    out = {name: p.new_zeros(x.shape[0], *p.shape) for name, p in zip(names, tensors, strict=True)}
    for i in range(x.shape[0]):
        value = loss_fn(run_alone(model, x, i), y[i : i + 1])
        check_losses(value, 1, i)
        grads = gradients(value.sum(), tensors)
        for name, g in zip(names, grads, strict=True):
            if g is not None:
                out[name][i] = g.to_dense() if g.is_sparse else g
    return out


def _per_example_fn(
    model: nn.Module, loss_fn: PerExampleLoss, names: Sequence[str], *, outer: bool = False,
    seen: GradientPrecision | None = None,
) -> Callable[[dict[str, Tensor], Tensor, Tensor], tuple[dict[str, Tensor], Tensor]]:
    """(params of ``names``, x_i, y_i) -> (∇f_i w.r.t. those params, f_i). With ``outer``,
    f_i keeps the autograd graph of whatever it used from outside the functional call (a
    parameter the loss reads itself, which torch.func cannot see): ``outside_uses``.
    ``seen``: as ``loop_sq_norms``'s, armed before torch.func's backward runs."""
    fixed = {k: v.detach() for k, v in model.named_parameters()}
    fixed.update({k: v.detach() for k, v in model.named_buffers()})

    def loss_of_one(chosen: dict[str, Tensor], xi: Any, yi: Any, dims: tuple[Any, Any]
                    ) -> tuple[Tensor, Tensor]:
        one = one_example(xi, dims[0])
        args, kwargs = (one.args, one.kwargs) if isinstance(one, Inputs) else ((one,), {})
        with Casts(seen) if seen is not None else nullcontext():
            out = functional_call(model, {**fixed, **chosen}, args, kwargs)
            values = loss_fn(out, one_example(yi, dims[1]))
        if tuple(values.shape) != (1,):
            raise BatchboundError(f"the loss must return one value per example, got shape "
                                  f"{tuple(values.shape)} for one example; use reduction='none'")
        value = values.sum()
        return value, value if outer else value.detach()

    per_example = grad(loss_of_one, has_aux=True)

    def run(chosen: dict[str, Tensor], x: Tensor | Inputs, y: Any
            ) -> tuple[dict[str, Tensor], Tensor]:
        (xs, x_dims), (ys, y_dims) = vmap_parts(x), vmap_parts(y)
        mapped = vmap(lambda c, a, b: per_example(c, a, b, (x_dims, y_dims)),
                      in_dims=(None, x_dims, y_dims), randomness="different")
        return mapped(chosen, xs, ys)

    return run


@contextmanager
def _dense_embeddings(model: nn.Module) -> Iterator[None]:
    """torch.func cannot differentiate into sparse gradients; the dense ones are equal."""
    sparse = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    sparse = [m for m in sparse if m.sparse]
    for module in sparse:
        module.sparse = False
    try:
        yield
    finally:
        for module in sparse:
            module.sparse = True


@contextmanager
def _torch_func_errors() -> Iterator[None]:
    """torch.func's own failures (no batching rule, autograd.Function without vmap support,
    saved-tensor hooks) become VmapUnsupported; errors of the model or data pass through."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="There is a performance drop")
            yield
    except BatchboundError:
        raise
    except (RuntimeError, NotImplementedError, TypeError, ValueError, AssertionError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise VmapUnsupported(f"torch.func.vmap cannot run this model: {first[:200]}") from exc


def _sub_chunks(n: int, numel: int) -> Iterator[slice]:
    step = max(1, VMAP_BUDGET // max(1, numel))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def vmap_sq_norms(
    model: nn.Module, x: Tensor, y: Tensor, loss_fn: PerExampleLoss, names: Sequence[str],
    *, uses: set[str] | None = None, seen: GradientPrecision | None = None,
) -> tuple[SqNorms, GradSums, Tensor]:
    """Per-example squared norms and gradient sums of the parameters ``names``, and losses.
    Raises VmapUnsupported where torch.func cannot run the model. ``uses``, when given (run
    with grad enabled), receives the parameters the losses used outside the functional call
    (``outside_uses``): their numbers here are then incomplete. ``seen``: as
    ``loop_sq_norms``'s."""
    params = dict(model.named_parameters())
    chosen = {name: params[name].detach() for name in names}
    per_example = _per_example_fn(model, loss_fn, names, outer=uses is not None, seen=seen)
    n = x.shape[0]
    sq_norms = {name: p.new_zeros(n, dtype=norm_dtype(p.dtype)) for name, p in chosen.items()}
    grad_sum = {name: torch.zeros_like(p, dtype=norm_dtype(p.dtype)) for name, p in chosen.items()}
    losses = torch.zeros(n, dtype=next(iter(chosen.values())).dtype, device=x.device)
    for part in _sub_chunks(n, sum(p.numel() for p in chosen.values())):
        with _dense_embeddings(model), _torch_func_errors():
            grads, values = per_example(chosen, x[part], y[part])
        if uses is not None:
            uses.update(outside_uses(values, params))
        losses[part] = values.detach()
        for name, g in grads.items():
            sq_norms[name][part] = torch.linalg.vector_norm(
                g.reshape(g.shape[0], -1), dim=1, dtype=sq_norms[name].dtype).square()
            grad_sum[name] += g.sum(dim=0, dtype=grad_sum[name].dtype)
    return sq_norms, grad_sum, losses


def vmap_stats(
    model: nn.Module, x: Tensor, y: Tensor, loss_fn: PerExampleLoss, *, offset: int = 0,
    uses: set[str] | None = None, seen: GradientPrecision | None = None,
) -> PerExampleStats:
    names = list(trainable_parameters(model))
    sq_norms, grad_sum, losses = vmap_sq_norms(model, x, y, loss_fn, names, uses=uses,
                                               seen=seen)
    if uses:  # incomplete numbers: the caller refuses them, whatever the losses
        return PerExampleStats(losses, sq_norms, grad_sum)
    check_finite(losses, offset)
    return PerExampleStats(losses, sq_norms, grad_sum)


def vmap_gradients(
    model: nn.Module, x: Tensor, y: Tensor, loss_fn: PerExampleLoss, names: Sequence[str]
) -> tuple[dict[str, Tensor], set[str]]:
    """Per-example gradients of ``names`` by torch.func, and the parameters the losses used
    from outside the functional call (the loss function's own uses, which torch.func cannot
    see: those gradients are then incomplete), read off the losses' outer autograd graph,
    on this very call. Run it with grad enabled."""
    params = dict(model.named_parameters())
    chosen = {name: params[name].detach() for name in names}
    with _dense_embeddings(model), _torch_func_errors():
        grads, losses = _per_example_fn(model, loss_fn, names, outer=True)(chosen, x, y)
    check_finite(losses)
    return grads, outside_uses(losses, params)


def outside_uses(losses: Tensor, params: dict[str, nn.Parameter]) -> set[str]:
    """The parameters (trainable or not) that ``losses`` reach through their autograd graph."""
    if losses.grad_fn is None:
        return set()
    nodes, _ = walk([losses.grad_fn])
    return set(parameter_users(nodes, {id(p): k for k, p in params.items()}))


def fallback_sq_norms(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss_fn: PerExampleLoss,
    names: Sequence[str],
    method: str,
    *,
    offset: int = 0,
) -> tuple[SqNorms, GradSums, Tensor]:
    """The exact fallback for ``names`` (``method``: "vmap" or "loop"): squared norms,
    gradient sums, and each example's own loss."""
    if method == "vmap":
        return vmap_sq_norms(model, x, y, loss_fn, names)
    return loop_sq_norms(model, x, y, loss_fn, names, offset=offset)
