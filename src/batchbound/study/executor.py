"""Executors: where runs execute. The runner only needs ``submit`` and ``completed`` (and
``close`` at the end).

``LocalPool`` runs jobs in a pool of spawned local processes (one per core by default); every
run, in a pool or inline, computes on one torch thread and on the kernels that
``batchbound.kernels`` pins (portable unless $BATCHBOUND_KERNELS says native), so results do
not depend on the machine's cores, its processor or ``OMP_NUM_THREADS``. ``Inline`` runs them
one by one in this process, for tests and debugging. ``RayExecutor`` (ray_executor.py) runs
each job as a Ray task. Runs are independent, and a job carries everything it needs (config
fields, checkpoint directory, resume flag, the trainer's import name). Executors start their
workers on the first ``submit``, so a runner refused by the store's lock starts nothing.

Workers die with the runner, whatever ends it: pool workers watch their parent
(batchbound/lifetime.py) and stop at a checkpoint when it is gone; ``close`` with jobs still
outstanding (an error, Ctrl-C) sends them SIGTERM, so they checkpoint and stop, and kills any
that has not exited ``STOP_GRACE_SECONDS`` later.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Protocol

from batchbound import kernels
from batchbound.environment import usable_cores
from batchbound.errors import BatchboundError

STOP_GRACE_SECONDS = 30.0  # a stopped worker's time to write its checkpoint


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


# Every run computes on kernels.threads() torch threads (1 unless $BATCHBOUND_THREADS says
# otherwise), whatever the machine: a float sum's order depends on the thread count, so a
# study's numbers would otherwise change with the cores.


def run_job(job: Job) -> Outcome:
    """Execute one job on kernels.threads() torch threads; any exception becomes a failed outcome
    with its traceback."""
    import torch

    from batchbound.study.adapter import resolve_trainer

    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(kernels.threads())
    try:
        kernels.use()  # the kernels asked for ($BATCHBOUND_KERNELS, portable by default)
        result = resolve_trainer(job.trainer)(job.fields, job.checkpoint_dir, job.resume)
        return Outcome(job.key, result, None, time.perf_counter() - start)
    except Exception:  # a crashed run is a result (status failed), not a crashed study
        return Outcome(job.key, None, traceback.format_exc(), time.perf_counter() - start)
    except SystemExit as exc:
        # SIGTERM to a pool worker outside the run's own handler (``_leave``), or the trainer
        # calling sys.exit: the pool would hand the SystemExit to the runner, which ended
        # silently with it; the run fails instead (retried next time) and the study goes on
        why = (f"stopped by SIGTERM outside the run's checkpointing (exit {exc.code})"
               if exc.code == 128 + signal.SIGTERM else f"the run called sys.exit({exc.code!r})")
        return Outcome(job.key, None, why, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)


@contextmanager
def _main_not_rerun() -> Iterator[None]:
    """Start spawned workers without re-running the caller's ``__main__`` script.

    A spawned process imports the parent's main module (as ``__mp_main__``) so that its
    functions can be unpickled, which re-runs a script's unguarded top level: the study again,
    in every worker. Jobs only need ``batchbound``, so while workers start the main module is
    named by a spec called ``__main__``, which spawn skips (multiprocessing/spawn.py,
    ``_fixup_main_from_name``); a script pasted without ``if __name__ == "__main__"`` works."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = getattr(main, "__spec__", None)
    main.__spec__ = ModuleSpec("__main__", None)
    try:
        yield
    finally:
        main.__spec__ = saved


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

    from batchbound.lifetime import die_with_parent

    torch.set_num_threads(threads)
    die_with_parent()
    signal.signal(signal.SIGINT, _interrupt_runner)
    signal.signal(signal.SIGTERM, _leave)
    # at exit, before the finalizers registered earlier (torch's, at its import above: atexit
    # runs last-registered first), SIGTERM is ignored: the worker is leaving already
    atexit.register(signal.signal, signal.SIGTERM, signal.SIG_IGN)


