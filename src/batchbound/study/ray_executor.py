"""Runs as Ray tasks: ``batchbound study run SPEC --executor ray [--address ADDR]``.

Each job is one Ray task (``run_job``, one CPU, no automatic retry: a run whose worker dies
comes back failed, and the next ``study run`` retries it, as with the local pool). The store
stays with the driver, the process running ``study run``; tasks return their results to it.
Checkpoints are files in the job's checkpoint directory, so on a cluster of several machines
that directory must be on a file system every node mounts at the same path
(``--checkpoint-dir``); the SQLite store should stay on the driver's local disk.

Without ``address`` a local Ray instance is started with ``jobs`` CPUs (one per core by
default) and shut down at the end; with ``address="auto"`` or ``"HOST:PORT"`` the driver joins
an existing cluster (``ray start --head`` on one machine, ``ray start --address=...`` on the
others) and leaves it running. Killing the driver ends its tasks (Ray's ownership: a task
dies with the driver that submitted it), and the next ``study run`` resumes from the
checkpoints. A local instance's helper processes (Ray's agents) outlive a driver killed with
SIGKILL, so the driver starts a reaper for them (batchbound/lifetime.py).
Install with ``pip install 'batchbound[ray]'``.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any

from batchbound.errors import BatchboundError
from batchbound.lifetime import reap_when_dead
from batchbound.study.executor import Job, Outcome, default_jobs, run_job


class RayExecutor:
    def __init__(self, jobs: int | None = None, address: str | None = None) -> None:
        if jobs is not None and jobs < 1:
            raise BatchboundError(f"jobs must be at least 1 with the Ray executor, got {jobs}")
        try:
            import ray
        except ImportError:
            raise BatchboundError("the Ray executor needs Ray: pip install "
                                  "'batchbound[ray]'") from None
        self.ray = ray
        self.jobs, self.address = jobs, address
        self.started_here = False
        self.reaper: subprocess.Popen[bytes] | None = None
        self.remote: Any = None
        self.pending: dict[Any, Job] = {}  # ObjectRef -> job

    def _start(self) -> None:
        ray = self.ray
        if not ray.is_initialized():
            options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                       "logging_level": "ERROR"}
            if self.address is None:  # a local instance: this machine's cores, our env
                options["num_cpus"] = self.jobs or default_jobs()
                options["runtime_env"] = {"env_vars": {
                    k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}}
            try:
                ray.init(address=self.address, **options)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise BatchboundError(f"cannot start or reach Ray at "
                                      f"{self.address or 'a local instance'}: {exc}") from None
            self.started_here = self.address is None
            if self.started_here:
                self.reaper = reap_when_dead()
        self.remote = ray.remote(num_cpus=1, max_retries=0)(run_job)

    def submit(self, job: Job) -> None:
        if self.remote is None:
            self._start()
        self.pending[self.remote.remote(job)] = job

    def completed(self) -> Iterator[Outcome]:
        ray = self.ray
        while self.pending:
            done, _ = ray.wait(list(self.pending), num_returns=1)
            for ref in done:
                job = self.pending.pop(ref)
                try:
                    yield ray.get(ref)
                except ray.exceptions.RayError as exc:  # the task's worker or node died
                    yield Outcome(job.key, None, f"Ray task failed: {exc}", 0.0)

    def close(self) -> None:
        if self.remote is None:
            return
        for ref in self.pending:  # abandoned mid-study: the runs resume next time
            self.ray.cancel(ref, force=True)
        self.pending.clear()
        if self.started_here:
            self.ray.shutdown()
        if self.reaper is not None:  # a clean shutdown leaves it nothing to do
            self.reaper.terminate()
            self.reaper.wait()
