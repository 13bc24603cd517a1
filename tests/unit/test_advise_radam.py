"""RAdam's first steps, before its rectification (ρ_t > 5), are unscaled momentum steps; the
rest are Adam's. No one metric holds for its noise scale, nor one value for its start-up lag
(the unscaled steps' size follows the gradient's scale): advise refuses it, naming why."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchbound.advise import advise
from batchbound.errors import BatchboundError
from batchbound.train.optimizers import unscaled_start


def rectified_from(beta2: float) -> int:
    """The closed form: RAdam's steps t with ρ_t = ρ∞ − 2tβ2^t/(1 − β2^t) ≤ 5 are unscaled,
    ρ∞ = 2/(1 − β2) − 1 (Liu et al. 2020; torch.optim.RAdam)."""
    rho_inf = 2 / (1 - beta2) - 1
    t = 1
    while rho_inf - 2 * t * beta2**t / (1 - beta2**t) <= 5:
        t += 1
    return t - 1


@pytest.mark.parametrize("beta2", [0.999, 0.99, 0.9, 0.8])
def test_radams_unscaled_steps_are_counted_as_its_closed_form_says(beta2: float) -> None:
    expected = rectified_from(beta2)
    assert expected > 0
    assert unscaled_start(lambda p: torch.optim.RAdam(p, lr=1e-3, betas=(0.9, beta2))) \
        == expected


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.Adam(p, lr=1e-3),
    lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
    lambda p: torch.optim.Adagrad(p, lr=1e-2),
    lambda p: torch.optim.RMSprop(p, lr=1e-3),
])
def test_others_have_no_unscaled_start(make) -> None:
    assert unscaled_start(make) == 0


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.RAdam(p, lr=1e-3, betas=(0.9, 0.5)),  # ρ∞ = 3: never rectified
])
def test_an_optimiser_that_never_scales_is_unscaled_throughout(make) -> None:
    assert unscaled_start(make, horizon=200) == 200


def test_advise_takes_a_radam_that_never_rectifies_as_sgd() -> None:
    """Its steps are all momentum steps: the Euclidean noise scale and SGD's rate rule, not
    Adam's metric (which its betas alone would have given it)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 8, generator=g)
    y = x[:, :3].argmax(1)
    advice = advise(nn.Linear(8, 3), (x, y), "cross_entropy",
                    optimizer=lambda p: torch.optim.RAdam(p, lr=1e-2, betas=(0.9, 0.5)),
                    planned_epochs=2, pilot_fraction=0.3, critical_batch="noise",
                    max_workers=1)
    assert advice.pilot["metric"] == "euclidean" and advice.extra["strategy"] == "noise"


def test_advise_refuses_radam_naming_its_unscaled_steps() -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 8, generator=g), torch.randint(0, 3, (256,), generator=g)
    with pytest.raises(BatchboundError) as info:
        advise(nn.Linear(8, 3), (x, y), "cross_entropy",
               optimizer=lambda p: torch.optim.RAdam(p, lr=1e-3), planned_epochs=2,
               critical_batch="noise", max_workers=1)
    said = str(info.value)
    assert "first 5 steps unscaled" in said and "RAdam" in said and "\n" not in said
