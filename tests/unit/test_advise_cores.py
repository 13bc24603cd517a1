"""advise on the cores this process may run on (its CPU affinity: ``taskset``, a Slurm job's
cpuset), not every core of the machine: the default worker counts it times, the limit it
refuses past, and the other work that flags its timing."""

from __future__ import annotations

import os

import pytest

from batchbound.advise import advise
from batchbound.advise.advice import _worker_limit
from batchbound.advise.timing import _machine_busy_seconds
from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig

CONFIG = TrainConfig(dataset="digits", model="fc(depth=1,params=800)", batch_size=16, lr=0.05)


@pytest.fixture
def one_core_of_64(monkeypatch):
    """``srun -c 1`` on a 64-core node: os.cpu_count() says 64, the affinity one core."""
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5}, raising=False)


def test_the_default_worker_count_is_the_cores_this_process_may_run_on(one_core_of_64) -> None:
    # before: 64, and advise spawned 2, 4, …, 64 torch processes to time on one core
    assert _worker_limit(None, None) == (None, 1)


def test_more_local_workers_than_those_cores_are_refused_before_any_work(
        one_core_of_64) -> None:
    with pytest.raises(BatchboundError, match=r"may run on 1 cores .*--cluster FILE to model 2"):
        advise(CONFIG, planned_epochs=4, max_workers=2, critical_batch="noise")


STAT = """cpu  10100 0 0 50000 0 0 0 0 0 0
cpu0 100 0 0 25000 0 0 0 0 0 0
cpu1 10000 0 0 25000 0 0 0 0 0 0
intr 1 2 3
"""


def test_other_work_is_counted_on_those_cores_only() -> None:
    tick = os.sysconf("SC_CLK_TCK")
    # another job busy on cpu1 of a shared node takes nothing from a timing pinned to cpu0;
    # before, the all-CPU line counted it and every timing there was flagged busy
    assert _machine_busy_seconds(STAT, {0}) == pytest.approx(100 / tick)
    assert _machine_busy_seconds(STAT, {0, 1}) == pytest.approx(10100 / tick)
    assert _machine_busy_seconds(STAT, {7}) == pytest.approx(10100 / tick)  # not listed: all
    assert _machine_busy_seconds("no cpu lines\n", {0}) is None