def _leave(signum: int, frame: object) -> None:
    """SIGTERM to a pool worker outside a run's own handler (idle, or between runs): leave
    through the interpreter's normal exit, which runs multiprocessing's finalizers. Killed
    outright, as by default, a worker left what it had registered with the resource tracker
    (tqdm's multiprocessing lock, made by ``measure``) registered, and the tracker printed
    "leaked semaphore objects" after a study's one-line error. Within a run the trainer's
    StopFlag takes SIGTERM instead and stops the run at a checkpoint, as before; in a job
    outside that window the run fails (``run_job``) and the worker stays for the next.
    Once, and not while the worker exits already: the runner repeats SIGTERM while it waits,
    and a SystemExit raised inside the exit's own finalizers printed "Exception ignored in
    atexit callback" and a traceback after the study's one line (on a busy machine)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # leaving already: the exit finishes it
    raise SystemExit(128 + signum)


def _interrupt_runner(signum: int, frame: object) -> None:
    """SIGINT to one pool worker is SIGINT to the study: passed on to the runner, which
    stops every run at a checkpoint (as Ctrl-C to the whole group does), instead of a
    KeyboardInterrupt that breaks the pool and fails the runs in it. The trainer's own
    handler, installed while a run trains, stops that run and calls this one too."""
    parent = os.getppid()
    if parent > 1:
        os.kill(parent, signal.SIGINT)


_interrupt_runner.chained = True  # type: ignore[attr-defined]  # StopFlag calls it too


def default_jobs() -> int:
    return usable_cores()


class LocalPool:
    """A pool of spawned processes. A worker that dies (killed, out of memory, a crash in C
    code) breaks the pool: the runs in flight or queued in it fail (a later ``study run``
    retries them), the study goes on, and the pool is rebuilt for the jobs submitted next."""

    def __init__(self, jobs: int | None = None) -> None:
        if jobs is not None and jobs < 1:
            raise BatchboundError(f"jobs must be at least 1 (0 runs inline), got {jobs}")
        self.jobs = _check_memory(jobs) if jobs else _jobs_that_fit(default_jobs())
        self.threads = kernels.threads()
        self.pool: ProcessPoolExecutor | None = None  # started by the first submit
        self.pending: dict[Future[Outcome], Job] = {}

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.jobs, mp_context=get_context("spawn"),
                                   initializer=_init_worker, initargs=(self.threads,))

    def submit(self, job: Job) -> None:
        with _main_not_rerun():  # workers start inside submit
            if self.pool is None:
                self.pool = self._new_pool()
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
        if self.pool is None:
            return
        if not self.pending:  # every job is in: the workers exit when told
            self.pool.shutdown(wait=True, cancel_futures=True)
            return
        # abandoned mid-study: stop the runs at a checkpoint (their store records stay
        # `running`, which the next invocation resumes), then make sure nothing is left
        workers = multiprocessing.active_children()
        self.pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while workers and time.monotonic() < deadline:
            # again while they last: a worker whose run has stopped at its checkpoint
            # (its StopFlag took the first) leaves on the next, idle (``_leave``)
            for process in workers:
                process.terminate()
            for process in workers:
                process.join(min(0.2, max(0.0, deadline - time.monotonic())))
            workers = [p for p in workers if p.is_alive()]
        for process in workers:  # a run that did not stop within the grace
            process.kill()
            process.join()
        self.pending.clear()


def _check_memory(jobs: int) -> int:
    """Refuse more pool workers than the memory free now can start (each imports torch),
    before any starts: the kernel would kill them one by one, each run failing."""
    from batchbound.train.launch import WORKER_BYTES, available_memory_bytes

    memory = available_memory_bytes()
    if memory is not None and jobs * WORKER_BYTES > memory:
        raise BatchboundError(
            f"--jobs {jobs} needs about {jobs * WORKER_BYTES / 2**30:.1f} GB for its worker "
            f"processes (≈{WORKER_BYTES // 2**20} MB each with torch loaded); this machine has "
            f"{memory / 2**30:.1f} GB available now: use fewer --jobs")
    return jobs


def _jobs_that_fit(cores: int) -> int:
    """The default pool: one worker per core, as many as the free memory can start."""
    from batchbound.train.launch import WORKER_BYTES, available_memory_bytes

    memory = available_memory_bytes()
    return cores if memory is None else max(1, min(cores, memory // WORKER_BYTES))


# Executors by name: a module and the class in it, imported when chosen (Ray is optional).
# The executors by name: adding one is a module with a class taking (jobs, **options) and
# one entry here (the CLI's --executor choices come from it; inline is --jobs 0).
EXECUTORS = {
    "local": "batchbound.study.executor:LocalPool",
    "inline": "batchbound.study.executor:Inline",
    "ray": "batchbound.study.ray_executor:RayExecutor",
}


def make_executor(jobs: int | None, kind: str = "local", **options: Any) -> Executor:
    """``kind`` from EXECUTORS; ``jobs=0`` runs inline (local only); ``options`` go to the
    executor (Ray: ``address``)."""
    if kind not in EXECUTORS:
        raise BatchboundError(f"unknown executor {kind!r}; choose from {', '.join(EXECUTORS)}")
    if kind == "local" and jobs == 0:
        kind = "inline"
    module, _, name = EXECUTORS[kind].partition(":")
    cls = getattr(importlib.import_module(module), name)
    if kind == "inline":
        return cls(**options)
    return cls(jobs, **options)
