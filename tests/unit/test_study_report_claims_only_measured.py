"""The report claims only what it measured (issue 28): collapsed runs are marked and left out
of every fit, degenerate fits are never a headline number, grid edges and interpolated
advice are marked, verdicts state their independent units, Theorem 1 reads n·Δ along the
run to the target, replication is checked for its manipulation, and a setting that differs
from the paper's is said beside the verdict."""

from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from batchbound.study import analysis as A
from batchbound.study.answer import Answer, answer_table, sentence
from batchbound.study.claims import (
    CLAIMS,
    INCONCLUSIVE,
    SUPPORTED,
    UNTESTABLE,
    Context,
    evaluate,
    settings,
)
from batchbound.study.evidence import Evidence
from batchbound.study.experiments.registry import Section

BATCHES = [16, 32, 64, 128, 256, 512, 1024]


# ---- collapsed runs ---------------------------------------------------------------------------
def curves_of(rows: dict[str, dict[str, list[float]]]) -> pd.DataFrame:
    return pd.DataFrame([{"key": key, "iteration": 10 * i, "epoch": i, "metric": metric,
                          "value": v}
                         for key, metrics in rows.items() for metric, values in metrics.items()
                         for i, v in enumerate(values)])


def test_collapsed_runs_are_marked_from_accuracy_at_chance_or_a_loss_that_never_falls():
    runs = pd.DataFrame({"key": ["ok", "chance", "flat", "dead"], "data": "digits",
                         "role": "final", "status": ["complete", "complete", "complete",
                                                     "diverged"]})
    curves = curves_of({
        "ok": {"train_loss": [2.3, 1.0, 0.3], "train_acc": [0.1, 0.6, 0.95]},
        "chance": {"train_loss": [2.3, 2.2, 2.25], "train_acc": [0.1, 0.11, 0.105]},
        "flat": {"train_loss": [2.3, 2.4, 2.3], "train_acc": [0.1, 0.3, 0.4]},
        "dead": {"train_loss": [2.3, 50.0], "train_acc": [0.1, 0.1]},
    })
    marked = A.mark_collapsed(runs, curves, {"digits": 0.1}).set_index("key")["status"]
    assert marked.to_dict() == {"ok": "complete", "chance": "collapsed", "flat": "collapsed",
                                "dead": "diverged"}
    # without the number of classes only the loss rule applies
    assert A.collapsed_keys(runs, curves) == {"flat"}


def steps(b_crit: float = 100.0, s_min: float = 50.0) -> pd.DataFrame:
    rows = [{"key": f"{b}-{s}", "model_label": "M", "batch_size": b, "seed": s,
             "iterations": s_min * (1 + b_crit / b) * (1 + 0.02 * s), "diverged": False,
             "collapsed": False} for b in (16, 64, 256, 1024) for s in range(2)]
    return pd.DataFrame(rows)


def test_a_collapsed_run_stays_out_of_the_critical_batch_fit_and_is_counted():
    clean = A.critical_batch(steps(), bootstrap=0).iloc[0]
    bad = pd.concat([steps(), pd.DataFrame([{
        "key": "x", "model_label": "M", "batch_size": 1024, "seed": 9, "iterations": 1.0,
        "diverged": False, "collapsed": True}])], ignore_index=True)
    fit = A.critical_batch(bad, bootstrap=0).iloc[0]
    assert fit["b_crit"] == pytest.approx(clean["b_crit"])
    assert (fit["collapsed"], fit["diverged"], fit["points"]) == (1, 0, 8)
    summary = A.summarize_to_target(bad.assign(epochs=bad["iterations"]), "epochs")
    assert summary.set_index("batch_size").loc[1024, "collapsed"] == 1


# ---- degenerate fits --------------------------------------------------------------------------
def test_degenerate_fit_rules():
    assert "below the smallest batch 16" in A.degenerate_fit(0.016, 0.01, 0.02, BATCHES)
    assert "above the largest batch 1024" in A.degenerate_fit(4000, 3000, 5000, BATCHES)
    assert "two orders of magnitude" in A.degenerate_fit(200, 2, 5000, BATCHES)
    assert A.degenerate_fit(100, 50, 300, BATCHES) == ""
    assert A.degenerate_fit(9, 8, 10, BATCHES) == ""  # within ×2 of the grid


def answer(**changes) -> Answer:
    base = Answer(model="M", grid=(16.0, 1024.0), first=16.0, linear=64.0, stagnant=512.0,
                  b_crit=80.0, interval="60–120", degenerate="", bound=90.0,
                  bound_how="averaged over training", workers=2.0, batch=64.0, lr=0.3,
                  seconds=1.5, interpolated=False, diverged="0 of 21", collapsed="0 of 21")
    return replace(base, **changes)


