"""`batchbound study run` as its own process, with the closed-form simulated trainer, for the
tests that kill runners: start one, read which runs it executed, finish it, and find the
processes it started (from /proc: Linux)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

TRAINER = "simulated_trainer:execute"


def start_study(spec: Path, store: Path, log: Path, sleep: float, jobs: int = 0,
                extra: Sequence[str] = (), gate: Path | None = None) -> subprocess.Popen:
    """A runner in its own session; the simulated trainer sleeps ``sleep`` s per epoch and
    appends "key resumed?" to ``log`` for every run it starts; with ``gate``, each run waits
    until that file exists."""
    env = {**os.environ, "BATCHBOUND_SIM_LOG": str(log), "BATCHBOUND_SIM_SLEEP": str(sleep),
           **({"BATCHBOUND_SIM_GATE": str(gate)} if gate is not None else {})}
    return subprocess.Popen(
        [sys.executable, "-m", "batchbound", "study", "run", str(spec), "--store", str(store),
         "--jobs", str(jobs), "--trainer", TRAINER, "--no-progress", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    """Wait for a runner, close its pipes, assert it succeeded; returns its stderr."""
    _, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err.decode()
    return err.decode()


def log_nodes(log: Path) -> dict[str, set[str]]:
    """Ray node -> the run keys the simulated trainer started there."""
    nodes: dict[str, set[str]] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            key, _, node = line.split()
            nodes.setdefault(node, set()).add(key)
    return nodes


def log_entries(log: Path) -> list[tuple[str, int]]:
    """(run key, resumed?) for every run the simulated trainer started, in order."""
    if not log.exists():
        return []
    return [(line.split()[0], int(line.split()[1])) for line in log.read_text().splitlines()]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (a zombie has exited; only its parent's wait is
    missing)."""
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.add(pid)
    return out
