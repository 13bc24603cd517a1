"""The results store: one SQLite file in WAL mode, runs keyed by their config hash.

Only the study's main process writes. A run's record moves pending → running → a final
status (complete, diverged, stopped, failed); its targets, curves, Δ measurements and timings
are written in the same transaction as its final status, so a kill at any moment leaves either
the whole result or none of it. A run belongs to studies through ``study_runs`` (with its role,
tune or final, and the grid labels the analyses group by); the same config in two studies is
trained and stored once. Weight snapshots (``snapshot_every_epochs``) go to ``snapshots``, one
float32 BLOB per (run, epoch), read back by ``Store.snapshots(keys)``. The schema is documented
in docs/store.md.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import fcntl
import json
import math
import os
import socket
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from batchbound.errors import BatchboundError, FaultError
from batchbound.files import write_through
from batchbound.study.spec import DataSpec
from batchbound.train.config import TrainConfig
from batchbound.train.result import RunResult, TargetResult

SCHEMA_VERSION = 1
FINISHED = ("complete", "diverged")  # a rerun skips these; stopped ones resume, failed retry
STATUSES = ("pending", "running", *FINISHED, "stopped", "failed")
LABELS = ("data", "model", "model_label", "depth", "width", "params", "batch_size", "lr",
          "seed", "mechanism", "strategy", "n_train")
# Curve metrics that are gradient-diversity measurements go to their own table.
DIVERSITY_PREFIXES = ("diversity", "batch_bound", "online_")
SPEC_ORDERED = ("data", "model", "model_label", "mechanism", "strategy")  # text labels


def spec_order(spec: Mapping[str, Any]) -> dict[str, list[str]]:
    """The labels a stored study spec lists, per label column, in its order: data sets (as
    ``DataSpec.label`` writes them), strategies and mechanisms; models are labelled by the
    plan and keep the order it stored them in."""
    data = [DataSpec(d["dataset"], d.get("transform")).label for d in spec.get("data", ())
            if isinstance(d, Mapping) and isinstance(d.get("dataset"), str)]
    lr, train = spec.get("lr", {}), spec.get("train", {})
    return {"data": data, "strategy": list(lr.get("strategies", ())),
            "mechanism": list(train.get("mechanisms", ()))}

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS studies (
    name TEXT PRIMARY KEY, spec_json TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    key TEXT PRIMARY KEY, config_json TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ({", ".join(repr(s) for s in STATUSES)})),
    attempts INTEGER NOT NULL DEFAULT 0, started REAL, finished REAL, wall_seconds REAL,
    final_json TEXT, error TEXT);
CREATE TABLE IF NOT EXISTS study_runs (
    study TEXT NOT NULL REFERENCES studies(name), key TEXT NOT NULL REFERENCES runs(key),
    role TEXT NOT NULL, data TEXT, model TEXT, model_label TEXT, depth INTEGER, width INTEGER,
    params INTEGER, batch_size INTEGER, lr REAL, seed INTEGER, mechanism TEXT, strategy TEXT,
    n_train INTEGER,
    PRIMARY KEY (study, key, role));
CREATE TABLE IF NOT EXISTS targets (
    key TEXT NOT NULL REFERENCES runs(key), name TEXT NOT NULL, metric TEXT, threshold REAL,
    reached INTEGER NOT NULL, iteration INTEGER, epoch REAL, seconds REAL,
    PRIMARY KEY (key, name));
CREATE TABLE IF NOT EXISTS curves (
    key TEXT NOT NULL REFERENCES runs(key), iteration INTEGER NOT NULL, epoch REAL,
    seconds REAL, metric TEXT NOT NULL, value REAL);
CREATE INDEX IF NOT EXISTS curves_key ON curves (key, metric);
CREATE TABLE IF NOT EXISTS diversity (
    key TEXT NOT NULL REFERENCES runs(key), iteration INTEGER NOT NULL, epoch REAL,
    seconds REAL, metric TEXT NOT NULL, value REAL);
CREATE INDEX IF NOT EXISTS diversity_key ON diversity (key, metric);
CREATE TABLE IF NOT EXISTS timings (
    key TEXT NOT NULL REFERENCES runs(key), name TEXT NOT NULL, seconds REAL,
    PRIMARY KEY (key, name));
CREATE TABLE IF NOT EXISTS snapshots (
    key TEXT NOT NULL REFERENCES runs(key), epoch REAL NOT NULL, weights BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS snapshots_key ON snapshots (key);
"""
TABLES = ("studies", "runs", "study_runs", "targets", "curves", "diversity", "timings",
          "snapshots")
