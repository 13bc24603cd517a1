"""``none``: M(g) = g, the plain gradient; Δ^DIM = S/T, the plain diversity."""

from __future__ import annotations

import torch
from torch import Tensor

from batchbound.diversity.mechanisms.registry import (
    Mechanism,
    Sums,
    ratio,
    register_mechanism,
)


def closed_form(mech: Mechanism, sums: Sums) -> float:
    return ratio(sums.S, sums.T)


def unchanged(mech: Mechanism, grads: list[Tensor], *args: object) -> None:
    """Nothing to draw, at worker or example granularity."""


@register_mechanism("none", closed_form=closed_form, worker=unchanged, from_sum=unchanged,
                    identity=True)
def sample(
    mech: Mechanism,
    tensors: list[Tensor],
    generator: torch.Generator | None,
    *,
    batch_dims: int,
    rescale: bool,
) -> list[Tensor]:
    return [t.clone() for t in tensors]  # copies, as every other mechanism returns new tensors
