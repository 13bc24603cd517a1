"""The n·Δ the answer reports "over the pilot" is the pilot's own: the same pilot gives the
same value whatever the plan's length. It was the central trajectory's mean over the whole
plan, mostly the noise scale extrapolated past the pilot (a 10 % pilot: nine tenths of it),
printed as "n·Δ over the pilot"."""

from __future__ import annotations

import pytest

from batchbound.advise import advise
from batchbound.train import TrainConfig

CONFIG = TrainConfig(dataset="digits", model="fc(depth=1,params=800)", batch_size=16, lr=0.05)


def test_the_pilots_batch_bound_does_not_depend_on_the_plan_past_it() -> None:
    short = advise(CONFIG, planned_iterations=400, pilot_fraction=0.1, max_workers=1,
                   critical_batch="noise")
    long = advise(CONFIG, planned_iterations=1600, pilot_fraction=0.025, max_workers=1,
                  critical_batch="noise")
    # the same 40-step pilot (same seed, same steps): the same segments
    assert short.pilot["iterations"] == long.pilot["iterations"] == 40
    assert short.pilot["segments"] == long.pilot["segments"]
    # past the pilot the noise scale is extrapolated upwards, further over the longer plan
    assert long.source.noise_scale(1599) > short.source.noise_scale(399) \
        > short.source.noise_scale(41)
    assert short.batch_bound == pytest.approx(long.batch_bound, rel=1e-12)
    assert f"n·Δ over the pilot: {short.batch_bound:.4g}." in short.summary()
