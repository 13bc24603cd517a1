"""Run a test's worker on two (or more) spawned ranks and gather what each puts on the queue."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from batchbound.train.distributed import free_port


def run_ranks(worker: Callable[..., None], world: int = 2, timeout: float = 120) -> dict[Any, Any]:
    """``worker(rank, port, queue)`` on ``world`` spawned processes, each putting one
    ``(key, value)`` on the queue; returns them as a dict once every rank exited 0."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(rank, port, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=timeout) for _ in range(world))
    except Exception:  # a crashed rank leaves the other waiting in a collective
        for p in procs:
            p.kill()
        raise
    for p in procs:
        p.join(timeout=timeout)
        assert p.exitcode == 0
    return results
