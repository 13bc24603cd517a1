"""Online diversity monitoring inside the training loop. batchbound.diversity.online's
OnlineDiversity does the estimating; this module feeds it what the step already computed
and all-reduces the few numbers it needs with the gradient (no extra collective).

Modes (``TrainConfig.online_diversity``):

- ``off``: nothing, no cost.
- ``norms``: the step's backward runs through per_example_stats (per-layer hooks), which
  gives the gradient *and* each example's squared norm in one pass. Per iteration,
  S_B = Σ_{i∈B}‖g_i‖² (summed over ranks) and T_B = ‖Σ_{i∈B} g_i‖² (from the all-reduced
  gradient) update the estimator. Cost: the hooks' extra work in every backward; measured
  by benchmarks/train.py.
- ``two_batch``: McCandlish et al.'s two-batch-size estimator from the mean gradients of the
  small batches (each worker's micro-batches, or its whole share without ``micro_batch``) and
  the global mean (the big one). No per-example work; needs at least two small batches per
  step: P ≥ 2 workers, or ``micro_batch`` below the global batch on one process.

Each iteration records ``online_diversity`` (Δ̂) and ``online_batch_bound`` (n·Δ̂).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError
from batchbound.train.distributed import DistContext, shard_sizes


class OnlineMonitor:
    def __init__(self, mode: str, n: int, ctx: DistContext, sampling: str = "epoch",
                 micro_batch: int | None = None) -> None:
        self.mode, self.n, self.ctx, self.micro_batch = mode, n, ctx, micro_batch
        # two_batch in a diagonal metric (advise's pilot under Adam: its preconditioner),
        # set by the caller before each step; None: the Euclidean norm
        self.weights: list[torch.Tensor] | None = None
        # the same for every example, added to the mean gradient the optimiser steps on:
        # coupled weight decay's λθ per example (λθ/B under the sum convention; None: none,
        # or λ = 0), set by the caller before each step (advise's pilot); it moves G, not Σ
        self.shift: list[torch.Tensor | None] | None = None
        if mode == "two_batch" and ctx.world_size < 2 and micro_batch is None:
            raise BatchboundError(
                "online_diversity=two_batch compares small-batch and global gradients: it needs "
                "at least 2 workers, or micro_batch below the batch size on one process (or "
                "use norms)"
            )
        scheme = "without_replacement" if sampling == "epoch" else "with_replacement"
        self.estimator = OnlineDiversity(n=n, sampling=scheme) if mode != "off" else None

    @property
    def active(self) -> bool:
        return self.estimator is not None

    @property
    def needs_norms(self) -> bool:
        return self.mode == "norms"

    def small_batch_sq(self, grads: list[torch.Tensor], scale: float, size: int) -> float:
        """two_batch: ‖G_k‖² of one small batch's mean gradient, from ``grads`` holding
        scale·Σg_i over its ``size`` examples. The loop sums these over the rank's small
        batches and the all-reduce over ranks."""
        factor = 1.0 / (scale * size)
        if self.shift is not None:
            return squared_norm(shifted(grads, factor, self.shift), self.weights)
        return squared_norm(grads, self.weights) * factor**2

    def small_batch_sizes(self, batch: int) -> list[int]:
        """Every small batch of a step at global batch ``batch``: each rank's share, split
        into micro-batches of ``micro_batch`` (the last one smaller)."""
        sizes = []
        for share in shard_sizes(batch, self.ctx.world_size):
            step = self.micro_batch or share
            sizes += [min(step, share - start) for start in range(0, share, step)]
        return sizes

    def update(
        self, grads: list[torch.Tensor], scale: float, extras: list[float], batch: int
    ) -> dict[str, float]:
        """Fold in one step, given the all-reduced gradient (scale·Σg_i over the global batch)
        and the summed extras; returns the metrics to record."""
        assert self.estimator is not None
        if self.shift is None:
            total_sq = squared_norm(grads, self.weights) / scale**2  # T_B
        else:  # T_B of g_i + s: ‖Σg_i + B·s‖²; S_B: Σ‖g_i‖² + 2 s·Σg_i + B‖s‖²
            total_sq = squared_norm(shifted(grads, 1.0 / (scale * batch), self.shift),
                                    self.weights) * batch**2
            if self.mode == "norms":
                extras = [extras[0] + sum(
                    2.0 * float((g.double() * s.double()).sum()) / scale
                    + batch * float(s.double().square().sum())
                    for g, s in zip(grads, self.shift, strict=True) if s is not None)]
        if not all(math.isfinite(v) for v in (total_sq, *extras)):
            return {}  # a diverging step; the loop's divergence check reports it
        if self.mode == "norms":
            if batch >= 2:
                self.estimator.update_from_norms(extras[0], total_sq, batch)
        else:
            sizes = self.small_batch_sizes(batch)
            small_sq = extras[0] / len(sizes)
            harmonic = len(sizes) / sum(1.0 / b for b in sizes)
            if harmonic < batch:
                self.estimator.update_two_batch(small_sq, harmonic, total_sq / batch**2, batch)
        if not self.estimator.steps:
            return {}
        return {
            "online_diversity": self.estimator.diversity,
            "online_batch_bound": self.estimator.batch_bound,
        }

    def diversity_estimate(self) -> float:
        if self.estimator is None:
            raise BatchboundError(
                "adaptive(source=online) needs online_diversity=norms or two_batch"
            )
        return self.estimator.diversity

    def state_dict(self) -> dict[str, Any]:
        return {} if self.estimator is None else self.estimator.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.estimator is not None and state:
            self.estimator.load_state_dict(state)


def shifted(grads: list[torch.Tensor], factor: float,
            shift: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """factor·g + s per tensor, in float64 (s None: factor·g alone)."""
    return [g.double() * factor + (s.double() if s is not None else 0.0)
            for g, s in zip(grads, shift, strict=True)]


def squared_norm(tensors: list[torch.Tensor],
                 weights: list[torch.Tensor] | None = None) -> float:
    """Σ‖t‖² over tensors: fused per-tensor norms, squared and summed in float64 (one sync);
    with ``weights``, Σ w·t² (a diagonal metric, one weight tensor per tensor), in float64."""
    if weights is not None:
        return float(torch.stack([(w.double() * t.double().square()).sum()
                                  for w, t in zip(weights, tensors, strict=True)]).sum())
    norms = torch.stack([torch.linalg.vector_norm(t) for t in tensors])
    return float(norms.double().square().sum())
