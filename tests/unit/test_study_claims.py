"""The claim registry's verdicts on tables whose answer is known: a clear effect is
supported, a reversed one contradicted, a weak or unreplicated one inconclusive, and a claim
about a dimension the study does not vary is not shown."""

from __future__ import annotations

import math
from itertools import permutations

import numpy as np
import pandas as pd
import pytest

from batchbound.study import analysis as A
from batchbound.study.claims import (
    CLAIMS,
    CONTRADICTED,
    INCONCLUSIVE,
    SUPPORTED,
    Context,
    evaluate,
)
from batchbound.study.evidence import (
    Evidence,
    bootstrap_units,
    permutation_p,
    rank_correlation,
)

BATCHES = [16, 32, 64, 128, 256, 512, 1024]


def per_run(thresholds: dict[int, float], seeds: int = 3, noise: float = 0.05,
            width: dict[int, int] | None = None) -> pd.DataFrame:
    """Runs whose epochs to target are 1 up to the depth's threshold B* and 3 beyond it,
    with multiplicative noise per run."""
    rng = np.random.default_rng(0)
    rows = []
    for depth, b_star in thresholds.items():
        for batch in BATCHES:
            for seed in range(seeds):
                epochs = (1.0 if batch <= b_star else 3.0) * math.exp(noise * rng.normal())
                rows.append({"key": f"{depth}-{batch}-{seed}", "model_label": f"L={depth}",
                             "depth": depth, "width": (width or {}).get(depth, 100 - depth),
                             "batch_size": batch, "seed": seed, "epochs": epochs,
                             "iterations": epochs * 1000 / batch, "reached": True,
                             "diverged": False, "n_train": 1000})
    return pd.DataFrame(rows)


def verdict(runs: pd.DataFrame, name: str) -> str:
    context = Context(evidence=Evidence(runs, draws=200), budget=2.0, max_batch=1024.0)
    return CLAIMS[name].test(context).verdict


def test_rank_correlation_and_exact_permutation_p():
    assert rank_correlation([1, 2, 3, 4, 5], [5, 4, 3, 2, 1]) == pytest.approx(-1)
    assert rank_correlation([1, 2, 3], [math.inf, 2, 1]) == pytest.approx(-1)  # a miss ranks last
    assert rank_correlation([1, 2, 3], [7, 7, 7]) == 0  # no variation: no evidence
    # a perfect ordering of 5 points is one of 5! orderings
    assert permutation_p([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], +1) == pytest.approx(1 / 120)
    # the brute-force count agrees on a tied, unordered case
    x, y = [1, 2, 3, 4], [2, 1, 4, 4]
    observed = rank_correlation(x, y)
    count = sum(rank_correlation(x, [y[i] for i in p]) >= observed - 1e-12
                for p in permutations(range(4)))
    assert permutation_p(x, y, +1) == pytest.approx(count / 24)


def test_clear_trend_is_supported_reversed_is_contradicted():
    falling = per_run({1: 512, 2: 256, 3: 128, 4: 64, 5: 32})
    assert verdict(falling, "threshold_falls_with_depth") == SUPPORTED
    rising = per_run({1: 32, 2: 64, 3: 128, 4: 256, 5: 512})
    assert verdict(rising, "threshold_falls_with_depth") == CONTRADICTED


def test_no_trend_is_inconclusive_not_contradicted():
    flat = per_run({1: 32, 2: 32, 3: 32, 4: 32, 5: 32})
    assert verdict(flat, "threshold_falls_with_depth") == INCONCLUSIVE
    noisy = per_run({1: 64, 2: 32, 3: 64, 4: 32, 5: 64}, noise=0.4)
    assert verdict(noisy, "threshold_falls_with_depth") == INCONCLUSIVE


def test_weak_correlation_on_five_points_is_inconclusive():
    # ρ = 0.3 between depth and B*: the sign alone once made this "supported"
    weak = per_run({1: 64, 2: 256, 3: 32, 4: 128, 5: 64})
    rho = rank_correlation([1, 2, 3, 4, 5], [64, 256, 32, 128, 64])
    assert abs(rho) < 0.5
    assert verdict(weak, "threshold_falls_with_depth") == INCONCLUSIVE


