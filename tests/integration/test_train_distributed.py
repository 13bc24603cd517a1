"""Two gloo processes on loopback train exactly what one process trains.

B = 33 is split 17/16 across the two ranks; gradients are summed, so in float64 the
parameters after 15 momentum steps agree with single-process training to 1e-12 (relative):
only the order of floating-point additions differs.
"""

from __future__ import annotations

import pytest
import torch

from batchbound.train import TrainConfig, train
from batchbound.train.checkpoint import load_checkpoint

pytestmark = pytest.mark.distributed

CONFIG = TrainConfig(
    dataset="digits",
    model="fc(depth=1,params=800)",
    batch_size=33,
    lr=0.2,
    momentum=0.9,
    max_iterations=15,
    eval_every_iterations=5,
    checkpoint_every=15,
    dtype="float64",
    diversity_every_epochs=0.3,
)


def final_parameters(path) -> torch.Tensor:
    state = load_checkpoint(path)["model"]
    return torch.cat([v.reshape(-1) for v in state.values()])


def test_two_workers_match_one(tmp_path) -> None:
    one = train(CONFIG, checkpoint_path=tmp_path / "one.ckpt")
    two = train(CONFIG.replace(workers=2), checkpoint_path=tmp_path / "two.ckpt")
    assert one.status == two.status == "complete"
    a, b = final_parameters(tmp_path / "one.ckpt"), final_parameters(tmp_path / "two.ckpt")
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    for metric in ("batch_loss", "train_loss", "test_acc", "diversity"):
        ours = [row[3] for row in one.curve(metric)]
        theirs = [row[3] for row in two.curve(metric)]
        assert ours == pytest.approx(theirs, rel=1e-10), metric
    assert two.environment["world_size"] == 2 and two.environment["backend"] == "gloo"
    d = sum(p.numel() for p in load_checkpoint(tmp_path / "two.ckpt")["model"].values())
    assert two.timings["bytes_per_iteration"] == (d + 3) * 8  # gradients + 3 flags, float64
    assert two.timings["communication_seconds"] > 0


def test_two_workers_with_micro_batches_match_one(tmp_path) -> None:
    """17/16 examples per rank in micro-steps of 5 (4 micro-batches each): the same weights as
    one process with the whole batch, and two_batch estimates from the 8 micro-batches."""
    train(CONFIG, checkpoint_path=tmp_path / "one.ckpt")
    two = train(CONFIG.replace(workers=2, micro_batch=5, online_diversity="two_batch"),
                checkpoint_path=tmp_path / "two.ckpt")
    assert two.status == "complete"
    a, b = final_parameters(tmp_path / "one.ckpt"), final_parameters(tmp_path / "two.ckpt")
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    assert len(two.curve("online_batch_bound")) == 15


@pytest.mark.slow
def test_two_workers_with_mechanism_monitor_and_adaptive_batch(tmp_path) -> None:
    """Everything that talks across ranks at once: a worker mechanism, the two-batch monitor,
    adaptive B from it, exact Δ, checkpoints; every rank must take the same decisions."""
    base = CONFIG.replace(workers=2, max_iterations=40, dtype="float32", checkpoint_every=20)
    quantized = train(base.replace(mechanism="quantization"), checkpoint_path=tmp_path / "q")
    assert quantized.status == "complete" and quantized.final["iterations"] == 40
    adaptive = train(
        base.replace(
            online_diversity="two_batch",
            batch_policy="adaptive(delta=0.5,min=8,max=256,every=10,source=online)",
        ),
        checkpoint_path=tmp_path / "a",
    )
    assert adaptive.status == "complete"
    assert len(adaptive.curve("online_batch_bound")) > 20
    assert len(adaptive.curve("batch_size")) >= 1
