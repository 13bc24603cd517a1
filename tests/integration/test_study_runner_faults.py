"""The runner under faults: a stopped run resumes, a killed runner leaves no process behind,
a second runner on the same store is refused, and a store SQLite cannot use is a one-line
error. Uses the closed-form simulated trainer (real processes, real store, real checkpoints)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from bad_input import BAD_INPUT, FAULT, refused
from full_disk import fill, small_disk
from study_processes import TRAINER, alive, descendants, finish, log_entries, start_study

from batchbound.errors import BatchboundError
from batchbound.study.store import Store

SPEC = """
[study]
name = "faults"
[data]
datasets = ["digits"]
[models]
family = "fc"
params = 2000
depths = [1, 2]
[batches]
sizes = [64, 256]
[lr]
grid = [0.1]
tuning = "none"
[train]
targets = { train_acc = 0.99 }
max_epochs = 6
repeats = 1
"""


def wait_for(condition, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(SPEC)
    return path


@FAULT
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
# SIGTERM here is test_sigterm_stops_the_study_with_its_own_exit_code's case (below), which
# asserts all of this and more: `make test-slow` only
@pytest.mark.parametrize("sig", [signal.SIGKILL, pytest.param(signal.SIGTERM,
                                                              marks=pytest.mark.slow)])
def test_a_killed_runner_leaves_no_process_behind(tmp_path, spec, sig):
    store, log = tmp_path / "s.sqlite", tmp_path / "log"
    proc = start_study(spec, store, log, sleep=0.3, jobs=2)
    # both pool workers busy, each in a run with a checkpoint
    wait_for(lambda: len(list((tmp_path / "s-checkpoints").glob("*/state.json"))) >= 2, proc)
    family = descendants(proc.pid)
    assert len(family) >= 2
    os.kill(proc.pid, sig)  # the runner alone, as `kill` or the OOM killer would
    proc.communicate(timeout=30)
    deadline = time.time() + 10
    while alive(family) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(family), f"still alive 10 s after {sig.name}: {alive(family)}"
    # and the rerun finishes everything, resuming the interrupted runs
    before = len(log_entries(log))
    finish(start_study(spec, store, log, sleep=0.0, jobs=2))
    assert any(resumed for _, resumed in log_entries(log)[before:])
    with Store(store) as s:
        assert {st for (st,) in s.db.execute("SELECT status FROM runs")} == {"complete"}


@FAULT
def test_a_stopped_run_resumes(tmp_path, spec):
    """A pool worker sent SIGTERM stops its run at a checkpoint; the run is `stopped`, keeps
    its checkpoint, and the next invocation resumes it instead of skipping it."""
    store, log = tmp_path / "s.sqlite", tmp_path / "log"
    proc = start_study(spec, store, log, sleep=0.3, jobs=1)
    wait_for(lambda: list((tmp_path / "s-checkpoints").glob("*/state.json")), proc)
    workers = descendants(proc.pid)
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75 and "1 stopped (a rerun resumes them)" in err.decode()
    with Store(store) as s:
        stopped = [k for k, st in s.db.execute("SELECT key, status FROM runs")
                   if st == "stopped"]
    assert len(stopped) == 1
    assert (tmp_path / "s-checkpoints" / stopped[0] / "state.json").exists()

    before = len(log_entries(log))
    finish(start_study(spec, store, log, sleep=0.0, jobs=2))
    assert (stopped[0], 1) in log_entries(log)[before:]  # resumed, from its checkpoint
    with Store(store) as s:
        assert s.status(stopped[0]) == "complete"
    assert not (tmp_path / "s-checkpoints" / stopped[0]).exists()


def _same_store(store: Path, how: str) -> Path:
    """Another name for the store file: itself, a symlink, a hard link, or the path through a
    symlinked folder (as a second mount path of one file system would be)."""
    if how == "same path":
        return store
    other = store.parent / "other"
    other.mkdir()
    if how == "symlink":
        (other / "link.sqlite").symlink_to(store)
        return other / "link.sqlite"
    if how == "hard link":
        os.link(store, other / "hard.sqlite")
        return other / "hard.sqlite"
    (other / "folder").symlink_to(store.parent, target_is_directory=True)
    return other / "folder" / store.name


@FAULT
@pytest.mark.parametrize("how", ["same path", "symlink", "hard link", "symlinked folder"])
def test_a_second_runner_on_the_same_store_is_refused(tmp_path, spec, capsys, how):
    store = tmp_path / "s.sqlite"
    with Store(store, exclusive=True):
        name = _same_store(store, how)
        line = refused(["study", "run", str(spec), "--store", str(name), "--jobs", "0",
                        "--trainer", TRAINER, "--no-progress"],
                       rf"in use by another `study run` \(pid {os.getpid()} on \S+\)", capsys)
    assert str(name) in line
    with Store(store) as s:  # the refused runner touched nothing
        assert s.db.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0


@FAULT
def test_two_runners_under_two_names_execute_each_run_once(tmp_path, spec):
    """Two `study run`s on one store under a hard link: while one runs, the other is refused;
    every run is executed once and recorded once. The first is held mid-run (a gate file)
    until the second has answered, so a slow start on a busy machine cannot let the first
    finish before the second looks."""
    store, log, gate = tmp_path / "s.sqlite", tmp_path / "log", tmp_path / "gate"
    Store(store).close()
    os.link(store, tmp_path / "hard.sqlite")
    first = start_study(spec, store, log, sleep=0.0, jobs=1, gate=gate)
    try:
        wait_for(lambda: log_entries(log), first)  # its first run started: it holds the store
        second = start_study(spec, tmp_path / "hard.sqlite", log, sleep=0.0, jobs=1)
        _, err = second.communicate(timeout=300)
        assert first.poll() is None  # still mid-run: the second met it, not a finished store
    finally:
        gate.touch()
    assert second.returncode == 2 and "in use by another `study run`" in err.decode()
    finish(first)
    keys = [key for key, _ in log_entries(log)]
    assert len(keys) == len(set(keys)) == 4
    with Store(store) as s:
        assert s.db.execute("SELECT status, COUNT(*) FROM runs GROUP BY status").fetchall() \
            == [("complete", 4)]


@FAULT
def test_the_lock_dies_with_its_holder(tmp_path, spec):
    store, log = tmp_path / "s.sqlite", tmp_path / "log"
    proc = start_study(spec, store, log, sleep=0.3, jobs=1)
    wait_for(lambda: log_entries(log), proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    Store(store, exclusive=True).close()  # free again: nothing to clean up by hand


# ---------------------------------------------- stores SQLite cannot use: one line, exit 2


def _corrupt(path: Path) -> None:
    path.write_bytes(b"this is not a database\x00" * 100)


def _foreign(path: Path) -> None:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE invoices (id INTEGER, amount REAL)")


def _other_schema(path: Path) -> None:
    with Store(path) as s:
        s.db.execute("UPDATE meta SET value='99' WHERE key='schema'")


def _truncated(path: Path) -> None:
    with Store(path):
        pass
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3] + b"\xff" * 100)


STORES = {
    "not a database": (_corrupt, r"is not a batchbound store \(not a valid SQLite"),
    "a foreign database": (_foreign, r"SQLite database but not a batchbound store.*invoices"),
    "another schema": (_other_schema, r"has schema '99'; this batchbound reads schema 1"),
    "a damaged database": (_truncated, r"not a batchbound store|malformed"),
    "a directory": (lambda p: p.mkdir(), r"is a directory"),
}


@BAD_INPUT
@pytest.mark.parametrize("case", list(STORES))
@pytest.mark.parametrize("command", ["run", "report", "export"])
def test_a_store_sqlite_cannot_use(tmp_path, spec, capsys, case, command):
    make, match = STORES[case]
    store = tmp_path / "s.sqlite"
    make(store)
    before = store.read_bytes() if store.is_file() else None
    argv = {"run": ["study", "run", str(spec), "--store", str(store), "--jobs", "0",
                    "--trainer", TRAINER, "--no-progress"],
            "report": ["report", "faults", "--store", str(store), "--out", str(tmp_path / "r")],
            "export": ["study", "export", str(store), "--out", str(tmp_path / "e")]}[command]
    refused(argv, match, capsys)
    if before is not None:
        assert store.read_bytes() == before  # refused without writing to it


def _as_unprivileged(argv: list[str]) -> list[str]:
    """Root ignores file permissions: run the command as `nobody` then (needs setpriv)."""
    if os.geteuid() != 0:
        return argv
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: permissions cannot be tested")
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = subprocess.run([*drop, sys.executable, "-c", "import batchbound"],
                           capture_output=True, cwd="/", timeout=120)
    if probe.returncode != 0:  # a checkout or venv `nobody` cannot read
        pytest.skip("`nobody` cannot import batchbound here: permissions cannot be tested")
    return [*drop, *argv]


@BAD_INPUT
def test_a_read_only_store_refuses_a_run_and_still_reports(tmp_path, spec):
    from batchbound.study.runner import run_study
    from batchbound.study.spec import load_study

    shared = Path(tempfile.mkdtemp(prefix="batchbound-ro-"))  # tmp_path is private to root
    try:
        store = shared / "ro" / "s.sqlite"
        run_study(load_study(spec), store, jobs=0, progress=False, trainer=TRAINER)
        (shared / "spec.toml").write_text(SPEC)
        os.chmod(store, 0o444)
        os.chmod(store.parent, 0o555)
        os.chmod(shared, 0o777)
        cli = [sys.executable, "-m", "batchbound"]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "HOME": str(shared),
               "MPLCONFIGDIR": str(shared / "mpl")}
        refused_run = subprocess.run(_as_unprivileged(
            [*cli, "study", "run", str(shared / "spec.toml"), "--store", str(store), "--jobs",
             "0", "--trainer", TRAINER, "--no-progress"]), capture_output=True, text=True,
            env=env, cwd=shared, timeout=120)
        lines = refused_run.stderr.strip().splitlines()
        assert refused_run.returncode == 2 and len(lines) == 1, refused_run.stderr
        assert re.search(r"cannot (open the store|create the store's lock file|write)", lines[0])
        export = subprocess.run(_as_unprivileged(
            [*cli, "study", "export", str(store), "--out", str(shared / "export")]),
            capture_output=True, text=True, env=env, cwd=shared, timeout=120)
        assert export.returncode == 0, export.stderr  # reading needs no write access
        assert (shared / "export" / "runs.csv").exists()
    finally:
        for path in (shared, *shared.rglob("*")):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        shutil.rmtree(shared)


# ------------------------------------------------ faults in the middle of a study (issue 29)


@FAULT
def test_sigterm_stops_the_study_with_its_own_exit_code(tmp_path, spec):
    """SIGTERM to the runner: the runs in progress stop at their checkpoints, the runner
    says so in one line and exits 75 (not 0: a batch script can tell preempted from done);
    the rerun resumes them."""
    store, log = tmp_path / "s.sqlite", tmp_path / "log"
    proc = start_study(spec, store, log, sleep=0.3, jobs=2)
    wait_for(lambda: len(list((tmp_path / "s-checkpoints").glob("*/state.json"))) >= 2, proc)
    family = descendants(proc.pid)
    assert len(family) >= 2
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 75, err.decode()
    assert len(lines) == 1 and "stopped by SIGTERM" in lines[0] and "resumes" in lines[0]
    deadline = time.time() + 10
    while alive(family) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(family), f"still alive 10 s after the runner ended: {alive(family)}"
    before = len(log_entries(log))
    finish(start_study(spec, store, log, sleep=0.0, jobs=2))
    assert sum(resumed for _, resumed in log_entries(log)[before:]) >= 2
    with Store(store) as s:
        assert {st for (st,) in s.db.execute("SELECT status FROM runs")} == {"complete"}


@FAULT
def test_a_full_disk_under_the_store_loses_no_run(tmp_path, spec):
    """The store's disk fills after a run is recorded: the runner ends with one line naming
    the store and the error (exit 1), the recorded run is intact, and once there is space
    again the rerun finishes every run, none executed twice to completion."""
    log = tmp_path / "log"
    with small_disk(2048) as disk:
        store = disk / "s.sqlite"
        proc = start_study(spec, store, log, sleep=0.5, jobs=1,
                           extra=["--checkpoint-dir", str(tmp_path / "ck")])

        def complete() -> set[str]:
            try:
                with Store(store, readonly=True) as s:
                    return {k for (k,) in s.db.execute("SELECT key FROM runs WHERE "
                                                       "status='complete'")}
            except BatchboundError as exc:  # the runner has not created it yet
                if "is empty" in str(exc) or "no store at" in str(exc):
                    return set()
                raise

        wait_for(lambda: complete(), proc)
        filler = fill(disk)
        _, err = proc.communicate(timeout=120)
        lines = err.decode().strip().splitlines()
        assert proc.returncode == 1, err.decode()
        assert len(lines) == 1 and "Traceback" not in err.decode()
        assert re.search(r"error: cannot write to the store .*s.sqlite: database or disk is "
                         r"full; every run recorded before is kept", lines[0]), lines[0]
        kept = complete()
        assert kept  # what was recorded before the disk filled is there
        filler.unlink()
        before = len(log_entries(log))
        finish(start_study(spec, store, log, sleep=0.0, jobs=1,
                           extra=["--checkpoint-dir", str(tmp_path / "ck")]))
        with Store(store) as s:
            rows = s.db.execute("SELECT key, status FROM runs").fetchall()
        assert len(rows) == 4 and {st for _, st in rows} == {"complete"}
        assert not {key for key, _ in log_entries(log)[before:]} & kept  # none ran again


@FAULT
def test_a_full_disk_under_the_report(tmp_path, spec, monkeypatch, capsys):
    """The report's folder fills up while its figures are written: one line naming the
    folder and the error (exit 1: a fault, not bad input); the store is untouched."""
    import batchbound.study.report as report
    from batchbound.advise.workers import COLUMNS
    from batchbound.study.runner import run_study
    from batchbound.study.spec import load_study

    store = tmp_path / "s.sqlite"
    run_study(load_study(spec), store, jobs=0, progress=False, trainer=TRAINER)
    before = store.read_bytes()
    # the workers table times local processes: not what this case is about
    monkeypatch.setattr("batchbound.advise.workers.workers_table",
                        lambda *a, **k: report.pd.DataFrame(columns=COLUMNS))
    from batchbound.cli import main

    with small_disk(64) as disk:
        capsys.readouterr()
        rc = main(["report", "faults", "--store", str(store), "--out", str(disk / "r")])
        err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert re.search(r"error: cannot write the report to .*/r: No space left on device",
                     lines[0]), lines[0]
    assert store.read_bytes() == before
