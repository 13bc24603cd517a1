"""A study run with train.workers = 2 inside the local pool: each pool process starts its own
gloo group (real processes on loopback) and the run trains data-parallel to its target."""

from __future__ import annotations

import json

import pytest

from batchbound.study.runner import run_study
from batchbound.study.spec import study_from_dict
from batchbound.study.store import Store

pytestmark = pytest.mark.distributed


def test_data_parallel_runs_inside_the_pool(tmp_path):
    spec = study_from_dict({
        "study": {"name": "two-workers"},
        "data": {"datasets": ["digits"]},
        "models": {"specs": ["fc(depth=1,width=16)"]},
        "batches": {"sizes": [64]},
        "lr": {"grid": [0.3], "tuning": "none"},
        "train": {"targets": {"train_acc": 0.8}, "max_epochs": 4, "workers": 2, "repeats": 1},
    })
    outcome = run_study(spec, tmp_path / "s.sqlite", jobs=1, progress=False)
    assert (outcome.executed, outcome.failed) == (1, 0)
    with Store(tmp_path / "s.sqlite") as store:
        runs = store.frames("two-workers")["runs"]
    assert runs["status"].tolist() == ["complete"]
    assert json.loads(runs["config_json"][0])["workers"] == 2
    final = json.loads(runs["final_json"][0])
    assert final["train_acc"] >= 0.8