def test_a_degenerate_b_crit_is_never_a_headline_number():
    row = answer(b_crit=0.016, degenerate="B_crit is below the smallest batch 16 by more "
                 "than ×2")
    text = sentence(row, "train_acc>=0.95")
    assert "degenerate" in text and "0.016" not in text
    assert "the critical batch size is" not in text
    assert answer_table([row])["B_crit"].iloc[0].startswith("degenerate (0.016")


# ---- grid edges and interpolated advice -------------------------------------------------------
def test_answer_marks_grid_edges_and_interpolated_advice():
    plain = sentence(answer(), "t")
    assert "grid edge" not in plain and "interpolated" not in plain
    top = answer(linear=1024.0)
    assert "(at the grid edge" in sentence(top, "t")
    assert answer_table([top])["near-linear up to"].iloc[0] == "1024 (at the grid edge)"
    floor = answer(linear=16.0, first=16.0)
    assert "at the grid edge" in sentence(floor, "t")
    made = answer(batch=128.0, lr=0.548, interpolated=True)
    assert "η 0.548 (interpolated" in sentence(made, "t")
    table = answer_table([made])
    assert (table["batch"].iloc[0], table["η"].iloc[0]) == ("128 (interpolated)",
                                                            "0.548 (interpolated)")
    collapsed = sentence(answer(collapsed="2 of 21"), "t")
    assert "Collapsed runs" in collapsed and "2 of 21" in collapsed


def test_a_target_reached_by_the_first_evaluation_is_marked():
    # evaluated every 0.25 epochs: a run that records 0.26 crossed the target somewhere in
    # (0, 0.26]; one that records 0.51 was seen unreached at 0.25
    config = '{"eval_every_epochs": 0.25}'
    runs = pd.DataFrame({"key": ["a", "b", "c"], "role": "final", "model_label": "m",
                         "batch_size": [16, 16, 64], "seed": [0, 1, 0], "lr": 0.1,
                         "status": "complete", "config_json": config})
    targets = pd.DataFrame({"key": ["a", "b", "c"], "name": "t", "reached": 1,
                            "epoch": [0.26, 0.51, 0.26], "iteration": [10, 20, 3]})
    per_run = A.per_run_to_target(runs, targets)
    assert list(per_run["first_eval"]) == [True, False, True]
    assert list(A.summarize_to_target(per_run)["first_eval"]) == [1, 1]
    early = answer(first=16.0, linear=64.0, first_eval=(16.0, 64.0))
    text = sentence(early, "t")
    assert "at the first evaluation at B = 16, 64" in text and "not measured" in text
    table = answer_table([early])
    assert table["first reached"].iloc[0] == "16 (at the first evaluation)"
    assert table["near-linear up to"].iloc[0] == "64 (at the first evaluation)"
    assert "first evaluation" not in sentence(answer(), "t")


def test_workers_table_marks_a_batch_and_step_size_no_run_used(monkeypatch):
    import batchbound.advise.workers as advise_workers

    def row(workers, batch, lr):
        return SimpleNamespace(workers=workers, batch_size=batch, lr=lr, iterations=10.0,
                               seconds_per_iteration=0.1, seconds_to_target=1.0, speedup=1.0)

    rows = [row(1, 64, 0.3), row(2, 128, 0.548)]
    monkeypatch.setattr(advise_workers, "advise_from_study", lambda *a, **k: SimpleNamespace(
        rows=rows, recommended=rows[1], extra={}))
    table = advise_workers.workers_table([("M", {"ran": [(64.0, 0.3), (256.0, 0.3)]})])
    notes = dict(zip(table["batch"], table["note"], strict=True))
    assert notes[64] == "" and notes[128].startswith("interpolated: no run used")


def test_tuned_step_size_at_the_edge_of_its_grid():
    runs = pd.DataFrame({"key": list("abcd"), "role": "final", "model_label": "M",
                         "batch_size": [16, 16, 64, 256], "lr": [1.0, 1.0, 0.3, 0.03]})
    edges = A.tuned_at_edge(runs, [0.03, 0.1, 0.3, 1.0])
    assert dict(zip(edges["batch_size"], edges["edge"], strict=True)) == {16: "top",
                                                                         256: "bottom"}
    assert A.tuned_at_edge(runs, [0.3]).empty  # one η: nothing was tuned


def per_run(thresholds: dict[int, float], seeds: int = 3) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    return pd.DataFrame([{
        "key": f"{d}-{b}-{s}", "model_label": f"L={d}", "depth": d, "width": 100 - d,
        "batch_size": b, "seed": s,
        "epochs": (1.0 if b <= t else 3.0) * math.exp(0.05 * rng.normal()),
        "iterations": 1000.0 / b, "reached": True, "diverged": False, "n_train": 1000}
        for d, t in thresholds.items() for b in BATCHES for s in range(seeds)])


