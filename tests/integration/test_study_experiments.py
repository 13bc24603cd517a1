"""The papers' experiment sections on tiny real studies: each section appears exactly when
the study's data supports it, its tables hold what the runs recorded, and its claims carry
a verdict inside the section of report.html."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from batchbound.study import report as R
from batchbound.study.experiments.replication import loss_ratios, replication_factor
from batchbound.study.experiments.timing import best_batches, seconds_to_targets
from batchbound.study.runner import run_study
from batchbound.study.spec import study_from_dict
from batchbound.study.store import Store

VERDICTS = ("supported", "contradicted", "inconclusive", "not testable")


def run(tmp_path, name, data, models, sizes, **train):
    spec = study_from_dict({
        "study": {"name": name},
        "data": {"datasets": data},
        "models": {"specs": models},
        "batches": {"sizes": sizes},
        "lr": {"grid": [0.3], "tuning": "none"},
        "train": {"targets": {"train_acc": 0.8}, "max_epochs": 2, "repeats": 2,
                  "eval_every_epochs": 0.5, "checkpoint_every_epochs": None, **train},
    })
    store = tmp_path / f"{name}.sqlite"
    outcome = run_study(spec, store, jobs=0, progress=False)
    assert outcome.failed == 0
    with Store(store) as s:
        return R.analyze(s.frames(name), s.study_spec(name)), store


def keys(a):
    return [s.key for s in a.sections]


def test_replication_factor_reads_the_transform():
    assert replication_factor("digits") == 1
    assert replication_factor("digits | replicate(r=4)") == 4
    assert replication_factor("digits | subset(fraction=0.5)") is None


@pytest.fixture(scope="module")
def replication(tmp_path_factory):
    data = ["digits", *[{"dataset": "digits", "transform": f"replicate(r={r})"}
                        for r in (2, 4)]]
    return run(tmp_path_factory.mktemp("rep"), "rep", data, ["fc(depth=1,width=16)"],
               [16, 128], stop_at_targets=False)


def test_replication_section_and_loss_ratio(replication):
    a, _ = replication
    assert keys(a) == ["replication"]
    section = a.sections[0]
    table = section.tables[0][1]
    assert list(table["r"]) == [1, 2, 4]
    # the loss ratio is each seed's L(B=128)/L(B=16) at the same pass, from the curves
    ratios = loss_ratios(a, 16, 128)
    runs = a.frames["runs"]
    curves = a.frames["curves"]
    pick = runs[(runs["role"] == "final") & (runs["data"] == "digits") & (runs["seed"] == 0)]
    loss = {int(r.batch_size): curves[(curves["key"] == r.key)
                                      & (curves["metric"] == "train_loss")]
            for r in pick.itertuples()}
    at_one = {b: float(np.interp(1.0, c["epoch"], c["value"])) for b, c in loss.items()}
    mine = ratios[(ratios["data"] == "digits") & (ratios["seed"] == 0)
                  & np.isclose(ratios["passes"], 1.0)]["ratio"].iloc[0]
    assert mine == pytest.approx(at_one[128] / at_one[16], rel=1e-9)
    found = [f for f in R.claims(a) if f.section == "replication"]
    assert {f.claim.split(":")[0][:20] for f in found} and all(f.verdict in VERDICTS
                                                              for f in found)
    assert len(found) == 3  # two claims and their manipulation check
    assert any(f.claim.startswith("Manipulation check") for f in found)


def test_replication_report_html_holds_the_section(replication, tmp_path):
    _, store = replication
    paths = R.write_report(store, "rep", tmp_path / "report", max_workers=1)
    page = paths.html.read_text()
    start = page.index("<section id='replication'>")
    block = page[start:page.index("</section>", start)]
    assert "replication_loss_ratio" in block and "<table>" in block
    assert any(f"class='{c}'" in block for c in ("supported", "not", "inconclusive"))
    assert (tmp_path / "report" / "figures" / "replication_loss_ratio.png").stat().st_size > 0
    assert "## Data replication [diversity]" in paths.markdown.read_text()


def test_plain_study_has_no_sections(tmp_path):
    a, _ = run(tmp_path, "plain", ["digits"], ["fc(depth=1,width=16)"], [16, 64])
    assert keys(a) == []
    assert not [f for f in R.claims(a) if f.section]


def test_architectures_section_needs_two_families(tmp_path):
    a, _ = run(tmp_path, "arch", ["digits"],
               ["fc(depth=1,width=16)", "cnn1d(width=4,depth=2)"], [16, 32, 64])
    assert keys(a) == ["architectures"]
    table = a.sections[0].tables[0][1]
    assert len(table) == 2 and "s(64)" in table
    found = {f.claim[:30]: f for f in R.claims(a)}
    assert any(f.section == "architectures" for f in found.values())
    # widths of different families are not compared
    assert not any("Wider" in c for c in found)
    # every figure drawn without a library warning reaching the user's terminal
    import warnings

    import matplotlib.pyplot as plt

    from batchbound.study.figures import figures

    drawn = {stem: (caption, draw) for stem, caption, draw in figures(a)}
    assert "per model" in drawn["delta_vs_shape"][0]  # a cnn1d's depth is no fc's
    # Δ along training at the smallest batch: only where some run there was measured twice
    smallest = a.along[a.along["batch_size"] == a.along["batch_size"].min()]
    assert ("delta_along_training" in drawn) == bool((smallest.groupby("key").size() > 1).any())
    for stem in ("delta_vs_shape", "loss_contour"):
        fig = plt.figure(figsize=(6.4, 4.6), dpi=110)  # as render_figures makes it
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                drawn[stem][1](fig)
            if stem == "delta_vs_shape":
                assert fig.axes[0].get_xlabel() == "model"
            else:  # two panels one above the other, as wide as every other figure
                panels = [ax for ax in fig.axes if ax.get_ylabel() == "iterations (log)"]
                assert len(panels) == 2 and fig.get_figwidth() == 6.4
                assert panels[0].get_position().y0 > panels[1].get_position().y1
        finally:
            plt.close(fig)


def assert_panels_stacked(section) -> None:
    """A two-panel figure: one panel above the other, as wide as every other figure (side by
    side, an 800 px page shrank its 11-inch image and its text to 63 %)."""
    import matplotlib.pyplot as plt

    ((_, caption, draw),) = section.figures
    fig = plt.figure(figsize=(6.4, 4.6), dpi=110)  # as render_figures makes it
    try:
        draw(fig)
        top, bottom = fig.axes[:2]
        assert fig.get_figwidth() == 6.4
        assert top.get_position().y0 > bottom.get_position().y1
        assert "(top)" in caption and "(bottom)" in caption and "(left)" not in caption
    finally:
        plt.close(fig)


def test_generalization_section_reads_the_probes(tmp_path):
    a, _ = run(tmp_path, "gen", ["digits"], ["fc(depth=1,width=16)"], [16, 64, 256],
               stop_at_targets=False, final_probes=["osg", "linear_error"],
               diversity_every_epochs=None)
    assert keys(a) == ["generalization"]
    table = a.sections[0].tables[0][1]
    finals = a.frames["runs"][a.frames["runs"]["role"] == "final"]
    osg = [json.loads(t)["osg_mean"] for t in finals[finals["batch_size"] == 64]["final_json"]]
    row = table[table["batch_size"] == 64].iloc[0]
    assert row["E[OSG] mean"] == pytest.approx(np.mean(osg))
    assert row["runs"] == 2
    sections = {f.section for f in R.claims(a)}
    assert "generalization" in sections
    assert_panels_stacked(a.sections[0])


def test_timing_picks_the_fastest_batch_per_setting(tmp_path):
    a, _ = run(tmp_path, "time", ["digits"], ["fc(depth=1,width=16)"], [16, 64],
               mechanisms=["none", "dropconnect(p=0.5)"], targets={"train_acc": [0.5, 0.7]})
    times = seconds_to_targets(a)
    target, best = best_batches(times, a.targets)
    assert target in a.targets and set(best) == {"none", "dropconnect(p=0.5)"}
    for mechanism, batch in best.items():
        part = times[(times["mechanism"] == mechanism) & (times["target"] == target)]
        medians = part.groupby("batch_size")["seconds"].median()
        assert medians[batch] == medians.min() and math.isfinite(medians[batch])
    assert "timing" in keys(a)
    table = a.sections[keys(a).index("timing")].tables[0][1]
    assert list(table["setting"]) == ["none", "dropconnect(p=0.5)"]
    assert f"gain % {a.targets[0]}" in table
    # the step size is η in the whole report, the timing section's too
    section = a.sections[keys(a).index("timing")]
    ((_, caption, draw),) = section.figures
    assert "η" in table and "γ" not in "".join(map(str, table.columns))
    assert "(η, B)" in caption and "γ" not in caption + section.text
    import matplotlib.pyplot as plt

    fig = plt.figure()
    try:
        draw(fig)
        assert fig.axes[0].get_title() == "time to target at each setting's best (η, B)"
    finally:
        plt.close(fig)


def test_stability_distances_from_the_snapshots(tmp_path):
    data = [{"dataset": "digits", "transform": f"neighbour_pair(side={s})"} for s in (0, 1)]
    a, store = run(tmp_path, "stab", data, ["fc(depth=1,width=16)"], [16, 256],
                   stop_at_targets=False, snapshot_every_epochs=1)
    assert not a.snapshots  # analyze() alone is given no snapshots: no section
    paths = R.write_report(store, "stab", tmp_path / "report", max_workers=1)
    b = paths.analysis
    assert keys(b) == ["stability"]
    runs = b.frames["runs"]
    final = runs[(runs["role"] == "final") & (runs["batch_size"] == 16) & (runs["seed"] == 0)]
    (_, w0), (_, w1) = (b.snapshots[k] for k in final.sort_values("data")["key"])
    w, v = w0[-1].astype(np.float64), w1[-1].astype(np.float64)
    expected = math.sqrt(((w - v) ** 2).sum() / ((w**2).sum() + (v**2).sum()))
    assert expected > 0
    draws = b.sections[0].data["distance"][16]
    assert draws[0] == pytest.approx(np.mean([expected, _last_distance(b, 16, 1)]))
    # the spread's unit is the pair: 2 seeds, 4 runs per batch size
    assert b.sections[0].data["spread_pairs"][16] == 2
    table = b.sections[0].tables[0][1]
    assert int(table.loc[table["batch_size"] == 16, "runs"].iloc[0]) == 4
    assert "<section id='stability'>" in paths.html.read_text()
    assert_panels_stacked(b.sections[0])


def _last_distance(b, batch, seed):
    runs = b.frames["runs"]
    final = runs[(runs["role"] == "final") & (runs["batch_size"] == batch)
                 & (runs["seed"] == seed)]
    (_, w0), (_, w1) = (b.snapshots[k] for k in final.sort_values("data")["key"])
    w, v = w0[-1].astype(np.float64), w1[-1].astype(np.float64)
    return math.sqrt(((w - v) ** 2).sum() / ((w**2).sum() + (v**2).sum()))


def test_theory_section_for_linear_networks(tmp_path):
    spec = study_from_dict({
        "study": {"name": "lin"},
        "data": {"datasets": ["synthetic-linear(n=256,d=16,outputs=1,depth=2,width=8)"]},
        "models": {"specs": [f"linear(depth={d},width={k},init=normal,init_std=0.1)"
                             for d, k in ((1, 4), (1, 16), (3, 16))]},
        "batches": {"sizes": [16, 64]},
        "lr": {"grid": [0.01], "tuning": "none"},
        "train": {"targets": {"train_loss": 0.5}, "max_epochs": 1, "repeats": 2,
                  "eval_every_epochs": 0.5, "diversity_every_epochs": 0.5,
                  "checkpoint_every_epochs": None},
    })
    outcome = run_study(spec, tmp_path / "lin.sqlite", jobs=0, progress=False)
    assert outcome.failed == 0
    with Store(tmp_path / "lin.sqlite") as s:
        a = R.analyze(s.frames("lin"), s.study_spec("lin"))
    assert keys(a) == ["theory"]
    table = a.sections[0].tables[0][1]
    from batchbound.theory import linear_network_rho_bound

    row = table[(table["depth"] == 3) & (table["width"] == 16)].iloc[0]
    assert row["Theorem 3 bound"] == pytest.approx(linear_network_rho_bound(16, [16] * 3))
    along = a.along[a.along["model_label"] == row["model_label"]]
    first = along.sort_values("epoch").groupby("key").first()["batch_bound"].mean()
    assert row["n·Δ at init"] == pytest.approx(first)
    assert any(f.section == "theory" for f in R.claims(a))
