"""The single-process loop: conventions, divergence, resume, adaptive B, bad input, records."""

from __future__ import annotations

import itertools
import os
import signal

import pytest
import torch

from batchbound.data import Dataset, load_dataset
from batchbound.errors import BatchboundError
from batchbound.train import Target, TrainConfig, train
from batchbound.train.distributed import DistContext, shard, shard_sizes
from batchbound.train.loop import Trainer

SMALL = dict(
    dataset="digits",
    model="fc(depth=1,params=800)",
    batch_size=32,
    lr=0.1,
    max_iterations=12,
    eval_every_iterations=6,
    dtype="float64",
)


def run(**changes: object) -> Trainer:
    trainer = Trainer(TrainConfig(**{**SMALL, **changes}), DistContext())
    trainer.result_ = trainer.run()  # type: ignore[attr-defined]
    return trainer


def params(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])


def test_sum_convention_with_lr_over_b_equals_mean() -> None:
    mean = run(convention="mean", lr=0.2, momentum=0.9)
    total = run(convention="sum", lr=0.2 / 32, momentum=0.9)
    assert torch.allclose(params(mean), params(total), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(params(mean), params(run(convention="sum", lr=0.2)))


def test_records_targets_curves_and_timings() -> None:
    trainer = run(targets=(Target("train_acc", 0.01), Target("train_acc", 0.999)))
    result = trainer.result_  # type: ignore[attr-defined]
    easy, hard = result.targets
    assert easy.reached and easy.iteration == 0 and easy.epoch == 0.0  # chance level at init
    assert not hard.reached and hard.iteration is None
    assert result.status == "complete" and result.final["iterations"] == 12
    evals = [row[0] for row in result.curves if row[3] == "train_acc"]
    assert evals == [0, 6, 12]
    losses = result.curve("batch_loss")
    assert [r[0] for r in losses] == list(range(1, 13))
    assert result.curve("lr")[0][3] == 0.1 and result.curve("batch_size")[0][3] == 32
    assert result.final["epochs"] == pytest.approx(12 * 32 / 1438)
    timings = result.timings
    assert timings["iterations"] == 12 and timings["samples"] == 12 * 32
    assert timings["compute_seconds"] > 0 and timings["bytes_per_iteration"] == 0


def test_divergence_is_caught_and_recorded() -> None:
    result = run(lr=50.0, max_iterations=200).result_  # type: ignore[attr-defined]
    assert result.status == "diverged"
    assert "iteration" in result.message
    assert result.final["iterations"] < 200
    assert result.curve("batch_loss")  # the record is kept
    # with a tiny factor, the first loss increase already counts
    assert run(lr=50.0, divergence_factor=1.01).result_.status == "diverged"  # type: ignore[attr-defined]


def test_lsr_warmup_in_the_loop() -> None:
    result = run(strategy="lsr(base_batch=16,warmup_epochs=0.5)", max_iterations=40).result_  # type: ignore[attr-defined]
    lrs = result.curve("lr")
    assert lrs[0][3] == pytest.approx(0.1)  # η0 at epoch 0
    assert lrs[-1][3] == pytest.approx(0.2)  # η0·32/16 after warm-up
    assert all(a[3] <= b[3] for a, b in itertools.pairwise(lrs))


def strip_seconds(curves: list) -> list:
    return [(i, e, m, v) for i, e, _, m, v in curves]


@pytest.mark.parametrize("changes", [{}, {"momentum": 0.9, "mechanism": "dropconnect(p=0.3)"}])
def test_resume_is_bit_identical(tmp_path, changes: dict) -> None:
    config = TrainConfig(**{**SMALL, "max_iterations": 30, "checkpoint_every": 7, **changes})
    whole = Trainer(config, DistContext())
    expected = whole.run()

    path = tmp_path / "run.ckpt"
    first = Trainer(config, DistContext(), checkpoint_path=path)
    step = first.train_step

    def interrupted(*args: object) -> dict:
        if first.iteration == 11:  # SIGTERM arrives during iteration 12
            os.kill(os.getpid(), signal.SIGTERM)
        return step(*args)

    first.train_step = interrupted  # type: ignore[method-assign]
    stopped = first.run()
    assert stopped.status == "stopped" and stopped.final["iterations"] == 13
    again = Trainer(config, DistContext(), checkpoint_path=path)
    resumed = again.run(resume=True)
    assert resumed.status == "complete" and resumed.final["iterations"] == 30
    assert strip_seconds(resumed.curves) == strip_seconds(expected.curves)
    assert torch.equal(params(again), params(whole))
    for mine, theirs in zip(
        again.optimizer.state_dict()["state"].values(),
        whole.optimizer.state_dict()["state"].values(),
        strict=True,
    ):
        assert all(torch.equal(mine[k], theirs[k]) for k in mine if mine[k] is not None)


def test_resume_refuses_another_config(tmp_path) -> None:
    config = TrainConfig(**{**SMALL, "checkpoint_every": 6})
    Trainer(config, DistContext(), checkpoint_path=tmp_path / "c").run()
    with pytest.raises(BatchboundError, match="resume with the same configuration"):
        Trainer(config.replace(lr=0.3), DistContext(), checkpoint_path=tmp_path / "c").run(
            resume=True
        )


def orthogonal_data(n: int = 64) -> Dataset:
    """One-hot inputs and a linear model without bias: per-example gradients are pairwise
    orthogonal, so Δ = 1 and n·Δ = n; replicate(r) makes it n/r (r copies of n/r examples)."""
    gen = torch.Generator().manual_seed(0)
    return Dataset(
        name="orthogonal",
        task="regression",
        x_train=torch.eye(n),
        y_train=torch.randn(n, 1, generator=gen),
        x_test=torch.eye(n)[:8],
        y_test=torch.randn(8, 1, generator=gen),
        num_classes=None,
        source="test",
    )


@pytest.mark.parametrize("r, expected", [(1, 33), (4, 9)])
def test_adaptive_batch_follows_the_diversity(r: int, expected: int) -> None:
    config = TrainConfig(
        dataset="orthogonal",
        model="fc(depth=0,bias=false)",
        batch_size=16,
        lr=0.05,
        transform=None if r == 1 else f"replicate(r={r})",
        max_iterations=4,
        eval_every_iterations=4,
        batch_policy="adaptive(delta=0.5,min=2,max=64,every=2)",
        dtype="float64",
    )
    result = train(config, dataset=orthogonal_data())
    sizes = [row[3] for row in result.curve("batch_size")]
    diversity = [row[3] for row in result.curve("diversity")]
    assert diversity[0] == pytest.approx(1 / r)
    assert sizes == [16, expected]  # B = ⌊0.5·64·Δ⌋ + 1: up for r=1, down for r=4
    assert result.final["batch_size"] == expected


def test_split_rule() -> None:
    assert shard_sizes(10, 3) == [4, 3, 3]
    idx = torch.arange(10)
    assert torch.equal(torch.cat([shard(idx, r, 3) for r in range(3)]), idx)
    with pytest.raises(BatchboundError, match="smaller than the 4 workers"):
        shard_sizes(3, 4)


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"batch_size": 5000}, "larger than the training set"),
        (
            {"targets": (Target("train_acc", 0.9),), "dataset": "synthetic-linear(n=100,d=4)"},
            "regression task",
        ),
        ({"dataset": "nosuchdata"}, "unknown data set"),
        ({"model": "fc(depth=1,wdth=3)"}, "no option"),
    ],
)
def test_bad_input_fails_before_training(changes: dict, words: str) -> None:
    with pytest.raises(BatchboundError) as info:
        train(TrainConfig(**{**SMALL, **changes}))
    assert words in str(info.value)