# The weights are float32, little-endian: what RunResult.to_dict() base64-encodes.
SNAPSHOT_DTYPE = np.dtype("<f4")
# frames() and table() show snapshots without their BLOBs (Store.snapshots() decodes those).
_SNAPSHOT_INDEX = "key, epoch, length(weights) / 4 AS numel"


def _number(value: Any) -> float | None:
    """NaN becomes NULL; ±inf (also spelled "inf" in JSON) stays a float."""
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def curve_rows(curves: Any) -> list[tuple[Any, ...]]:
    """Rows (iteration, epoch, seconds, metric, value) from RunResult.to_dict()'s curves,
    which is {"columns": [...], "rows": [[...]]}, or from a plain list of rows or dicts."""
    if isinstance(curves, Mapping):
        columns = list(curves.get("columns", ("iteration", "epoch", "seconds", "metric",
                                              "value")))
        order = [columns.index(c) for c in ("iteration", "epoch", "seconds", "metric", "value")]
        return [tuple(row[i] for i in order) for row in curves.get("rows", [])]
    return [
        (r["iteration"], r.get("epoch"), r.get("seconds"), r["metric"], r.get("value"))
        if isinstance(r, Mapping) else tuple(r)
        for r in curves
    ]


def snapshot_rows(snapshots: Any) -> list[tuple[float, bytes]]:
    """(epoch, raw float32 bytes) from RunResult.to_dict()'s ``snapshots``, which is
    {"epochs": [...], "dtype": "float32", "data": [base64, ...]}; empty for None."""
    if not snapshots:
        return []
    if snapshots.get("dtype", "float32") != "float32":
        raise BatchboundError(f"snapshots of dtype {snapshots.get('dtype')!r}; the store keeps "
                              "float32")
    epochs, data = list(snapshots["epochs"]), list(snapshots["data"])
    if len(epochs) != len(data):
        raise BatchboundError(f"{len(epochs)} snapshot epochs but {len(data)} weight vectors")
    rows = []
    for epoch, blob in zip(epochs, data, strict=True):
        raw = base64.b64decode(blob) if isinstance(blob, str) else bytes(blob)
        if len(raw) % SNAPSHOT_DTYPE.itemsize:
            raise BatchboundError(f"a snapshot of {len(raw)} bytes is not float32 values")
        rows.append((float(epoch), raw))
    return rows


