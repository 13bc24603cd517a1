"""Each mechanism's expected update equals the plain gradient (Monte Carlo, float64).

The check: over K independent draws, every coordinate of the mean update lies within 6
standard errors of the plain gradient, the standard errors from each mechanism's closed-form
variance (DropConnect g²p/(1−p), SGLD σ², quantization ‖v‖|v_l| − v_l², summed over the
units). The same check rejects [diversity]'s unrescaled DropConnect (mean (1 − p)·g), so it
has the power to fail.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchbound.diversity.losses import cross_entropy
from batchbound.diversity.mechanisms import parse_mechanism
from batchbound.train.mechanisms import apply_to_worker, example_gradients

N, SCALE = 12, 1 / 12
MECHANISMS = [
    "dropconnect(p=0.5)",
    "sgld(sigma=0.3)",
    "quantization",
    "quantization(per_tensor=true)",
]


def problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor, list[list[torch.Tensor]]]:
    """A small float64 net, a batch, and its per-example gradients (loop reference)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(N, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (N,))
    per_example = [
        list(
            torch.autograd.grad(
                cross_entropy(model(x[i : i + 1]), y[i : i + 1]).sum(), list(model.parameters())
            )
        )
        for i in range(N)
    ]
    return model, x, y, per_example


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def variance(spec: str, unit: list[torch.Tensor]) -> torch.Tensor:
    """Per-coordinate variance of M(v) for one unit's gradient v (before scaling)."""
    m, v = parse_mechanism(spec), flat(unit)
    if m.name == "dropconnect":
        return v.square() * m.p / (1 - m.p)
    if m.name == "sgld":
        return torch.full_like(v, m.sigma**2)
    if m.per_tensor:
        norms = torch.cat([t.norm().expand(t.numel()) for t in unit])
    else:
        norms = v.norm().expand(v.numel())
    return norms * v.abs() - v.square()


def within(samples: torch.Tensor, expected: torch.Tensor, var: torch.Tensor) -> bool:
    bound = 6 * (var / samples.shape[0]).sqrt() + 1e-12
    return bool(((samples.mean(0) - expected).abs() <= bound).all())


@pytest.mark.parametrize("spec", MECHANISMS)
def test_worker_granularity_is_unbiased(spec: str) -> None:
    _, _, _, per_example = problem()
    worker = [sum(gs) for gs in zip(*per_example, strict=True)]  # the worker's gradient sum
    mechanism, gen = parse_mechanism(spec), torch.Generator().manual_seed(1)
    draws = []
    for _ in range(1500):
        grads = [g * SCALE for g in worker]
        apply_to_worker(mechanism, grads, SCALE, gen)
        draws.append(flat(grads))
    samples = torch.stack(draws)
    assert within(samples, flat(worker) * SCALE, variance(spec, worker) * SCALE**2)
    assert not torch.allclose(samples[0], flat(worker) * SCALE)  # it did perturb


@pytest.mark.parametrize("spec", MECHANISMS)
def test_example_granularity_is_unbiased(spec: str) -> None:
    model, x, y, per_example = problem()
    mechanism, gen = parse_mechanism(spec), torch.Generator().manual_seed(2)
    draws = []
    for _ in range(60):
        losses, grads = example_gradients(mechanism, model, x, y, cross_entropy, SCALE, gen)
        draws.append(flat(grads))
    assert losses.shape == (N,)
    plain = sum(flat(g) for g in per_example) * SCALE
    var = sum(variance(spec, g) for g in per_example) * SCALE**2
    assert within(torch.stack(draws), plain, var)


def test_check_rejects_unrescaled_dropconnect() -> None:
    _, _, _, per_example = problem()
    g = sum(flat(gs) for gs in per_example)
    gen = torch.Generator().manual_seed(3)
    samples = torch.stack(
        [g * (torch.rand(g.shape, generator=gen, dtype=g.dtype) >= 0.5) for _ in range(1500)]
    )
    assert not within(samples, g, g.square())  # Bernoulli(0.5) variance g²/4 < g²


def test_example_sgld_draws_the_summed_variance() -> None:
    """Σ of n independent N(0, σ²I) is N(0, nσ²I): drawn once, with the right spread."""
    model, x, y, per_example = problem()
    gen, sigma = torch.Generator().manual_seed(4), 0.3
    plain = sum(flat(g) for g in per_example)
    mechanism = parse_mechanism(f"sgld(sigma={sigma})")
    noise = torch.stack(
        [
            flat(example_gradients(mechanism, model, x, y, cross_entropy, 1.0, gen)[1]) - plain
            for _ in range(300)
        ]
    )
    assert noise.std().item() == pytest.approx(sigma * N**0.5, rel=0.1)