def test_dataset_loads_once_and_matches() -> None:
    digits = load_dataset("digits")
    a = run(max_iterations=3)
    b = Trainer(TrainConfig(**{**SMALL, "max_iterations": 3}), DistContext(), dataset=digits)
    b.run()
    assert torch.equal(params(a), params(b))


@pytest.mark.parametrize(
    "changes",
    [
        {"online_diversity": "norms"},
        {"mechanism": "dropconnect(p=0.2)", "mechanism_granularity": "example"},
    ],
)
def test_divergence_under_per_example_engines(changes: dict) -> None:
    """The per-example engines refuse non-finite losses; the loop records divergence."""
    regression = dict(
        dataset="synthetic-linear(n=200,d=5)",
        model="fc(depth=1,params=300)",
        dtype="float32",
        lr=20.0,
        max_iterations=300,
        divergence_factor=None,
    )
    result = run(**regression, **changes).result_  # type: ignore[attr-defined]
    assert result.status == "diverged" and "non-finite" in result.message


def test_diversity_is_measured_at_initialisation_and_on_cadence() -> None:
    from batchbound.diversity import measure

    trainer = Trainer(TrainConfig(**{**SMALL, "diversity_every_epochs": 0.1}), DistContext())
    data = (trainer.data.x_train, trainer.data.y_train)
    at_init = measure(trainer.model, data, trainer.loss_fn).diversity
    rows = trainer.run().curve("diversity")
    # 12 steps of 32 on 1438 examples = 0.27 epochs: at 0, then past 0.1 and 0.2
    assert [r[0] for r in rows] == [0, 5, 9]
    assert rows[0][3] == pytest.approx(at_init, rel=1e-12)
    assert rows[2][3] != pytest.approx(at_init, rel=1e-6)  # measured on the trained weights
