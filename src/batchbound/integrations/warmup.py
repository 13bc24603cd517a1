"""Batch-size warmup in your own loop: how many micro-batches to accumulate next.

The rule is the trainer's (``batchbound.train.adaptive``, ``warmup``): every ``every``
optimizer steps the global batch B = micro-batch × accumulation × ranks doubles when
2B ≤ fraction·(B_noise − its standard error), up to ``max_batch``, never down, and the rate
changes by ``lr`` (McCandlish et al.'s rule by default). B_noise comes from an online estimate
the loop already keeps (``OnlineDiversity``: the DDP communication hook's, or a
DiversityCallback's monitor), so every rank decides the same.

    warmup = AccumulationWarmup(micro_batch=32, world_size=dist.get_world_size())
    ...after each optimizer step:
    factor = warmup.step(state.monitor)          # state: gns_hook_state(...)
    warmup.scale_rates(optimizer, factor)
    for _ in range(warmup.accumulation): ...     # the next step's micro-batches

Change the accumulation only where a new accumulation group starts (``ready``): the
Lightning and Hugging Face callbacks wait for such a boundary.
"""

from __future__ import annotations

from typing import Any

from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError
from batchbound.train.adaptive import BatchPolicy


class AccumulationWarmup:
    """The accumulation a loop should use next; ``history`` holds (optimizer step, batch,
    accumulation, n·Δ estimate) at every decision."""

    def __init__(self, micro_batch: int, accumulation: int = 1, world_size: int = 1, *,
                 every: int = 25, max_batch: int | None = None, fraction: float = 0.5,
                 lr: str = "noise") -> None:
        for name, value in (("micro_batch", micro_batch), ("accumulation", accumulation),
                            ("world_size", world_size), ("every", every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BatchboundError(f"warmup: {name} must be a positive integer, got "
                                      f"{value!r}")
        self.policy = BatchPolicy(adaptive=True, source="online", pick="warmup",
                                  max=max_batch or 1 << 30, every=every, fraction=fraction,
                                  lr=lr)
        self.micro_batch, self.accumulation, self.world_size = micro_batch, accumulation, world_size
        self.start = self.batch_size  # B0, where the rate rule's s(B/B0) is 1
        self.steps = 0
        self.pending = False  # a doubling decided, waiting for an accumulation boundary
        self.history: list[tuple[int, int, int, float]] = []

    @property
    def batch_size(self) -> int:
        return self.micro_batch * self.accumulation * self.world_size

    def deciding(self) -> bool:
        """Whether the next ``step`` decides (so the caller folds its estimate first)."""
        return (self.steps + 1) % self.policy.every == 0 or self.pending

    def step(self, monitor: OnlineDiversity, ready: bool = True) -> float:
        """Call after every optimizer step; returns the factor for the rate (1.0 when the
        batch did not change). ``ready``: a new accumulation group of twice the size could
        start now (the callbacks pass their framework's alignment)."""
        self.steps += 1
        if self.steps % self.policy.every == 0 and not self.pending:
            noise = monitor.noise_scale
            wanted = self.policy.warmed(self.batch_size, noise, monitor.batch_bound_se)
            self.history.append((self.steps, self.batch_size, self.accumulation,
                                 monitor.batch_bound))
            self.pending = wanted > self.batch_size
        return self.apply(monitor) if ready else 1.0

    def apply(self, monitor: OnlineDiversity) -> float:
        """Double the accumulation if a doubling is pending; the rate's factor (else 1.0)."""
        if not self.pending:
            return 1.0
        old = self.batch_size
        self.accumulation *= 2
        self.pending = False
        self.history.append((self.steps, self.batch_size, self.accumulation,
                             monitor.batch_bound))
        return self.policy.lr_change(old, self.batch_size, monitor.noise_scale, self.start)

    @staticmethod
    def scale_rates(optimizer: Any, factor: float, scheduler: Any = None) -> None:
        """Multiply every parameter group's rate (the documented lever) by ``factor``, and a
        torch scheduler's base rates, which it would otherwise restore."""
        if factor == 1.0:
            return
        for group in optimizer.param_groups:
            group["lr"] *= factor
        if scheduler is not None and hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]

    def metrics(self) -> dict[str, float]:
        return {"warmup/batch_size": float(self.batch_size),
                "warmup/accumulation": float(self.accumulation)}

    def state_dict(self) -> dict[str, Any]:
        return {"accumulation": self.accumulation, "steps": self.steps,
                "pending": self.pending, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accumulation, self.steps = int(state["accumulation"]), int(state["steps"])
        self.pending = bool(state["pending"])
        self.history = [tuple(h) for h in state["history"]]  # type: ignore[misc]
