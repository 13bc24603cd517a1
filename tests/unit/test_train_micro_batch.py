"""Gradient accumulation (``micro_batch``): exact against one big batch, and the two-batch
estimator from micro-batches on one process."""

from __future__ import annotations

import pytest
import torch

from batchbound.diversity import per_example_gradients
from batchbound.diversity.losses import cross_entropy
from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Trainer

SMALL = dict(dataset="digits", model="fc(depth=2,params=2000)", batch_size=50, lr=0.2,
             momentum=0.9, max_iterations=8, eval_every_iterations=8, dtype="float64")


def trained(**changes: object) -> Trainer:
    trainer = Trainer(TrainConfig(**{**SMALL, **changes}), DistContext())
    trainer.result_ = trainer.run()  # type: ignore[attr-defined]
    return trainer


def weights(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])


@pytest.mark.parametrize("micro", [1, 7, 25, 49])
@pytest.mark.parametrize("convention", ["mean", "sum"])
def test_micro_batches_equal_one_big_batch(micro: int, convention: str) -> None:
    lr = 0.2 if convention == "mean" else 0.2 / 50
    big = trained(convention=convention, lr=lr)
    small = trained(convention=convention, lr=lr, micro_batch=micro)
    assert torch.allclose(weights(small), weights(big), rtol=1e-11, atol=1e-13)
    assert small.result_.curve("batch_loss")[-1][3] == pytest.approx(  # type: ignore[attr-defined]
        big.result_.curve("batch_loss")[-1][3], rel=1e-11)  # type: ignore[attr-defined]


def test_micro_batches_keep_the_norms_monitor_exact() -> None:
    big = trained(online_diversity="norms", lr=1e-3)
    small = trained(online_diversity="norms", lr=1e-3, micro_batch=16)
    a = big.result_.curve("online_batch_bound")  # type: ignore[attr-defined]
    b = small.result_.curve("online_batch_bound")  # type: ignore[attr-defined]
    assert [r[3] for r in b] == pytest.approx([r[3] for r in a], rel=1e-10)
    assert torch.allclose(weights(small), weights(big), rtol=1e-11, atol=1e-13)


def test_two_batch_on_one_process_from_micro_batches() -> None:
    """One step's update equals the two-batch formula computed from a float64 per-example
    reference: the micro-batches' mean gradients against the batch's."""
    config = TrainConfig(**{**SMALL, "momentum": 0.0, "max_iterations": 1},
                         online_diversity="two_batch", micro_batch=16)
    trainer = Trainer(config, DistContext())
    model = trainer.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = torch.get_rng_state()
    trainer.run()
    # the same batch: the sampler is deterministic in the seed
    replay = Trainer(config, DistContext())
    idx = replay.sampler.next_indices(50)
    torch.set_rng_state(state)
    with torch.no_grad():
        for n, p in replay.model.named_parameters():
            p.copy_(before[n])
    per = per_example_gradients(replay.model, replay.data.x_train[idx], replay.data.y_train[idx],
                                cross_entropy)
    flat = torch.cat([g.reshape(50, -1) for g in per.values()], dim=1)
    sizes = [16, 16, 16, 2]
    chunks = flat.split(sizes)
    small_sq = sum(float(c.mean(0).square().sum()) for c in chunks) / len(sizes)
    harmonic = len(sizes) / sum(1 / b for b in sizes)
    reference = OnlineDiversity(n=trainer.n)
    reference.update_two_batch(small_sq, harmonic, float(flat.mean(0).square().sum()), 50)
    got = trainer.monitor.estimator
    assert got is not None and got.steps == 1
    assert got.m2 == pytest.approx(reference.m2, rel=1e-9)
    assert got.cross == pytest.approx(reference.cross, rel=1e-9)


def test_two_batch_on_one_process_needs_micro_batches_below_b() -> None:
    with pytest.raises(BatchboundError, match="two small batches"):
        TrainConfig(online_diversity="two_batch")
    TrainConfig(online_diversity="two_batch", batch_size=32, micro_batch=8)


def test_a_micro_batch_not_below_the_batch_is_refused() -> None:
    with pytest.raises(BatchboundError, match="nothing to accumulate"):
        TrainConfig(batch_size=32, micro_batch=32)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_micro_batch_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(BatchboundError, match=r"micro_batch: expected an integer|"
                       r"micro_batch must be a positive integer"):
        TrainConfig(micro_batch=bad)  # type: ignore[arg-type]


def test_micro_batch_is_hashed_only_when_set() -> None:
    assert TrainConfig().config_hash() == "956d8208960ae2e5"
    assert TrainConfig(micro_batch=8).config_hash() != TrainConfig().config_hash()
