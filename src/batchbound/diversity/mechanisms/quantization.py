"""``quantization`` (alias ``quantize``): [diversity]'s stochastic quantizer
[Q(v)]_l = ‖v‖₂ sign(v_l) η_l with P(η_l = 1) = |v_l|/‖v‖₂.

Q is unbiased and E‖Q(v)‖² = ‖v‖₂‖v‖₁, so with R = Σ_i ‖g_i‖₂‖g_i‖₁, Δ = R / (T − S + R).
By default v is the whole flattened gradient; ``quantization(per_tensor=true)`` quantizes
each parameter tensor on its own, and R sums ‖g_ip‖₂‖g_ip‖₁ over tensors p. Q is positively
homogeneous (the default worker application is right); per-example draws need per-example
gradients, and the exact Δ needs their L1 norms (R).
"""

from __future__ import annotations

import torch
from torch import Tensor

from batchbound.diversity.mechanisms.registry import (
    Mechanism,
    Option,
    Sums,
    ratio,
    register_mechanism,
)


def quantization_diversity(S: float, T: float, R: float) -> float:
    """Δ under stochastic quantization: R / (T − S + R), with R = Σ_i ‖g_i‖₂‖g_i‖₁."""
    return ratio(R, T - S + R)


def quantize(v: Tensor, generator: torch.Generator | None = None, *, batch_dims: int = 0) -> Tensor:
    """[diversity]'s stochastic quantizer: [Q(v)]_l = ‖v‖₂ sign(v_l) η_l, with
    η_l ~ Bernoulli(|v_l|/‖v‖₂).

    Unbiased (E Q(v) = v), with E‖Q(v)‖² = ‖v‖₂‖v‖₁. The first ``batch_dims`` dimensions index
    independent vectors (``batch_dims=1`` on per-example gradients (n, ...) quantizes each
    example's gradient); the remaining dimensions form one vector. A zero vector maps to zero.
    """
    return quantize_group([v], generator, batch_dims=batch_dims)[0]


def quantize_group(
    tensors: list[Tensor], generator: torch.Generator | None = None, *, batch_dims: int = 0
) -> list[Tensor]:
    """Quantize several tensors as one concatenated vector (the norm is over all of them),
    e.g. all of a model's gradient tensors; shapes are kept."""
    if not tensors:
        return []
    lead = tensors[0].shape[:batch_dims]
    sq = sum(t.reshape(*lead, -1).square().sum(-1) for t in tensors)
    norm = torch.as_tensor(sq).sqrt()
    out = []
    for t in tensors:
        scale = norm.reshape(*lead, *([1] * (t.dim() - batch_dims)))
        prob = torch.where(scale > 0, t.abs() / scale.clamp_min(torch.finfo(t.dtype).tiny), 0.0)
        eta = torch.rand(t.shape, generator=generator, device=t.device, dtype=t.dtype) < prob
        out.append(scale * torch.sign(t) * eta.to(t.dtype))
    return out


def closed_form(mech: Mechanism, sums: Sums) -> float:
    assert sums.R is not None  # diversity_under checks needs_R
    return quantization_diversity(sums.S, sums.T, sums.R)


def per_tensor(mech: Mechanism) -> bool:
    return bool(mech.per_tensor)


@register_mechanism(
    "quantization",
    closed_form=closed_form,
    options=(Option("per_tensor", False),),
    aliases=("quantize", "quantise"),
    needs_R=True,
    splits_tensors=per_tensor,
)
def sample(
    mech: Mechanism,
    tensors: list[Tensor],
    generator: torch.Generator | None,
    *,
    batch_dims: int,
    rescale: bool,
) -> list[Tensor]:
    # Q is unbiased already: nothing to rescale
    if mech.per_tensor:
        return [quantize(t, generator, batch_dims=batch_dims) for t in tensors]
    return quantize_group(tensors, generator, batch_dims=batch_dims)
