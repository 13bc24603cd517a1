"""Final probes: measurements at the final weights w*, taken once training has ended.

``TrainConfig.final_probes`` names them; ``Trainer`` runs them when a run ends ``complete``
(not after divergence, a stop signal or a failure) and merges what they return into
``RunResult.final``. Their time is reported as ``timings["probe_seconds"]`` (and per probe
``timings["probes"][name]``), never as training time.

A probe is one function ``(FinalState) -> dict[str, float]`` plus one entry in ``PROBES``.
Under torch.distributed every rank calls it with the same w*; a probe shards its work over
the ranks and all-reduces, so every rank returns the same numbers. All probes look at the
model in eval mode (as ``evaluate`` and ``measure`` do), so L, its gradients and the
per-example gradients are one deterministic function of w.

- ``osg`` ([slides]'s E[OSG]): with f_i the per-example losses over the whole training set,
  ``osg_mean`` = (1/n) Σ_i ‖∇f_i(w*)‖² and ``osg_sd`` = the standard deviation of
  ‖∇f_i(w*)‖² over the n examples (population, ddof = 0). One pass of the exact per-example
  machinery (``batchbound.diversity.PreparedStats``, the engine ``measure`` uses), in the
  run's dtype; the n squared norms are kept, so the deviation is a second, exact pass over
  them rather than a difference of sums.
- ``linear_error`` ([inefficiency], Fig. 2 right): how far one step of the run's own update rule
  leaves the linear model of the loss. L = mean loss over the training set; for each of
  ``LINEAR_ERROR_BATCHES`` mini-batches of the run's final global batch size B (drawn by
  ``probe_batches`` from a generator seeded by ``config.seed``), g_m = ∇ of the batch's mean
  loss at w*, s = η·(c·g_m + λ·w*) the step the trainer would take (c = 1 for
  ``convention="mean"``, B for ``"sum"``; λ the weight decay; no momentum state, no
  mechanism noise), η = the strategy's rate at the final (B, epoch), and
  error = |L(w* − s) − (L(w*) − ⟨g_m, s⟩)|. Returns ``linear_error`` (mean over the batches),
  ``linear_error_sd`` (their sample standard deviation, ddof = 1), ``final_lr`` (η) and
  ``final_train_loss`` (L(w*) over the whole training set). Computed in float64 on a copy of
  the model, so the difference of two losses is not float32 rounding.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from batchbound.diversity import PreparedStats
from batchbound.diversity.losses import PerExampleLoss
from batchbound.diversity.stats import eval_mode
from batchbound.errors import NonFiniteLossError
from batchbound.train.distributed import DistContext, all_reduce_sum, shard

if TYPE_CHECKING:
    from batchbound.train.config import TrainConfig

LINEAR_ERROR_BATCHES = 8
_PROBE_SEED = 104_729  # keeps the probe's batches apart from the sampler's and mechanisms'


@dataclass(frozen=True)
class FinalState:
    """What a probe sees: the trained model at w* and the run around it."""

    model: nn.Module
    x: Tensor  # the whole training set, on the model's device, in the run's dtype
    y: Tensor
    loss_fn: PerExampleLoss
    ctx: DistContext
    config: TrainConfig
    batch_size: int  # the global batch size the run ended with
    lr: float  # η the trainer's next step would use: the strategy at the final (B, epoch)
    chunk_size: int = 256


Probe = Callable[[FinalState], dict[str, float]]


def _chunks(x: Tensor, y: Tensor, size: int) -> Iterator[tuple[int, Tensor, Tensor]]:
    for start in range(0, x.shape[0], size):
        yield start, x[start : start + size], y[start : start + size]


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t.to(dtype) if t.dtype.is_floating_point else t


def _parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# ---------------------------------------------------------------- osg
def osg(state: FinalState) -> dict[str, float]:
    """E[OSG] at w*: the mean and standard deviation of ‖∇f_i(w*)‖² over the training set."""
    ctx, model = state.ctx, state.model
    x, y = state.x[ctx.rank :: ctx.world_size], state.y[ctx.rank :: ctx.world_size]
    parts: list[Tensor] = []
    bad = 0.0
    with eval_mode(model):
        stats_of = PreparedStats(model, state.loss_fn)
        try:
            for start, xc, yc in _chunks(x, y, state.chunk_size):
                parts.append(stats_of(xc, yc, offset=start).total_sq_norms.detach().double())
        except NonFiniteLossError:  # every rank must still reach the all-reduce below
            bad, parts = 1.0, []
    norms = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=x.device)
    sums = torch.stack([norms.new_tensor(float(norms.numel())), norms.sum(), norms.new_tensor(bad)])
    all_reduce_sum(sums)
    count, total, bad_ranks = (float(v) for v in sums)
    if bad_ranks > 0 or count == 0:
        return {"osg_mean": math.nan, "osg_sd": math.nan}
    mean = total / count
    deviation = (norms - mean).square().sum().reshape(1)
    all_reduce_sum(deviation)
    return {"osg_mean": mean, "osg_sd": math.sqrt(float(deviation) / count)}


# ---------------------------------------------------------------- linear_error
def probe_batches(n: int, batch_size: int, seed: int,
                  count: int = LINEAR_ERROR_BATCHES) -> list[Tensor]:
    """The probe's mini-batches: ``count`` draws of ``batch_size`` distinct indices out of n,
    from a CPU generator seeded by the run's seed (the same on every rank and every rerun)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + _PROBE_SEED) % 2**64)
    return [torch.randperm(n, generator=gen)[:batch_size] for _ in range(count)]