def context(runs: pd.DataFrame, **extra) -> Context:
    return Context(evidence=Evidence(runs, draws=200), budget=2.0, max_batch=1024.0, **extra)


def test_b_star_at_either_grid_edge_supports_nothing():
    inside = CLAIMS["threshold_exists"].test(context(per_run({1: 128, 2: 256})))
    assert inside.verdict == SUPPORTED and "grid edge" not in inside.evidence
    for at in (16, 1024):
        found = CLAIMS["threshold_exists"].test(context(per_run({1: at, 2: 128})))
        assert found.verdict == INCONCLUSIVE
        assert "at the grid edge" in found.evidence


# ---- n on every verdict -----------------------------------------------------------------------
def test_every_verdict_states_its_independent_units():
    found = evaluate(context(per_run({1: 512, 2: 128, 3: 64})))
    assert found and all(f.n == "n = 3 seeds per cell" for f in found)


# ---- Theorem 1: n·Δ along the run -------------------------------------------------------------
def test_n_delta_along_the_run_stops_at_the_target():
    runs = pd.DataFrame({"key": ["r"], "role": "final", "status": "complete",
                         "model_label": "M", "batch_size": [16], "n_train": [100]})
    bound = [50.0, 20.0, 80.0, 5000.0]  # the last measurement is after the target
    diversity = pd.DataFrame([{"key": "r", "iteration": 10 * i, "epoch": i, "metric": m,
                               "value": v / (100 if m == "diversity" else 1)}
                              for i, v in enumerate(bound) for m in ("diversity",
                                                                     "batch_bound")])
    curves = curves_of({"r": {"train_loss": [2.0, 1.0, 0.5, 0.1]}})
    targets = pd.DataFrame({"key": ["r"], "name": ["train_acc>=0.9"], "reached": [1],
                            "iteration": [20], "epoch": [2.0]})
    run = A.diversity_runs(runs, diversity, curves, targets).iloc[0]
    assert (run["bound_min_run"], run["bound_at_target_run"]) == (20.0, 80.0)
    assert run["delta_run"] == pytest.approx(50 / 100)  # (50 + 20 + 80)/3, never 5000
    summary = A.diversity_summary(runs, diversity, curves, targets=targets).iloc[0]
    assert (summary["bound_min"], summary["bound_at_target"]) == (20.0, 80.0)


def test_theorem_1_claim_reads_the_bound_along_the_run():
    runs = per_run({1: 128})
    critical = pd.DataFrame([{"model_label": "L=1", "b_crit": 100.0, "low": 80.0,
                              "high": 120.0, "outside": "", "at_bound": False,
                              "one_run": False, "degenerate": ""}])
    diversity = pd.DataFrame([{"model_label": "L=1", "bound_min": 40.0,
                               "bound_at_target": 90.0, "runs_reached": "3 of 3"}])
    found = CLAIMS["critical_batch_near_bound"].test(context(
        runs, critical=critical, diversity=diversity))
    assert found.verdict == SUPPORTED and "minimum 40, at the target 90" in found.evidence
    far = diversity.assign(bound_min=1.0, bound_at_target=2.0)  # 4× 2 = 8 < 80
    assert CLAIMS["critical_batch_near_bound"].test(context(
        runs, critical=critical, diversity=far)).verdict == "contradicted"
    broken = critical.assign(degenerate="B_crit is below the smallest batch 16 by more than ×2")
    assert CLAIMS["critical_batch_near_bound"].test(context(
        runs, critical=broken, diversity=diversity)).verdict == INCONCLUSIVE


# ---- replication's manipulation check ---------------------------------------------------------
def replication_context(bound_by_r: dict[int, float]) -> Context:
    rng = np.random.default_rng(1)
    # four factors: with three, an exact permutation test cannot reach p ≤ 0.05 (1/3! > 0.05)
    labels = {r: "digits" if r == 1 else f"digits | replicate(r={r})" for r in (1, 2, 4, 8)}
    rows, deltas = [], []
    for r, label in labels.items():
        for seed in range(3):
            for batch in (16, 256):
                epochs = (1.0 if batch == 16 else 1.0 + r) * math.exp(0.02 * rng.normal())
                rows.append({"key": f"{r}-{batch}-{seed}", "model_label": "M", "data": label,
                             "batch_size": batch, "seed": seed, "epochs": epochs,
                             "iterations": epochs * 100, "reached": True, "diverged": False,
                             "n_train": 1000})
            deltas.append({"data": label, "n_train": 1000,
                           "delta_run": bound_by_r[r] * (1 + 0.01 * seed) / 1000})
    section = Section("replication", "", "diversity", "", data={
        "factors": {label: r for r, label in labels.items()}, "small": 16, "large": 256,
        "log_ratio": {}, "seeds": {r: 3 for r in labels}})
    return context(pd.DataFrame(rows), sections={"replication": section},
                   diversity_runs=pd.DataFrame(deltas),
                   spec={"lr": {"tuning": "lowest_loss_2_epochs"}})


