"""A study killed with SIGKILL mid-run resumes: no finished run is redone, and the final
tables equal an uninterrupted study's. Uses the closed-form simulated trainer (real
processes, real store, real checkpoints) so the test is fast and deterministic."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from study_processes import TRAINER, finish, log_entries, start_study

from batchbound.study.store import Store

SPEC = """
[study]
name = "killme"
[data]
datasets = ["digits"]
[models]
family = "fc"
params = 2000
depths = [1, 2]
[batches]
sizes = [64, 256]
[lr]
grid = [0.1, 0.3]
[train]
targets = { train_acc = 0.5 }
max_epochs = 6
diversity_every_epochs = 1
repeats = 2
"""


def tables(store_path: Path) -> dict[str, pd.DataFrame]:
    with Store(store_path) as store:
        frames = store.frames("killme")
    runs = frames["runs"][["key", "role", "model", "batch_size", "lr", "seed", "status"]]
    out = {"runs": runs}
    for name in ("targets", "curves", "diversity", "timings"):
        frame = frames[name]
        out[name] = frame.sort_values(list(frame.columns)).reset_index(drop=True)
    out["runs"] = runs.sort_values(["key", "role"]).reset_index(drop=True)
    return out


def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    store, log = tmp_path / "killed.sqlite", tmp_path / "killed.log"
    proc = start_study(spec, store, log, sleep=0.15, jobs=1)  # a pool: its worker dies too
    deadline = time.time() + 120
    # wait until some runs have finished and another is part-way (has a checkpoint)
    while time.time() < deadline:
        entries = log_entries(log)
        ckpts = list((tmp_path / "killed-checkpoints").glob("*/state.json"))
        if len(entries) >= 6 and ckpts:
            break
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    with Store(store) as s:
        finished = {k for k, st in s.db.execute("SELECT key, status FROM runs")
                    if st == "complete"}
        interrupted = {k for k, st in s.db.execute("SELECT key, status FROM runs")
                       if st == "running"}
    assert finished and interrupted, "the kill should land mid-study"
    before = len(log_entries(log))

    finish(start_study(spec, store, log, sleep=0.0))
    after = log_entries(log)[before:]
    redone = {key for key, _ in after} & finished
    assert not redone, f"finished runs executed again: {redone}"
    resumed = [key for key, resumed in after if resumed]
    assert resumed and set(resumed) <= interrupted  # part-done runs resumed from checkpoints

    clean_store, clean_log = tmp_path / "clean.sqlite", tmp_path / "clean.log"
    finish(start_study(spec, clean_store, clean_log, sleep=0.0))
    killed_tables, clean_tables = tables(store), tables(clean_store)
    for name, frame in clean_tables.items():
        pd.testing.assert_frame_equal(killed_tables[name], frame, check_dtype=False)
    # each run executed exactly once in the clean study; a third run changes nothing
    assert len(log_entries(clean_log)) == len({k for k, _ in log_entries(clean_log)})
    err = finish(start_study(spec, clean_store, clean_log, sleep=0.0))
    assert len(log_entries(clean_log)) == len({k for k, _ in log_entries(clean_log)})
    assert "0 runs executed" in err


REAL_SPEC = """
[study]
name = "killme"
[data]
datasets = ["digits"]
[models]
family = "fc"
params = 2000
depths = [1, 3]
[batches]
sizes = [16, 64]
[lr]
grid = [0.3]
tuning = "none"
[train]
targets = { train_acc = 0.99 }
max_epochs = 8
diversity_every_epochs = 1
checkpoint_every_epochs = 0.5
repeats = 1
"""


@pytest.mark.slow
def test_sigkill_resume_with_the_real_trainer(tmp_path):
    """The same with batchbound.train: interrupted runs resume from the trainer's own
    checkpoints, and the recorded results match an uninterrupted study (times aside)."""
    spec = tmp_path / "spec.toml"
    spec.write_text(REAL_SPEC)
    store = tmp_path / "killed.sqlite"

    def start(path):
        return subprocess.Popen(
            [sys.executable, "-m", "batchbound", "study", "run", str(spec), "--store",
             str(path), "--jobs", "0", "--no-progress"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    proc = start(store)
    deadline = time.time() + 300
    while time.time() < deadline:
        if list((tmp_path / "killed-checkpoints").glob("*/checkpoint.pt")):
            with Store(store) as s:
                done = s.db.execute("SELECT COUNT(*) FROM runs WHERE status='complete'")
                if done.fetchone()[0] >= 1:
                    break
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    with Store(store) as s:
        finished = dict(s.db.execute("SELECT key, finished FROM runs WHERE status='complete'"))
    assert finished
    finish(start(store))
    with Store(store) as s:
        after = dict(s.db.execute("SELECT key, finished FROM runs WHERE status='complete'"))
        attempts = dict(s.db.execute("SELECT key, attempts FROM runs"))
    assert all(after[k] == t for k, t in finished.items())  # not redone
    assert all(attempts[k] == 1 for k in finished)
    assert any(n == 2 for n in attempts.values())  # the interrupted run went again (resumed)
    clean = tmp_path / "clean.sqlite"
    finish(start(clean))
    a, b = tables(store), tables(clean)
    pd.testing.assert_frame_equal(a["runs"], b["runs"])
    cols = ["key", "name", "reached", "iteration", "epoch"]
    pd.testing.assert_frame_equal(a["targets"][cols], b["targets"][cols])
    keep = ["key", "iteration", "metric", "value"]
    for name in ("curves", "diversity"):
        x = a[name][keep].sort_values(keep[:3]).reset_index(drop=True)
        y = b[name][keep].sort_values(keep[:3]).reset_index(drop=True)
        pd.testing.assert_frame_equal(x, y, check_exact=False, rtol=1e-6)


def test_a_dying_worker_fails_its_runs_not_the_study(tmp_path, monkeypatch):
    """A worker process that dies fails the runs it held; the rest of the study completes,
    and a rerun finishes the failed ones without duplicating any final."""
    from batchbound.study.runner import run_study
    from batchbound.study.spec import load_study

    spec_path = tmp_path / "spec.toml"
    spec_path.write_text(SPEC)
    spec = load_study(spec_path)
    monkeypatch.setenv("BATCHBOUND_SIM_CRASH_LR", "0.3")  # every tuning run at η = 0.3 dies
    first = run_study(spec, tmp_path / "s.sqlite", jobs=1, progress=False, trainer=TRAINER)
    # the 4 crashing runs fail, and so may runs queued in the same broken pool; none is lost
    assert first.failed >= 4 and first.executed + first.failed == first.total == 16
    assert set(first.chosen.values()) == {0.1}
    monkeypatch.delenv("BATCHBOUND_SIM_CRASH_LR")
    second = run_study(spec, tmp_path / "s.sqlite", jobs=0, progress=False, trainer=TRAINER)
    assert (second.executed, second.failed) == (first.failed, 0)  # only those ran again
    with Store(tmp_path / "s.sqlite") as store:
        frames = store.frames("killme")
    finals = frames["runs"][frames["runs"]["role"] == "final"]
    assert len(finals) == 8 and set(frames["runs"]["status"]) == {"complete"}


def test_an_edited_spec_unlinks_what_it_dropped(tmp_path):
    from batchbound.study.runner import run_study
    from batchbound.study.spec import load_study

    path = tmp_path / "spec.toml"
    path.write_text(SPEC)
    run_study(load_study(path), tmp_path / "s.sqlite", jobs=0, progress=False, trainer=TRAINER)
    path.write_text(SPEC.replace("sizes = [64, 256]", "sizes = [64]"))
    again = run_study(load_study(path), tmp_path / "s.sqlite", jobs=0, progress=False,
                      trainer=TRAINER)
    assert again.executed == 0
    with Store(tmp_path / "s.sqlite") as store:
        runs = store.frames("killme")["runs"]
        assert set(runs["batch_size"]) == {64} and len(runs) == 4 + 4  # tune + final
        assert store.db.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 16
