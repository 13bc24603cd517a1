"""The branch test's statistics (train/branches.py, advise's plan): every rung sees the same
examples, σ is read from B0's two runs symmetrically with its n stated, the interval is not
narrowed by intersecting correlated rungs, and a rung the model cannot explain is excluded
and named rather than read as "B_crit small"."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from batchbound.advise.critical import MIN_STEPS, TooShort, plan_branches
from batchbound.errors import BatchboundError
from batchbound.train.branches import (
    MIN_SPREAD,
    branch_point,
    doubles,
    fit_point,
    replicate_spread,
)

E = 128


def model(b_crit: float, b0: int, batch: int) -> float:
    return (b0 + b_crit) / (batch + b_crit)


def test_every_rung_sees_the_same_examples() -> None:
    plan = plan_branches(16, n=10_000, largest=10_000, budget_examples=7015,
                         planned_examples=100_000, points=1)
    assert plan.ladder == (16, 32, 64, 128)
    seen = {b: plan.examples // b * b for b in plan.ladder}
    assert set(seen.values()) == {plan.examples} == {1280}  # not 1403 at B0, 1280 at 128
    # ratios made exactly from B_crit = 100, each rung's progress scaled by the examples it
    # saw over B0's: the plan's equal examples leave the fit unbiased (was 55 with 383)
    ratios = {b: model(100.0, 16, b) * seen[b] / seen[16] for b in plan.ladder}
    assert fit_point(ratios, 16, MIN_SPREAD, 1).critical_batch == pytest.approx(100, rel=0.03)


def test_a_budget_without_a_step_for_every_rung_is_refused() -> None:
    with pytest.raises(TooShort, match="branch budget") as caught:
        plan_branches(16, n=10_000, largest=10_000, budget_examples=3 * MIN_STEPS * 32 - 1,
                      planned_examples=100_000, points=1)
    assert caught.value.needed == 3 * MIN_STEPS * 32 and isinstance(caught.value,
                                                                     BatchboundError)
    assert "\n" not in str(caught.value)


def linear(stop: float, start: float = 1.0) -> list[tuple[int, float]]:
    return [(E * k // 8, start + (stop - start) * k / 8) for k in range(9)]


def test_the_replicate_is_read_both_ways() -> None:
    base, better = linear(0.5), linear(0.3)  # the replicate ends below B0's own minimum
    # base's 0.5 is where the replicate was at 5/7 of E: d = 2/7 either way round
    assert replicate_spread(base, better) == pytest.approx((2 / 7) / math.sqrt(2))
    assert replicate_spread(better, base) == pytest.approx(replicate_spread(base, better))

    def run(batch: int, evaluations: int, seed: int) -> list[tuple[int, float]]:
        if batch == 16:
            return better if seed == 8 else base
        return [(0, 1.0), (E, 1.0 - 0.5 * 0.9)]

    point = branch_point(run, [16, 32, 64], seed=7, iteration=3)
    assert point is not None
    assert point.spread == pytest.approx(0.2020, abs=1e-3)  # was the 0.1 floor (σ = 0)
    assert point.replicates == 1 and point.to_dict()["spread_n"] == 1
    assert "n = 1" in point.text()


def test_the_interval_covers_when_the_rungs_vary_independently() -> None:
    """Each rung's r off by its own N(0, σ√(B/B0)): the ±2σ interval must hold the truth at
    least ~95 % of the time; intersecting the rungs' ±2σ bands held it 92 % here (≈ 0.95³
    less the clipping), the joint shift 100 %."""
    rng = np.random.default_rng(0)
    b0, ladder, truth, sigma = 16, [32, 64, 128], 24.0, 0.03
    covered = 0
    draws = 300
    for _ in range(draws):
        ratios = {b0: 1.0} | {b: model(truth, b0, b) + rng.normal(0, sigma * math.sqrt(b / b0))
                             for b in ladder}
        point = fit_point(ratios, b0, sigma, 1)
        covered += point.low <= truth <= point.high
    assert covered / draws >= 0.97


def test_a_rung_outside_the_model_is_excluded_and_named() -> None:
    point = fit_point({16: 1.0, 32: 0.9, 64: 0.0}, 16, MIN_SPREAD, 1)
    assert set(point.excluded) == {64} and "outside the model" in point.excluded[64]
    assert point.critical_batch == pytest.approx(128, rel=0.03)  # 32's alone; was 7.6
    assert point.to_dict()["excluded"] == {"64": point.excluded[64]}
    assert "excluded: B = 64" in point.text()
    diverged = fit_point({16: 1.0, 32: 0.9, 64: 0.0}, 16, MIN_SPREAD, 1,
                         {16: 0.5, 32: 0.55, 64: math.inf})
    assert diverged.excluded == {64: "diverged"}


def test_no_rung_left_is_a_bound_not_a_number() -> None:
    point = fit_point({16: 1.0, 32: 0.3, 64: 0.1}, 16, MIN_SPREAD, 1)
    assert point.below == 32 and set(point.excluded) == {32, 64}
    assert point.to_dict()["critical_batch"] is None and point.to_dict()["below"] == 32
    assert "below 32" in point.text()
    assert not doubles(point)


def test_advises_text_names_exclusions_n_and_the_early_assumption() -> None:
    from batchbound.advise.advice import _critical_text

    points = [fit_point({16: 1.0, 32: 0.9, 64: 0.0}, 16, MIN_SPREAD, 40),
              fit_point({16: 1.0, 32: 0.3, 64: 0.1}, 16, MIN_SPREAD, 80)]
    text = _critical_text(points, [], None)
    assert "excluded: B = 64" in text and "n = 1" in text
    assert "below 32" in text  # the second point is a bound
    assert "before iteration 40 (the first branch point)" in text


def test_a_bound_is_inconclusive_not_a_prediction(monkeypatch) -> None:
    """Every rung outside the model (fortunes GPT, AdamW: r = 0.42 at 32, 0.00 at 64) leaves
    only "below 32": advise's measure() calls that inconclusive (the noise scale predicts),
    where it used to hand the bound on as B_crit 0 (869 iterations at every B, measured
    658/490/434)."""
    import batchbound.advise.critical as critical
    from batchbound.train.config import TrainConfig

    bound = fit_point({16: 1.0, 32: 0.42, 64: 0.0}, 16, MIN_SPREAD, 42)
    assert bound.below == 32
    monkeypatch.setattr(critical, "branch_point", lambda *args, **kwargs: bound)
    plan = plan_branches(16, n=10_000, largest=64, budget_examples=4 * 640,
                         planned_examples=100_000, points=1)
    state = (42, 0.5, {}, {})
    config = TrainConfig(dataset="digits", model="fc(depth=1,params=800)", batch_size=16)
    data = SimpleNamespace(n_train=10_000)
    with pytest.raises(critical.Inconclusive, match="below 32") as caught:
        critical.measure([state], config, data, None, plan, lambda b: 0.1)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value) and "no value to predict from" in str(caught.value)
