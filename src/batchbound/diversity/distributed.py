"""Summing a measurement across torch.distributed ranks.

Each rank measures its own shard; S, n, the loss sum, the per-parameter S and Σg_i are sums
over examples, so one all-reduce (SUM) of them gives every rank the exact global Δ.
T = ‖Σg‖² is computed after the reduction, never summed (it is not additive).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def all_reduce_sum(tensors: list[Tensor]) -> list[Tensor]:
    """Sum each tensor over all ranks (one flat all-reduce); identity without a process group.

    The buffer stays on the tensors' device (CUDA for NCCL); under gloo it is moved to the
    CPU, which gloo always supports.
    """
    if not is_distributed():
        return tensors
    device = tensors[0].device
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors])
    if dist.get_backend() == "gloo":
        flat = flat.cpu()
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat = flat.to(device)
    out, start = [], 0
    for t in tensors:
        out.append(flat[start : start + t.numel()].reshape(t.shape))
        start += t.numel()
    return out
