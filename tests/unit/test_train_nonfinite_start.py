"""A loss that is not finite at the initial weights is bad input, not a divergence: train
refuses it in one line naming the cause (as advise does); a study still records it as the
diverged run it is, and a run that diverges after a step stays a result."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from batchbound.errors import BatchboundError
from batchbound.study.adapter import execute
from batchbound.train import TrainConfig, run, train

MODULE = '''
import math
from torch import nn


class NaNAtStart(nn.Module):
    def __init__(self, inputs, outputs):
        super().__init__()
        self.linear = nn.Linear(inputs, outputs)

    def forward(self, x):
        return self.linear(x) * math.nan


def nan_model(input_shape, num_outputs):
    return NaNAtStart(input_shape[0], num_outputs)
'''

BASE = dict(dataset="digits", batch_size=32, lr=0.1, max_iterations=6,
            eval_every_iterations=3, dtype="float64")


@pytest.fixture()
def nan_config(tmp_path, monkeypatch) -> TrainConfig:
    (tmp_path / "nanmodels43.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return TrainConfig(model="nanmodels43:nan_model", **BASE)


def test_train_refuses_a_loss_not_finite_at_the_initial_weights(nan_config) -> None:
    with pytest.raises(BatchboundError) as info:
        train(nan_config)
    said = str(info.value)
    assert "nan at the initial weights, before any step" in said and "\n" not in said
    result = run(nan_config)  # the result itself is a divergence at iteration 1
    assert result.status == "diverged" and result.final["iterations"] == 1
    assert result.start_refusal() == said


def test_a_study_records_it_as_diverged(nan_config, tmp_path) -> None:
    record = execute(nan_config.to_dict(), tmp_path / "checkpoint", False)
    assert record["status"] == "diverged"


def test_a_run_that_diverges_after_a_step_is_still_a_result() -> None:
    result = train(TrainConfig(model="fc(depth=1,params=800)", **{**BASE, "lr": 50.0,
                                                                  "max_iterations": 200}))
    assert result.status == "diverged" and result.final["iterations"] > 1
    assert math.isfinite(result.curve("train_loss")[0][3]) and result.start_refusal() is None


class NaNWhenTraining(nn.Module):
    """Finite under evaluation (no grad), NaN in a training step: the first evaluation
    cannot see it, the first step's batch loss does."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        return out * math.nan if torch.is_grad_enabled() else out


@pytest.mark.parametrize("online", ["off", "norms"])  # norms: the per-example engine refuses
def test_a_first_batch_not_finite_at_the_initial_weights_counts(online: str) -> None:
    from batchbound.train.distributed import DistContext
    from batchbound.train.loop import Parts, Trainer

    config = TrainConfig(model="fc(depth=1,params=800)", online_diversity=online, **BASE)
    result = Trainer(config, DistContext(), parts=Parts(model=NaNWhenTraining())).run()
    assert result.status == "diverged"
    assert math.isfinite(result.curve("train_loss")[0][3])
    refusal = result.start_refusal()
    assert refusal is not None and refusal.startswith("the first batch's loss is nan at the "
                                                      "initial weights")
