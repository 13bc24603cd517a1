"""TrainConfig/RunResult: validation before any work, round trips, hash identity."""

from __future__ import annotations

import math

import pytest

from batchbound.data import load_dataset
from batchbound.errors import BatchboundError
from batchbound.train import RunResult, Target, TargetResult, TrainConfig


def test_round_trip_and_hash_ignores_data_dir() -> None:
    config = TrainConfig(
        targets=(Target("train_acc", 0.9), Target("train_acc", 0.95)),
        strategy="lsr(base_batch=32,warmup_epochs=5)",
        mechanism="dropconnect(p=0.5)",
        batch_policy="adaptive(delta=0.1,min=8,max=512,every=20)",
    )
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert config.replace(data_dir="/elsewhere").config_hash() == config.config_hash()
    assert config.replace(lr=0.05).config_hash() != config.config_hash()


def test_targets_accept_plain_forms() -> None:
    config = TrainConfig(targets=[{"metric": "test_acc", "threshold": 0.9}, ["train_loss", 0.1]])
    assert config.targets == (Target("test_acc", 0.9), Target("train_loss", 0.1))


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"lr": 0.0}, "lr must be a positive"),
        ({"lr": -1.0}, "lr must be a positive"),
        ({"strategy": "linear"}, "unknown learning-rate strategy"),
        ({"strategy": "lsr(warmup_epochs=3)"}, "needs base_batch"),
        ({"workers": 8, "batch_size": 4}, "more workers (8)"),
        ({"convention": "avg"}, "choose from mean, sum"),
        ({"sampling": "shuffle"}, "unknown sampling"),
        ({"mechanism": "dropout(p=0.1)"}, "unknown mechanism"),
        ({"mechanism": "dropconnect(p=1.0)"}, "p in [0, 1)"),
        ({"batch_policy": "adaptive(delta=0.1)"}, "needs every, max, min"),
        ({"targets": [("train_acc", 95)]}, "write 0.95"),
        ({"targets": [("val_acc", 0.9)]}, "unknown target metric"),
        ({"max_epochs": None}, "no limit"),
        ({"divergence_factor": 0.5}, "divergence_factor"),
        ({"device": "tpu"}, "unknown device"),
    ],
)
def test_bad_config_fails_with_a_named_problem(changes: dict, words: str) -> None:
    with pytest.raises(BatchboundError, match=None) as info:
        TrainConfig(**changes)
    assert words in str(info.value)


def test_checks_against_the_data() -> None:
    digits = load_dataset("digits")
    with pytest.raises(BatchboundError, match="larger than the training set"):
        TrainConfig(batch_size=digits.n_train + 1).validate_against(digits)
    regression = load_dataset("synthetic-linear(n=200,d=5,outputs=2)")
    with pytest.raises(BatchboundError, match="regression task"):
        TrainConfig(targets=[("train_acc", 0.9)], batch_size=16).validate_against(regression)
    TrainConfig(targets=[("train_loss", 0.1)], batch_size=16).validate_against(regression)


def test_result_json_keeps_non_finite_values() -> None:
    config = TrainConfig()
    result = RunResult(
        config,
        config.config_hash(),
        status="diverged",
        targets=[TargetResult("train_acc>=0.9", "train_acc", 0.9)],
        curves=[(0, 0.0, 0.0, "batch_loss", 2.3), (1, 0.1, 0.01, "batch_loss", math.inf)],
        final={"train_loss": math.nan},
    )
    back = RunResult.from_json(result.to_json())
    assert back.curves[1][4] == math.inf and math.isnan(back.final["train_loss"])
    assert back.targets == result.targets and back.config == config


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"online_diversity": "norms", "mechanism": "sgld(sigma=0.1)"}, "cannot be combined"),
        ({"online_diversity": "two_batch"}, "workers >= 2"),
        (
            {"batch_policy": "adaptive(delta=1,min=2,max=9,every=5,source=online)"},
            "needs online_diversity",
        ),
        ({"batch_policy": "adaptive(delta=1,min=1,max=9,every=5)", "workers": 2}, "below"),
    ],
)
def test_monitoring_combinations(changes: dict, words: str) -> None:
    with pytest.raises(BatchboundError) as info:
        TrainConfig(**changes)
    assert words in str(info.value)