def test_one_run_per_cell_claims_nothing():
    single = per_run({1: 512, 2: 256, 3: 128, 4: 64, 5: 32}, seeds=1)
    context = Context(evidence=Evidence(single, draws=50), budget=2.0, max_batch=1024.0)
    finding = CLAIMS["threshold_falls_with_depth"].test(context)
    assert finding.verdict == INCONCLUSIVE and "no spread" in finding.evidence


def test_three_regimes_need_a_linear_start_and_a_stagnant_end():
    rng = np.random.default_rng(1)

    def runs(iterations):
        return pd.DataFrame([
            {"key": f"{b}-{s}", "model_label": "M", "batch_size": b, "seed": s,
             "iterations": iterations(b) * math.exp(0.02 * rng.normal()), "epochs": 1.0,
             "reached": True, "diverged": False}
            for b in [16, 32, 64, 128, 256, 512, 1024, 2048, 4096] for s in range(3)])

    # S(B) = S_min(1 + B_crit/B): α ≈ 0.85 at the first step, ≈ 0.04 at the last
    assert verdict(runs(lambda b: 100 * (1 + 128 / b)), "three_regimes") == SUPPORTED
    # perfect scaling all the way: it never stagnates
    assert verdict(runs(lambda b: 1e5 / b), "three_regimes") != SUPPORTED
    # no step is linear: the old rule called this "supported" when the tail was flat
    assert verdict(runs(lambda b: 100 * (1 + 4 / b)), "three_regimes") != SUPPORTED


def test_three_regimes_read_a_missed_largest_batch_as_censored_not_stagnant():
    # perfect scaling to B = 2048, then B = 4096 misses the target within the budget: its α
    # is only bounded, log(k_2048 / K_4096)/log 2 with K = max_epochs·n/4096 (−∞ before,
    # which "supported" stagnation that the runs never showed)
    n = 100_000

    def runs(max_reached: int) -> pd.DataFrame:
        return pd.DataFrame([
            {"key": f"{b}-{s}", "model_label": "M", "batch_size": b, "seed": s,
             "n_train": n, "iterations": 1e5 / b if b <= max_reached else math.inf,
             "epochs": 1e5 / n if b <= max_reached else math.inf,
             "reached": b <= max_reached, "diverged": False}
            for b in [16, 32, 64, 128, 256, 512, 1024, 2048, 4096] for s in range(3)])

    def finding(max_epochs: float):
        context = Context(evidence=Evidence(runs(2048), draws=50), budget=2.0,
                          max_batch=4096.0, spec={"train": {"max_epochs": max_epochs}})
        return CLAIMS["three_regimes"].test(context)

    # 1.5 epochs: K = 36.6 against k_2048 = 48.8, α ≤ 0.41: no sign of stagnation
    loose = finding(1.5)
    assert loose.verdict != SUPPORTED
    assert "censored" in loose.evidence and "≤ 0.415" in loose.evidence
    # a bound never contradicts: 1.05 epochs, K = 25.6, α ≤ 0.93
    assert finding(1.05).verdict != CONTRADICTED
    # 2.2 epochs: B = 4096 missed in more iterations (K = 53.7) than B = 2048 needed, so
    # α ≤ −0.14: stagnant whatever the censored value
    assert finding(2.2).verdict == SUPPORTED


def test_claims_apply_only_to_what_the_study_varies():
    one_depth = per_run({2: 128}).assign(width=50)
    context = Context(evidence=Evidence(one_depth, draws=20), budget=2.0, max_batch=1024.0)
    names = {f.claim for f in evaluate(context)}
    assert not any("depth" in n or "width" in n.lower() for n in names)
    assert any("threshold B*" in n for n in names)  # B varies: that claim applies


def test_threshold_claim_counts_models_that_never_train():
    runs = per_run({1: 64, 2: 128})
    never = runs[runs["depth"] == 2].assign(model_label="L=9", depth=9, epochs=math.inf,
                                            iterations=math.inf, reached=False)
    finding = CLAIMS["threshold_exists"].test(Context(
        evidence=Evidence(pd.concat([runs, never]), draws=100), budget=2.0, max_batch=1024.0))
    assert finding.verdict == SUPPORTED and "1 model(s) never reach" in finding.evidence


