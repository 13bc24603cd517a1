"""Executors: where runs execute. The runner only needs ``submit`` and ``completed``.

``LocalPool`` runs jobs in a pool of spawned local processes (one per core by default, each
with ``cores // jobs`` torch threads). ``Inline`` runs them one by one in this process, for
tests and debugging. A cluster engine replaces both by implementing the same two methods:
runs are independent, and a job carries everything it needs (config fields, checkpoint
directory, resume flag, the trainer's import name).
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class Job:
    key: str
    fields: dict[str, Any]
    checkpoint_dir: Path
    resume: bool
    trainer: str


@dataclass(frozen=True)
class Outcome:
    key: str
    result: dict[str, Any] | None  # RunResult.to_dict(), or None when the run raised
    error: str | None
    wall_seconds: float


class Executor(Protocol):
    def submit(self, job: Job) -> None: ...

    def completed(self) -> Iterator[Outcome]:
        """Yield outcomes as jobs finish, until none is outstanding (jobs may be submitted
        while iterating)."""
        ...

    def close(self) -> None: ...


def run_job(job: Job) -> Outcome:
    """Execute one job; any exception becomes a failed outcome with its traceback."""
    from batchbound.study.adapter import resolve_trainer

    start = time.perf_counter()
    try:
        result = resolve_trainer(job.trainer)(job.fields, job.checkpoint_dir, job.resume)
        return Outcome(job.key, result, None, time.perf_counter() - start)
    except Exception:  # a crashed run is a result (status failed), not a crashed study
        return Outcome(job.key, None, traceback.format_exc(), time.perf_counter() - start)


class Inline:
    def __init__(self) -> None:
        self.queue: list[Job] = []

    def submit(self, job: Job) -> None:
        self.queue.append(job)

    def completed(self) -> Iterator[Outcome]:
        while self.queue:
            yield run_job(self.queue.pop(0))

    def close(self) -> None:
        self.queue.clear()


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def default_jobs() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class LocalPool:
    """A pool of spawned processes. A worker that dies (killed, out of memory, a crash in C
    code) breaks the pool: the runs in flight or queued in it fail (a later ``study run``
    retries them), the study goes on, and the pool is rebuilt for the jobs submitted next."""

    def __init__(self, jobs: int | None = None) -> None:
        self.jobs = jobs or default_jobs()
        self.threads = max(1, default_jobs() // self.jobs)
        self.pool = self._new_pool()
        self.pending: dict[Future[Outcome], Job] = {}

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.jobs, mp_context=get_context("spawn"),
                                   initializer=_init_worker, initargs=(self.threads,))

    def submit(self, job: Job) -> None:
        try:
            future = self.pool.submit(run_job, job)
        except BrokenProcessPool:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = self._new_pool()
            future = self.pool.submit(run_job, job)
        self.pending[future] = job

    def completed(self) -> Iterator[Outcome]:
        while self.pending:
            done, _ = wait(list(self.pending), return_when=FIRST_COMPLETED)
            for future in done:
                job = self.pending.pop(future)
                try:
                    yield future.result()
                except BrokenProcessPool as exc:
                    yield Outcome(job.key, None, f"worker process died: {exc!r}", 0.0)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def make_executor(jobs: int | None) -> Executor:
    """``jobs=0``: inline in this process; otherwise a local pool of ``jobs`` processes."""
    return Inline() if jobs == 0 else LocalPool(jobs)
