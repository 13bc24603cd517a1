"""Analyses against small tables whose answers are computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from batchbound.study import analysis as A

INF = math.inf


def make_runs(epochs: dict, iterations_per_epoch: float = 10.0):
    """runs and targets tables from {(model, depth, width): {B: [epochs per seed]}}."""
    runs, targets = [], []
    for (label, depth, width), by_batch in epochs.items():
        for batch, values in by_batch.items():
            for seed, value in enumerate(values):
                key = f"{label}-{batch}-{seed}"
                runs.append({"key": key, "role": "final", "model_label": label, "depth": depth,
                             "width": width, "params": 100, "batch_size": batch, "seed": seed,
                             "status": "complete", "n_train": 100, "data": "d",
                             "strategy": "blr", "mechanism": "none"})
                reached = math.isfinite(value)
                targets.append({"key": key, "name": "train_acc>=0.9", "reached": int(reached),
                                "epoch": value if reached else None,
                                "iteration": value * iterations_per_epoch if reached else None})
    runs.append({**runs[0], "key": "tune-run", "role": "tune"})  # never counted
    targets.append({"key": "tune-run", "name": "train_acc>=0.9", "reached": 1, "epoch": 0.1,
                    "iteration": 1})
    return pd.DataFrame(runs), pd.DataFrame(targets)


EPOCHS = {
    ("A", 1, 10): {16: [2, 2, 3], 32: [2, 3, 3], 64: [3, 4, INF], 128: [INF, INF, 5]},
    ("B", 2, 5): {16: [INF, INF, INF], 32: [4, 4, 4], 64: [5, 5, 5], 128: [7, 8, 9]},
}


@pytest.fixture
def summary():
    runs, targets = make_runs(EPOCHS)
    per_run = A.per_run_to_target(runs, targets)
    assert len(per_run) == 24  # the tuning run is left out
    return A.summarize_to_target(per_run, "epochs")


def test_epochs_to_target_censored_not_dropped(summary):
    row = summary[(summary["model_label"] == "A") & (summary["batch_size"] == 64)].iloc[0]
    assert (row["runs"], row["censored"], row["median"], row["mean_reached"]) == (3, 1, 4, 3.5)
    assert row["std_reached"] == pytest.approx(math.sqrt(0.5))
    assert math.isinf(row["max"])
    row = summary[(summary["model_label"] == "A") & (summary["batch_size"] == 128)].iloc[0]
    assert math.isinf(row["median"]) and row["censored"] == 2 and row["mean_reached"] == 5


def test_threshold_batch(summary):
    b_star = A.threshold_batch(summary).set_index("model_label")["threshold_batch"]
    # A: 2, 3 (≤1.5·2), 4 (>1.5·2) → 32.  B: miss at 16 skipped; 4, 5 (≤6), 8 (>6) → 64
    assert b_star.to_dict() == {"A": 32, "B": 64}
    assert A.threshold_batch(summary, growth=2.5).set_index("model_label").loc[
        "B", "threshold_batch"] == 128


def test_largest_batch_within(summary):
    within = A.largest_batch_within(summary, 3.5).set_index("model_label")["largest_batch"]
    assert within["A"] == 32 and math.isnan(within["B"])
    within = A.largest_batch_within(summary, 8).set_index("model_label")["largest_batch"]
    assert within["A"] == 64 and within["B"] == 128


def test_speedup_and_regimes():
    ks = {16: 1000, 32: 500, 64: 300, 128: 280, 256: INF}
    summary = pd.DataFrame([{"model_label": "M", "batch_size": b, "median": k} for b, k in
                            ks.items()])
    s = A.speedup(summary).set_index("batch_size")
    assert s.loc[64, "speedup"] == pytest.approx(1000 / 300)
    assert s.loc[64, "ideal"] == 4 and s.loc[64, "efficiency"] == pytest.approx(1000 / 1200)
    assert s.loc[32, "alpha"] == pytest.approx(1.0)
    assert s.loc[64, "alpha"] == pytest.approx(math.log(5 / 3) / math.log(2))
    # B = 256 missed: censored, not stagnant, unless the budget bounds its α below 0.1
    assert s["regime"].tolist() == ["", "linear", "diminishing", "stagnant", "censored"]
    bounds = A.regime_boundaries(A.speedup(summary)).iloc[0]
    assert bounds["linear_until"] == 32 and math.isnan(bounds["stagnation_from"])
    # 256 had 3·16 000/256 = 187.5 iterations (< 280 at 128): α ≤ 0.58, still censored;
    # with 6 epochs, 375 > 280 iterations: α ≤ −0.42, stagnant
    for epochs, regime, start in ((3, "censored", math.nan), (6, "stagnant", 64)):
        s = A.speedup(summary.assign(n_train=16_000), max_epochs=epochs)
        assert s["regime"].iloc[-1] == regime
        assert s["alpha"].iloc[-1] == pytest.approx(math.log(280 / (epochs * 16_000 / 256))
                                                    / math.log(2))
        found = A.regime_boundaries(s).iloc[0]["stagnation_from"]
        assert found == start or (math.isnan(start) and math.isnan(found))


def test_speedup_starts_at_first_reached_batch():
    summary = pd.DataFrame([{"model_label": "M", "batch_size": b, "median": k}
                            for b, k in {16: INF, 32: 400, 64: 200}.items()])
    s = A.speedup(summary)
    assert s["batch_size"].tolist() == [32, 64] and s["speedup"].tolist() == [1.0, 2.0]


def steps_table(s_mins: dict, b_crit: float, seeds: int = 2):
    rows = []
    for label, s_min in s_mins.items():
        for batch in [16, 32, 64, 128, 256, 512, 1024]:
            for seed in range(seeds):
                rows.append({"model_label": label, "batch_size": batch, "seed": seed,
                             "iterations": s_min * (1 + b_crit / batch)})
    return pd.DataFrame(rows)


def test_critical_batch_recovers_the_tradeoff():
    table = steps_table({"M": 100.0}, 64.0)
    fit = A.critical_batch(table, bootstrap=20).iloc[0]
    assert fit["b_crit"] == pytest.approx(64, rel=1e-3)
    assert fit["s_min"] == pytest.approx(100, rel=1e-3)
    assert fit["e_min"] == pytest.approx(6400, rel=1e-3)
    assert fit["low"] == pytest.approx(64, rel=1e-3) == fit["high"]  # exact data: no spread
    assert not fit["at_bound"]
    # the points satisfy (S/S_min − 1)(E/E_min − 1) = 1 with E = S·B
    s, b = table["iterations"], table["batch_size"]
    product = (s / fit["s_min"] - 1) * (s * b / fit["e_min"] - 1)
    assert np.allclose(product, 1, rtol=1e-2)


def test_critical_batch_joint_and_noisy():
    table = steps_table({"M": 100.0, "N": 300.0}, 200.0)
    joint = A.critical_batch(table, by=[], bootstrap=10).iloc[0]
    assert joint["b_crit"] == pytest.approx(200, rel=1e-3) and joint["points"] == 28
    rng = np.random.default_rng(1)
    noisy = table.assign(iterations=table["iterations"] * rng.lognormal(0, 0.05, len(table)))
    fit = A.critical_batch(noisy, bootstrap=50).set_index("model_label")
    assert fit.loc["M", "b_crit"] == pytest.approx(200, rel=0.25)
    assert fit.loc["M", "low"] < fit.loc["M", "high"]
    censored = table.assign(iterations=np.where(table["batch_size"] > 64, INF,
                                                table["iterations"]))
    assert A.critical_batch(censored, bootstrap=5).iloc[0]["points"] == 6  # 3 B × 2 seeds


def curve_tables():
    runs = pd.DataFrame([
        {"key": "a16", "role": "final", "model_label": "A", "depth": 1, "width": 10,
         "batch_size": 16, "n_train": 100},
        {"key": "a16b", "role": "final", "model_label": "A", "depth": 1, "width": 10,
         "batch_size": 16, "n_train": 100},
        {"key": "a64", "role": "final", "model_label": "A", "depth": 1, "width": 10,
         "batch_size": 64, "n_train": 100},
        {"key": "a64b", "role": "final", "model_label": "A", "depth": 1, "width": 10,
         "batch_size": 64, "n_train": 100},
        {"key": "b16", "role": "final", "model_label": "B", "depth": 2, "width": 5,
         "batch_size": 16, "n_train": 100},
    ])
    loss = [("a16", [0, 10, 20], [2.0, 1.0, 0.5]), ("a16b", [0, 10], [2.0, 0.8]),
            ("a64", [0, 10, 20, 30], [4, 3, 2, 1]), ("a64b", [0, 10], [5, 1]),
            ("b16", [0, 10], [2.0, 1.5])]
    curves = pd.DataFrame([{"key": k, "iteration": i, "epoch": i / 10, "metric": "train_loss",
                            "value": v} for k, its, vs in loss for i, v in zip(its, vs,
                                                                                strict=True)])
    deltas = [("a16", [0, 10, 20], [0.1, 0.2, 0.3]), ("a16b", [0, 10], [0.2, 0.4]),
              ("a64", [0], [9.0]), ("b16", [0, 10], [1.0, 5.0])]
    diversity = pd.DataFrame([{"key": k, "iteration": i, "epoch": i / 10, "metric": m,
                               "value": v * (100 if m == "batch_bound" else 1)}
                              for k, its, vs in deltas for i, v in zip(its, vs, strict=True)
                              for m in ("diversity", "batch_bound")])
    return runs, curves, diversity


def test_loss_threshold_rule():
    runs, curves, _ = curve_tables()
    thresholds = A.loss_threshold(runs, curves).set_index("model_label")["threshold"]
    # A's largest batch (64) recorded [4, 3, 2, 1, 5, 1]: lower quartile 1.25
    assert thresholds["A"] == pytest.approx(1.25)
    assert thresholds["B"] == pytest.approx(np.quantile([2.0, 1.5], 0.25))
    hits = A.per_run_to_loss(runs, curves, A.loss_threshold(runs, curves)).set_index("key")
    assert hits.loc["a64", "iterations"] == 30 and hits.loc["a64b", "iterations"] == 10
    assert hits.loc["a16", "iterations"] == 10 and hits.loc["a16b", "iterations"] == 10  # 1.0, 0.8
    assert hits.loc["a64", "epochs"] == 3.0 and bool(hits["reached"].all())


def test_loss_threshold_is_nan_when_the_largest_batch_never_trained():
    """An unstable largest batch (loss up, not 10× up: not diverged) puts the quartile above
    the initial loss; every run would reach it at iteration 0 (k = 0, a division by zero in
    the speedup). No threshold then, and no loss-threshold speedup."""
    runs, curves, _ = curve_tables()
    unstable = curves["key"].isin(["a64", "a64b"]) & (curves["iteration"] > 0)
    curves.loc[unstable, "value"] = 30.0  # started at 4 and 5, then stuck at 30
    thresholds = A.loss_threshold(runs, curves).set_index("model_label")["threshold"]
    assert math.isnan(thresholds["A"]) and not math.isnan(thresholds["B"])
    hits = A.per_run_to_loss(runs, curves, A.loss_threshold(runs, curves)).set_index("key")
    assert not hits.loc[["a16", "a16b", "a64", "a64b"], "reached"].any()
    speedups = A.speedup(A.summarize_to_target(hits.reset_index(), "iterations"))
    assert set(speedups["model_label"]) == {"B"}


def test_diversity_over_training_and_at_matched_loss():
    runs, curves, diversity = curve_tables()
    summary = A.diversity_summary(runs, diversity, curves).set_index("model_label")
    assert summary.loc["A", "batch_size"] == 16  # the smallest batch is the reference
    assert summary.loc["A", "delta_mean"] == pytest.approx(0.25)  # runs average 0.2 and 0.3
    assert summary.loc["A", "bound_mean"] == pytest.approx(25)
    assert summary.loc["B", "delta_mean"] == pytest.approx(3.0)
    # ℓ* = max(min loss of A = 0.5, min loss of B = 1.5) = 1.5
    assert summary.loc["A", "matched_loss"] == 1.5
    assert summary.loc["A", "delta_matched"] == pytest.approx(0.3)  # (0.2 + 0.4) / 2
    assert summary.loc["B", "delta_matched"] == pytest.approx(5.0)
    along = A.diversity_along_training(runs, diversity)
    assert len(along) == 8 and set(along.columns) >= {"diversity", "batch_bound", "epoch"}


def test_tuning_rules():
    from batchbound.study.tuning import choose_step_sizes, final_loss

    summary = pd.DataFrame([
        # cell a: η=0.1 lowest loss; η=0.3 fewest steps
        {"cell": "a", "lr": 0.1, "seed": 0, "final_loss": 0.20, "iterations": 300.0},
        {"cell": "a", "lr": 0.1, "seed": 1, "final_loss": 0.30, "iterations": 320.0},
        {"cell": "a", "lr": 0.3, "seed": 0, "final_loss": 0.10, "iterations": 100.0},
        {"cell": "a", "lr": 0.3, "seed": 1, "final_loss": 0.50, "iterations": math.nan},
        {"cell": "a", "lr": 1.0, "seed": 0, "final_loss": INF, "iterations": math.nan},
        {"cell": "a", "lr": 1.0, "seed": 1, "final_loss": INF, "iterations": math.nan},
        # cell b: nobody reaches the target; a tie in loss goes to the smaller η
        {"cell": "b", "lr": 0.3, "seed": 0, "final_loss": 0.4, "iterations": math.nan},
        {"cell": "b", "lr": 0.1, "seed": 0, "final_loss": 0.4, "iterations": math.nan},
    ])
    # mean losses: 0.1 → 0.25, 0.3 → 0.30, 1.0 → ∞
    assert choose_step_sizes(summary, "lowest_loss_2_epochs") == {"a": 0.1, "b": 0.1}
    # median steps: 0.1 → 310, 0.3 → median(100, ∞) = ∞, so 0.1 wins on steps too
    assert choose_step_sizes(summary, "fewest_steps") == {"a": 0.1, "b": 0.1}
    one_seed = summary[summary["seed"] == 0]
    assert choose_step_sizes(one_seed, "fewest_steps")["a"] == 0.3
    assert choose_step_sizes(one_seed, "lowest_loss_2_epochs")["a"] == 0.3
    curves = pd.DataFrame({"iteration": [0, 20, 10], "metric": ["train_loss"] * 3,
                           "value": [2.0, 0.5, 1.0]})
    assert final_loss(curves, "complete") == 0.5  # the last by iteration, not by row
    assert final_loss(curves, "diverged") == INF


def test_each_cells_bootstrap_draws_are_its_own():
    from batchbound.study.evidence import bootstrap_units, means

    # one seed for every cell resampled each at the same positions: two cells' draws moved
    # together (correlation 1 here), so a rank correlation across cells barely varied
    low, high = np.arange(1.0, 6.0), np.arange(10.0, 60.0, 10.0)
    a, b = means(low)[1:], means(high)[1:]
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.3
    assert np.array_equal(means(low), means(low.copy()))  # same values, same draws
    pairs = [np.array([1.0, 2.0]), np.array([3.0, 5.0]), np.array([4.0, 9.0])]
    shifted = [p + 100 for p in pairs]
    assert abs(np.corrcoef(bootstrap_units(pairs)[1:], bootstrap_units(shifted)[1:])[0, 1]) < 0.3
    # a fit's interval rests on its own model's runs: adding another model leaves it alone
    one = steps_table({"M": 100.0}, 200.0, seeds=3)
    rng = np.random.default_rng(3)
    one = one.assign(iterations=one["iterations"] * rng.lognormal(0, 0.1, len(one)))
    two = pd.concat([steps_table({"A": 50.0}, 100.0, seeds=3), one])
    alone = A.critical_batch(one, bootstrap=40).set_index("model_label").loc["M"]
    beside = A.critical_batch(two, bootstrap=40).set_index("model_label").loc["M"]
    assert (alone["low"], alone["high"]) == (beside["low"], beside["high"])


def test_tables_built_row_by_row_keep_the_spec_order_and_strategies_shorten_in_place():
    order = ["d", "d | replicate(r=8)", "d | replicate(r=64)", "d | replicate(r=512)"]
    runs = pd.DataFrame({"data": pd.Categorical(order, categories=order, ordered=True)})
    table = pd.DataFrame({"data": sorted(order * 2), "batch_size": [16, 64] * 4})
    out = A.in_spec_order(table, runs)
    assert list(dict.fromkeys(out["data"])) == order
    assert list(out["batch_size"]) == [16, 64] * 4  # stable within a data set
    strategies = ["blr", "lsr(base_batch=16)", None]
    runs = pd.DataFrame({"strategy": pd.Categorical(strategies, categories=strategies[:2],
                                                    ordered=True)})
    short = A.short_strategies(runs)["strategy"]
    assert list(short.cat.categories) == ["blr", "lsr"] and short.isna().tolist()[2]


def test_an_interval_stays_when_a_model_on_other_data_joins():
    one = steps_table({"M": 100.0}, 200.0, seeds=3).assign(data="a")
    rng = np.random.default_rng(3)
    one = one.assign(iterations=one["iterations"] * rng.lognormal(0, 0.1, len(one)))
    other = steps_table({"N": 50.0}, 100.0, seeds=3).assign(data="b")
    alone = A.critical_batch(one, bootstrap=40).iloc[0]
    beside = A.critical_batch(pd.concat([one, other]), bootstrap=40)
    beside = beside[beside["model_label"] == "M"].iloc[0]
    assert (alone["low"], alone["high"]) == (beside["low"], beside["high"])
    from batchbound.study.evidence import means

    assert np.array_equal(means(np.array([-0.0, 1.0])), means(np.array([0.0, 1.0])))


def test_the_loss_threshold_is_a_quantile_over_training_time_under_geometric_evaluation():
    # a loss falling as 1/(1 + t) over 1000 iterations: at even evaluations the lower
    # quartile is ≈ 1/751; evaluations at 1, 2, 4, ... crowd the early, high losses
    runs = pd.DataFrame({"key": ["g", "e"], "role": "final", "model_label": ["G", "E"],
                         "batch_size": 64, "status": "complete",
                         "config_json": ['{"eval_growth": 2.0}', '{}']})
    geometric = [0, *[2 ** i for i in range(11)]]
    even = list(range(0, 1025, 64))
    curves = pd.DataFrame([{"key": k, "iteration": t, "epoch": t / 100, "metric": "train_loss",
                            "value": 1 / (1 + t)} for k, ts in (("g", geometric), ("e", even))
                           for t in ts])
    found = A.loss_threshold(runs, curves).set_index("model_label")["threshold"]
    assert found["G"] == pytest.approx(found["E"], rel=0.35)
    assert np.quantile([1 / (1 + t) for t in geometric], 0.25) > 3 * found["E"]  # unweighted
