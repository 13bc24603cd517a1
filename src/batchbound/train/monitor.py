"""Online diversity monitoring inside the training loop (batchbound.diversity.online does the
estimating; this module feeds it what the step already computed).

Modes (``TrainConfig.online_diversity``):

- ``off``: nothing (no cost).
- ``norms``: the step's backward also yields per-example squared norms (per_example_stats,
  one backward with per-layer hooks), so every iteration gives S_B = Σ_{i∈B}‖g_i‖² and
  T_B = ‖Σ_{i∈B} g_i‖², all-reduced with the gradient. Its cost is measured by the
  benchmark (benchmarks/train.py) and shown in timings["monitor_seconds"].
- ``two_batch``: McCandlish et al.'s two-batch-size estimator from each worker's local
  gradient (|G_local|²) and the global one; needs no per-example work, but P ≥ 2.
"""

from __future__ import annotations

from typing import Any

import torch

from batchbound.errors import BatchboundError
from batchbound.train.distributed import DistContext


class OnlineMonitor:
    def __init__(self, mode: str, n: int, ctx: DistContext) -> None:
        self.mode, self.n, self.ctx = mode, n, ctx
        self.estimator: Any = None
        if mode == "off":
            return
        if mode == "two_batch" and ctx.world_size < 2:
            raise BatchboundError("online_diversity=two_batch needs at least 2 workers")
        try:
            from batchbound.diversity.online import OnlineDiversity
        except ImportError:  # pragma: no cover - until batchbound.diversity.online lands
            raise BatchboundError(
                "online diversity monitoring needs batchbound.diversity.online, "
                "which this installation lacks"
            ) from None
        self.estimator = OnlineDiversity(n=n)

    @property
    def active(self) -> bool:
        return self.mode != "off"

    @property
    def needs_norms(self) -> bool:
        return self.mode == "norms"

    def local_extras(self, grads: list[torch.Tensor], scale: float) -> list[float]:
        return []

    def update(
        self, grads: list[torch.Tensor], scale: float, extras: list[float], batch: int
    ) -> dict[str, float]:
        raise NotImplementedError

    def diversity_estimate(self) -> float:
        if self.estimator is None:
            raise BatchboundError(
                "adaptive(source=online) needs online_diversity=norms or two_batch"
            )
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
