"""The store round-trips what it is given, atomically, and exports it."""

from __future__ import annotations

import math
import sqlite3

import pandas as pd
import pytest

from batchbound.errors import BatchboundError
from batchbound.study.store import Store, export

RESULT = {
    "status": "complete",
    "targets": [{"name": "train_acc>=0.9", "metric": "train_acc", "threshold": 0.9,
                 "reached": True, "iteration": 40, "epoch": 1.25, "seconds": 0.5},
                {"name": "test_acc>=0.99", "metric": "test_acc", "threshold": 0.99,
                 "reached": False, "iteration": None, "epoch": None, "seconds": None}],
    "curves": {"columns": ["iteration", "epoch", "seconds", "metric", "value"],
               "rows": [[0, 0.0, 0.0, "train_loss", 2.3], [32, 1.0, 0.4, "train_loss", 0.7],
                        [32, 1.0, 0.4, "train_acc", 0.8], [32, 1.0, 0.4, "diversity", 0.01],
                        [32, 1.0, 0.4, "batch_bound", 14.4], [33, 1.03, 0.41, "batch_loss", "inf"],
                        [34, 1.06, 0.42, "batch_loss", "nan"]]},
    "timings": {"train_seconds": 1.5, "compute": {"forward": 0.5, "backward": 0.7}},
    "final": {"train_loss": 0.6},
    "message": "",
}
LABELS = {"data": "digits", "model": "fc(depth=1,width=8)", "model_label": "L=1 K=8",
          "depth": 1, "width": 8, "params": 592, "batch_size": 32, "lr": 0.1, "seed": 0,
          "mechanism": "none", "strategy": "blr", "n_train": 1000}


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "s.sqlite") as s:
        s.register_study("demo", {"name": "demo"})
        s.register_runs("demo", [("k1", "final", {"lr": 0.1}, LABELS)])
        yield s


def test_round_trip(store):
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.status("k1") == "pending"
    store.mark_running("k1")
    assert store.status("k1") == "running"
    store.record_result("k1", RESULT, wall_seconds=2.0)
    frames = store.frames("demo")
    run = frames["runs"].iloc[0]
    assert run["status"] == "complete" and run["attempts"] == 1 and run["role"] == "final"
    assert {k: run[k] for k in ("depth", "width", "batch_size", "seed")} == \
        {"depth": 1, "width": 8, "batch_size": 32, "seed": 0}
    targets = frames["targets"].set_index("name")
    assert targets.loc["train_acc>=0.9", "iteration"] == 40
    assert targets.loc["train_acc>=0.9", "reached"] == 1
    assert targets.loc["test_acc>=0.99", "reached"] == 0
    curves = frames["curves"]
    assert len(curves) == 5 and set(curves["metric"]) == {"train_loss", "train_acc",
                                                          "batch_loss"}
    assert math.isinf(curves[curves["iteration"] == 33]["value"].iloc[0])
    assert curves[curves["iteration"] == 34]["value"].isna().all()  # NaN stored as NULL
    diversity = frames["diversity"].set_index("metric")["value"]
    assert diversity["diversity"] == 0.01 and diversity["batch_bound"] == 14.4
    timings = frames["timings"].set_index("name")["seconds"]
    assert timings.to_dict() == {"train_seconds": 1.5, "compute.forward": 0.5,
                                 "compute.backward": 0.7}


def test_rerecording_replaces_not_duplicates(store):
    store.record_result("k1", RESULT, 1.0)
    store.record_result("k1", RESULT, 1.0)
    assert len(store.frames("demo")["curves"]) == 5
    store.register_runs("demo", [("k1", "final", {"lr": 0.1}, LABELS)])
    assert store.status("k1") == "complete"  # registering again keeps the status
    assert len(store.frames("demo")["runs"]) == 1


def test_failed_write_rolls_back_whole_result(store):
    store.record_result("k1", RESULT, 1.0)
    bad = dict(RESULT, status="diverged", targets=[dict(RESULT["targets"][0], name=None)])
    with pytest.raises(sqlite3.IntegrityError):  # fails inside the transaction
        store.record_result("k1", bad, 1.0)
    assert store.status("k1") == "complete"  # the earlier record is intact
    assert len(store.frames("demo")["curves"]) == 5
    store.mark_failed("k1", "boom")
    assert store.status("k1") == "failed"


def test_unknown_study_and_bad_status(store):
    with pytest.raises(BatchboundError, match="no study 'nope'"):
        store.frames("nope")
    with pytest.raises(BatchboundError, match="unexpected status"):
        store.record_result("k1", dict(RESULT, status="weird"), 1.0)


def test_export_csv_and_parquet(store, tmp_path):
    store.record_result("k1", RESULT, 1.0)
    paths = export(store, tmp_path / "csv", "csv", "demo")
    curves = pd.read_csv(tmp_path / "csv" / "curves.csv")
    assert len(curves) == 5 and {p.name for p in paths} >= {"runs.csv", "targets.csv"}
    pytest.importorskip("pyarrow")
    export(store, tmp_path / "pq", "parquet")
    assert len(pd.read_parquet(tmp_path / "pq" / "curves.parquet")) == 5
    with pytest.raises(BatchboundError, match="csv, parquet"):
        export(store, tmp_path, "xlsx")


