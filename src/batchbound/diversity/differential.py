"""Differential gradient diversity between two parameter states ([diversity], §5, Definition 6):

    Δ_S(w, w') = Σ_i ‖g_i(w) − g_i(w')‖² / ‖Σ_i (g_i(w) − g_i(w'))‖²,    B_S(w, w') = n·Δ_S(w, w').

It governs the stability (generalization) of mini-batch SGD the way Δ_S(w) governs its
convergence. The numerator needs each example's gradient *difference* at two different
points, which no single backward pass gives (the two points run different forward passes),
so both per-example gradients are materialised chunk by chunk (memory: 2 × chunk × params)
and subtracted. The denominator is the squared norm of the difference of the two full
gradient sums, accumulated in float64.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from batchbound.diversity.distributed import all_reduce_sum
from batchbound.diversity.measure import check_copy_alone, check_finite_sums, measuring
from batchbound.diversity.mechanisms import chunks_for
from batchbound.diversity.prepared import per_example_gradients
from batchbound.diversity.stats import trainable_parameters
from batchbound.errors import BatchboundError


@dataclass
class DifferentialReport:
    """Δ_S(w, w') over a data set. ``distance`` is ‖w − w'‖₂ over the trainable parameters;
    ``per_parameter`` splits S by parameter, as ``DiversityReport`` does."""

    n: int
    S: float
    T: float
    distance: float
    per_parameter: dict[str, float]
    seconds: float

    @property
    def diversity(self) -> float:
        if self.T == 0.0:
            return float("nan") if self.S == 0.0 else float("inf")
        return self.S / self.T

    @property
    def batch_bound(self) -> float:
        return self.n * self.diversity

    def to_dict(self) -> dict[str, Any]:
        return {
            "n": self.n, "S": self.S, "T": self.T, "diversity": self.diversity,
            "batch_bound": self.batch_bound, "distance": self.distance,
            "per_parameter": dict(self.per_parameter), "seconds": self.seconds,
        }


def differential_diversity(
    model_a: nn.Module,
    model_b: nn.Module | Mapping[str, Tensor],
    data: Any,
    loss: Any = None,
    *,
    chunk_size: int = 256,
    dtype: torch.dtype | None = None,
) -> DifferentialReport:
    """Exact Δ_S(w, w') of two states of one architecture over all of ``data``.

    ``model_b`` is a second model of the same architecture, or a state dict for
    ``model_a``'s architecture (loaded into a copy; ``model_a`` is never changed). ``data``,
    ``loss``, ``chunk_size`` and ``dtype`` are as for ``measure``. Both models are evaluated
    in eval mode; their modes are restored afterwards. When w and w' are close, the two
    gradients nearly cancel: measure with ``dtype=torch.float64``.
    """
    if isinstance(model_b, Mapping):
        state = model_b
        model_b = copy.deepcopy(model_a)
        try:
            model_b.load_state_dict(state)
        except (RuntimeError, KeyError) as exc:
            raise BatchboundError(f"the state dict does not fit model_a: {exc}") from None
    _check_same_parameters(model_a, model_b)
    start = time.perf_counter()
    acc = torch.float64
    with measuring(model_a, dtype) as work_a, measuring(model_b, dtype) as work_b:
        pa, pb = trainable_parameters(work_a), trainable_parameters(work_b)
        first = next(iter(pa.values()))
        other = next(iter(pb.values()))
        if (first.device, first.dtype) != (other.device, other.dtype):
            raise BatchboundError(
                f"the two models must share device and dtype, got {first.device}/{first.dtype} "
                f"and {other.device}/{other.dtype}; pass dtype= to convert both"
            )
        distance = float(sum((a.detach().to(acc) - pb[k].detach().to(acc)).square().sum()
                             for k, a in pa.items())) ** 0.5
        device = first.device
        per_param = {k: torch.zeros((), dtype=acc, device=device) for k in pa}
        diff_sum = {k: torch.zeros(p.shape, dtype=acc, device=device) for k, p in pa.items()}
        n = torch.zeros((), dtype=acc, device=device)
        chunks, loss_fn = chunks_for(work_a, data, loss, chunk_size)
        for index, (x, y) in enumerate(chunks):
            if index == 0:  # a dtype copy that reaches its model is refused
                check_copy_alone(model_a, work_a, x, y, loss_fn)
                check_copy_alone(model_b, work_b, x, y, loss_fn)
            ga = per_example_gradients(work_a, x, y, loss_fn)
            gb = per_example_gradients(work_b, x, y, loss_fn)
            for k in pa:
                diff = ga[k].to(acc) - gb[k].to(acc)
                per_param[k] += diff.square().sum()
                diff_sum[k] += diff.sum(0)
            n += x.shape[0]
    names = list(pa)
    reduced = all_reduce_sum([n, *per_param.values(), *diff_sum.values()])
    n_total = int(reduced[0])
    per_param_s = {k: float(v) for k, v in zip(names, reduced[1 : 1 + len(names)], strict=True)}
    T = float(sum(t.square().sum() for t in reduced[1 + len(names) :]))
    check_finite_sums(sum(per_param_s.values()), T)
    return DifferentialReport(
        n=n_total, S=sum(per_param_s.values()), T=T, distance=distance,
        per_parameter=per_param_s, seconds=time.perf_counter() - start,
    )


def _check_same_parameters(model_a: nn.Module, model_b: nn.Module) -> None:
    shapes_a = {k: tuple(p.shape) for k, p in trainable_parameters(model_a).items()}
    shapes_b = {k: tuple(p.shape) for k, p in trainable_parameters(model_b).items()}
    if shapes_a != shapes_b:
        only_a = sorted(set(shapes_a) - set(shapes_b))
        only_b = sorted(set(shapes_b) - set(shapes_a))
        differ = sorted(k for k in set(shapes_a) & set(shapes_b) if shapes_a[k] != shapes_b[k])
        raise BatchboundError(
            "differential diversity needs two states of one architecture; trainable parameters "
            f"differ: only in model_a {only_a}, only in model_b {only_b}, shapes differ {differ}"
        )