def _mean_loss(model: nn.Module, state: FinalState, dtype: torch.dtype) -> float:
    """L(w) = (1/n) Σ_i f_i(w) over the training set, sharded over ranks, summed in float64."""
    ctx = state.ctx
    x, y = state.x[ctx.rank :: ctx.world_size], state.y[ctx.rank :: ctx.world_size]
    total = torch.zeros(1, dtype=torch.float64, device=state.x.device)
    with torch.no_grad():
        for _, xc, yc in _chunks(x, y, state.chunk_size):
            total += state.loss_fn(model(_as(xc, dtype)), _as(yc, dtype)).double().sum()
    all_reduce_sum(total)
    return float(total) / state.x.shape[0]


def _batch_gradient(model: nn.Module, params: list[nn.Parameter], state: FinalState,
                    indices: Tensor, dtype: torch.dtype) -> list[Tensor]:
    """g_m = ∇ (1/B) Σ_{i∈batch} f_i(w): each rank its slice of the batch (the trainer's split
    rule), all-reduced in one flat buffer, so every rank holds the same g_m."""
    ctx = state.ctx
    local = shard(indices, ctx.rank, ctx.world_size) if ctx.distributed else indices
    local = local.to(state.x.device)
    grads = [torch.zeros_like(p) for p in params]
    for _, xc, yc in _chunks(state.x[local], state.y[local], state.chunk_size):
        with torch.enable_grad():
            total = state.loss_fn(model(_as(xc, dtype)), _as(yc, dtype)).sum()
            parts = torch.autograd.grad(total, params, allow_unused=True)
        for g, part in zip(grads, parts, strict=True):
            if part is not None:
                g.add_(part)
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce_sum(flat)
    flat /= len(indices)
    return [chunk.view_as(p) for chunk, p in zip(flat.split([p.numel() for p in params]),
                                                 params, strict=True)]


def linear_error(state: FinalState) -> dict[str, float]:
    """|L(w* − s) − (L(w*) − ⟨g_m, s⟩)| for the trainer's own step s on random mini-batches."""
    cfg, dtype = state.config, torch.float64
    work = copy.deepcopy(state.model).to(dtype)
    errors: list[float] = []
    with eval_mode(work):
        params = _parameters(work)
        start = [p.detach().clone() for p in params]
        loss0 = _mean_loss(work, state, dtype)
        factor = state.batch_size if cfg.convention == "sum" else 1
        for indices in probe_batches(state.x.shape[0], state.batch_size, cfg.seed):
            g = _batch_gradient(work, params, state, indices, dtype)
            steps = [state.lr * (factor * gi + cfg.weight_decay * w0)
                     for gi, w0 in zip(g, start, strict=True)]
            inner = float(sum((gi * si).sum() for gi, si in zip(g, steps, strict=True)))
            with torch.no_grad():
                for p, w0, s in zip(params, start, steps, strict=True):
                    p.copy_(w0 - s)
            loss1 = _mean_loss(work, state, dtype)
            with torch.no_grad():
                for p, w0 in zip(params, start, strict=True):
                    p.copy_(w0)
            errors.append(abs(loss1 - (loss0 - inner)))
    values = torch.tensor(errors, dtype=torch.float64)
    return {
        "linear_error": float(values.mean()),
        "linear_error_sd": float(values.std()) if len(errors) > 1 else math.nan,
        "final_lr": float(state.lr),
        "final_train_loss": loss0,
    }


# ---------------------------------------------------------------- the registry
# name -> probe; TrainConfig validates final_probes against it and keeps them in this order.
PROBES: dict[str, Probe] = {
    "osg": osg,
    "linear_error": linear_error,
}


def run_probes(names: tuple[str, ...], state: FinalState) -> tuple[dict[str, float],
                                                                   dict[str, float]]:
    """Run the named probes; return (their merged values, seconds per probe)."""
    values: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for name in names:
        started = time.perf_counter()
        values.update(PROBES[name](state))
        seconds[name] = time.perf_counter() - started
    return values, seconds


__all__ = ["LINEAR_ERROR_BATCHES", "PROBES", "FinalState", "probe_batches", "run_probes"]