def test_replace_finals_unlinks_a_stale_choice(store):
    other = {**LABELS, "lr": 0.3}
    store.replace_finals("demo", [("k2", {"lr": 0.3}, other)])
    runs = store.frames("demo")["runs"]
    assert runs["key"].tolist() == ["k2"]  # k1 (η 0.1) no longer belongs to the study
    assert store.status("k1") == "pending"  # its record is kept in the store
    store.replace_finals("demo", [("k2", {"lr": 0.3}, other)])
    seed1 = {**LABELS, "seed": 1}
    store.replace_finals("demo", [("k3", {"lr": 0.1}, seed1)])
    assert sorted(store.frames("demo")["runs"]["key"]) == ["k2", "k3"]


def test_labels_come_back_in_the_spec_order_not_string_order(tmp_path):
    data = ["digits", "digits | replicate(r=8)", "digits | replicate(r=64)",
            "digits | replicate(r=512)"]
    with Store(tmp_path / "s.sqlite") as s:
        s.register_study("demo", {"name": "demo"})
        s.register_runs("demo", [(f"k{i}", "final", {"lr": 0.1}, {**LABELS, "data": d})
                                 for i, d in enumerate(data)])
        runs = s.frames("demo")["runs"]
    assert [name for name, _ in runs.groupby("data")] == data
    assert list(runs.sort_values("data")["data"]) == data
    assert list(runs.astype({"data": str})["data"].sort_values()) != data  # as strings


def test_a_data_set_added_to_the_spec_later_is_listed_where_the_spec_lists_it(tmp_path):
    spec = {"name": "demo", "data": [{"dataset": "digits", "transform": None},
                                     {"dataset": "digits", "transform": "replicate(r=8)"},
                                     {"dataset": "digits", "transform": "replicate(r=64)"}],
            "lr": {"strategies": ["blr"]}, "train": {"mechanisms": ["none"]}}
    with Store(tmp_path / "s.sqlite") as s:
        s.register_study("demo", spec)
        # r = 8 was added between two data sets that had already run: stored last
        for i, d in enumerate(["digits", "digits | replicate(r=64)", "digits | replicate(r=8)"]):
            s.register_runs("demo", [(f"k{i}", "final", {"lr": 0.1}, {**LABELS, "data": d})])
        runs = s.frames("demo")["runs"]
    assert list(runs["data"].cat.categories) == ["digits", "digits | replicate(r=8)",
                                                 "digits | replicate(r=64)"]


def test_export_does_not_replace_a_file_it_did_not_write(store, tmp_path):
    """``study export --out .`` in a folder holding the user's own runs.csv replaced it (an
    outside review); refused now, before any table is written, and that file kept. Tables it
    exported there itself are replaced, whatever their columns (one study's, then all)."""
    store.record_result("k1", RESULT, 1.0)
    mine = tmp_path / "runs.csv"
    mine.write_text("experiment,notes\n1,my own\n")
    with pytest.raises(BatchboundError, match=r"runs\.csv exists and is not a table "
                                              r"batchbound exported there"):
        export(store, tmp_path, "csv")
    assert mine.read_text() == "experiment,notes\n1,my own\n"
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".csv" and p != mine]

    out = tmp_path / "export"
    export(store, out, "csv", "demo")
    export(store, out, "csv")  # other columns than the study's tables: replaced all the same
    assert len(pd.read_csv(out / "curves.csv")) == 5
    (out / ".batchbound-export.json").unlink()  # an export from before the list: its header
    export(store, out, "csv")
    (out / "runs.csv").write_text("experiment,notes\n")
    (out / ".batchbound-export.json").unlink()
    with pytest.raises(BatchboundError, match="is not a table batchbound exported"):
        export(store, out, "csv")


def test_the_default_export_folder_is_ours_whatever_wrote_it(tmp_path):
    """``<store dir>/export`` exported into before the folder listed its files: one study's
    tables, then all (other columns), were refused as not batchbound's (an outside review).
    A listing that is a folder is refused before any table is written."""
    from batchbound.cli import main

    with Store(tmp_path / "s.sqlite") as s:
        s.register_study("demo", {"name": "demo"})
        s.register_runs("demo", [("k1", "final", {"lr": 0.1}, LABELS)])
        s.record_result("k1", RESULT, 1.0)
    store, out = str(tmp_path / "s.sqlite"), tmp_path / "export"
    assert main(["study", "export", store, "--study", "demo"]) == 0
    (out / ".batchbound-export.json").unlink()  # as a folder written before the listing
    assert main(["study", "export", store]) == 0
    assert len(pd.read_csv(out / "curves.csv")) == 5
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    (out / ".batchbound-export.json").unlink()
    (out / ".batchbound-export.json").mkdir()
    assert main(["study", "export", store]) == 2
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()} == {
        k: v for k, v in before.items() if k != ".batchbound-export.json"}
