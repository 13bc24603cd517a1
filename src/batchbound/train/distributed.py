"""Process groups, the split of the global batch across workers, and the gradient all-reduce.

**Splitting B across P workers.** Every rank draws the same global batch of B indices from
an identically seeded sampler, then takes a contiguous slice: rank r gets ⌊B/P⌋ examples,
plus one more when r < B mod P. B < P is an error (a worker with no example).

**Combining gradients.** Each rank backpropagates the *sum* of its per-example losses scaled
by 1/B (convention ``mean``) or 1 (``sum``), copies its gradients into one flat buffer and
``torch.distributed.all_reduce``\\ s it with SUM: the collective DDP itself uses. Summing
(instead of DDP's average over ranks) is what makes unequal slices exact: the result is
(1/B)·Σ_{i∈batch} g_i whatever the split, i.e. single-process training up to the order of
floating-point additions. We do not wrap the model in DDP because (a) DDP divides by the
world size, which is wrong for unequal slices, (b) one explicit all-reduce is timed exactly,
without guessing which bucket overlapped with backward, and (c) worker-granularity
mechanisms and the step's stop/loss flags ride on the same buffer. The price is no overlap of
communication with backward, which for the models here (≤ a few M parameters) is small.
"""

from __future__ import annotations

import os
import socket
import warnings
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from batchbound.environment import check_torchrun_environment
from batchbound.errors import BatchboundError
from batchbound.train.stall import forget_store, keep_store


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None  # None when not distributed

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> ``cuda:<local_rank>`` when CUDA is available, else ``cpu``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise BatchboundError("device 'cuda' requested but CUDA is not available")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    device = torch.device(name)
    if device.type == "cuda":  # cuda:i: fail here, not in torch's first .to(device)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index is not None and device.index >= count:
            raise BatchboundError(f"device {name!r} requested but this machine has "
                                  f"{count} CUDA device(s)")
    return device


def env_world_size() -> int:
    """WORLD_SIZE from torchrun's environment (1 when not launched by torchrun), after
    ``check_torchrun_environment``: a malformed or incomplete one is a one-line error."""
    return check_torchrun_environment()[0]


def env_rank() -> int:
    """RANK from torchrun's environment (0 when not launched by torchrun)."""
    return check_torchrun_environment()[1]




def init_group(backend: str, *, stall_timeout: float | None = None, **options: Any) -> None:
    """``dist.init_process_group(backend, **options)``, with the torch modules that capture
    the default group at import time imported first, every collective bounded by
    ``stall_timeout`` seconds (torch's 30 minutes when None), and the rendezvous store kept
    for the roll call that names a silent rank (stall.py).

    Without a ``store`` or ``init_method`` in ``options`` the rendezvous is torch's env://
    (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE; under torchrun, its agent's store), done
    here as ``init_process_group`` would do it, so that the store is in hand.

    ``torch.distributed.nn.functional`` declares ``group=group.WORLD`` defaults, which bind
    whatever group exists when it is imported; ``torch._dynamo`` imports it, and the first
    ``torch.optim`` optimizer imports ``torch._dynamo``. Imported after the group exists, it
    keeps the group alive past ``destroy_process_group``: the gloo worker threads then run
    on into interpreter shutdown, and one that drops its last finished all-reduce there
    (whose tensor holds a Python object) takes the GIL during finalisation and aborts the
    process (SIGABRT, "terminate called without an active exception"; a few % of 2-rank
    runs, docs/torchrun-abort.md). Imported first, the defaults bind None (the default
    group, looked up at call time)."""
    import torch.distributed.nn.functional  # noqa: F401  (import order is the point)

    if stall_timeout is not None:
        options["timeout"] = timedelta(seconds=stall_timeout)
    if "store" not in options and "init_method" not in options:
        timeout = options.get("timeout", timedelta(minutes=30))
        store, rank, world_size = next(dist.rendezvous(
            "env://", rank=options.pop("rank", -1), world_size=options.pop("world_size", -1),
            timeout=timeout))
        store.set_timeout(timeout)
        options.update(store=dist.PrefixStore("default_pg", store), rank=rank,
                       world_size=world_size)
        keep_store(store, timeout.total_seconds())
    elif "store" in options:
        keep_store(options["store"], options.get("timeout", timedelta(minutes=30)).total_seconds())
    dist.init_process_group(backend=backend, **options)


def setup(device: str, stall_timeout: float | None = None) -> DistContext:
    """Join (or create) the process group when running under several ranks.

    Uses an already initialised group; else, under torchrun (WORLD_SIZE > 1 in the
    environment), initialises one from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, its
    collectives bounded by ``stall_timeout`` seconds.
    """
    if not dist.is_initialized() and env_world_size() > 1:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        target = resolve_device(device, local_rank)
        init_group("nccl" if target.type == "cuda" else "gloo", stall_timeout=stall_timeout)
    if not dist.is_initialized():
        return DistContext(device=resolve_device(device))
    local_rank = int(os.environ.get("LOCAL_RANK", str(dist.get_rank())))
    target = resolve_device(device, local_rank)
    if target.type == "cuda":
        torch.cuda.set_device(target)
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=target,
        backend=dist.get_backend(),
    )


def shard_sizes(batch_size: int, world_size: int) -> list[int]:
    """⌊B/P⌋ each, plus one for the first B mod P ranks."""
    if batch_size < world_size:
        raise BatchboundError(
            f"global batch {batch_size} is smaller than the {world_size} workers: every worker "
            "needs at least one example"
        )
    base, extra = divmod(batch_size, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def shard(indices: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous slice of the global batch ``indices``."""
    sizes = shard_sizes(len(indices), world_size)
    start = sum(sizes[:rank])
    return indices[start : start + sizes[rank]]


def all_reduce_sum(buffer: torch.Tensor) -> None:
    """In-place SUM across ranks (no-op on one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)


def teardown(synchronise: bool = True) -> bool:
    """Leave the process group; True when it is gone (nothing in Python still holds it).

    With ``synchronise`` (every rank got here normally) a barrier comes first, so that every
    rank has finished its collectives before any closes its connections. After an error,
    pass False: a peer may never reach the barrier.

    ``destroy_process_group`` frees the group only when nothing else refers to it. Something
    that still does (a module imported after ``init_process_group`` that bound it as a
    default argument: see ``init_group``) keeps its gloo threads running into interpreter
    shutdown, where they can abort the process; after a normal run that is warned about."""
    if not dist.is_initialized():
        return True
    try:
        released: weakref.ref[Any] | None = weakref.ref(dist.group.WORLD)
    except TypeError:  # None, or a group type without weak references: nothing to check
        released = None
    try:
        if synchronise:
            dist.barrier()
    finally:
        dist.destroy_process_group()
        forget_store()
    if released is None or released() is None:
        return True
    if synchronise:  # after an error, the traceback's frames may still hold it: no news
        warnings.warn(
            "the torch.distributed process group is still referenced after "
            "destroy_process_group (a module imported after init_process_group bound it, "
            "e.g. as a default argument); its threads outlive it and may abort the process "
            "at exit (docs/torchrun-abort.md)",
            RuntimeWarning,
            stacklevel=2,
        )
    return False


def free_port() -> int:
    """A free TCP port on loopback (bind to port 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
