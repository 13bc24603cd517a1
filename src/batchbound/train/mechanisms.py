"""Diversity-inducing mechanisms of [diversity] applied in training: ``dropconnect(p=..)``,
``sgld(sigma=..)`` and ``quantization``, at one of two granularities. The samplers and the
spec are batchbound.diversity.mechanisms' (one module per mechanism, found through its
table); this module decides *where* they act, for any registered mechanism.

Every mechanism acts on a gradient sum Σ_{i∈unit} g_i and is unbiased, so the expected
update equals the plain one:

- DropConnect: D·g/(1 − p), D a diagonal Bernoulli(1 − p) keep-mask. [diversity] writes D·g
  without the 1/(1 − p); we rescale so the step size keeps its meaning.
- SGLD: g + ξ, ξ ~ N(0, σ²I), one ξ per unit.
- Quantization: Q(g), [Q(v)]_l = ‖v‖₂·sign(v_l)·η_l with P(η_l = 1) = |v_l|/‖v‖₂, over the
  whole flattened model gradient (``quantization(per_tensor=true)``: per parameter tensor).

Granularity:

- ``example`` (exact, [diversity]'s definition): the unit is one example. Mechanisms with
  ``needs_per_example`` (DropConnect, quantization) need the per-example gradients
  (``per_example_gradients``, torch.func vmap): memory B_local × |w| and several times the
  cost of a plain backward. The others draw Σ_i M(g_i) from the summed gradient (their
  entry's ``from_sum``; SGLD: the sum of B independent N(0, σ²I) draws is one N(0, Bσ²I)).
- ``worker`` (the practical form): the unit is one worker's local gradient (each rank's
  slice of the global batch; on one process, the whole batch), applied to the flat gradient
  buffer just before the all-reduce (the entry's ``worker``).

Gradients here are already multiplied by the convention's ``scale`` (1/B for ``mean``, 1
for ``sum``). DropConnect and Q are positively homogeneous, Q(c·v) ~ c·Q(v) for c > 0, so
applying them after the scale is the same; SGLD's noise is multiplied by ``scale``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from batchbound.diversity import per_example_gradients
from batchbound.diversity.losses import PerExampleLoss
from batchbound.diversity.mechanisms import Mechanism, apply_mechanism, parse_mechanism

GRANULARITIES = ("example", "worker")

__all__ = ["GRANULARITIES", "Mechanism", "apply_to_worker", "example_gradients", "parse_mechanism",
           "worker_seed"]


def worker_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s mechanism draws (independent workers): reduced modulo
    2^64 only when it would not fit torch's generator, so every int64 run seed works and
    the usual seeds keep their draws."""
    value = seed * 1_000_003 + 7919 * (rank + 1)
    return value if -(2**63) <= value < 2**64 else value % 2**64


def apply_to_worker(
    mechanism: Mechanism,
    grads: list[Tensor],
    scale: float,
    generator: torch.Generator,
) -> None:
    """Replace this worker's (already scaled) gradient tensors in place by M(gradient)."""
    mechanism.entry.worker(mechanism, grads, scale, generator)


def example_gradients(
    mechanism: Mechanism,
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss_fn: PerExampleLoss,
    scale: float,
    generator: torch.Generator,
) -> tuple[Tensor, list[Tensor]]:
    """Σ_i M(g_i)·scale over this worker's examples, each example's mechanism drawn on its
    own. Returns (per-example losses, gradients in ``model.parameters()`` order)."""
    params = [p for p in model.parameters() if p.requires_grad]
    from_sum = mechanism.entry.from_sum
    if from_sum is not None:  # the sum's distribution needs only Σ g_i: one plain backward
        outputs = model(x)
        losses = loss_fn(outputs, y)
        grads = list(torch.autograd.grad(losses.sum() * scale, params))
        from_sum(mechanism, grads, x.shape[0], scale, generator)
        return losses.detach(), grads
    with torch.no_grad():
        losses = loss_fn(model(x), y)
    per_example = per_example_gradients(model, x, y, loss_fn)
    drawn = apply_mechanism(mechanism, per_example, generator, batch_dims=1, rescale=True)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    return losses, [drawn[name].sum(dim=0) * scale for name in names]