class Store:
    """A study results database. Use as a context manager or call ``close()``."""

    def __init__(self, path: str | Path, *, readonly: bool = False,
                 exclusive: bool = False) -> None:
        """Open (or create) the store at ``path``; ``readonly`` opens an existing one for
        reading only (reports, exports), which also works on read-only files and folders.
        ``exclusive`` holds it for one runner until ``close()`` (see ``_hold``)."""
        self.path = Path(path)
        self.readonly = readonly
        self._held: int | None = None  # the locked descriptor of the database file
        self.identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the file opened
        if exclusive:
            self._hold()
        try:
            self.db = self._connect()
            self._check_schema()
            self._check_pages()
            if exclusive:
                self._sign()
            if not readonly:
                self.identity = _identity(self.path.resolve())
        except sqlite3.DatabaseError as exc:
            self._release()
            if _disk_fault(exc):  # the disk's fault, not the user's input: exit 1, not 2
                raise FaultError(
                    f"cannot {'read' if readonly else 'write to'} the store {self.path}: {exc} "
                    "(a full disk, a file-size limit such as `ulimit -f`, or a failing disk); "
                    "every run recorded before is kept") from None
            raise BatchboundError(_explain(self.path, exc, readonly)) from None
        except BaseException:
            self._release()
            raise

    def _sign(self) -> None:
        """Say who holds the store, for the runner that is refused."""
        with self.transaction():
            self.db.execute("INSERT OR REPLACE INTO meta VALUES ('runner', ?)",
                            (f"pid {os.getpid()} on {socket.gethostname()}",))
        # into the database file itself: SQLite keeps one write-ahead log per name, and a
        # runner refused under a hard link reads the file without this name's log
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _hold(self) -> None:
        """One runner per store: an advisory ``flock`` on the database file itself, taken
        before SQLite opens it and dropped by the kernel when the holder dies, however it
        dies. It follows the file, not its name, so a store reached through a symlink, a
        hard link or another mount path is the same store, and a second runner on it is
        refused before it reads or writes anything (two would execute the same runs)."""
        if self.path.is_dir():
            raise BatchboundError(f"store {self.path} is a directory; give a file path "
                                  "(for example runs/study.sqlite)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:  # an empty file is a new SQLite database
            fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise BatchboundError(f"cannot open the store {self.path}: "
                                  f"{exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise BatchboundError(
                f"store {self.path} is in use by another `study run` ({self._holder()}); one "
                "runner per store, so that no run executes twice: wait for it, or stop it (a "
                "rerun resumes)") from None
        self._held = fd

    def _holder(self) -> str:
        """The runner holding the store, as it wrote itself into ``meta``."""
        try:
            with Store(self.path, readonly=True) as peek:
                row = peek.db.execute("SELECT value FROM meta WHERE key='runner'").fetchone()
        except (BatchboundError, sqlite3.Error):
            row = None
        return row[0] if row else "a process that has not said who it is yet"

    def _release(self) -> None:
        """Drop the lock. The descriptor is closed only after SQLite's own: closing any
        descriptor of a file drops this process's POSIX locks on it, which are SQLite's."""
        if self._held is not None:
            fcntl.flock(self._held, fcntl.LOCK_UN)
            os.close(self._held)
            self._held = None

    def _connect(self) -> sqlite3.Connection:
        if self.path.is_dir():
            raise BatchboundError(f"store {self.path} is a directory; give a file path "
                                  "(for example runs/study.sqlite)")
        # SQLite names its write-ahead log after the path it is given: every symlink to one
        # store must give the same one
        real = self.path.resolve()
        if self.readonly:
            if not self.path.is_file():
                raise BatchboundError(f"no store at {self.path}")
            uri = real.as_uri()
            try:
                db = sqlite3.connect(f"{uri}?mode=ro", uri=True, isolation_level=None)
                db.execute("SELECT count(*) FROM sqlite_master").fetchone()
            except sqlite3.OperationalError as exc:  # a WAL file in a read-only folder: no -shm
                wal = real.with_name(real.name + "-wal")
                if wal.is_file() and wal.stat().st_size > 0:
                    # immutable=1 reads the database file alone: the runs still in the log
                    # would be missing, and a report or export of it silently short
                    raise BatchboundError(
                        f"store {self.path} cannot be read here: its write-ahead log {wal.name} "
                        f"holds results not yet in the database file, and SQLite cannot read "
                        f"it in this place ({exc}; a read-only folder, or a copy without its "
                        f"-shm file); copy {real.name} and {wal.name} together to a writable "
                        "folder and read the copy there") from None
                db = sqlite3.connect(f"{uri}?immutable=1", uri=True, isolation_level=None)
            return db
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(real, isolation_level=None, timeout=60)
        self._refuse_foreign(db)  # never add our tables to someone else's database
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA foreign_keys=ON")
        # idempotent (IF NOT EXISTS, OR IGNORE) and one transaction: a reader never sees the
        # tables of a store being created without its schema version
        db.executescript(f"BEGIN IMMEDIATE;{SCHEMA}INSERT OR IGNORE INTO meta VALUES "
                         f"('schema', '{SCHEMA_VERSION}');COMMIT;")
        return db

    def _refuse_foreign(self, db: sqlite3.Connection) -> None:
        """A database is a batchbound store when it is empty (a new store) or has our
        ``meta`` table with a schema version and our ``runs`` table: another program's file
        with a table called ``meta`` is refused before anything is written to it."""
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        ours = {"meta", "runs"} <= tables and _has_schema_row(db)
        if self.readonly and not tables:
            # a new store's file exists a moment before its tables (`study run` creates it)
            db.close()
            raise BatchboundError(f"store {self.path} is empty: nothing is recorded in it yet")
        if tables and not ours:
            db.close()
            raise BatchboundError(f"{self.path} is an SQLite database but not a batchbound "
                                  f"store (its tables: {', '.join(sorted(tables)[:6])}); give "
                                  "another store path")

    def _check_pages(self) -> None:
        """A damaged page (a disk error, a partial copy) found before any work, as one line,
        not from whichever query reaches it first. ``quick_check`` reads every page once."""
        problems = [" ".join(str(r[0]).split()) for r in self.db.execute("PRAGMA quick_check(3)")]
        if problems != ["ok"]:
            raise BatchboundError(
                f"store {self.path} is damaged (SQLite's quick_check: {'; '.join(problems)}); "
                f"restore it from a copy, or salvage what is readable with `sqlite3 "
                f"{self.path} .recover | sqlite3 recovered.sqlite` and use that")

    def check_identity(self, when: str) -> None:
        """Fault when the store's path no longer names the file this store opened (removed,
        or replaced by another file, the folder deleted): what was written since went into
        a file no one can read, so nothing may be reported as saved."""
        if self.identity is None:
            return
        try:
            now: tuple[int, int] | None = _identity(self.path.resolve())
        except OSError:
            now = None
        if now != self.identity:
            what = "removed" if now is None else "replaced by another file"
            raise FaultError(
                f"the store {self.path} was {what} while the study ran ({when}); the results "
                "recorded since are not in any store you can read. Put the store back (or "
                "choose a new --store) and `study run` again: runs not in the store are "
                "executed again")

    def _check_schema(self) -> None:
        if self.readonly:
            self._refuse_foreign(self.db)
        # a writable store got its version when _connect created or opened it
        row = self.db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        if row is None or row[0] != str(SCHEMA_VERSION):
            found = "no schema" if row is None else f"schema {row[0]!r}"
            raise BatchboundError(f"store {self.path} has {found}; this batchbound reads "
                                  f"schema {SCHEMA_VERSION}")

    def close(self) -> None:
        self.db.close()
        self._release()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def transaction(self) -> _Transaction:
        return _Transaction(self.db, self.path, self.check_identity)

    # ---- writing --------------------------------------------------------------------------
    def register_study(self, name: str, spec: Mapping[str, Any]) -> None:
        now = time.time()
        with self.transaction():
            self.db.execute(
                "INSERT INTO studies VALUES (?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET "
                "spec_json=excluded.spec_json, updated=excluded.updated",
                (name, json.dumps(spec, sort_keys=True), now, now),
            )

    def register_runs(self, study: str, runs: Iterable[tuple[str, str, Mapping[str, Any],
                                                               Mapping[str, Any]]]) -> None:
        """Add (key, role, config, labels) rows; runs already known keep their status."""
        with self.transaction():
            for key, role, config, labels in runs:
                self.db.execute(
                    "INSERT OR IGNORE INTO runs (key, config_json, status) VALUES (?, ?, "
                    "'pending')", (key, json.dumps(config, sort_keys=True)))
                self.db.execute(
                    f"INSERT OR IGNORE INTO study_runs (study, key, role, {', '.join(LABELS)}) "
                    f"VALUES (?, ?, ?, {', '.join('?' * len(LABELS))})",
                    (study, key, role, *(labels.get(k) for k in LABELS)))

    def replace_finals(self, study: str, runs: Iterable[tuple[str, Mapping[str, Any],
                                                            Mapping[str, Any]]]) -> None:
        """Register final runs (key, config, labels), unlinking any earlier final of the same
        grid point (data, model, B, seed, mechanism, strategy) under another key: a rerun
        whose tuning chose a different η must not leave two finals for one point."""
        runs = list(runs)
        point = ("data", "model", "batch_size", "seed", "mechanism", "strategy")
        with self.transaction():
            for key, _, labels in runs:
                self.db.execute(
                    "DELETE FROM study_runs WHERE study=? AND role='final' AND key<>? AND "
                    + " AND ".join(f"{c} IS ?" for c in point),
                    (study, key, *(labels.get(c) for c in point)))
        self.register_runs(study, [(key, "final", config, labels)
                                   for key, config, labels in runs])

    def prune(self, study: str, tune_keys: set[str],
              final_points: set[tuple[Any, ...]]) -> int:
        """Unlink runs a re-planned study no longer contains (its spec was edited): tuning
        runs not in ``tune_keys`` and finals whose grid point (data, model, B, seed,
        mechanism, strategy) is not in ``final_points``. Run records stay. Returns the count."""
        point = ("data", "model", "batch_size", "seed", "mechanism", "strategy")
        rows = self.db.execute(f"SELECT rowid, key, role, {', '.join(point)} FROM study_runs "
                               "WHERE study=?", (study,)).fetchall()
        stale = [row[0] for row in rows
                 if (row[2] == "tune" and row[1] not in tune_keys)
                 or (row[2] == "final" and tuple(row[3:]) not in final_points)]
        with self.transaction():
            self.db.executemany("DELETE FROM study_runs WHERE rowid=?", [(r,) for r in stale])
        return len(stale)

    def mark_running(self, key: str) -> None:
        with self.transaction():
            self.db.execute("UPDATE runs SET status='running', attempts=attempts+1, started=? "
                            "WHERE key=?", (time.time(), key))

    def mark_failed(self, key: str, error: str) -> None:
        with self.transaction():
            self.db.execute("UPDATE runs SET status='failed', error=?, finished=? WHERE key=?",
                            (error[-4000:], time.time(), key))

    def record_result(self, key: str, result: Mapping[str, Any], wall_seconds: float) -> None:
        """Write a finished run's whole result atomically (replacing any partial record)."""
        status = result.get("status", "complete")
        if status not in (*FINISHED, "stopped", "failed"):
            raise BatchboundError(f"run {key}: unexpected status {status!r}")
        curves, diversity = [], []
        for iteration, epoch, seconds, metric, value in curve_rows(result.get("curves", [])):
            item = (key, int(iteration), _number(epoch), _number(seconds), str(metric),
                    _number(value))
            (diversity if item[4].startswith(DIVERSITY_PREFIXES) else curves).append(item)
        targets = [
            (key, t["name"], t.get("metric"), _number(t.get("threshold")), int(bool(t["reached"])),
             t.get("iteration"), _number(t.get("epoch")), _number(t.get("seconds")))
            for t in result.get("targets", [])
        ]
        timings = [(key, name, _number(sec)) for name, sec in _flat(result.get("timings", {}))]
        snapshots = [(key, epoch, raw) for epoch, raw in snapshot_rows(result.get("snapshots"))]
        with self.transaction():
            for table in ("targets", "curves", "diversity", "timings", "snapshots"):
                self.db.execute(f"DELETE FROM {table} WHERE key=?", (key,))
            self.db.executemany("INSERT INTO targets VALUES (?,?,?,?,?,?,?,?)", targets)
            self.db.executemany("INSERT INTO curves VALUES (?,?,?,?,?,?)", curves)
            self.db.executemany("INSERT INTO diversity VALUES (?,?,?,?,?,?)", diversity)
            self.db.executemany("INSERT INTO timings VALUES (?,?,?)", timings)
            self.db.executemany("INSERT INTO snapshots VALUES (?,?,?)", snapshots)
            self.db.execute(
                "UPDATE runs SET status=?, finished=?, wall_seconds=?, final_json=?, error=? "
                "WHERE key=?",
                (status, time.time(), wall_seconds,
                 json.dumps(result.get("final", {}), default=str, allow_nan=True),
                 result.get("message") or result.get("error"), key))
        # into the database file itself, as far as readers allow: a copy of the file alone
        # (without its -wal) then holds every run recorded so far
        with contextlib.suppress(sqlite3.Error):
            self.db.execute("PRAGMA wal_checkpoint(PASSIVE)")

    # ---- reading --------------------------------------------------------------------------
    def status(self, key: str) -> str | None:
        row = self.db.execute("SELECT status FROM runs WHERE key=?", (key,)).fetchone()
        return None if row is None else row[0]

    def statuses(self, keys: Iterable[str]) -> dict[str, str]:
        out = {}
        for key in keys:
            status = self.status(key)
            if status is not None:
                out[key] = status
        return out

    def studies(self) -> list[str]:
        return [r[0] for r in self.db.execute("SELECT name FROM studies ORDER BY name")]

    def study_spec(self, name: str) -> dict[str, Any]:
        row = self.db.execute("SELECT spec_json FROM studies WHERE name=?", (name,)).fetchone()
        if row is None:
            raise BatchboundError(f"no study {name!r} in {self.path}; studies: "
                                  f"{', '.join(self.studies()) or 'none'}")
        return json.loads(row[0])

    def frames(self, study: str) -> dict[str, pd.DataFrame]:
        """The study's tables as DataFrames: runs (labels + status; the SPEC_ORDERED labels
        ordered as the spec lists them), targets, curves, ...; ``snapshots`` lists (key,
        epoch, numel) without the weights (``snapshots(keys)``)."""
        self.study_spec(study)
        runs = self._query(
            "SELECT s.*, r.status, r.attempts, r.wall_seconds, r.final_json, r.config_json "
            "FROM study_runs s JOIN runs r USING (key) WHERE s.study=? ORDER BY s.rowid",
            self.db, params=(study,))
        listed = spec_order(self.study_spec(study))
        for column in SPEC_ORDERED:
            # as the spec lists them (then in the order they were stored), so every table
            # and figure lists r = 8, 64, 512 as the spec does, not as strings sort
            seen = list(dict.fromkeys(runs[column].dropna()))
            present = set(seen)
            first = [v for v in listed.get(column, ()) if v in present]
            runs[column] = pd.Categorical(runs[column], categories=[
                *first, *[v for v in seen if v not in first]], ordered=True)
        frames = {"runs": runs}
        for table in ("targets", "curves", "diversity", "timings"):
            frames[table] = self._query(
                f"SELECT t.* FROM {table} t WHERE t.key IN (SELECT key FROM study_runs "
                f"WHERE study=?) ORDER BY t.rowid", self.db, params=(study,))
        frames["snapshots"] = self._query(
            f"SELECT {_SNAPSHOT_INDEX} FROM snapshots WHERE key IN (SELECT key FROM study_runs "
            "WHERE study=?) ORDER BY rowid", self.db, params=(study,))
        return frames

    def run_result(self, key: str) -> tuple[RunResult, float | None]:
        """(RunResult, finished time) rebuilt from the store's record of one run: curves and
        Δ rows in iteration order, NaN where the store kept NULL."""
        config, status, final, error, finished = self.db.execute(
            "SELECT config_json, status, final_json, error, finished FROM runs WHERE key=?",
            (key,)).fetchone()
        rows = [row for table in ("curves", "diversity") for row in self.db.execute(
            f"SELECT iteration, epoch, seconds, metric, value FROM {table} WHERE key=? "
            "ORDER BY rowid", (key,))]
        rows.sort(key=lambda row: row[0])  # stable: each metric keeps its stored order

        def number(value: Any) -> float:
            return math.nan if value is None else float(value)

        targets = [TargetResult(name, metric, number(threshold), bool(reached), iteration,
                                epoch, seconds)
                   for name, metric, threshold, reached, iteration, epoch, seconds
                   in self.db.execute("SELECT name, metric, threshold, reached, iteration, "
                                       "epoch, seconds FROM targets WHERE key=? ORDER BY rowid",
                                       (key,))]
        result = RunResult(
            config=TrainConfig.from_dict(json.loads(config)), config_hash=key, status=status,
            targets=targets,
            curves=[(int(i), number(e), number(s), str(m), number(v)) for i, e, s, m, v in rows],
            final=json.loads(final) if final else {}, message=error or "")
        return result, finished

    def snapshots(self, keys: Iterable[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """key -> (epochs, shape (k,) float64; weights, shape (k, d) float32), in the order
        the run took them, for the given keys that have snapshots (others are left out)."""
        out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for key in dict.fromkeys(keys):
            rows = self.db.execute("SELECT epoch, weights FROM snapshots WHERE key=? "
                                   "ORDER BY rowid", (key,)).fetchall()
            if not rows:
                continue
            sizes = {len(blob) for _, blob in rows}
            if len(sizes) != 1:
                raise BatchboundError(f"run {key}: snapshots of different sizes {sorted(sizes)}")
            epochs = np.array([epoch for epoch, _ in rows], dtype=np.float64)
            weights = np.frombuffer(b"".join(blob for _, blob in rows), dtype=SNAPSHOT_DTYPE)
            out[key] = (epochs, weights.astype(np.float32).reshape(len(rows), -1))
        return out

    def _query(self, sql: str, db: sqlite3.Connection, **options: Any) -> pd.DataFrame:
        """``pd.read_sql_query``; a page SQLite cannot read is one line, not pandas' error."""
        try:
            return pd.read_sql_query(sql, db, **options)
        except (sqlite3.DatabaseError, pd.errors.DatabaseError) as exc:
            raise BatchboundError(f"store {self.path} could not be read ({exc}); it may be "
                                  "damaged: restore it from a copy, or `sqlite3 STORE .recover`"
                                  ) from None

    def table(self, name: str) -> pd.DataFrame:
        if name not in (*TABLES, "meta"):
            raise BatchboundError(f"no table {name!r}; tables: {', '.join(TABLES)}")
        if name == "snapshots":  # the weights are BLOBs: Store.snapshots(keys) reads them
            return self._query(f"SELECT {_SNAPSHOT_INDEX} FROM snapshots", self.db)
        return self._query(f"SELECT * FROM {name}", self.db)


def _identity(path: Path) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino


def _has_schema_row(db: sqlite3.Connection) -> bool:
    try:
        return db.execute("SELECT 1 FROM meta WHERE key='schema'").fetchone() is not None
    except sqlite3.DatabaseError:  # a `meta` table of other columns: not ours
        return False


def _disk_fault(exc: sqlite3.DatabaseError) -> bool:
    """SQLite's SQLITE_FULL or SQLITE_IOERR_*: the disk failed a read or a write."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    text = str(exc)
    return (name == "SQLITE_FULL" or name.startswith("SQLITE_IOERR")
            or "disk is full" in text or "disk I/O error" in text)


def _explain(path: Path, exc: sqlite3.DatabaseError, readonly: bool) -> str:
    """One line for a store SQLite cannot use: not a database, read-only, locked, full."""
    text = str(exc)
    if "not a database" in text or "malformed" in text:
        return f"{path} is not a batchbound store (not a valid SQLite database: {text})"
    if "readonly" in text or "unable to open" in text:
        where = "" if readonly else " for writing"
        return (f"cannot open the store {path}{where} ({text}); check the permissions of the "
                "file and its folder")
    return f"store {path}: {text}"


def _flat(timings: Any, prefix: str = "") -> list[tuple[str, float]]:
    """Flatten nested timing dicts to (dotted name, seconds) for numeric leaves."""
    out: list[tuple[str, float]] = []
    if isinstance(timings, Mapping):
        for name, value in timings.items():
            out += _flat(value, f"{prefix}{name}.")
    elif isinstance(timings, (int, float)) and not isinstance(timings, bool):
        out.append((prefix.rstrip("."), float(timings)))
    return out


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on error. A write SQLite cannot make (its
    OperationalError: a full disk, an I/O error, a lock held too long) is a one-line
    FaultError: the transaction is rolled back whole, and what earlier ones wrote stays."""

    def __init__(self, db: sqlite3.Connection, path: Path,
                 check_identity: Callable[[str], None]) -> None:
        self.db, self.path, self.check_identity = db, path, check_identity

    def __enter__(self) -> None:
        self.check_identity("found before a write")
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            raise self._fault(exc) from None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            try:
                self.db.execute("COMMIT")
            except sqlite3.OperationalError as error:  # a full disk may show only here
                exc = error
            else:  # committed, but into the file the path still names?
                self.check_identity("found after a write")
                return
        with contextlib.suppress(sqlite3.Error):  # SQLite may have rolled back already
            self.db.execute("ROLLBACK")
        # a bug's IntegrityError stays itself; a damaged page (DatabaseError) is a fault
        if isinstance(exc, sqlite3.DatabaseError) and not isinstance(exc, sqlite3.IntegrityError):
            raise self._fault(exc) from None

    def _fault(self, exc: sqlite3.Error) -> FaultError:
        return FaultError(f"cannot write to the store {self.path}: {exc}; every run recorded "
                          "before is kept, and `study run` again resumes the others")


def export(store: Store, directory: str | Path, fmt: str = "csv",
           study: str | None = None, ours: bool = False) -> list[Path]:
    """Write every table (or one study's tables) as CSV or Parquet files; return the paths.
    A file there that no earlier export wrote is refused, not replaced; ``ours``: the folder
    is batchbound's own (``<store dir>/export``), whose tables are replaced whatever wrote
    them (a folder exported into before it listed its files)."""
    if fmt not in ("csv", "parquet"):
        raise BatchboundError(f"unknown export format {fmt!r}; choose from csv, parquet")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if study is None:
        frames = {name: store.table(name) for name in TABLES}
    else:
        frames = store.frames(study)
        frames["studies"] = store.table("studies").query("name == @study")
    targets = {name: directory / f"{name}.{fmt}" for name in frames}
    listing = directory / EXPORTED
    if listing.exists() and not listing.is_file():
        raise BatchboundError(f"{listing} is not a file; export into another folder (--out), "
                              "or move it away")
    exported = _exported(directory)
    for name, path in targets.items():  # all checked before any is written
        if path.exists() and not ours and path.name not in exported and not _same_table(
                path, list(frames[name].columns), fmt):
            raise BatchboundError(
                f"{path} exists and is not a table batchbound exported there; export into "
                "another folder (--out), or move that file away")
    paths = []
    for name, frame in frames.items():
        path = targets[name]

        def write(tmp: Path, frame: pd.DataFrame = frame) -> None:
            if fmt == "csv":
                frame.to_csv(tmp, index=False)
            else:
                frame.to_parquet(tmp, index=False)

        try:
            write_through(path, write)  # each file whole or not at all
        except ImportError as exc:
            raise BatchboundError("parquet export needs pyarrow: pip install "
                                  "'batchbound[parquet]'") from exc
        paths.append(path)
    names = sorted(exported | {path.name for path in paths})
    write_through(directory / EXPORTED, lambda tmp: tmp.write_text(json.dumps(names)))
    return paths


# The files ``export`` wrote into a folder, which a later export may replace (a user's own
# runs.csv there is not replaced).
EXPORTED = ".batchbound-export.json"


def _exported(directory: Path) -> set[str]:
    try:
        names = json.loads((directory / EXPORTED).read_text())
    except (OSError, ValueError):
        return set()
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()


def _same_table(path: Path, columns: list[str], fmt: str) -> bool:
    """Whether ``path`` holds a table with these columns (an export from before the folder
    listed its files)."""
    try:
        if fmt == "csv":
            with open(path, newline="") as handle:
                return next(csv.reader(handle), None) == columns
        import pyarrow.parquet as pq

        return pq.read_schema(path).names == columns
    except (OSError, ValueError, ImportError, UnicodeDecodeError):
        return False
