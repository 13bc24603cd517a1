"""The warmup schedule advise prints: the trainer's rule simulated along a trajectory."""

from __future__ import annotations

import pytest

from batchbound.advise.iterations import Pilot
from batchbound.advise.warmup import warmup_schedule


def flat(noise: float, planned: int = 1000, b0: int = 16) -> Pilot:
    return Pilot(b0, 0.1, planned, (0,), (1.0 + noise,))


def test_no_noise_no_doubling_and_the_plan_itself():
    plan = warmup_schedule(flat(0.0))
    assert plan.changes == () and plan.steps == 1000 and plan.examples == 16000


def test_a_large_noise_scale_doubles_every_decision_up_to_the_ceiling():
    plan = warmup_schedule(flat(1e6), "warmup(every=25,max=128,trigger=noise)")
    assert [b for _, _, b in plan.changes] == [32, 64, 128]
    assert [s for _, s, _ in plan.changes] == [25, 50, 75]
    # B_noise ≫ B: each step at B is worth B/B0 steps of B0 (perfect scaling)
    made = 25 + 25 * 2 + 25 * 4
    assert plan.steps - 75 == pytest.approx((1000 - made) / 8, abs=1.5)


def test_the_fraction_holds_the_batch_below_the_noise_scale():
    plan = warmup_schedule(flat(100.0), "warmup(every=10,fraction=0.5)")
    assert [b for _, _, b in plan.changes] == [32]  # 2·32 = 64 > 0.5·100
    assert plan.to_dict()["steps_vs_fixed_b0"] < 1 < plan.to_dict()["examples_vs_fixed_b0"]
