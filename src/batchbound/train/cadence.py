"""When a run's cadenced steps fall due: evaluations, Δ measurements and snapshots every k
epochs (evaluations optionally at k, k·q, k·q², ...). Plain arithmetic, so the report's
analyses can ask where a run evaluated without importing the trainer."""

from __future__ import annotations

import math

EPS = 1e-9  # epoch comparisons: samples_seen / n is exact, but sums of fractions are not


def next_due(due: float, epoch: float, every: float, growth: float | None = None) -> float:
    """The first of due, due + every, due + 2·every, ... past ``epoch`` (with ``growth`` q:
    of due, due·q, due·q², ...), computed, not stepped to: a cadence far below one step
    (1e-12 epochs) cannot spin the loop."""
    if due > epoch + EPS:
        return due
    if growth is None:
        return due + every * (math.floor((epoch + EPS - due) / every) + 1)
    due *= growth ** (math.floor(math.log((epoch + EPS) / due, growth)) + 1)
    return due if due > epoch + EPS else due * growth  # log's rounding at a power of q


def first_evaluations(every: float, growth: float | None, step: float) -> tuple[float, float]:
    """The epochs of a run's first two evaluations after the start when each step is
    ``step`` epochs (0: unknown, taken as fine): a target seen at the first was crossed
    somewhere before it."""
    def boundary(due: float) -> float:  # evaluations happen after the step that passes due
        return math.ceil((due - EPS) / step) * step if step > 0 else due

    first = boundary(every)
    return first, boundary(next_due(every, first, every, growth))
