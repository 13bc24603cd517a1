"""``sgld(sigma)``: M(g) = g + ξ, ξ ~ N(0, σ²I_d); Δ = (S + ndσ²) / (T + ndσ²).

The noise does not scale with the gradient, so a worker's (already scaled) gradient gets
scale·σ noise. Example granularity needs no per-example gradients: the sum of n independent
N(0, σ²I) draws is one N(0, nσ²I) draw, added to the summed gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from batchbound.diversity.mechanisms.registry import (
    Mechanism,
    Option,
    Sums,
    ratio,
    register_mechanism,
)
from batchbound.errors import BatchboundError


def check_sigma(sigma: float) -> str | None:
    if not (sigma >= 0.0 and math.isfinite(sigma)):
        return f"sgld needs a noise level sigma ≥ 0, got {sigma}"
    return None


def sgld_diversity(S: float, T: float, n: int, d: int, sigma: float) -> float:
    """Δ under SGLD with isotropic N(0, σ²I_d) noise per example: (S + ndσ²) / (T + ndσ²)."""
    problem = check_sigma(sigma)
    if problem:
        raise BatchboundError(problem)
    noise = n * d * sigma**2
    return ratio(S + noise, T + noise)


def sgld_noise(
    like: Tensor, sigma: float, *, generator: torch.Generator | None = None
) -> Tensor:
    """N(0, σ²) noise shaped like ``like``; the SGLD surrogate is g + sgld_noise(g, σ)."""
    return sigma * torch.randn(
        like.shape, generator=generator, device=like.device, dtype=like.dtype
    )


def closed_form(mech: Mechanism, sums: Sums) -> float:
    return sgld_diversity(sums.S, sums.T, sums.n, sums.d, mech.sigma)


def on_worker(
    mech: Mechanism, grads: list[Tensor], scale: float, generator: torch.Generator
) -> None:
    for g in grads:
        g.add_(sgld_noise(g, mech.sigma * scale, generator=generator))


def from_sum(
    mech: Mechanism, grads: list[Tensor], n: int, scale: float, generator: torch.Generator
) -> None:
    sigma = mech.sigma * math.sqrt(n) * scale  # Σ of n independent N(0, σ²) = N(0, nσ²)
    for g in grads:
        g.add_(sgld_noise(g, sigma, generator=generator))


@register_mechanism(
    "sgld",
    closed_form=closed_form,
    options=(Option("sigma", 0.0, check=check_sigma,
                    required="sgld needs a noise level, e.g. sgld(sigma=0.01)"),),
    worker=on_worker,
    from_sum=from_sum,
)
def sample(
    mech: Mechanism,
    tensors: list[Tensor],
    generator: torch.Generator | None,
    *,
    batch_dims: int,
    rescale: bool,
) -> list[Tensor]:
    return [t + sgld_noise(t, mech.sigma, generator=generator) for t in tensors]
