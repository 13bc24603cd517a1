"""Quantization diversity and differential diversity across two gloo ranks, each holding half
the data, equal the single-process values."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from batchbound.diversity.differential import differential_diversity
from batchbound.diversity.mechanisms import mechanism_diversity
from batchbound.train.distributed import free_port, teardown

# Spawning two torch processes costs ~30 s on the shared 2-core machine: kept out of the
# default run (`make test-slow` runs it). measure()'s own two-rank test runs by default.
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def problem():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    b = copy.deepcopy(a)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.2 * torch.randn_like(p))
    x, y = torch.randn(30, 4, dtype=torch.float64), torch.randint(0, 3, (30,))
    return a, b, x, y


def measure_all(a, b, x, y) -> list[float]:
    quant = mechanism_diversity(a, (x, y), "cross_entropy", "quantize", chunk_size=7)
    diff = differential_diversity(a, b, (x, y), "cross_entropy", chunk_size=7)
    return [quant.n, quant.S, quant.T, quant.R, diff.n, diff.S, diff.T]


def worker(rank: int, port: int, queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        a, b, x, y = problem()
        half = slice(0, 13) if rank == 0 else slice(13, 30)  # unequal shards on purpose
        queue.put((rank, measure_all(a, b, x[half], y[half])))
    finally:
        teardown()


def test_two_ranks_equal_one_process() -> None:
    single = measure_all(*problem())
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(rank, port, queue)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    results = dict(queue.get() for _ in range(2))
    for values in results.values():
        assert values == pytest.approx(single, rel=1e-10)