def test_censored_runs_enter_the_critical_batch_fit():
    rows = []
    for b in [16, 32, 64, 128, 256, 512, 1024]:
        for seed in range(2):
            s = 100 * (1 + 64 / b)
            rows.append({"model_label": "M", "batch_size": b, "seed": seed,
                         "iterations": s, "ran_iterations": s, "diverged": False})
    exact = pd.DataFrame(rows)
    # the two largest batches stopped short of the target after 3× the iterations the
    # curve predicts: dropping them hides that; censored, they lift the fitted curve there
    censored = exact.assign(iterations=np.where(exact["batch_size"] >= 512, math.inf,
                                                exact["iterations"]),
                            ran_iterations=np.where(exact["batch_size"] >= 512,
                                                    3 * exact["iterations"],
                                                    exact["ran_iterations"]))
    fit = A.critical_batch(censored, bootstrap=20).iloc[0]
    dropped = A.critical_batch(censored.drop(columns="ran_iterations"), bootstrap=0).iloc[0]
    assert dropped["b_crit"] == pytest.approx(64, rel=1e-2)
    def predicted(row, batch):
        return row["s_min"] * (1 + row["b_crit"] / batch)

    assert fit["censored"] == 4 and fit["points"] == 10
    assert predicted(fit, 1024) > 1.3 * predicted(dropped, 1024)
    assert fit["b_crit"] != pytest.approx(64, rel=0.1)
    # consistent censoring (stopped before the curve says it could reach) changes nothing
    early = censored.assign(ran_iterations=np.where(censored["batch_size"] >= 512,
                                                    0.5 * exact["iterations"],
                                                    censored["ran_iterations"]))
    assert A.critical_batch(early, bootstrap=0).iloc[0]["b_crit"] == pytest.approx(64, rel=1e-2)
    # diverged runs are left out and counted
    dead = exact.assign(diverged=exact["batch_size"] == 1024,
                        iterations=np.where(exact["batch_size"] == 1024, math.inf,
                                            exact["iterations"]))
    fit = A.critical_batch(dead, bootstrap=0).iloc[0]
    assert fit["diverged"] == 2 and fit["b_crit"] == pytest.approx(64, rel=1e-2)


def test_critical_batch_flags_outside_grid_and_one_run():
    rows = [{"model_label": "M", "batch_size": b, "seed": 0, "iterations": 100 * (1 + 5000 / b)}
            for b in [16, 32, 64, 128]]
    fit = A.critical_batch(pd.DataFrame(rows), bootstrap=10).iloc[0]
    assert fit["outside"] == "above" and fit["one_run"]
    assert fit["low"] == fit["high"]  # one run per batch: no spread, and flagged as such


def test_a_unit_bootstrap_resamples_whole_pairs():
    # the two runs of a stability pair are one unit: a draw takes both or neither, so the
    # spread's interval rests on the pairs (2 here), never on the runs (4)
    pairs = [np.array([0.80, 0.80]), np.array([0.90, 0.90])]

    def sd(v: np.ndarray) -> float:
        return float(np.std(v, ddof=1))

    draws = bootstrap_units(pairs, sd, draws=200)
    assert draws[0] == pytest.approx(sd(np.array([0.8, 0.8, 0.9, 0.9])))
    # a draw of one pair twice has no spread at all; one of each pair has the full one
    assert set(np.round(draws[1:], 12)) <= {0.0, round(draws[0], 12)}
    assert (draws[1:] == 0).any()
    assert math.isnan(bootstrap_units([], sd)[0])


def test_b_star_says_whether_it_or_only_its_interval_is_at_the_grid_edge():
    from batchbound.study.claims.width import _edge

    assert "at the grid edge: the smallest batch" in _edge(32, (32, 128), 32, 4096)
    inside = _edge(256, (128, 512), 64, 8192)  # inside 64-8192 with its interval
    assert "its interval reaches" not in inside and "grid edge" not in inside
    touching = _edge(128, (64, 128), 64, 8192)
    assert "its interval reaches the grid edge, the smallest batch" in touching
    assert "no flat part" not in touching
    assert "at the grid edge: the largest batch" in _edge(4096, (1024, 4096), 32, 4096)
    assert "its interval reaches the grid edge, the largest" in _edge(1024, (512, 4096), 32, 4096)
    both = _edge(4096, (32, 4096), 32, 4096)  # B* at the top, its interval over the whole grid
    assert "at the grid edge: the largest batch" in both and "interval reaches" in both
