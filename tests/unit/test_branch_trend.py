"""The warmup's branch test read on B0's trend (train/branch_trend.py): σ from B0's own
scatter checked against a float64 calibration-line formula and by simulation, the decision
on constructed losses (×4, ×2, none), and the doubling cadence."""

from __future__ import annotations

import math

import numpy as np
import pytest

from batchbound.train.branch_trend import growth, next_test, trend, trend_point, trend_spread
from batchbound.train.branches import MIN_SPREAD

E = 128  # examples per constructed branch


def runs(ends: dict[int, float], base: list[float]):
    """A ``run`` whose B0 branch passes through ``base`` (evenly over E examples) and whose
    other branches end at ``ends``; it records its calls."""
    calls: list[tuple[int, int, int]] = []

    def run(batch: int, evaluations: int, seed: int) -> list[tuple[int, float]]:
        calls.append((batch, evaluations, seed))
        if batch == min(ends):
            k = len(base) - 1
            return [(E * j // k, v) for j, v in enumerate(base)]
        return [(0, base[0]), (E, ends[batch])]

    return run, calls


def line(noise: list[float] | None = None) -> list[float]:
    """B0's loss falling from 1 to 0.5 over E in 8 steps, plus ``noise``."""
    noise = noise or [0.0] * 9
    return [1.0 - 0.5 * j / 8 + noise[j] for j in range(9)]


def at(ratio: float) -> float:
    """The loss on the line after ratio·E examples."""
    return 1.0 - 0.5 * ratio


def test_the_spread_is_the_calibration_lines_inverse_prediction_error():
    """σ = s·√(1 + 1/k + (E − ē)²/Sxx)/(|b|·E), s from the residuals with k − 2 degrees of
    freedom, computed here by hand in float64 from the textbook sums."""
    rng = np.random.default_rng(3)
    base = line(list(rng.normal(0, 0.03, 9)))
    curve = [(E * j // 8, v) for j, v in enumerate(base)]
    fitted = trend(curve)
    assert fitted is not None
    x = np.array([e for e, _ in curve], dtype=np.float64)
    y = np.array(base, dtype=np.float64)
    xm, ym = x.mean(), y.mean()
    sxx = ((x - xm) ** 2).sum()
    b = ((x - xm) * (y - ym)).sum() / sxx
    a = ym - b * xm
    s = math.sqrt(((y - a - b * x) ** 2).sum() / 7)
    assert fitted[:3] == pytest.approx((a, b, s), rel=1e-9)
    expected = s * math.sqrt(1 + 1 / 9 + (E - xm) ** 2 / sxx) / (abs(b) * E)
    assert trend_spread(curve, fitted) == pytest.approx(expected, rel=1e-12)


def test_the_spread_covers_a_rung_that_is_as_good_as_b0_about_as_often_as_it_says():
    """Simulation: B0's curve and a rung ending where B0's line does (r = 1), both with
    Gaussian scatter; |r̂ − 1| ≤ σ̂ (z = 1) should hold about 68 % of the time (the t
    quantile with 7 df and σ̂'s own spread make it a little less; the floor is off here)."""
    rng = np.random.default_rng(0)
    hits, trials = 0, 2000
    for _ in range(trials):
        base = line(list(rng.normal(0, 0.02, 9)))
        curve = [(E * j // 8, v) for j, v in enumerate(base)]
        fitted = trend(curve)
        assert fitted is not None
        a, b, _, _ = fitted
        end = at(1.0) + rng.normal(0, 0.02)
        r = (end - a) / b / E
        hits += abs(r - 1.0) <= trend_spread(curve, fitted)
    assert 0.60 <= hits / trials <= 0.72, hits / trials


@pytest.mark.parametrize("r2, r4, noise, expected", [
    (1.0, 1.0, 0.0, 4),  # 2B and 4B as good per example as B: B_crit ≫ 4B
    (0.9, 0.7, 0.0, 2),  # B_crit ≈ 6B: above 2B with confidence, not above 4B
    (0.75, 0.6, 0.0, 1),  # exactly B_crit = 2B: not *above* it with confidence
    (0.5, 0.25, 0.0, 1),  # B_crit = 0: a larger batch wastes its examples
    (1.0, 1.0, 0.2, 1),  # B0's curve is mostly scatter: the test cannot tell
])
def test_the_growth_on_constructed_losses(r2, r4, noise, expected):
    b0 = 16
    wiggle = [0.0, noise, -noise, noise, -noise, noise, -noise, noise, 0.0]
    run, calls = runs({b0: 0.5, 2 * b0: at(r2), 4 * b0: at(r4)}, line(wiggle))
    point = trend_point(run, [b0, 2 * b0, 4 * b0], seed=7, iteration=100, evaluations=8, z=1.0)
    assert point is not None
    if noise == 0:
        assert point.ratios[2 * b0] == pytest.approx(r2)
        assert point.ratios[4 * b0] == pytest.approx(r4)
        assert point.spread == MIN_SPREAD  # no scatter: the floor
    assert growth(point) == expected
    assert point.replicates == 7  # k − 2 degrees of freedom
    # B0 (evaluated along the way), 2B, 4B, and no replicate
    assert calls == [(16, 8, 7), (32, 1, 7), (64, 1, 7)]


def test_no_progress_by_the_trend_grows_nothing_and_runs_nothing_else():
    run, calls = runs({16: 0.5, 32: 0.1, 64: 0.1}, [1.0, 0.9, 1.1, 1.0, 1.05, 0.95, 1.0, 1.1, 1.0])
    assert trend_point(run, [16, 32, 64], 7, 100, 8, 1.0) is None
    assert growth(None) == 1
    assert calls == [(16, 8, 7)]


def test_a_diverged_rung_is_excluded_and_four_needs_its_rung():
    run, _ = runs({16: 0.5, 32: at(1.0), 64: math.inf}, line())
    point = trend_point(run, [16, 32, 64], 7, 100, 8, 1.0)
    assert point is not None and point.excluded == {64: "diverged"}
    assert growth(point) == 2  # 4 needs the 4B rung fitted
    run, _ = runs({16: 0.5, 32: at(1.0)}, line())
    assert growth(trend_point(run, [16, 32], 7, 100, 8, 1.0)) == 2  # no 4B rung run


def test_the_cadence_doubles_the_examples_between_tests():
    assert [next_test(e, 800) for e in (0, 799, 800, 1599, 1600, 5000)] == \
        [800, 800, 1600, 1600, 3200, 6400]
