"""``advise`` on a user's MLP with BatchNorm1d: in train mode it cannot take a
step on one example ("Expected more than 1 value per channel"), and timing the step at
micro-batch 1 raised that ValueError as a bare traceback. The sizes the model's step fails
at below the first that runs are not timed, and no row asks for a micro-batch below it."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from batchbound.advise import advise
from batchbound.advise.timing import ComputeCurve
from batchbound.errors import BatchboundError


def data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_advise_answers_for_a_batch_norm_mlp_without_a_micro_batch_of_one() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        advice = advise(model, data(), "cross_entropy", batch_size=8, lr=0.05,
                        planned_epochs=40, critical_batch="noise", max_workers=2)
    assert advice.rows
    assert all(r.batch_size // r.workers >= 2 for r in advice.rows
               if math.isfinite(r.seconds_to_target))
    assert advice.recommended.batch_size // advice.recommended.workers >= 2


class FailsBelowFour(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < 4:
            raise RuntimeError("needs four examples")
        return self.body(x)


def test_a_step_that_fails_everywhere_is_one_line() -> None:
    from batchbound.advise.inputs import from_objects
    from batchbound.advise.timing import time_compute

    class Never(FailsBelowFour):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("never runs\nsecond line")

    config, dataset, parts = from_objects(Never(), data(), "cross_entropy", None, batch_size=8,
                                          lr=0.1, seed=0, device="cpu")
    with pytest.raises(BatchboundError, match="never runs") as info:
        time_compute(config, dataset, [1, 2, 4], 1, budget_s=0.01, parts=parts)
    assert "\n" not in str(info.value)


def test_the_timed_curve_starts_where_the_step_runs() -> None:
    from batchbound.advise.inputs import from_objects
    from batchbound.advise.timing import time_compute

    config, dataset, parts = from_objects(FailsBelowFour(), data(), "cross_entropy", None,
                                          batch_size=8, lr=0.1, seed=0, device="cpu")
    curve = time_compute(config, dataset, [1, 2, 4, 8], 1, budget_s=0.01, parts=parts)
    assert curve.sizes == (4, 8)
    assert curve.step(2) == math.inf and math.isfinite(curve.step(4))
    assert math.isfinite(ComputeCurve((1, 2), (1.0, 2.0), (0.5, 1.0)).step(1))
