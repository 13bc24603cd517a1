"""Studies on Ray: a local Ray instance (2 CPUs) runs a study to completion; killing the
driver with SIGKILL leaves no process behind, and the rerun resumes without redoing a
finished run; the real trainer gives the same results on Ray as inline."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from study_processes import alive, descendants, finish, log_entries, start_study
from test_study_runner_faults import SPEC

from batchbound.study.store import Store

pytest.importorskip("ray")
RAY = ("--executor", "ray")
# on one pytest worker (make test runs several): one local Ray instance at a time
pytestmark = pytest.mark.xdist_group("ray")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ray_study_survives_a_killed_driver(tmp_path):
    spec, store, log = tmp_path / "spec.toml", tmp_path / "s.sqlite", tmp_path / "log"
    spec.write_text(SPEC.replace("max_epochs = 6", "max_epochs = 12"))
    proc = start_study(spec, store, log, sleep=0.4, jobs=2, extra=RAY)
    deadline = time.time() + 240
    while not (log_entries(log) and list((tmp_path / "s-checkpoints").glob("*/state.json"))):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.time() < deadline, "Ray never started a run"
        time.sleep(0.1)
    family = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    deadline = time.time() + 10
    while alive(family) and time.time() < deadline:
        time.sleep(0.2)
    assert not alive(family), f"alive 10 s after the driver's SIGKILL: {alive(family)}"
    with Store(store) as s:
        finished = {k for k, st in s.db.execute("SELECT key, status FROM runs")
                    if st == "complete"}
    before = len(log_entries(log))

    finish(start_study(spec, store, log, sleep=0.0, jobs=2, extra=RAY))
    again = log_entries(log)[before:]
    assert not {key for key, _ in again} & finished  # nothing finished ran twice
    assert any(resumed for _, resumed in again)  # interrupted runs resumed from checkpoints
    with Store(store) as s:
        assert {st for (st,) in s.db.execute("SELECT status FROM runs")} == {"complete"}


REAL = """
[study]
name = "ray-real"
[data]
datasets = ["digits"]
[models]
family = "fc"
params = 1000
depths = [1]
[batches]
sizes = [32, 128]
[lr]
grid = [0.3]
tuning = "none"
[train]
targets = { train_acc = 0.8 }
max_epochs = 3
repeats = 1
"""


def test_the_real_trainer_on_ray_matches_inline(tmp_path):
    from batchbound.study.executor import make_executor
    from batchbound.study.runner import run_study
    from batchbound.study.spec import load_study

    path = tmp_path / "spec.toml"
    path.write_text(REAL)
    spec = load_study(path)
    on_ray = run_study(spec, tmp_path / "ray.sqlite", progress=False,
                       executor=make_executor(2, "ray"))
    inline = run_study(spec, tmp_path / "inline.sqlite", jobs=0, progress=False)
    assert on_ray.executed == inline.executed == 2 and on_ray.failed == 0

    def results(store: Path) -> list[tuple]:
        with Store(store) as s:
            return sorted(s.db.execute(
                "SELECT r.key, r.status, t.reached, t.iteration FROM runs r JOIN targets t "
                "USING (key)").fetchall())

    assert results(tmp_path / "ray.sqlite") == results(tmp_path / "inline.sqlite")
