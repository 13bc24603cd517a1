"""How a run starts: ``train()`` runs in this process (alone, or as a rank of an existing or
torchrun process group), or spawns P local processes for ``--workers P``.

With P local processes, the parent loads and validates the data first (bad input fails
before any process starts), hands it to the workers through torch.multiprocessing's shared
memory, hosts the rendezvous store on a free port, and waits. Rank 0 writes the RunResult to
a temporary file the parent reads back. SIGINT or SIGTERM to the parent is forwarded to the
workers as SIGTERM, so they checkpoint and stop together. Each worker computes on
``kernels.threads()`` torch threads (1 unless $BATCHBOUND_THREADS says otherwise), as a run
in this process does, so the numbers depend neither on the cores nor on OMP_NUM_THREADS. A
rank that dies (SIGKILL, the OOM killer) or falls silent (stall.py) ends the run with one
line naming it and the checkpoint to resume from; the other ranks are stopped.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchbound import kernels
from batchbound.data import Dataset, apply_transform, load_dataset
from batchbound.environment import restart_count, usable_cores
from batchbound.errors import BatchboundError, FaultError, InterruptedWorkError, warn
from batchbound.files import write_whole
from batchbound.lifetime import die_with_parent
from batchbound.train.checkpoint import overwrite_refusal
from batchbound.train.config import TrainConfig
from batchbound.train.distributed import (
    env_rank,
    env_world_size,
    init_group,
    resolve_device,
    teardown,
)
from batchbound.train.loop import train_in_group
from batchbound.train.result import RunResult
from batchbound.train.stall import DEFAULT_STALL_TIMEOUT, resume_hint


def train(
    config: TrainConfig,
    *,
    dataset: Dataset | None = None,
    checkpoint_path: str | Path | None = None,
    resume: bool = False,
    progress: bool = False,
    stall_timeout: float = DEFAULT_STALL_TIMEOUT,
    keep_checkpoint: bool = False,
) -> RunResult:
    """Train per ``config``; return the RunResult (on every rank; rank 0 is the one to keep).

    ``dataset``: an already loaded Dataset instead of ``config.dataset`` (the transform is
    still applied). ``checkpoint_path``: where checkpoints go (periodic with
    ``config.checkpoint_every``, and on SIGTERM/SIGINT). ``resume``: continue from it; a run
    that torchrun restarted (``--max-restarts``) resumes from it by itself when it exists.
    ``stall_timeout``: seconds a collective waits for a silent rank before the run ends
    naming it (stall.py). ``keep_checkpoint`` (``batchbound train``): a run that would start
    afresh over an existing checkpoint is refused, naming --resume; under torchrun only
    when no agent has restarted, decided by all ranks together (``loop._agreed``). With
    ``config.workers > 1`` and no process group, P local processes are spawned (gloo on
    CPU, NCCL on CUDA); under torchrun the environment's group is joined.
    """
    if resume and checkpoint_path is None:
        raise BatchboundError("resume needs a checkpoint path")
    if not stall_timeout > 0:
        raise BatchboundError(f"stall timeout must be > 0 seconds, got {stall_timeout!r}")
    restarts = restart_count()  # the torchrun environment, checked before any work
    if restarts and not resume and checkpoint_path and Path(checkpoint_path).exists():
        resume = True
        if env_rank() == 0:
            print(f"batchbound: restart {restarts} by torchrun: resuming from the checkpoint "
                  f"{checkpoint_path}", file=sys.stderr, flush=True)
    options = {"checkpoint_path": checkpoint_path, "resume": resume, "progress": progress,
               "stall_timeout": stall_timeout}
    if config.workers > 1 and env_world_size() == 1 and not dist.is_initialized():
        if keep_checkpoint and not resume and checkpoint_path and Path(checkpoint_path).exists():
            raise overwrite_refusal(checkpoint_path)  # before spawning: no group to agree in
        return launch_local(config, dataset=dataset, **options)
    return train_in_group(config, dataset=dataset, keep_checkpoint=keep_checkpoint, **options)


def launch_local(
    config: TrainConfig,
    *,
    dataset: Dataset | None = None,
    checkpoint_path: str | Path | None = None,
    resume: bool = False,
    progress: bool = False,
    stall_timeout: float = DEFAULT_STALL_TIMEOUT,
) -> RunResult:
    data = dataset if dataset is not None else load_dataset(config.dataset, config.data_dir)
    checked = apply_transform(data, config.transform, config.seed) if config.transform else data
    config.validate_against(checked)
    device = resolve_device(config.device)  # a missing CUDA fails here, not in P workers
    _check_gpus(config.device, device, config.workers)
    _check_local_workers(config.workers, device)
    _check_shared_memory(checked, config.workers)
    threads = kernels.threads()
    # the rendezvous store lives here, not in a rank, so a roll call works whichever is silent
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=stall_timeout))
    with tempfile.TemporaryDirectory(prefix="batchbound-") as tmp:
        out = Path(tmp) / "result.json"
        options = {"checkpoint_path": checkpoint_path, "resume": resume, "progress": progress}
        context = mp.start_processes(
            _worker,
            args=(config.to_dict(), data, store.port, threads, str(out), stall_timeout, options),
            nprocs=config.workers,
            join=False,
            start_method="spawn",
        )
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        stopped_by: list[str] = []  # the signals this process received: the user's stop

        def forward(signum: int, frame: Any) -> None:
            stopped_by.append(signal.Signals(signum).name)
            for process in context.processes:
                if process.is_alive() and process.pid is not None:
                    os.kill(process.pid, signal.SIGTERM)

        quiet = logging.getLogger("torch.multiprocessing.spawn")  # its warnings as it ends
        level = quiet.level  # the ranks left after a failure: we say what happened, once
        try:
            for sig in previous:
                signal.signal(sig, forward)
            quiet.setLevel(logging.ERROR)
            while not context.join(grace_period=RANK_GRACE_SECONDS):
                pass
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:  # others ended
            if stopped_by:  # a rank ended by the stop before it could take it (starting up)
                raise InterruptedWorkError(
                    f"stopped by {stopped_by[0]} before every rank could stop at a "
                    f"checkpoint (a rank was still starting); {resume_hint(checkpoint_path)}"
                ) from None
            raise _rank_fault(exc, config.workers, out, checkpoint_path) from None
        finally:
            quiet.setLevel(level)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return RunResult.from_json(out.read_text())


# After one rank fails, the others' time to reach the same conclusion (a roll call) and
# exit before they are sent SIGTERM, and then SIGKILL.
RANK_GRACE_SECONDS = 5.0


def _rank_fault(exc: Exception, ranks: int, out: Path,
                checkpoint: str | Path | None) -> Exception:
    """One line for a local run that lost a rank: the rank that died by a signal, else the
    message a rank left (a stall's roll call, a full disk, bad input only a rank could see),
    else the original exception (a bug's traceback is worth more than a line)."""
    if isinstance(exc, mp.ProcessExitedException) and exc.signal_name:
        return FaultError(f"rank {exc.error_index} (pid {exc.error_pid}) was killed by "
                          f"{exc.signal_name}; the other ranks were stopped; "
                          f"{resume_hint(checkpoint)}")
    for rank in range(ranks):
        left = Path(f"{out}.error-{rank}")
        if left.exists():
            kind, _, message = left.read_text().partition("\n")
            return FaultError(message) if kind == "fault" else BatchboundError(message)
    return exc


def _check_gpus(name: str, device: torch.device, workers: int) -> None:
    """One GPU per local worker, checked before any is spawned: NCCL refuses two ranks on
    one device, but only after start-up and with its own message."""
    if device.type != "cuda":
        return
    if ":" in name:  # cuda:i pins every rank to the same device
        raise BatchboundError(
            f"--workers {workers} with --device {name}: every worker would use that one GPU, "
            "and NCCL needs one GPU per worker; use --device cuda (worker r on GPU r)")
    count = torch.cuda.device_count()
    if workers > count:
        raise BatchboundError(
            f"--workers {workers} on CUDA needs {workers} GPUs, one per worker, but this "
            f"machine has {count}; use --workers {count} or fewer, or --device cpu")


# What one spawned worker costs before it holds any data: Python with torch imported.
WORKER_BYTES = 300 * 2**20


def _check_local_workers(workers: int, device: torch.device | None = None) -> None:
    """Refuse more local processes than the memory free now can start (each imports
    torch), before the first one is spawned: total memory says nothing on a machine other
    jobs already fill. More processes than the cores this process may use compute by
    turns on a CPU: said, since every time the run reports then measures the turns (on GPUs
    the cores only launch the work)."""
    memory = available_memory_bytes()
    if memory is not None and workers * WORKER_BYTES > memory:
        raise BatchboundError(
            f"{workers} local worker processes need about {workers * WORKER_BYTES / 2**30:.1f} "
            f"GB (≈{WORKER_BYTES // 2**20} MB each with torch loaded); this machine has "
            f"{memory / 2**30:.1f} GB available now: use fewer --workers, or torchrun across "
            "machines")
    cores = usable_cores()
    if workers > cores and (device is None or device.type == "cpu"):
        warn(f"batchbound: {workers} local workers on the {cores} CPU cores this process may "
             f"use take turns on them: the run takes about {workers / cores:.2g}× as long as "
             "on one core each, and its times (train_seconds, the step and all-reduce times) "
             "measure the turns, not the job; what it trains to is the same")


# Where torch's shared memory lives (shm_open) on Linux: the data set goes there once, for
# every spawned rank to map, plus what each rank's tensors passed between processes use.
SHARED_MEMORY = Path("/dev/shm")
SHARED_MEMORY_PER_WORKER = 16 * 2**20


def shared_memory_bytes(data: Dataset, workers: int) -> int:
    """What ``launch_local`` puts in shared memory: the data set's tensors, once, and a
    margin per rank."""
    tensors = (data.x_train, data.y_train, data.x_test, data.y_test)
    return sum(t.numel() * t.element_size() for t in tensors) \
        + workers * SHARED_MEMORY_PER_WORKER


def _check_shared_memory(data: Dataset, workers: int) -> None:
    """Refuse before the first rank is spawned when the shared memory the ranks receive the
    data set through cannot hold it (a full or small /dev/shm, as in many containers);
    torch would fail in every rank with tens of lines."""
    try:
        free = shutil.disk_usage(SHARED_MEMORY).free
    except OSError:  # no /dev/shm: torch falls back or fails on its own
        return
    need = shared_memory_bytes(data, workers)
    if need > free:
        raise BatchboundError(
            f"{workers} local workers need about {need / 2**20:,.0f} MB of shared memory "
            f"({SHARED_MEMORY}) to receive the data set; {free / 2**20:,.0f} MB is free: free "
            f"some (or enlarge it, e.g. docker --shm-size), use a smaller data set, or "
            "--workers 1")


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


def _hand_back(path: Path, text: str, launcher: int) -> None:
    """Write ``path`` in the launcher's folder for it to read; nothing once the launcher is
    gone (die_with_parent removes the folder: a write would fail, or outlive everyone)."""
    if os.getppid() != launcher:
        return
    try:
        write_whole(path, text)
    except OSError:
        if os.getppid() == launcher:
            raise


def _worker(
    rank: int,
    config_dict: dict[str, Any],
    data: Dataset,
    port: int,
    threads: int,
    out: str,
    stall_timeout: float,
    options: dict[str, Any],
) -> None:
    launcher = os.getppid()
    # a rank whose launcher was killed stops at a checkpoint, then exits, and removes the
    # launcher's folder, which no one would read or delete any more
    die_with_parent(parent=launcher, remove=Path(out).parent)
    kernels.use()  # as the launcher asked ($BATCHBOUND_KERNELS, inherited)
    config = TrainConfig.from_dict(config_dict)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(config.workers), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    device = resolve_device(config.device, rank)
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=timedelta(seconds=stall_timeout))
    init_group("nccl" if device.type == "cuda" else "gloo", stall_timeout=stall_timeout,
               store=store, rank=rank, world_size=config.workers)
    finished = False
    try:
        result = train_in_group(config, dataset=data, **options)
        if rank == 0:
            _hand_back(Path(out), result.to_json(), launcher)
        finished = True
    except BatchboundError as exc:  # one line for the launcher, not a traceback
        kind = "fault" if isinstance(exc, FaultError) else "bad input"
        _hand_back(Path(f"{out}.error-{rank}"), f"{kind}\n{exc}", launcher)
        raise SystemExit(exc.exit_code) from None
    finally:
        teardown(synchronise=finished)
        if os.getppid() != launcher:  # its folder would outlive everyone
            shutil.rmtree(Path(out).parent, ignore_errors=True)
