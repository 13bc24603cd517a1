"""advise's pilot under an Adam-type optimiser estimates the noise scale in its metric."""

from __future__ import annotations

import pytest
import torch

import batchbound.advise.pilot as pilot_module
from batchbound.advise.pilot import run_pilot
from batchbound.data import load_dataset
from batchbound.train import TrainConfig
from batchbound.train.optimizers import adam_preconditioner


@pytest.mark.parametrize("optimizer, metric", [("adamw", "adam"), ("sgd", "euclidean")])
def test_the_pilot_estimates_in_the_optimisers_metric(monkeypatch, optimizer, metric):
    config = TrainConfig(dataset="digits", model="fc(depth=1,params=800)", batch_size=16,
                         lr=0.003, optimizer=optimizer)
    seen: list[bool] = []
    original = pilot_module._PilotTrainer.train_step

    def spy(self, *args, **kwargs):
        weights = adam_preconditioner(self.optimizer, self.params)
        flags = original(self, *args, **kwargs)
        # the weights the step used are the optimiser's before it stepped
        seen.append(self.monitor.weights is not None)
        if self.monitor.weights is not None:
            for w, expected in zip(self.monitor.weights, weights, strict=True):
                assert torch.equal(w, expected)
        return flags

    monkeypatch.setattr(pilot_module._PilotTrainer, "train_step", spy)
    data = load_dataset("digits")
    run = run_pilot(config, data, torch.device("cpu"), iterations=30, precondition=True)
    assert run.metric == metric
    assert seen == [metric == "adam" and i > 0 for i in range(30)]
    # the first step is not estimated: an Adam-type optimiser has no metric before it, and
    # one without a second moment (SGD here) is known as such only after it
    assert run.segments[0].start == 2
