"""How a run starts: ``train()`` runs in this process (alone, or as a rank of an existing or
torchrun process group), or spawns P local processes for ``--workers P``.

With P local processes, the parent loads and validates the data first (bad input fails
before any process starts), hands it to the workers through torch.multiprocessing's shared
memory, picks a free port, and waits. Rank 0 writes the RunResult to a temporary file the
parent reads back. SIGINT or SIGTERM to the parent is forwarded to the workers as SIGTERM,
so they checkpoint and stop together. Each worker gets ⌊cores/P⌋ intra-op threads so P
workers do not oversubscribe.
"""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchbound import kernels
from batchbound.data import Dataset, apply_transform, load_dataset
from batchbound.errors import BatchboundError
from batchbound.lifetime import die_with_parent
from batchbound.train.config import TrainConfig
from batchbound.train.distributed import (
    env_world_size,
    free_port,
    init_group,
    resolve_device,
    teardown,
)
from batchbound.train.loop import train_in_group
from batchbound.train.result import RunResult


def train(
    config: TrainConfig,
    *,
    dataset: Dataset | None = None,
    checkpoint_path: str | Path | None = None,
    resume: bool = False,
    progress: bool = False,
) -> RunResult:
    """Train per ``config``; return the RunResult (on every rank; rank 0 is the one to keep).

    ``dataset``: an already loaded Dataset instead of ``config.dataset`` (the transform is
    still applied). ``checkpoint_path``: where checkpoints go (periodic with
    ``config.checkpoint_every``, and on SIGTERM/SIGINT). ``resume``: continue from it.
    With ``config.workers > 1`` and no process group, P local processes are spawned (gloo on
    CPU, NCCL on CUDA); under torchrun the environment's group is joined.
    """
    if resume and checkpoint_path is None:
        raise BatchboundError("resume needs a checkpoint path")
    options = {"checkpoint_path": checkpoint_path, "resume": resume, "progress": progress}
    if config.workers > 1 and env_world_size() == 1 and not dist.is_initialized():
        return launch_local(config, dataset=dataset, **options)
    return train_in_group(config, dataset=dataset, **options)


def launch_local(
    config: TrainConfig,
    *,
    dataset: Dataset | None = None,
    checkpoint_path: str | Path | None = None,
    resume: bool = False,
    progress: bool = False,
) -> RunResult:
    data = dataset if dataset is not None else load_dataset(config.dataset, config.data_dir)
    checked = apply_transform(data, config.transform, config.seed) if config.transform else data
    config.validate_against(checked)
    resolve_device(config.device)  # a missing CUDA fails here, not in P workers
    _check_local_workers(config.workers)
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // config.workers)
    with tempfile.TemporaryDirectory(prefix="batchbound-") as tmp:
        out = Path(tmp) / "result.json"
        options = {"checkpoint_path": checkpoint_path, "resume": resume, "progress": progress}
        context = mp.start_processes(
            _worker,
            args=(config.to_dict(), data, port, threads, str(out), options),
            nprocs=config.workers,
            join=False,
            start_method="spawn",
        )
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def forward(signum: int, frame: Any) -> None:
            for process in context.processes:
                if process.is_alive() and process.pid is not None:
                    os.kill(process.pid, signal.SIGTERM)

        try:
            for sig in previous:
                signal.signal(sig, forward)
            while not context.join():
                pass
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return RunResult.from_json(out.read_text())


# What one spawned worker costs before it holds any data: Python with torch imported.
WORKER_BYTES = 300 * 2**20


def _check_local_workers(workers: int) -> None:
    """Refuse more local processes than the memory free now can start (each imports
    torch), before the first one is spawned: total memory says nothing on a machine other
    jobs already fill."""
    memory = available_memory_bytes()
    if memory is not None and workers * WORKER_BYTES > memory:
        raise BatchboundError(
            f"{workers} local worker processes need about {workers * WORKER_BYTES / 2**30:.1f} "
            f"GB (≈{WORKER_BYTES // 2**20} MB each with torch loaded); this machine has "
            f"{memory / 2**30:.1f} GB available now: use fewer --workers, or torchrun across "
            "machines")


def available_memory_bytes() -> int | None:
    """Memory that can be allocated now without swapping: the kernel's MemAvailable, or
    what is left under this container's limit when that is less; None when unknown."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        available = int(meminfo.split("MemAvailable:")[1].split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        return None
    try:
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        used = int((cgroup / "memory.current").read_text())
    except (OSError, ValueError):
        return available
    return min(available, int(limit) - used) if limit.isdigit() else available


def _worker(
    rank: int,
    config_dict: dict[str, Any],
    data: Dataset,
    port: int,
    threads: int,
    out: str,
    options: dict[str, Any],
) -> None:
    die_with_parent()  # a rank whose launcher was killed stops at a checkpoint, then exits
    kernels.use()  # as the launcher asked ($BATCHBOUND_KERNELS, inherited)
    config = TrainConfig.from_dict(config_dict)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(config.workers),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(threads)
    device = resolve_device(config.device, rank)
    init_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=config.workers)
    finished = False
    try:
        result = train_in_group(config, dataset=data, **options)
        if rank == 0:
            tmp = Path(out + ".tmp")
            tmp.write_text(result.to_json())
            os.replace(tmp, out)
        finished = True
    finally:
        teardown(synchronise=finished)
