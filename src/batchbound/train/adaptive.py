"""Adaptive batch size (seed 002: "set the batch size ≈ n·Δ").

``adaptive(delta=δ, min=b_min, max=b_max, every=k)`` resets the global batch size every k
iterations to B = clip(⌊δ·n·Δ̂(w)⌋ + 1, b_min, b_max), the bound of seed 001's Lemma 1 with
the measured diversity Δ̂ in place of Δ_S(w). The learning rate then follows the strategy
for the new B (see schedule.py). ``fixed`` keeps the configured batch size.

``pick=time`` chooses instead by the model ``batchbound advise`` uses: with B_noise =
n·Δ̂ − 1, a step at B makes 1/(1 + B_noise/B) of the progress of an infinitely large batch
(McCandlish et al. 2018), so the time per unit of progress is t(B)·(1 + B_noise/B), t(B)
the seconds of one iteration at B on P workers. The policy picks the B = P·2^k in
[min, max] that minimises it; t is timed once, at the first adaptation, and agreed across
ranks (``Trainer.step_cost``).

The Δ̂ measurements (or the online monitor's work) the policy depends on are part of its
training time: they count in the run's seconds and its targets' seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from batchbound.errors import BatchboundError
from batchbound.spec import parse_spec

SOURCES = ("exact", "online")
PICKS = ("bound", "time")


@dataclass(frozen=True)
class BatchPolicy:
    """``adaptive`` is False for a fixed batch size; then the other fields are unused."""

    adaptive: bool = False
    delta: float = 1.0
    min: int = 1
    max: int = 1 << 30
    every: int = 100
    source: str = "exact"
    pick: str = "bound"

    def __post_init__(self) -> None:
        if not self.adaptive:
            return
        if self.delta <= 0:
            raise BatchboundError(f"adaptive batch: delta must be > 0, got {self.delta}")
        if not 1 <= self.min <= self.max:
            raise BatchboundError(
                f"adaptive batch: need 1 <= min <= max, got min={self.min}, max={self.max}"
            )
        if self.every < 1:
            raise BatchboundError(f"adaptive batch: every must be >= 1 iteration, got {self.every}")
        if self.pick not in PICKS:
            raise BatchboundError(
                f"adaptive batch: unknown pick {self.pick!r}; choose from {', '.join(PICKS)}"
            )
        if self.source not in SOURCES:
            raise BatchboundError(
                f"adaptive batch: unknown source {self.source!r}; choose from {', '.join(SOURCES)}"
            )

    def batch_size(self, n: int, diversity: float) -> int:
        """B = clip(⌊δ·n·Δ̂⌋ + 1, min, max). A Δ̂ that is infinite or not positive comes
        from T → 0 (gradients that cancel, or vanish): the bound is then unlimited, so the
        upper end."""
        if not math.isfinite(diversity) or diversity <= 0:
            return self.max
        return int(min(max(math.floor(self.delta * n * diversity) + 1, self.min), self.max))

    def candidates(self, workers: int) -> list[int]:
        """B = P·2^k within [min, max] (at least one: the multiple of P nearest min)."""
        out, batch = [], workers
        while batch <= self.max:
            if batch >= self.min:
                out.append(batch)
            batch *= 2
        return out or [max(workers, self.min - self.min % workers)]

    def time_optimal(self, n: int, diversity: float, workers: int,
                     seconds: Callable[[int], float]) -> int:
        """The candidate B minimising t(B)·(1 + B_noise/B), B_noise = n·Δ̂ − 1 (the upper
        end when Δ̂ is infinite or not positive, as for the bound)."""
        candidates = self.candidates(workers)
        if not math.isfinite(diversity) or diversity <= 0:
            return candidates[-1]
        noise = max(n * diversity - 1.0, 0.0)
        return min(candidates, key=lambda b: seconds(b) * (1.0 + noise / b))


def parse_batch_policy(text: str) -> BatchPolicy:
    """``fixed`` or ``adaptive(delta=0.1,min=16,max=1024,every=50[,source=exact|online]
    [,pick=bound|time])``; with pick=time, delta is not used and may be left out."""
    spec = parse_spec(text)
    if spec.name == "fixed":
        if spec.kwargs:
            raise BatchboundError("batch policy 'fixed' takes no options")
        return BatchPolicy()
    if spec.name != "adaptive":
        raise BatchboundError(
            f"unknown batch policy {spec.name!r}; choose fixed or "
            "adaptive(delta=..,min=..,max=..,every=..)"
        )
    allowed = {"delta", "min", "max", "every", "source", "pick"}
    unknown = sorted(set(spec.kwargs) - allowed)
    if unknown:
        raise BatchboundError(
            f"adaptive batch has no option {', '.join(map(repr, unknown))}; "
            f"options: {', '.join(sorted(allowed))}"
        )
    needed = {"min", "max", "every"} | ({"delta"} if spec.kwargs.get("pick") != "time" else set())
    missing = sorted(needed - set(spec.kwargs))
    if missing:
        raise BatchboundError(f"adaptive batch needs {', '.join(missing)}")
    return BatchPolicy(adaptive=True, **spec.kwargs)
