"""Δ^DIM of actual gradients, for any registered mechanism: sampled (Monte Carlo, to check the
closed forms) on a matrix of per-example gradients, and exact on a model and data set from the
closed forms (one pass over the data for several mechanisms)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from batchbound.diversity.distributed import all_reduce_sum
from batchbound.diversity.losses import resolve_loss
from batchbound.diversity.measure import (
    check_copy_alone,
    check_finite_sums,
    data_chunks,
    measure,
    measuring,
)
from batchbound.diversity.mechanisms.registry import (
    Mechanism,
    apply_mechanism,
    diversity_under,
    mechanism_names,
    parse_mechanism,
    ratio,
)
from batchbound.diversity.prepared import per_example_gradients
from batchbound.diversity.stats import trainable_parameters
from batchbound.errors import BatchboundError

# ----------------------------------------------------------------------- Monte Carlo


@dataclass(frozen=True)
class MonteCarloEstimate:
    """Δ^DIM estimated by sampling: the numerator Σ_i E‖M(g_i)‖² and denominator
    E‖Σ_i M(g_i)‖² are averaged separately over ``samples`` draws (Δ^DIM is a ratio of
    expectations, not an expected ratio). Standard errors are of the two means; the ratio's
    comes from the delta method."""

    samples: int
    numerator: float
    denominator: float
    numerator_se: float
    denominator_se: float
    diversity: float
    diversity_se: float


def monte_carlo_diversity(
    mechanism: str | Mechanism,
    grads: Tensor,
    *,
    samples: int = 1000,
    generator: torch.Generator | None = None,
    block: int = 64,
    parameter_slices: list[slice] | None = None,
) -> MonteCarloEstimate:
    """Sample the mechanism on an (n, d) matrix of per-example gradients.

    ``parameter_slices`` splits the d columns into parameter tensors, which matters only for
    mechanisms that treat each tensor on its own (``quantization(per_tensor=true)``).
    """
    mech = parse_mechanism(mechanism)
    if grads.dim() != 2 or grads.shape[0] == 0:
        raise BatchboundError(f"grads must be an (n, d) matrix, got shape {tuple(grads.shape)}")
    if samples < 2:
        raise BatchboundError(f"samples must be ≥ 2, got {samples}")
    g = grads.detach().double()
    nums, dens = [], []
    for start in range(0, samples, block):
        count = min(block, samples - start)
        tiled = g.expand(count, *g.shape)  # (count, n, d): count independent draws
        if mech.splits_tensors and parameter_slices:
            pieces = {str(i): tiled[..., s] for i, s in enumerate(parameter_slices)}
            parts = apply_mechanism(mech, pieces, generator, batch_dims=2)
            drawn = torch.cat(list(parts.values()), -1)
        else:
            drawn = apply_mechanism(mech, tiled, generator, batch_dims=2)
        nums.append(drawn.square().sum(dim=(1, 2)))
        dens.append(drawn.sum(dim=1).square().sum(dim=1))
    num, den = torch.cat(nums), torch.cat(dens)
    m_num, m_den = float(num.mean()), float(den.mean())
    se_num = float(num.std() / math.sqrt(samples))
    se_den = float(den.std() / math.sqrt(samples))
    cov = float(((num - m_num) * (den - m_den)).sum() / (samples - 1) / samples)
    estimate = ratio(m_num, m_den)
    var = (se_num**2 / m_den**2 + m_num**2 * se_den**2 / m_den**4
           - 2 * m_num * cov / m_den**3) if m_den else math.nan
    se = math.sqrt(max(var, 0.0))
    return MonteCarloEstimate(samples, m_num, m_den, se_num, se_den, estimate, se)


# -------------------------------------------------------------- exact, on a model


@dataclass
class MechanismReport:
    """Exact Δ^DIM of a model on a data set, beside the plain Δ it changes."""

    mechanism: str
    n: int
    d: int
    S: float
    T: float
    R: float | None
    diversity: float
    batch_bound: float
    base_diversity: float
    base_batch_bound: float
    seconds: float
    engine: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "mechanism": self.mechanism, "n": self.n, "d": self.d, "S": self.S, "T": self.T,
            "R": self.R, "diversity": self.diversity, "batch_bound": self.batch_bound,
            "base_diversity": self.base_diversity, "base_batch_bound": self.base_batch_bound,
            "seconds": self.seconds, "engine": self.engine,
        }


def mechanism_diversity(
    model: nn.Module,
    data: Any,
    loss: Any = None,
    mechanism: str | Mechanism = "dropconnect(p=0.5)",
    *,
    chunk_size: int = 256,
    engine: str = "auto",
    dtype: torch.dtype | None = None,
) -> MechanismReport:
    """Exact Δ^DIM over the whole data set from the closed forms.

    ``data``, ``loss``, ``chunk_size``, ``engine`` and ``dtype`` are as for ``measure``.
    Most closed forms (DropConnect, SGLD) need only S and T, which come from ``measure`` (the
    fast per-example norm engines). Those with ``needs_R`` (quantization) need per-example L1
    norms, so the pass materialises per-example gradients chunk by chunk (memory: chunk_size
    × parameters; ``engine`` does not apply).
    """
    return mechanism_diversities(model, data, loss, [mechanism], chunk_size=chunk_size,
                                 engine=engine, dtype=dtype)[0]


def mechanism_diversities(
    model: nn.Module,
    data: Any,
    loss: Any = None,
    mechanisms: Sequence[str | Mechanism] = ("dropconnect(p=0.5)",),
    *,
    chunk_size: int = 256,
    engine: str = "auto",
    dtype: torch.dtype | None = None,
) -> list[MechanismReport]:
    """Several mechanisms from one pass over the data (one report each, in order)."""
    mechs = [parse_mechanism(m) for m in mechanisms]
    if not mechs:
        raise BatchboundError("no mechanism given; choose from " + ", ".join(mechanism_names()))
    start = time.perf_counter()
    d = sum(p.numel() for p in trainable_parameters(model).values())
    R: dict[bool, float] = {}  # keyed by splits_tensors: R over the whole vector, per tensor
    if any(m.needs_R for m in mechs):
        n, S, T, R[False], R[True] = _materialised_sums(model, data, loss, chunk_size, dtype)
        used = "materialise"
    else:
        report = measure(model, data, loss, chunk_size=chunk_size, engine=engine, dtype=dtype)
        n, S, T, used = report.n, report.S, report.T, report.engine
    seconds = time.perf_counter() - start
    base = ratio(S, T)
    reports = []
    for mech in mechs:
        r = R[mech.splits_tensors] if mech.needs_R else None
        diversity = diversity_under(mech, S=S, T=T, n=n, d=d, R=r)
        reports.append(MechanismReport(
            mechanism=str(mech), n=n, d=d, S=S, T=T, R=r, diversity=diversity,
            batch_bound=n * diversity, base_diversity=base, base_batch_bound=n * base,
            seconds=seconds, engine=used,
        ))
    return reports


def _materialised_sums(
    model: nn.Module, data: Any, loss: Any, chunk_size: int, dtype: torch.dtype | None
) -> tuple[int, float, float, float, float]:
    """n, S, T, R = Σ_i ‖g_i‖₂‖g_i‖₁ and R per tensor = Σ_i Σ_p ‖g_ip‖₂‖g_ip‖₁ in one pass of
    materialised per-example gradients, chunk by chunk, summed across ranks."""
    acc = torch.float64
    with measuring(model, dtype) as work:
        chunks, loss_fn = chunks_for(work, data, loss, chunk_size)
        params = trainable_parameters(work)
        device = next(iter(params.values())).device
        sums = torch.zeros(4, dtype=acc, device=device)  # n, S, R, R per tensor
        total = {k: torch.zeros(p.shape, dtype=acc, device=device) for k, p in params.items()}
        for index, (x, y) in enumerate(chunks):
            if index == 0:  # a dtype copy that reaches its model is refused
                check_copy_alone(model, work, x, y, loss_fn)
            grads = per_example_gradients(work, x, y, loss_fn)
            flat = {k: g.reshape(g.shape[0], -1).to(acc) for k, g in grads.items()}
            sq = {k: g.square().sum(1) for k, g in flat.items()}
            l1 = {k: g.abs().sum(1) for k, g in flat.items()}
            sq_all = torch.stack(list(sq.values())).sum(0)
            l1_all = torch.stack(list(l1.values())).sum(0)
            r_tensor = torch.stack([(sq[k].sqrt() * l1[k]).sum() for k in flat]).sum()
            sums += torch.stack([sums.new_tensor(x.shape[0]), sq_all.sum(),
                                 (sq_all.sqrt() * l1_all).sum(), r_tensor])
            for k, g in flat.items():
                total[k] += g.sum(0).reshape(total[k].shape)
    names = list(total)
    reduced = all_reduce_sum([sums, *total.values()])
    sums, total = reduced[0], dict(zip(names, reduced[1:], strict=True))
    T = float(sum(t.square().sum() for t in total.values()))
    check_finite_sums(float(sums[1]), T)
    return int(sums[0]), float(sums[1]), T, float(sums[2]), float(sums[3])


# ------------------------------------------------- engine access (chunks, gradients)
# Shared with differential.py: the model prepared as ``measure`` prepares it, and the data
# streamed through the engine's own chunker.


def chunks_for(
    model: nn.Module, data: Any, loss: Any, chunk_size: int
) -> tuple[Iterator[tuple[Tensor, Tensor]], Any]:
    """(chunks already on the model's device and dtype, per-example loss)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise BatchboundError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    chunks, _, task = data_chunks(data, chunk_size)
    loss_fn = resolve_loss(loss, task)
    first = next(iter(trainable_parameters(model).values()))

    def moved() -> Iterator[tuple[Tensor, Tensor]]:
        for x, y in chunks:
            yield (
                x.to(device=first.device, dtype=first.dtype if x.is_floating_point() else None),
                y.to(device=first.device, dtype=first.dtype if y.is_floating_point() else None),
            )

    return moved(), loss_fn
