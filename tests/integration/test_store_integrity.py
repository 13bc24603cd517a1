"""The store knows what it is and where it is (issue 39): another program's SQLite file is
refused before anything is written to it; a store removed or replaced under a running study
ends it with a fault, nothing reported as saved that was not; a damaged store, or a copy whose
write-ahead log cannot be read, is one line saying so and what to do, never empty tables."""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from bad_input import BAD_INPUT, FAULT, refused
from study_processes import TRAINER, log_entries, start_study

from batchbound.errors import BatchboundError, FaultError
from batchbound.study.store import Store

SPEC = """
[study]
name = "integrity"
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


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(SPEC)
    return path


def _run_argv(spec: Path, store: Path) -> list[str]:
    return ["study", "run", str(spec), "--store", str(store), "--jobs", "0", "--trainer",
            TRAINER, "--no-progress"]


def _wait(condition, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


# ------------------------------------------------------------ another program's database


def _meta_of_another_program(path: Path) -> None:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.execute("INSERT INTO meta VALUES ('app', 'someone else')")


def _meta_of_other_columns(path: Path) -> None:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE meta (name TEXT, version INTEGER)")
        db.execute("CREATE TABLE runs (id INTEGER)")


@BAD_INPUT
@pytest.mark.parametrize("make", [_meta_of_another_program, _meta_of_other_columns])
@pytest.mark.parametrize("command", ["run", "export"])
def test_a_foreign_database_with_a_meta_table_is_refused_untouched(tmp_path, spec, capsys,
                                                                    make, command):
    store = tmp_path / "theirs.db"
    make(store)
    before = store.read_bytes()
    argv = _run_argv(spec, store) if command == "run" else [
        "study", "export", str(store), "--out", str(tmp_path / "e")]
    refused(argv, r"is an SQLite database but not a batchbound store \(its tables: meta",
            capsys)
    assert store.read_bytes() == before  # not stamped, not switched to WAL
    assert not Path(f"{store}-wal").exists()
    with sqlite3.connect(store) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"


@BAD_INPUT
def test_reading_an_empty_store_says_nothing_is_recorded_yet(tmp_path, capsys):
    """A store's file exists a moment before `study run` creates its tables: read then, it
    is a new store with nothing in it, not someone else's database."""
    store = tmp_path / "new.sqlite"
    store.touch()
    refused(["study", "export", str(store), "--out", str(tmp_path / "e")],
            r"store .*new\.sqlite is empty: nothing is recorded in it yet", capsys)
    assert store.read_bytes() == b""


# ------------------------------------------------------ the store removed under a study


@FAULT
@pytest.mark.parametrize("how", ["folder removed", "file replaced"])
def test_a_store_removed_under_a_running_study_is_a_fault(tmp_path, spec, how):
    """Every result went into the unlinked file before: "4 runs executed ... store X",
    exit 0, and X gone. Now: one line saying so, exit 1, and no summary of saved runs."""
    folder = tmp_path / "s5"
    store, log = folder / "study.sqlite", tmp_path / "log"
    proc = start_study(spec, store, log, sleep=0.2, jobs=0,
                       extra=["--checkpoint-dir", str(tmp_path / "ck")])
    _wait(lambda: log_entries(log), proc)
    if how == "folder removed":
        shutil.rmtree(folder)
    else:
        Path(f"{store}-new").write_bytes(b"")
        Path(f"{store}-new").replace(store)
    _, err = proc.communicate(timeout=300)
    text = err.decode()
    lines = text.strip().splitlines()
    assert proc.returncode == 1, text
    assert "Traceback" not in text and len(lines) == 1, text
    what = "removed" if how == "folder removed" else "replaced by another file"
    assert f"the store {store} was {what} while the study ran" in lines[0]
    assert "runs executed" not in text  # nothing reported as saved


def test_a_store_replaced_between_writes_refuses_the_next_write(tmp_path):
    store = tmp_path / "s.sqlite"
    with Store(store, exclusive=True) as s:
        s.register_study("a", {})
        store.rename(tmp_path / "moved.sqlite")
        with pytest.raises(FaultError, match="was removed while the study ran"):
            s.register_study("b", {})


# --------------------------------------------------------------- damaged or incomplete


def _filled_store(path: Path) -> None:
    with Store(path) as s:
        s.register_study("a", {"x": "y" * 2000})
        s.register_runs("a", [(f"k{i}", "tune", {"i": "z" * 500}, {}) for i in range(300)])


