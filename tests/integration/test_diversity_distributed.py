"""Two gloo processes on loopback, each holding part of the data, get the one-process Δ."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from batchbound.train.distributed import free_port, teardown

pytestmark = pytest.mark.distributed

N = 13  # odd, so the shards differ in size (7 and 6)


def make_problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(15, 4))
    x = torch.randn(N, 2, 5, generator=gen)
    y = torch.randint(0, 4, (N,), generator=gen)
    return model, x, y


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from batchbound.diversity import measure

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        model, x, y = make_problem()
        shard = slice(0, 7) if rank == 0 else slice(7, N)
        report = measure(
            model, (x[shard], y[shard]), "cross_entropy", dtype=torch.float64, chunk_size=4
        )
        Path(out_dir, f"rank{rank}.json").write_text(report.to_json())
    finally:
        teardown()


def test_two_ranks_match_one_process(tmp_path: Path) -> None:
    from batchbound.diversity import measure

    mp.start_processes(
        worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn"
    )
    model, x, y = make_problem()
    single = measure(model, (x, y), "cross_entropy", dtype=torch.float64, chunk_size=5)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["n"] == N and got["world_size"] == 2
        assert got["S"] == pytest.approx(single.S, rel=1e-12)
        assert got["T"] == pytest.approx(single.T, rel=1e-12)
        assert got["diversity"] == pytest.approx(single.diversity, rel=1e-12)
        assert got["loss"] == pytest.approx(single.loss, rel=1e-12)
        for name, value in single.per_parameter_S.items():
            assert got["per_parameter_S"][name] == pytest.approx(value, rel=1e-12)
