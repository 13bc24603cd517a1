"""A step_timer rank whose advice died removes the folder its advice made for it, and
nothing else: the all-reduce form (``allreduce OUT THREADS ...``) took its THREADS argument
for the output's path and removed the folder '.' of '2', the user's working directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("form", ["allreduce", "steps"])
def test_an_orphaned_timer_removes_only_its_own_folder(tmp_path: Path, form: str) -> None:
    work = tmp_path / "work"  # the user's working directory
    (work / "sub").mkdir(parents=True)
    (work / "results.json").write_text("{}")
    (work / "sub" / "precious.pt").write_text("x")
    folder = tmp_path / "batchbound-steps-x"  # what timing.py makes and hands the ranks
    folder.mkdir()
    out = folder / "out.json"
    args = (["allreduce", str(out), "2", "100000", "4"] if form == "allreduce"
            else [str(folder / "missing-config.json"), str(out), "2", "3", "1"])
    env = {**os.environ, "PYTHONPATH": str(SRC), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           # a parent that is not this process's: the watcher acts at once, as on a kill
           "BATCHBOUND_TIMER_PARENT": "999999999", "BATCHBOUND_TIMER_FOLDER": str(folder)}
    subprocess.run([sys.executable, "-m", "batchbound.advise.step_timer", *args], cwd=work,
                   env=env, capture_output=True, timeout=120)
    assert (work / "results.json").exists() and (work / "sub" / "precious.pt").exists()
    assert not folder.exists() or form == "steps"  # the steps form may fail first (no config)


def test_a_timer_run_by_hand_removes_nothing(tmp_path: Path) -> None:
    """Without the folder named by its advice (a rank started by hand), nothing is removed."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("x")
    env = {**os.environ, "PYTHONPATH": str(SRC), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "BATCHBOUND_TIMER_PARENT": "999999999"}
    env.pop("BATCHBOUND_TIMER_FOLDER", None)
    subprocess.run([sys.executable, "-m", "batchbound.advise.step_timer", "allreduce",
                    "out.json", "2", "100000", "4"], cwd=work, env=env, capture_output=True,
                   timeout=120)
    assert (work / "keep.txt").exists()
