"""Worker-granularity mechanisms as a DistributedDataParallel communication hook.

For users who train with their own DDP loop: each worker's gradient goes through the
mechanism (DropConnect, SGLD, stochastic quantization of [diversity], or any other registered
in batchbound.diversity.mechanisms) before DDP all-reduces it, as ``batchbound train`` does
on its flat gradient buffer (both call ``apply_to_worker``, which dispatches to the
mechanism's own worker sampler).

    from torch.nn.parallel import DistributedDataParallel as DDP
    from batchbound.train.comm_hook import mechanism_hook, mechanism_hook_state

    ddp = DDP(model, bucket_cap_mb=1024)            # one bucket: Q over the whole gradient
    ddp.register_comm_hook(mechanism_hook_state("quantization", seed=0), mechanism_hook)

What the hook does to a bucket, on every rank: M(bucket) / P, then an all-reduce SUM; with no
mechanism this is DDP's own averaging. The mechanism acts on the gradient DDP hands over (the
gradient of that rank's loss), so SGLD's σ is in those units. DropConnect and SGLD act
element-wise, so buckets do not matter; quantization's norm is over one bucket (over each
parameter with ``quantization(per_tensor=true)``), so it equals [diversity]'s whole-model Q only
when the model fits one bucket (a large ``bucket_cap_mb``). Each rank draws from its own
generator (``seed`` and the rank), so workers' draws are independent.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook inspects the
# hook's annotations and wants the real dist.GradBucket and Future types, not strings.
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from batchbound.diversity.mechanisms import Mechanism, parse_mechanism
from batchbound.errors import BatchboundError
from batchbound.train.mechanisms import apply_to_worker, worker_seed


@dataclass
class MechanismHookState:
    mechanism: Mechanism
    generator: torch.Generator
    process_group: dist.ProcessGroup | None = None


def mechanism_hook_state(
    mechanism: str | Mechanism,
    seed: int = 0,
    *,
    device: str | torch.device = "cpu",
    process_group: dist.ProcessGroup | None = None,
) -> MechanismHookState:
    """The hook's state on this rank: the mechanism and a generator on the gradients' device
    seeded from ``seed`` and the rank (call after ``init_process_group``)."""
    if not dist.is_available() or not dist.is_initialized():
        raise BatchboundError("mechanism_hook_state needs an initialised torch.distributed "
                              "process group (call init_process_group first)")
    rank = dist.get_rank(process_group)
    generator = torch.Generator(device=device)
    generator.manual_seed(worker_seed(seed, rank))
    return MechanismHookState(parse_mechanism(mechanism), generator, process_group)


def bucket_views(buffer: Tensor, sizes: list[int]) -> list[Tensor]:
    """The flat bucket as one view per parameter (DDP lays them out in ``parameters()``
    order); in-place changes to the views change the buffer."""
    if sum(sizes) != buffer.numel():
        return [buffer]  # an unexpected layout: treat the bucket as one tensor
    return list(buffer.split(sizes))


def mechanism_hook(
    state: MechanismHookState, bucket: dist.GradBucket
) -> torch.futures.Future[Tensor]:
    """DDP communication hook: M(this rank's bucket) / P, then all-reduce SUM."""
    buffer = bucket.buffer()
    sizes = [math.prod(p.shape) for p in bucket.parameters()]
    apply_to_worker(state.mechanism, bucket_views(buffer, sizes), 1.0, state.generator)
    buffer.div_(dist.get_world_size(state.process_group))
    work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
