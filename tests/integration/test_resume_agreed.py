"""Every rank of a group resumes from the checkpoint, or none does. Under torchrun each rank
decides from its agent's restart count, and an agent that replaced a lost node counts no
restart while the others do: its ranks started afresh (other weights, iteration 0) beside
resumed ones, on the same all-reduced gradients. Here rank 1 is told not to resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from batchbound.train import TrainConfig, train
from batchbound.train.distributed import free_port, init_group, teardown

pytestmark = pytest.mark.distributed

CONFIG = dict(dataset="digits", model="fc(depth=1,params=800)", batch_size=32, lr=0.1,
              max_iterations=12, eval_every_iterations=6, checkpoint_every=6, dtype="float64",
              workers=2)


def rank(r: int, port: int, checkpoint: str, out: str) -> None:
    from batchbound.train.loop import train_in_group

    # init_group and teardown, not torch's own: the optimizer imports torch._dynamo, which
    # would keep the group alive past destroy_process_group and abort the rank at exit
    # (SIGABRT, "terminate called without an active exception": docs/torchrun-abort.md)
    init_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    try:
        result = train_in_group(TrainConfig(**CONFIG), checkpoint_path=checkpoint,
                                resume=(r == 0), stall_timeout=30)
        Path(out, f"rank{r}.json").write_text(json.dumps(
            {"iterations": result.final["iterations"], "status": result.status,
             "curves": [(i, m, v) for i, _, _, m, v in result.curves]}))
    finally:
        teardown()


def test_ranks_that_disagree_on_resuming_all_resume(tmp_path: Path) -> None:
    checkpoint = tmp_path / "run.ckpt"
    finished = train(TrainConfig(**CONFIG), checkpoint_path=checkpoint)
    assert finished.status == "complete" and checkpoint.exists()
    mp.start_processes(rank, args=(free_port(), str(checkpoint), str(tmp_path)), nprocs=2,
                       join=True, start_method="spawn")
    expected = [[i, m, v] for i, _, _, m, v in finished.curves]
    for r in (0, 1):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["status"] == "complete" and got["iterations"] == 12, r
        assert got["curves"] == expected, r
