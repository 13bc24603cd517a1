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

B_crit is the least-squares fit of r over the rungs the model can explain; a rung that
diverged, or whose r lies below B0/B (worse than its steps alone: outside the model), is left
out of the fit and named in ``excluded``; when none is left the point is only a bound (the
critical batch is below the first rung above B0), not a number. Every rung runs the same
examples (the caller's duty: advise's plan rounds them to a multiple of the largest batch).

The chance variation: B0's two runs (the base and the replicate at another data order) are
each read against the other's curve, d = (1 − r(rep | base)) + (1 − r(base | rep)), no
clipping at either end, so σ = |d|/√2 is an estimate from n = 1 independent pair (one degree
of freedom), floored at ``MIN_SPREAD`` (a lucky close pair must not make the band vanish).
Every rung is read against the same B0 curve, so their errors are correlated: the interval's
ends are the fits of all rungs' ratios shifted jointly by ∓z·σ·√(B/B0) (a rung of B takes
B0/B as many steps, so it varies more), never the intersection of the rungs' ranges (which
would be narrower than the evidence). With z = 2 this is a ±2σ band; with σ from one pair it
is not a calibrated 95 % interval (a t quantile with 1 df, 12.7, would
make every interval [0, cap]); the floor and the joint shift are what widen it
(docs/advise.md).

This module is the shared core: ``batchbound advise`` measures the critical batch along its
pilot with it (advise/critical.py); batch-size warmup's branch trigger fits its rungs with
``fit_point`` too, but reads them on B0's trend line with σ from B0's own scatter, without
the replicate (train/branch_trend.py), and grows the batch when the interval's low end is at
least 2·B0 (train/callbacks.py). Running a branch is the
caller's (``run``): the trainer and advise build it from their own parts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
    excluded: dict[int, str] = field(default_factory=dict)  # rung -> why it is not fitted
    replicates: int = 1  # n: independent B0 pairs σ rests on (degrees of freedom)
    below: int | None = None  # no rung fitted: the critical batch is below this rung (a bound)

    def to_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration,
                "critical_batch": None if self.below is not None else self.critical_batch,
                "interval": [self.low, self.high], "spread": self.spread,
                "spread_n": self.replicates,
                **({"below": self.below} if self.below is not None else {}),
                "excluded": {str(b): why for b, why in self.excluded.items()},
                "ratio": {str(b): v for b, v in self.ratios.items()},
                "final_loss": {str(b): v for b, v in self.losses.items()}}

    def text(self) -> str:
        """The point in words: the estimate (or the bound), σ with its n, the exclusions."""
        if self.below is not None:
            head = f"critical batch below {self.below} (no rung fitted: a bound)"
        else:
            head = f"critical batch {self.critical_batch:.3g} ({self.low:.3g}–{self.high:.3g})"
        out = f"{head}; σ = {self.spread:.2g} from n = {self.replicates} B0 replicate pair"
        if self.excluded:
            out += "; excluded: " + ", ".join(f"B = {b} ({why})"
                                              for b, why in self.excluded.items())
        return out


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


def outside(ratio: float, loss: float, batch: int, b0: int) -> str | None:
    """Why a rung cannot be fitted (None when it can): a diverged run, or r below B0/B
    (fewer of B0's examples than its steps alone would give: no B_crit ≥ 0 explains it)."""
    if not math.isfinite(loss):
        return "diverged"
    if not math.isfinite(ratio) or ratio * batch < b0:
        return f"r = {ratio:.2f} below B0/B = {b0 / batch:.2f}, outside the model"
    return None


def fit_point(ratios: dict[int, float], b0: int, spread: float, iteration: int,
              losses: dict[int, float] | None = None, z: float = Z,
              replicates: int = 1) -> CriticalPoint:
    """B_crit and its interval from one state's ratios r(B) (see the module docstring)."""
    losses = losses or {}
    rungs, excluded = [], {}
    for b in sorted(ratios):
        if b == b0:
            continue
        why = outside(ratios[b], losses.get(b, 0.0), b, b0)
        if why is None:
            rungs.append(b)
        else:
            excluded[b] = why
    if not rungs:  # nothing the model explains: only a bound, below the first rung
        first = min(b for b in ratios if b != b0)
        return CriticalPoint(iteration, 0.0, 0.0, float(first), spread, dict(ratios), losses,
                             excluded, replicates, below=first)
    cap = CAP * max(ratios)
    grid = np.concatenate([[0.0], np.geomspace(b0 / 64, cap, 400)])

    def fit(shift: float) -> float:  # least squares over the grid, every rung moved by shift·σ_B
        wide = {b: ratios[b] + shift * spread * math.sqrt(b / b0) for b in rungs}
        errors = [sum((wide[b] - (b0 + c) / (b + c)) ** 2 for b in rungs) for c in grid]
        return float(grid[int(np.argmin(errors))])

    central = fit(0.0)
    # every rung is read against one B0 curve: their errors move together, so the ends are
    # the fits of all rungs shifted jointly by ∓z σ√(B/B0) (a rung of B takes B0/B as many
    # steps as B0's: it varies √(B/B0) times more), never an intersection of the rungs
    low, high = min(fit(-z), central), max(fit(z), central)
    return CriticalPoint(iteration, central, low, high, spread, dict(ratios), losses,
                         excluded, replicates)


def replicate_spread(base: Sequence[tuple[int, float]],
                     replicate: Sequence[tuple[int, float]]) -> float:
    """σ of r from B0's two runs, each read against the other's curve (no clipping): the
    examples one needed for the other's final loss fall short of E by d in total, and a
    difference of two runs varies √2 times one run's r. One pair: one degree of freedom."""
    d = (1.0 - examples_ratio(base, replicate[-1][1])) + (
        1.0 - examples_ratio(replicate, base[-1][1]))
    return abs(d) / math.sqrt(2)


def progressed(curve: Sequence[tuple[int, float]]) -> bool:
    """B0's run lowered its loss (else nothing can be read against it)."""
    return len(curve) > 1 and math.isfinite(curve[-1][1]) and curve[-1][1] < curve[0][1]


def branch_point(run: Run, ladder: Sequence[int], seed: int, iteration: int,
               evaluations: int = B0_EVALUATIONS, z: float = Z) -> CriticalPoint | None:
    """The branches from one state at ``ladder`` = (B0, 2·B0, ...), B0 replicated at seed + 1;
    the fitted point, or None when B0's run made no progress. ``run`` must give every rung
    the same examples (E a multiple of the largest batch)."""
    b0 = ladder[0]
    base = run(b0, evaluations, seed)
    if not progressed(base):
        return None
    ends = {b0: base[-1][1]}
    ratios = {b0: 1.0}
    for batch in ladder[1:]:
        ends[batch] = run(batch, 1, seed)[-1][1]
        ratios[batch] = examples_ratio(base, ends[batch])
    # read both ways, so it takes B0's evaluations too (a diverged replicate gives d = 1)
    spread = max(replicate_spread(base, run(b0, evaluations, seed + 1)), MIN_SPREAD)
    return fit_point(ratios, b0, spread, iteration, ends, z, replicates=1)


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
    "outside",
    "progressed",
    "replicate_spread",
]
