"""The reference engines: a per-example loop, and torch.func vmap.

``loop_stats`` runs one forward and backward per example: slow and obviously correct, the
reference every fast path is tested against. ``vmap_stats`` vectorises the same computation
with torch.func (functional_call + vmap + grad) and reduces each per-example gradient to its
squared norm straight away, in sub-chunks small enough to bound memory; it also serves the
hooks engine as the fallback for parameters that no layer rule covers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from batchbound.diversity.losses import PerExampleLoss, check_finite
from batchbound.diversity.stats import PerExampleStats, trainable_parameters

# Per-example gradients held at once by vmap: examples × parameters ≤ this many numbers.
VMAP_BUDGET = 2**25


def loop_stats(
    model: nn.Module, x: Tensor, y: Tensor, loss_fn: PerExampleLoss, *, offset: int = 0
) -> PerExampleStats:
    params = trainable_parameters(model)
    names, tensors = list(params), list(params.values())
    n = x.shape[0]
    sq_norms = {name: p.new_zeros(n) for name, p in params.items()}
    grad_sum = {name: torch.zeros_like(p) for name, p in params.items()}
    losses = []
    for i in range(n):
        value = loss_fn(model(x[i : i + 1]), y[i : i + 1])
        check_finite(value, offset + i)
        grads = torch.autograd.grad(value.sum(), tensors, allow_unused=True)
        for name, g in zip(names, grads, strict=True):
            if g is not None:
                g = g.to_dense() if g.is_sparse else g
                sq_norms[name][i] = g.square().sum()
                grad_sum[name] += g
        losses.append(value.detach())
    return PerExampleStats(torch.cat(losses), sq_norms, grad_sum)


def _per_example_fn(
    model: nn.Module, loss_fn: PerExampleLoss, names: Sequence[str]
) -> Callable[[dict[str, Tensor], Tensor, Tensor], tuple[dict[str, Tensor], Tensor]]:
    """(params of ``names``, x_i, y_i) -> (∇f_i w.r.t. those params, f_i)."""
    fixed = {k: v.detach() for k, v in model.named_parameters()}
    fixed.update({k: v.detach() for k, v in model.named_buffers()})

    def loss_of_one(chosen: dict[str, Tensor], xi: Tensor, yi: Tensor) -> tuple[Tensor, Tensor]:
        out = functional_call(model, {**fixed, **chosen}, (xi.unsqueeze(0),))
        value = loss_fn(out, yi.unsqueeze(0)).sum()
        return value, value.detach()

    return vmap(grad(loss_of_one, has_aux=True), in_dims=(None, 0, 0), randomness="different")


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


def _sub_chunks(n: int, numel: int) -> Iterator[slice]:
    step = max(1, VMAP_BUDGET // max(1, numel))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def vmap_sq_norms(
    model: nn.Module, x: Tensor, y: Tensor, loss_fn: PerExampleLoss, names: Sequence[str]
) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor]:
    """Per-example squared norms and gradient sums of the parameters ``names``, and losses."""
    params = dict(model.named_parameters())
    chosen = {name: params[name].detach() for name in names}
    per_example = _per_example_fn(model, loss_fn, names)
    n = x.shape[0]
    sq_norms = {name: p.new_zeros(n) for name, p in chosen.items()}
    grad_sum = {name: torch.zeros_like(p) for name, p in chosen.items()}
    losses = x.new_zeros(n, dtype=next(iter(chosen.values())).dtype)
    for part in _sub_chunks(n, sum(p.numel() for p in chosen.values())):
        with _dense_embeddings(model):
            grads, values = per_example(chosen, x[part], y[part])
        losses[part] = values
        for name, g in grads.items():
            sq_norms[name][part] = g.reshape(g.shape[0], -1).square().sum(dim=1)
            grad_sum[name] += g.sum(dim=0)
    return sq_norms, grad_sum, losses


def vmap_stats(
    model: nn.Module, x: Tensor, y: Tensor, loss_fn: PerExampleLoss, *, offset: int = 0
) -> PerExampleStats:
    names = list(trainable_parameters(model))
    sq_norms, grad_sum, losses = vmap_sq_norms(model, x, y, loss_fn, names)
    check_finite(losses, offset)
    return PerExampleStats(losses, sq_norms, grad_sum)


def vmap_gradients(
    model: nn.Module, x: Tensor, y: Tensor, loss_fn: PerExampleLoss, names: Sequence[str]
) -> dict[str, Tensor]:
    params = dict(model.named_parameters())
    chosen = {name: params[name].detach() for name in names}
    with _dense_embeddings(model):
        grads, losses = _per_example_fn(model, loss_fn, names)(chosen, x, y)
    check_finite(losses)
    return grads
