"""SGD momentum in advise's model: the model sees the rate only as η(B)/η0, so momentum μ is
kept at every batch and the effective step η/(1 − μ) scales with the rate rule; the answer
says so, from a named optimiser and from a user's factory alike."""

from __future__ import annotations

import pytest
import torch

from batchbound.advise import advise
from batchbound.advise.iterations import lr_scale
from batchbound.train import TrainConfig

CONFIG = TrainConfig(dataset="digits", model="fc(depth=1,params=800)", batch_size=16, lr=0.01,
                     momentum=0.9)


@pytest.mark.slow  # two pilots and timings: ~25 s here
def test_momentum_is_kept_and_the_effective_step_said() -> None:
    advice = advise(CONFIG, planned_epochs=4, max_workers=1, critical_batch="noise")
    out = advice.to_dict()
    assert out["momentum"] == 0.9
    assert "momentum μ = 0.9" in out["assumptions"]
    # the heavy ball builds its step over μ/(1 − μ) = 9 steps: the loss trend counts from there
    assert out["pilot"]["lag"] == pytest.approx(9.0, rel=1e-4)
    assert "counted from 9 steps in" in out["assumptions"]
    assert "η/(1 − μ) (= 0.1 at B0)" in out["assumptions"]
    for row in advice.rows:  # the rule scales η; μ stays, so η/(1 − μ) scales the same
        assert row.lr == pytest.approx(
            0.01 * lr_scale("noise", row.batch_size, advice.source, momentum=0.9))
    assert "B_lo taken (1 + μ) times over" in out["assumptions"]
    plain = advise(CONFIG.replace(momentum=0.0), planned_epochs=4, max_workers=1,
                   critical_batch="noise").to_dict()
    assert plain["momentum"] == 0.0 and "momentum μ" not in plain["assumptions"]
    assert plain["pilot"]["lag"] == 0.0 and "steps in" not in plain["assumptions"]


@pytest.mark.slow
def test_a_factorys_momentum_is_read() -> None:
    from batchbound.data import load_dataset

    data = load_dataset("digits")

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))

    out = advise(model, data, "cross_entropy",
                 optimizer=lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.5),
                 batch_size=16, planned_epochs=4, max_workers=1,
                 critical_batch="noise").to_dict()
    assert out["momentum"] == 0.5 and "η/(1 − μ) (= 0.04 at B0)" in out["assumptions"]
    assert out["pilot"]["lag"] == pytest.approx(1.0, rel=1e-4)  # the factory's own μ
