"""Batch-size warmup's branch test: B0's chance variation read from its own curve, not a replicate.

The branch test of train/branches.py spends a fourth run, B0 again at another data order, to
measure the chance variation from one pair (n = 1). In a warmup that is the test's dearest
part: it takes as many steps as B0's run, the most of any rung, and its one-pair σ swings
from the floor to 0.7 between tests at the same point of a run (mnist5k fc, B0 = 16), so the
test is inconclusive whatever the rungs show. Here the variation comes from B0's run alone:
its k evaluations along E examples are fitted by a straight line L(e) = a + b·e (b < 0: the
run progressed), whose residuals give the loss's scatter s about its trend with k − 2
degrees of freedom. A rung's final loss L_B is read on that line, e*(B) = (L_B − a)/b, and
r(B) = e*(B)/E as before. An error s in L_B moves r by s/(|b|·E), and the line's own
uncertainty at E adds the inverse-prediction term of a calibration line, so

    σ = s·√(1 + 1/k + (E − ē)²/Sxx) / (|b|·E),   floored at branches.MIN_SPREAD.

What this σ holds: the iterate's step-to-step scatter (which dominates short SGD branches)
and the trend's uncertainty; not how far two data orders drift apart beyond that scatter,
nor a curve that bends over E (a bend shows up as a larger s, so it widens the band). The fit
of B_crit and its interval are branches.fit_point's, unchanged.

The doubling decision: B grows by 4 when the interval's low end is at least 4·B0 (and the
rung at 4·B0 was run and fitted), by 2 when it is at least 2·B0, else not.

The cadence: the first test is due once the run has trained on every·B0 examples, each
next one at the first every·B0·2^j beyond the examples trained on at the last. The
critical batch follows the loss, which moves by about as much per doubling of
the examples trained on as per the one before, so tests at doubling example counts sample
it evenly while their number stays logarithmic in the run's length and their cost, a fixed
number of B-sized steps per test, falls as a share of the run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from batchbound.train.branches import MIN_SPREAD, CriticalPoint, Run, fit_point

MIN_POINTS = 4  # B0's curve needs this many evaluations (k − 2 ≥ 2 degrees of freedom)


def trend(curve: Sequence[tuple[int, float]]) -> tuple[float, float, float, int] | None:
    """(a, b, s, k): the least-squares line L = a + b·e through B0's curve and the residuals'
    standard deviation (k − 2 degrees of freedom); None when it has too few finite points or
    its line does not fall (b ≥ 0: no progress to read the other rungs against)."""
    if len(curve) < MIN_POINTS or not all(math.isfinite(v) for _, v in curve):
        return None
    e = np.array([x for x, _ in curve], dtype=np.float64)
    loss = np.array([v for _, v in curve], dtype=np.float64)
    b, a = np.polyfit(e, loss, 1)
    if not b < 0:
        return None
    residual = loss - (a + b * e)
    s = math.sqrt(float(residual @ residual) / (len(curve) - 2))
    return float(a), float(b), s, len(curve)


def trend_spread(curve: Sequence[tuple[int, float]], fitted: tuple[float, float, float, int]
                 ) -> float:
    """σ of r read on the line at E (module docstring), before the floor."""
    _, b, s, k = fitted
    e = np.array([x for x, _ in curve], dtype=np.float64)
    total = float(e[-1])
    sxx = float(((e - e.mean()) ** 2).sum())
    return s * math.sqrt(1 + 1 / k + (total - e.mean()) ** 2 / sxx) / (abs(b) * total)


def trend_point(run: Run, ladder: Sequence[int], seed: int, iteration: int,
                evaluations: int, z: float) -> CriticalPoint | None:
    """The branches from one state at ``ladder`` = (B0, 2·B0, ...), each over the same E
    examples (``run`` as in train/branches.py), read on B0's trend line; None when B0's run
    did not progress by its trend. No replicate is run."""
    b0 = ladder[0]
    base = run(b0, evaluations, seed)
    fitted = trend(base)
    if fitted is None:
        return None
    a, b, _, k = fitted
    total = base[-1][0]
    ratios, ends = {b0: 1.0}, {b0: base[-1][1]}
    for batch in ladder[1:]:
        ends[batch] = run(batch, 1, seed)[-1][1]
        ratios[batch] = (ends[batch] - a) / b / total if math.isfinite(ends[batch]) else 0.0
    spread = max(trend_spread(base, fitted), MIN_SPREAD)
    return fit_point(ratios, b0, spread, iteration, ends, z, replicates=k - 2)


def growth(point: CriticalPoint | None) -> int:
    """The factor on B: 4 when the interval's low end is ≥ 4·B0 and the 4·B0 rung was fitted,
    2 when it is ≥ 2·B0, else 1 (no point: 1)."""
    if point is None or point.below is not None:
        return 1
    b0 = min(point.ratios)
    if 4 * b0 in point.ratios and 4 * b0 not in point.excluded and point.low >= 4 * b0:
        return 4
    return 2 if point.low >= 2 * b0 else 1


def next_test(examples: int, first: int) -> int:
    """The example count the next test is due at: the least first·2^j above ``examples``."""
    due = first
    while due <= examples:
        due *= 2
    return due


__all__ = ["MIN_POINTS", "growth", "next_test", "trend", "trend_point", "trend_spread"]
