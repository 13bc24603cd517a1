"""The branch test: is the critical batch at least twice the batch? (Merrill et al. 2025)

From one state (model and optimiser), short runs branch at B0 = the batch, 2·B0 (and 4·B0),
each over the same E examples, at the optimiser's rate rule; B0's run is evaluated a few
times along the way, the others at their end, all on one fixed subset. One more run at B0
with another data order measures the chance variation.

Each run is read as the examples B0 needed for the same loss: B0's loss curve (made monotone
by its running minimum) is interpolated at B's final loss, giving e*(B), and r(B) = e*(B)/E.
With the rate near its best, McCandlish et al.'s model says a step at B is worth
B/(B + B_crit) examples at B0's best, so

    r(B) = (B0 + B_crit)/(B + B_crit),   so   B_crit = (r·B − B0)/(1 − r).

B_crit is the least-squares fit of r over the rungs; its interval is where every rung's
inversion at r ± z·σ·√(B/B0) agrees (σ: the replicated B0 run's |1 − r|/√2, at least
``MIN_SPREAD``; a rung of B takes B0/B as many steps, so it varies more), or their union when
they do not. With z = 2 each rung's band is about 95 % of its chance variation.

This module is the shared core: ``batchbound advise`` measures the critical batch along its
pilot with it (advise/critical.py), and batch-size warmup's branch trigger doubles the batch
when the interval's low end is at least 2·B0 (train/callbacks.py). Running a branch is the
caller's (``run``): the trainer and advise build it from their own parts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

MIN_SPREAD = 0.1  # the least relative spread of a branch's ratio assumed (short runs)
B0_EVALUATIONS = 8  # points on B0's loss curve, which the other rungs are read against
CAP = 8  # B_crit above CAP × the largest rung cannot be told apart: capped there
Z = 2.0  # each rung's band: ± Z σ

# run(batch, evaluations, seed) -> [(examples, loss on the fixed subset)], from 0 to E; a
# diverged run ends at +inf
Run = Callable[[int, int, int], list[tuple[int, float]]]


@dataclass(frozen=True)
class CriticalPoint:
    iteration: int
    critical_batch: float  # B_crit fitted
    low: float
    high: float
    spread: float  # σ of r, from the replicated B0 run (at least MIN_SPREAD)
    ratios: dict[int, float]  # batch -> r(B) = e*(B)/E (B0: 1)
    losses: dict[int, float]  # batch -> the loss the branch ended at

    def to_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "critical_batch": self.critical_batch,
                "interval": [self.low, self.high], "spread": self.spread,
                "ratio": {str(b): v for b, v in self.ratios.items()},
                "final_loss": {str(b): v for b, v in self.losses.items()}}


def invert(ratio: float, batch: int, b0: int, cap: float) -> float:
    """B_crit from r(B) = (B0 + B_crit)/(B + B_crit), clipped to [0, cap]."""
    if ratio >= 1:
        return cap
    if ratio * batch <= b0:
        return 0.0
    return min((ratio * batch - b0) / (1 - ratio), cap)


def examples_ratio(curve: Sequence[tuple[int, float]], loss: float) -> float:
    """r = e*/E: the examples B0's run (``curve``: (examples, loss) from 0 to E) needed to
    reach ``loss``, over E; its running minimum is interpolated linearly. 0 when ``loss`` is
    no lower than the start (or not finite), 1 when B0's run never got that low."""
    total = curve[-1][0]
    best = [curve[0]]
    for examples, value in curve[1:]:
        best.append((examples, min(value, best[-1][1])))
    if not math.isfinite(loss) or loss >= best[0][1]:
        return 0.0
    if loss <= best[-1][1]:
        return 1.0
    for (e0, l0), (e1, l1) in pairwise(best):
        if l1 <= loss < l0:
            return (e0 + (l0 - loss) / (l0 - l1) * (e1 - e0)) / total
    return 1.0  # not reached: the loop covers every loss strictly between the ends


def fit_point(ratios: dict[int, float], b0: int, spread: float, iteration: int,
              losses: dict[int, float] | None = None, z: float = Z) -> CriticalPoint:
    """B_crit and its interval from one state's ratios r(B) (see the module docstring)."""
    rungs = [b for b in ratios if b != b0]
    cap = CAP * max(ratios)
    grid = np.concatenate([[0.0], np.geomspace(b0 / 64, cap, 400)])
    errors = [sum((ratios[b] - (b0 + c) / (b + c)) ** 2 for b in rungs) for c in grid]
    central = float(grid[int(np.argmin(errors))])
    # a rung of B takes B0/B as many steps as B0's: it varies √(B/B0) times more
    lows = [invert(ratios[b] - z * spread * math.sqrt(b / b0), b, b0, cap) for b in rungs]
    highs = [invert(ratios[b] + z * spread * math.sqrt(b / b0), b, b0, cap) for b in rungs]
    low, high = max(lows), min(highs)
    if low > high:  # the rungs disagree beyond their noise: the union of what each says
        low, high = min(lows), max(highs)
    low, high = min(low, central), max(high, central)
    return CriticalPoint(iteration, central, low, high, spread, dict(ratios), losses or {})


def progressed(curve: Sequence[tuple[int, float]]) -> bool:
    """B0's run lowered its loss (else nothing can be read against it)."""
    return len(curve) > 1 and math.isfinite(curve[-1][1]) and curve[-1][1] < curve[0][1]


def branch_point(run: Run, ladder: Sequence[int], seed: int, iteration: int,
               evaluations: int = B0_EVALUATIONS, z: float = Z) -> CriticalPoint | None:
    """The branches from one state at ``ladder`` = (B0, 2·B0, ...), B0 replicated at seed + 1;
    the fitted point, or None when B0's run made no progress."""
    b0 = ladder[0]
    base = run(b0, evaluations, seed)
    if not progressed(base):
        return None
    ends = {b0: base[-1][1]}
    ratios = {b0: 1.0}
    for batch in ladder[1:]:
        ends[batch] = run(batch, 1, seed)[-1][1]
        ratios[batch] = examples_ratio(base, ends[batch])
    again = examples_ratio(base, run(b0, 1, seed + 1)[-1][1])
    spread = max(abs(1.0 - again) / math.sqrt(2), MIN_SPREAD)
    return fit_point(ratios, b0, spread, iteration, ends, z)


def doubles(point: CriticalPoint | None) -> bool:
    """The warmup's decision: the critical batch's interval lies at or above 2·B0 (each
    rung's band ± z σ); no point (B0 made no progress) never doubles."""
    if point is None:
        return False
    b0 = min(point.ratios)
    return point.low >= 2 * b0


__all__ = [
    "B0_EVALUATIONS",
    "CAP",
    "MIN_SPREAD",
    "CriticalPoint",
    "branch_point",
    "doubles",
    "examples_ratio",
    "fit_point",
    "invert",
    "progressed",
]
