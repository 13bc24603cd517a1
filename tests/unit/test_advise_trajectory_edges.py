"""The noise scale's extrapolation past the pilot (advise/trajectory.py) at its edges: a loss
that is not above 0, and a pilot that ends within the optimiser's start-up lag."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from batchbound.advise import advise
from batchbound.advise.trajectory import Segment, extrapolate
from batchbound.data import load_dataset
from batchbound.errors import BatchboundError


def _segments(losses: list[float]) -> list[Segment]:
    """Four 20-step segments, B_noise rising 40 → 70 with a 10 % standard error."""
    return [Segment(1 + 20 * k, 20 * (k + 1), 40.0 + 10 * k, 4.0 + k, loss)
            for k, loss in enumerate(losses)]


def test_a_loss_not_above_zero_is_refused_where_it_is_extrapolated() -> None:
    # a loss with a minimum below 0 (a Gaussian NLL, a shifted loss): B_noise·L = κ < 0.
    # Before: an answer whose "low" trajectory lay above the central one past the pilot
    # ((κ − 2 SE)/L with L < 0 is the larger) and whose final loss read "−3.2 (−0.3–−3.2)"
    segs = _segments([-2.0, -2.5, -2.8, -3.0])
    with pytest.raises(BatchboundError, match=r"mean batch loss over steps 21–40 was -2\.5, "
                                              r"not above 0.*shift the loss"):
        extrapolate(segs, 80, 800, 16, 0.1)
    # to a target nothing is extrapolated: the measured segments alone
    path = extrapolate(segs, 80, 80, 16, 0.1)
    assert path.central.noise_scale(70) == pytest.approx(70.0)
    # the same noise scales with a loss above 0 extrapolate as before
    fine = extrapolate(_segments([2.0, 1.5, 1.2, 1.0]), 80, 800, 16, 0.1)
    for t in (100, 400, 799):
        assert fine.low.noise_scale(t) <= fine.central.noise_scale(t) \
            <= fine.high.noise_scale(t)


def test_advise_refuses_a_users_loss_below_zero_with_a_plan() -> None:
    digits = load_dataset("digits")

    def shifted(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # the same gradients as cross-entropy, the same noise scale, a minimum of −5
        return nn.functional.cross_entropy(outputs, targets, reduction="none") - 5.0

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    with pytest.raises(BatchboundError, match="not above 0"):
        advise(model, digits, shifted, optimizer="sgd", lr=0.05, batch_size=16,
               planned_iterations=400, pilot_fraction=0.1, max_workers=1,
               critical_batch="noise")


def test_a_pilot_within_the_optimisers_lag_has_no_trend_and_no_nan() -> None:
    # SGD with momentum 0.99 builds up its step over μ/(1 − μ) = 99 steps; an 80-step pilot
    # ends inside it, so every segment sits at t − lag = 1. Before: κ's trend was 0/0 (nan
    # in the JSON as null, a RuntimeWarning) and the loss fit a RankWarning
    segs = _segments([2.0, 1.5, 1.2, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = extrapolate(segs, 80, 800, 16, 0.1, lag=99.0)
    assert path.kappa_trend == (0.0, 0.0)
    assert path.kappa_growth == 0.0 and path.loss_exponent == 0.0
    assert all(math.isfinite(v) for v in (path.kappa, path.kappa_se, *path.final_loss))
