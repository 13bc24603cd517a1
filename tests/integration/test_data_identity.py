"""Runs know their data (issue 39): a run's key includes a fingerprint of the files its data
set was read from, so a study whose data file was rewritten (same shape, other labels) reruns
its runs instead of reusing the old results as "already done"; a worker that finds the files
changed after planning refuses the run; embedded data sets read no file and keep their keys."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from study_processes import TRAINER

from batchbound.data.identity import fingerprint, recording
from batchbound.errors import BatchboundError
from batchbound.study.plan import make_plan
from batchbound.study.runner import run_study
from batchbound.study.spec import study_from_dict

pytestmark = pytest.mark.bad_input


def _write(path: Path, labels_seed: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 5)).astype(np.float32)
    y = np.random.default_rng(labels_seed).integers(0, 3, size=200)
    np.savez(path, x=x, y=y)


def _spec(dataset: str) -> dict:
    return {"study": {"name": "files"}, "data": {"datasets": [dataset]},
            "models": {"specs": ["fc(depth=1,width=8)"]}, "batches": {"sizes": [16, 32]},
            "lr": {"grid": [0.1], "tuning": "none"},
            "train": {"targets": {"train_acc": 0.99}, "max_epochs": 2, "repeats": 1}}


def test_a_rewritten_data_file_is_rerun_not_reused(tmp_path):
    data = tmp_path / "d.npz"
    _write(data, labels_seed=1)
    spec = study_from_dict(_spec(f"npz(path={data})"))
    store = tmp_path / "s.sqlite"
    first = run_study(spec, store, jobs=0, progress=False, trainer=TRAINER)
    assert first.executed == 2
    again = run_study(spec, store, jobs=0, progress=False, trainer=TRAINER)
    assert (again.executed, again.skipped) == (0, 2)  # the same files: reused
    before = fingerprint([data])
    _write(data, labels_seed=2)  # same shape, other labels
    os.utime(data, ns=(data.stat().st_atime_ns, data.stat().st_mtime_ns + 10**9))
    assert fingerprint([data]) != before
    changed = run_study(spec, store, jobs=0, progress=False, trainer=TRAINER)
    assert (changed.executed, changed.skipped) == (2, 0)
    from batchbound.study.store import Store

    with Store(store, readonly=True) as s:  # the study now holds the new runs only
        linked = s.frames("files")["runs"]
        assert len(linked) == 2
        assert {json.loads(c)["data_files"] for c in linked["config_json"]} == {
            fingerprint([data])}


def test_the_key_follows_the_content_not_the_time(tmp_path):
    data = tmp_path / "d.npz"
    _write(data, labels_seed=1)
    spec = study_from_dict(_spec(f"npz(path={data})"))
    keys = {r.key for r in make_plan(spec).final_runs({})}
    os.utime(data, ns=(0, 10**9))  # touched: the same bytes
    assert {r.key for r in make_plan(spec).final_runs({})} == keys
    runs = make_plan(spec).final_runs({})
    assert all(r.fields["data_files"].startswith("sha256:") for r in runs)


def test_embedded_data_keeps_its_keys():
    plan = make_plan(study_from_dict(_spec("digits")))
    assert all("data_files" not in r.fields for r in plan.final_runs({}))
    with recording() as read:
        from batchbound.data import load_dataset

        load_dataset("digits")
    assert read == []


def test_a_worker_refuses_data_changed_after_planning(tmp_path):
    from batchbound.study.adapter import execute

    data = tmp_path / "d.npz"
    _write(data, labels_seed=1)
    run = make_plan(study_from_dict(_spec(f"npz(path={data})"))).final_runs({})[0]
    _write(data, labels_seed=3)
    with pytest.raises(BatchboundError, match=r"changed after the study was planned"):
        execute(dict(run.fields), tmp_path / "ck", False)


def test_every_file_a_loader_finds_is_recorded(tmp_path):
    a, b = tmp_path / "train.txt", tmp_path / "test.txt"
    a.write_text("1 1:0.5 2:1\n0 1:0.1 2:0.3\n" * 20)
    b.write_text("1 1:0.4 2:1\n0 1:0.2 2:0.3\n" * 5)
    from batchbound.data import load_dataset

    with recording() as read:
        load_dataset(f"libsvm(path={a},test={b})")
    assert set(read) == {a.resolve(), b.resolve()}  # the test file too


def test_a_resume_on_rewritten_data_is_refused(tmp_path, capsys):
    """`train --resume` from a checkpoint whose data file was rewritten since (same shape,
    other labels) would continue on other data; the checkpoint records the data's digest."""
    from bad_input import refused

    from batchbound.cli import main

    data = tmp_path / "d.npz"
    _write(data, labels_seed=1)
    argv = ["train", "--dataset", f"npz(path={data})", "--model", "fc(depth=1,width=4)", "-B",
            "10", "--checkpoint", str(tmp_path / "ck.pt"), "--checkpoint-every", "2",
            "--max-iterations", "4", "--no-progress", "--json"]
    assert main(argv) == 0
    assert main([*argv, "--resume"]) == 0  # the same data: resumed
    _write(data, labels_seed=2)
    refused([*argv, "--resume"], r"checkpoint .*ck\.pt was trained on other data than "
            r"npz\(path=.*\) holds now", capsys)
