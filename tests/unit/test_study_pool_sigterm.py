"""SIGTERM to one pool worker while its job runs outside a trainer's own handler (here: a
simulated run waiting before it trains) fails that run, and the study goes on; it did not
end the runner with the worker's SystemExit(143), silently."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from batchbound.study.executor import Job, LocalPool

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="POSIX signals")


def test_sigterm_to_a_worker_outside_the_runs_handler_fails_that_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "log"
    monkeypatch.setenv("BATCHBOUND_SIM_LOG", str(log))
    monkeypatch.setenv("BATCHBOUND_SIM_GATE", str(tmp_path / "never"))
    pool = LocalPool(1)
    try:
        pool.submit(Job("k", {"lr": 0.1}, tmp_path, False, "simulated_trainer:execute"))
        deadline = time.monotonic() + 120
        while not log.exists() and time.monotonic() < deadline:  # the job has started
            time.sleep(0.05)
        assert log.exists()
        (worker,) = multiprocessing.active_children()
        os.kill(worker.pid, signal.SIGTERM)
        (outcome,) = list(pool.completed())
        assert outcome.result is None and outcome.error is not None
        assert "SIGTERM" in outcome.error
    finally:
        pool.close()


def test_sigterm_while_a_worker_exits_prints_nothing() -> None:
    """The runner repeats SIGTERM while it waits; one that reached a worker already in its
    exit's finalizers raised SystemExit there: "Exception ignored in atexit callback" and a
    traceback after the study's one line. Here the SIGTERM comes from an exit hook registered
    before the worker's set-up, so it runs after the worker's own (last registered, first run)."""
    import subprocess
    import sys

    code = ("import atexit, os, signal\n"
            "atexit.register(os.kill, os.getpid(), signal.SIGTERM)\n"
            "from batchbound.study.executor import _init_worker\n"
            "_init_worker(1)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