def _damage_a_page(path: Path) -> None:
    _filled_store(path)
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 6 * page
    data[4 * page: 4 * page + 200] = b"\xa5" * 200  # the middle of a b-tree page
    path.write_bytes(bytes(data))


@BAD_INPUT
@pytest.mark.parametrize("command", ["export", "run"])
def test_a_damaged_page_is_one_line(tmp_path, spec, capsys, command):
    store = tmp_path / "s.sqlite"
    _damage_a_page(store)
    argv = _run_argv(spec, store) if command == "run" else [
        "study", "export", str(store), "--out", str(tmp_path / "e")]
    refused(argv, r"store .* is damaged \(SQLite's quick_check: .*\); restore it from a copy",
            capsys)


def _as_unprivileged(argv: list[str]) -> list[str]:
    """Root ignores file permissions: run the command as `nobody` then (needs setpriv)."""
    if os.geteuid() != 0:
        return argv
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: permissions cannot be tested")
    drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = subprocess.run([*drop, sys.executable, "-c", "import batchbound"],
                           capture_output=True, cwd="/", timeout=120)
    if probe.returncode != 0:
        pytest.skip("`nobody` cannot import batchbound here: permissions cannot be tested")
    return [*drop, *argv]


@BAD_INPUT
def test_a_copy_with_its_log_but_without_shm_in_a_read_only_place(tmp_path):
    """A store copied (after a kill) with its -wal but not its -shm, to a read-only folder:
    the results in the log cannot be read there; export said rc 0 with empty CSVs."""
    shared = Path(tempfile.mkdtemp(prefix="batchbound-ro-"))  # tmp_path is private to root
    try:
        source = shared / "live" / "s.sqlite"
        source.parent.mkdir()
        writer = Store(source)
        writer.db.execute("PRAGMA wal_autocheckpoint=0")  # results stay in the log
        writer.register_study("a", {})
        writer.register_runs("a", [("k1", "tune", {}, {})])
        copy = shared / "copy"
        copy.mkdir()
        shutil.copy(source, copy / "s.sqlite")
        shutil.copy(f"{source}-wal", copy / "s.sqlite-wal")
        writer.db.close()
        assert (copy / "s.sqlite-wal").stat().st_size > 0
        for path in (copy / "s.sqlite", copy / "s.sqlite-wal"):
            path.chmod(0o444)
        copy.chmod(0o555)
        shared.chmod(0o777)
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "HOME": str(shared)}
        proc = subprocess.run(_as_unprivileged(
            [sys.executable, "-m", "batchbound", "study", "export", str(copy / "s.sqlite"),
             "--out", str(shared / "e")]), capture_output=True, text=True, env=env,
            cwd=shared, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert re.search(r"write-ahead log s\.sqlite-wal holds results not yet in the database "
                         r"file.*copy s\.sqlite and s\.sqlite-wal together to a writable "
                         r"folder", lines[0]), lines[0]
        assert not (shared / "e" / "runs.csv").exists()
    finally:
        for path in (shared, *shared.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
        shutil.rmtree(shared)


def test_a_read_only_copy_with_an_empty_log_is_read(tmp_path):
    store = tmp_path / "s.sqlite"
    with Store(store) as s:
        s.register_study("a", {})
    Path(f"{store}-wal").write_bytes(b"")
    with Store(store, readonly=True) as s:
        assert s.studies() == ["a"]


def test_a_damaged_page_found_by_a_read_is_one_line(tmp_path):
    store = tmp_path / "s.sqlite"
    _filled_store(store)
    with Store(store, readonly=True) as s:
        s.db.close()
        s.db = sqlite3.connect(":memory:")  # a query SQLite cannot answer
        with pytest.raises(BatchboundError, match="could not be read"):
            s.table("runs")


def test_the_database_file_alone_holds_every_recorded_run(tmp_path):
    """A copy of the store file without its -wal (the usual way a file is copied) holds
    every run recorded so far: each result is checkpointed into the file."""
    store = tmp_path / "s.sqlite"
    with Store(store, exclusive=True) as s:
        s.register_study("a", {})
        s.register_runs("a", [("k1", "tune", {}, {})])
        s.mark_running("k1")
        s.record_result("k1", {"status": "complete", "curves": [], "targets": []}, 1.0)
        copy = tmp_path / "copy.sqlite"
        shutil.copy(store, copy)  # while the runner holds it, without -wal and -shm
        with Store(copy, readonly=True) as c:
            assert c.status("k1") == "complete"
