"""A long plan's predictions: k(B) reads B_noise at every one of the plan's steps, for every
candidate batch and trajectory. One Python call per step made the rows of a 450 000-step
plan (90 ImageNet epochs at B0 = 256) take tens of minutes after the pilot; the steps are now
read as one array, with the same numbers to the last bit."""

from __future__ import annotations

import math
import random
import time

import pytest

from batchbound.advise.iterations import (
    Pilot,
    lr_scale,
    minimum_iterations,
    predict_iterations,
    steps_per_pilot_step,
    strategies,
)


def _pilots() -> list[Pilot]:
    rng = random.Random(0)
    out = [Pilot(16, 0.1, 50, (10,), (30.0,)),  # one measurement
           Pilot(16, 0.1, 40, (1, 1, 6, 30), (5.0, 9.0, 2.0, 40.0)),  # a repeated iteration
           Pilot(8, 0.1, 7, (20, 30), (3.0, 1.0))]  # all before the first measurement
    for _ in range(5):
        its = sorted(rng.sample(range(1, 3000), 12))
        out.append(Pilot(rng.choice([4, 16, 64]), 0.1, rng.randint(1, 4000), tuple(its),
                         tuple(1 + rng.uniform(0, 500) for _ in its)))
    return out


@pytest.mark.parametrize("pilot", _pilots())
def test_the_steps_noise_scales_are_noise_scale_at_each_step(pilot: Pilot) -> None:
    assert list(pilot.noise_scales()) == [pilot.noise_scale(t) for t in range(pilot.iterations)]
    assert not pilot.noise_scales().flags.writeable  # shared by every prediction


@pytest.mark.parametrize("pilot", _pilots())
def test_predictions_are_the_step_by_step_sums_to_the_last_bit(pilot: Pilot) -> None:
    steps = [pilot.noise_scale(t) for t in range(pilot.iterations)]
    b0 = pilot.batch_size
    assert minimum_iterations(pilot) == sum(1.0 / (1.0 + s / b0) for s in steps)
    for batch in (1, b0, 3 * b0, 64 * b0):
        for strategy in strategies():
            scale = lr_scale(strategy, batch, pilot)
            total = 0.0
            for s in steps:
                total += ((1.0 + s / batch) / (1.0 + s / b0) if strategy == "noise" else
                          steps_per_pilot_step(s, b0, batch, scale))
            assert predict_iterations(pilot, batch, strategy) == total, (batch, strategy)


def test_a_million_step_plan_is_predicted_in_seconds() -> None:
    its = (20, 60, 100, *(round(100 * 1.3**k) for k in range(1, 40)))
    plan = Pilot(256, 0.1, 1_000_000, its, tuple(1 + 30 * math.sqrt(i) for i in its))
    start = time.perf_counter()
    predicted = [predict_iterations(plan, 256 << k, "noise") for k in range(12)]
    predicted += [predict_iterations(plan, 256 << k, "srsr") for k in range(12)]
    assert time.perf_counter() - start < 10  # before: 4.8 s each here, 24 of them
    assert predicted[0] == pytest.approx(1_000_000)
    assert predicted[:12] == sorted(predicted[:12], reverse=True)
