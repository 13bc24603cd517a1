"""Learning-rate strategies: documented values at the warm-up boundaries and under decay."""

from __future__ import annotations

import math

import pytest

from batchbound.errors import BatchboundError
from batchbound.train.schedule import parse_strategy


def test_blr_ignores_batch_size() -> None:
    blr = parse_strategy("blr")
    assert [blr.lr(0.1, b, e) for b, e in [(8, 0), (1024, 3.0)]] == [0.1, 0.1]


@pytest.mark.parametrize(
    "spec, batch, expected_after_warmup",
    [
        ("lsr(base_batch=32,warmup_epochs=5)", 128, 0.4),
        ("srsr(base_batch=32,warmup_epochs=5)", 128, 0.2),
    ],
)
def test_warmup_boundaries(spec: str, batch: int, expected_after_warmup: float) -> None:
    s = parse_strategy(spec)
    assert s.lr(0.1, batch, 0.0) == pytest.approx(0.1)  # starts at η0
    midway = 0.1 + (expected_after_warmup - 0.1) / 2
    assert s.lr(0.1, batch, 2.5) == pytest.approx(midway)  # linear ramp
    assert s.lr(0.1, batch, 5.0 - 1e-9) == pytest.approx(expected_after_warmup, rel=1e-6)
    assert s.lr(0.1, batch, 5.0) == pytest.approx(expected_after_warmup)  # reached at W
    assert s.lr(0.1, batch, 50.0) == pytest.approx(expected_after_warmup)  # and kept


def test_no_warmup_and_base_batch_identity() -> None:
    lsr = parse_strategy("lsr(base_batch=32,warmup_epochs=0)")
    assert lsr.lr(0.1, 32, 0.0) == pytest.approx(0.1)
    assert lsr.lr(0.1, 64, 0.0) == pytest.approx(0.2)
    assert parse_strategy("srsr(base_batch=16)").lr(0.1, 64, 0.0) == pytest.approx(0.2)


def test_decays() -> None:
    step = parse_strategy("blr(decay=step,milestones=[10,20],gamma=0.1)")
    assert [step.lr(1.0, 8, e) for e in (9.99, 10.0, 19.0, 20.0)] == pytest.approx(
        [1.0, 0.1, 0.1, 0.01]
    )
    cos = parse_strategy("lsr(base_batch=8,decay=cosine,decay_epochs=10)")
    assert cos.lr(1.0, 16, 0.0) == pytest.approx(2.0)
    assert cos.lr(1.0, 16, 5.0) == pytest.approx(1.0)
    assert cos.lr(1.0, 16, 10.0) == pytest.approx(0.0, abs=1e-12)
    assert math.isclose(cos.lr(1.0, 16, 20.0), 0.0, abs_tol=1e-12)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("adam", "unknown learning-rate strategy"),
        ("lsr", "needs base_batch"),
        ("lsr(base_batch=0)", "base_batch must be >= 1"),
        ("blr(momentum=0.9)", "has no option 'momentum'"),
        ("blr(decay=step)", "needs milestones"),
        ("blr(decay=linear)", "unknown decay"),
    ],
)
def test_bad_strategies(spec: str, words: str) -> None:
    with pytest.raises(BatchboundError) as info:
        parse_strategy(spec)
    assert words in str(info.value)


def test_adaptive_batch_goes_to_the_upper_end_when_the_gradient_sum_vanishes() -> None:
    """T → 0 makes Δ̂ infinite (or 0/0): the bound n·Δ is then unlimited, not minimal."""
    import math

    from batchbound.train.adaptive import parse_batch_policy

    policy = parse_batch_policy("adaptive(delta=1,min=8,max=512,every=10)")
    assert policy.batch_size(1000, math.inf) == 512
    assert policy.batch_size(1000, math.nan) == 512
    assert policy.batch_size(1000, 0.05) == 51


def test_pick_time_minimises_seconds_per_unit_of_progress() -> None:
    from batchbound.train.adaptive import parse_batch_policy

    policy = parse_batch_policy("adaptive(min=8,max=1024,every=10,pick=time)")
    assert policy.candidates(1) == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert policy.candidates(3) == [12, 24, 48, 96, 192, 384, 768]

    def seconds(b: int) -> float:  # a fixed cost per step plus a cost per example
        return 1e-3 + 1e-5 * b

    n, delta = 1000, 0.2  # B_noise = 199
    best = min(policy.candidates(1), key=lambda b: seconds(b) * (1 + 199 / b))
    assert policy.time_optimal(n, delta, 1, seconds) == best
    # closed form of the continuous optimum: B = sqrt(a·B_noise/c) = sqrt(100·199) ≈ 141
    assert best in (128, 256)
    assert policy.time_optimal(n, math.inf, 1, seconds) == 1024
    assert policy.time_optimal(n, 0.0, 1, seconds) == 1024
    free = policy.time_optimal(n, delta, 1, lambda b: 1.0)  # steps cost the same: largest
    assert free == 1024
