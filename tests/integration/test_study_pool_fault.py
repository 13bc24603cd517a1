"""A store fault under `ulimit -f` while `study run --jobs 2` has its pool at work.

The runner abandons the study with one line (exit 1); it stops its pool workers with SIGTERM.
A worker killed by it outright ran no finalizer, so whatever it had registered with
multiprocessing's resource tracker (tqdm's lock, which the real trainer's `measure` makes)
stayed registered, and the tracker printed "There appear to be 1 leaked semaphore objects"
(two lines) after our one line; a worker whose run stopped at its checkpoint then waited,
idle, for its SIGKILL 30 s later. Now SIGTERM ends an idle worker through the interpreter's
normal exit, and the runner repeats it while it waits, so a worker leaves as soon as its run
has stopped: stderr is the one line, and the runner is done well within the grace."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bad_input import FAULT

pytestmark = [FAULT, pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                        reason="reads /proc")]

SUPPORT = Path(__file__).resolve().parents[1] / "support"
SRC = Path(__file__).resolve().parents[2] / "src"

STUDY = """
[study]
name = "pool"
[data]
datasets = ["digits"]
[models]
family = "fc"
params = 2000
depths = [1]
[batches]
sizes = [64, 256]
[lr]
grid = [0.1]
tuning = "none"
[train]
targets = { train_acc = 0.99 }
max_epochs = 2
repeats = 1
"""

# Each run makes a multiprocessing lock (as tqdm does in the real trainer) and so registers
# a semaphore; the batch-64 run returns at once with a record too big for the store's file
# limit, the other sleeps in its epochs (the trainer's SIGTERM handler installed) meanwhile.
TRAINER = '''
import math
import multiprocessing
import os

from simulated_trainer import execute as simulated

LOCKS = []


def execute(fields, checkpoint_dir, resume):
    LOCKS.append(multiprocessing.Lock())
    big = fields["batch_size"] == 64
    os.environ["BATCHBOUND_SIM_SLEEP"] = "0" if big else "5"
    result = simulated(fields, checkpoint_dir, resume)
    if big:
        result["curves"]["rows"] += [[i, i / 16, i * 1e-3, "train_loss", math.exp(-i / 9e3)]
                                     for i in range(10_000, 16_000)]
    return result
'''


def _limit_files(kib: int):
    def limit() -> None:  # a shell's `ulimit -f KIB`: a write past it fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (kib * 1024, kib * 1024))
    return limit


def test_a_store_fault_with_the_pool_at_work_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "spec.toml").write_text(STUDY)
    (tmp_path / "pool_trainer.py").write_text(TRAINER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # the tracker's on
    env.update(PYTHONPATH=os.pathsep.join([str(SRC), str(SUPPORT), str(tmp_path)]),
               TMPDIR=str(tmp_path))
    store = tmp_path / "s.sqlite"
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "batchbound", "study", "run", "spec.toml", "--store",
         str(store), "--jobs", "2", "--trainer", "pool_trainer:execute", "--no-progress"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300,
        preexec_fn=_limit_files(150))
    seconds = time.monotonic() - start
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert len(lines) == 1 and f"cannot write to the store {store}" in lines[0], lines
    assert seconds < 30, f"{seconds:.0f} s: a worker waited for its SIGKILL"
