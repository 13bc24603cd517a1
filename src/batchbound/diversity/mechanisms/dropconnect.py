"""``dropconnect(p)``: M(g) = D g, D a diagonal mask keeping each coordinate with probability
q = 1 − p.

E‖Dg‖² = q‖g‖² and E Dg = q g, so Δ = qS / (qS + q²(T−S)) = S / (S + q(T−S)). The rescaled
mask D/q used in training (unbiased) gives S/q over S/q + (T−S): the same Δ, because Δ is a
ratio and the scale cancels. The mask is positively homogeneous, so the default worker
application (on the already scaled gradient) is right; per-example masks need the
per-example gradients.
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
from batchbound.errors import BatchboundError


def check_p(p: float) -> str | None:
    if not 0.0 <= p < 1.0:
        return f"dropconnect needs a drop probability p in [0, 1), got {p}"
    return None


def require_p(p: float) -> None:
    problem = check_p(p)
    if problem:
        raise BatchboundError(problem)


def dropconnect_diversity(S: float, T: float, p: float) -> float:
    """Δ under DropConnect with drop probability p: S / (S + (1−p)(T−S)).

    The same for the unscaled mask D g ([diversity]) and the rescaled D g/(1−p) of training."""
    require_p(p)
    return ratio(S, S + (1.0 - p) * (T - S))


def dropconnect_mask(
    shape: torch.Size | tuple[int, ...],
    p: float,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    rescale: bool = False,
) -> Tensor:
    """A mask of independent entries: 0 with probability p, else 1 (or 1/(1−p) with
    ``rescale``, which keeps the masked gradient unbiased)."""
    require_p(p)
    keep = torch.rand(shape, generator=generator, device=device, dtype=dtype) >= p
    return keep.to(dtype) / (1.0 - p) if rescale else keep.to(dtype)


def closed_form(mech: Mechanism, sums: Sums) -> float:
    return dropconnect_diversity(sums.S, sums.T, mech.p)


@register_mechanism(
    "dropconnect",
    closed_form=closed_form,
    options=(Option("p", 0.0, check=check_p,
                    required="dropconnect needs a drop probability, e.g. dropconnect(p=0.5)"),),
)
def sample(
    mech: Mechanism,
    tensors: list[Tensor],
    generator: torch.Generator | None,
    *,
    batch_dims: int,
    rescale: bool,
) -> list[Tensor]:
    # one mask entry per coordinate: the batch dimensions need no special care
    return [masked(t, mech.p, generator, rescale=rescale) for t in tensors]


def masked(t: Tensor, p: float, generator: torch.Generator | None, *, rescale: bool) -> Tensor:
    """t times a fresh mask, with fewer passes over t: the same draws and the same
    bits as ``t * dropconnect_mask(t.shape, p, ..., rescale=rescale)`` (per-example DropConnect
    masks B × |w| entries per step, so these passes were most of its cost)."""
    require_p(p)
    keep = torch.rand(t.shape, generator=generator, device=t.device, dtype=t.dtype) >= p
    out = t * keep.to(t.dtype)  # faster than torch.where or masked_fill on CPU
    if rescale:  # the factor rounded as dropconnect_mask rounds it: 1 / (1 − p) in t's dtype
        out.mul_(torch.ones((), dtype=t.dtype, device=t.device) / (1.0 - p))
    return out
