"""Online diversity in the loop agrees with the exact Δ at (nearly) fixed weights."""

from __future__ import annotations

import pytest
import torch

from batchbound.data import load_dataset
from batchbound.diversity import measure, per_example_gradients
from batchbound.diversity.losses import cross_entropy
from batchbound.models import build_model
from batchbound.train import TrainConfig, train
from batchbound.train.distributed import DistContext
from batchbound.train.monitor import OnlineMonitor

MODEL = "fc(depth=1,params=800)"


def exact_bound() -> float:
    digits = load_dataset("digits")
    model = build_model(MODEL, digits.input_shape, digits.num_outputs, seed=0).double()
    return measure(model, digits, dtype=torch.float64).batch_bound


def test_norms_mode_tracks_the_exact_bound() -> None:
    # lr so small the weights stay put: the estimate must converge to the exact n·Δ
    config = TrainConfig(
        model=MODEL,
        batch_size=64,
        lr=1e-9,
        max_iterations=60,
        eval_every_iterations=60,
        online_diversity="norms",
        dtype="float64",
    )
    result = train(config)
    estimates = [row[3] for row in result.curve("online_batch_bound")]
    assert len(estimates) == 60
    assert estimates[-1] == pytest.approx(exact_bound(), rel=0.25)
    assert result.timings["monitor_seconds"] > 0


def test_two_batch_mode_from_worker_gradients() -> None:
    """Feed the monitor what two ranks would: their local mean-gradient norms and the sum."""
    digits = load_dataset("digits").to("cpu", torch.float64)
    model = build_model(MODEL, digits.input_shape, digits.num_outputs, seed=0).double()
    monitor = OnlineMonitor("two_batch", digits.n_train, DistContext(world_size=2))
    gen = torch.Generator().manual_seed(0)
    batch, scale = 64, 1 / 64
    for _ in range(120):
        idx = torch.randperm(digits.n_train, generator=gen)[:batch]
        per = per_example_gradients(model, digits.x_train[idx], digits.y_train[idx], cross_entropy)
        halves = [
            [g[:32].sum(0) * scale for g in per.values()],
            [g[32:].sum(0) * scale for g in per.values()],
        ]
        extras = [sum(monitor.small_batch_sq(h, scale, 32) for h in halves)]
        total = [a + b for a, b in zip(*halves, strict=True)]
        out = monitor.update(total, scale, extras, batch)
    assert out["online_batch_bound"] == pytest.approx(exact_bound(), rel=0.3)


def test_squared_norm_in_a_diagonal_metric() -> None:
    from batchbound.train.monitor import squared_norm

    torch.manual_seed(0)
    tensors = [torch.randn(4, 3), torch.randn(7)]
    weights = [torch.rand(4, 3) + 0.1, torch.rand(7) + 0.1]
    reference = sum(float((w.double() * t.double() ** 2).sum())
                    for w, t in zip(weights, tensors, strict=True))
    assert squared_norm(tensors, weights) == pytest.approx(reference, rel=1e-12)
    ones = [torch.ones_like(t) for t in tensors]
    assert squared_norm(tensors, ones) == pytest.approx(squared_norm(tensors), rel=1e-6)