def test_replication_reports_a_failed_manipulation_beside_its_verdict():
    works = replication_context({1: 90.0, 2: 50.0, 4: 20.0, 8: 10.0})
    assert CLAIMS["replication_lowers_diversity"].test(works).verdict == SUPPORTED
    gap = CLAIMS["replication_widens_gap"].test(works)
    assert gap.verdict == SUPPORTED and "manipulation" not in gap.differs
    failed = replication_context({1: 20.0, 2: 50.0, 4: 90.0, 8: 95.0})  # n·Δ rises with r
    assert CLAIMS["replication_lowers_diversity"].test(failed).verdict == "contradicted"
    gap = CLAIMS["replication_widens_gap"].test(failed)
    assert "the manipulation failed" in gap.differs
    unchecked = replace(failed, diversity_runs=pd.DataFrame())
    assert CLAIMS["replication_lowers_diversity"].test(unchecked).verdict == UNTESTABLE
    assert "unchecked" in CLAIMS["replication_widens_gap"].test(unchecked).differs


# ---- the paper's setting beside the verdict ---------------------------------------------------
def test_settings_that_differ_from_the_papers_are_named():
    ours = {"train": {"convention": "mean"}, "lr": {"tuning": "none"}}
    text = settings.stability(ours)
    assert "sums the gradients" in text and "one step size for every B" in text
    assert settings.stability({"train": {"convention": "sum"},
                               "lr": {"tuning": "lowest_loss_2_epochs"}}) == ""
    relu = {"models": {"family": "fc", "options": {"act": "relu"}}}
    assert "linear networks" in settings.gaussian_linear(relu)
    gaussian = {"models": {"specs": ["linear(depth=1,width=8,init=normal,init_std=0.2)"]}}
    assert settings.gaussian_linear(gaussian) == ""
    timing = {"data": [{"dataset": "fashion-mnist", "transform": None}],
              "train": {"mechanism_granularity": "example"}}
    text = settings.mechanism_timing(timing)
    assert "MNIST to 90/95/99 %" in text and "fashion-mnist" in text and "per-example" in text
    assert settings.mechanism_timing({"data": [{"dataset": "mnist"}], "train": {}}) == ""


# ---- stability pairs share their tuned step size ----------------------------------------------
def test_tune_data_first_tunes_on_the_first_data_set_for_all():
    from batchbound.study.plan import make_plan
    from batchbound.study.spec import study_from_dict

    def plan(**lr):
        return make_plan(study_from_dict({
            "study": {"name": "pairs"},
            "data": {"datasets": [{"dataset": "digits", "transform": f"neighbour_pair(side={i})"}
                                  for i in (0, 1)]},
            "models": {"specs": ["fc(depth=1,width=8)"]},
            "batches": {"sizes": [16, 64]},
            "lr": {"grid": [0.1, 0.3], **lr},
            "train": {"targets": {"train_acc": 0.5}, "max_epochs": 1, "repeats": 2,
                      "convention": "sum"},
        }))

    each, first = plan(), plan(tune_data="first")
    assert len(each.tuning_runs()) == 2 * len(first.tuning_runs()) == 8
    assert {r.data for r in first.tuning_runs()} == {"digits | neighbour_pair(side=0)"}
    assert first.spec.run_count()[0] == len(first.tuning_runs())
    chosen = {r.group(): 0.3 if r.batch_size == 16 else 0.1 for r in first.tuning_runs()}
    finals = first.final_runs(chosen)
    by_pair = {}
    for run in finals:
        by_pair.setdefault((run.batch_size, run.seed), set()).add(run.lr)
    assert all(len(lrs) == 1 for lrs in by_pair.values()) and len(finals) == 8
    # the side-0 cell's tuning decides both sides' finals as soon as it is in
    cell = next(iter(chosen))
    assert {r.data for r in first.final_runs(chosen, only_cell=cell)} == {
        "digits | neighbour_pair(side=0)", "digits | neighbour_pair(side=1)"}
    # the default plan keeps its keys
    assert [r.key for r in each.tuning_runs()][:4] == [r.key for r in first.tuning_runs()]


def test_a_wide_table_scrolls_inside_the_page_and_pre_breaks_between_words() -> None:
    import pandas as pd

    from batchbound.study.document import CSS, Table

    wide = Table(pd.DataFrame([list(range(17))], columns=[f"column {i}" for i in range(17)]))
    assert wide.html().startswith("<div class='wide'><table>")
    assert ".wide{overflow-x:auto" in CSS
    assert "word-break:break-all" not in CSS and "overflow-wrap:break-word" in CSS
