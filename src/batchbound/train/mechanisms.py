"""Diversity-inducing mechanisms of seed 001 applied in training: DropConnect(p), SGLD(σ) and
stochastic quantization, at one of two granularities.

Every mechanism acts on a *gradient sum* Σ_{i∈unit} g_i (the seeds' units) and is unbiased,
so the expected update equals the plain one:

- ``dropconnect(p=..)``: D·g / (1 − p), D a diagonal Bernoulli(1 − p) keep-mask. Seed 001
  writes D·g without the 1/(1 − p); we rescale so the step size keeps its meaning.
- ``sgld(sigma=..)``: g + ξ, ξ ~ N(0, σ²I), one ξ per unit.
- ``quantize``: Q(g), [Q(v)]_l = ‖v‖₂·sign(v_l)·η_l with P(η_l = 1) = |v_l|/‖v‖₂.

Granularity:

- ``example`` (exact, seed 001's definition): the unit is one example, so every example's
  gradient is masked / noised / quantized on its own. DropConnect and quantization need the
  per-example gradients (one (B, *shape) tensor per parameter), which costs memory B×|w| and
  a vmap'd backward: several times a plain step. SGLD needs none: the sum of B independent
  N(0, σ²) draws is one N(0, Bσ²) draw.
- ``worker`` (the practical form): the unit is one worker's local gradient (each rank's
  slice of the global batch; on one process, the whole batch). Applied to the flat gradient
  buffer just before the all-reduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchbound.errors import BatchboundError
from batchbound.spec import parse_spec

MECHANISMS = ("dropconnect", "sgld", "quantize")
GRANULARITIES = ("example", "worker")


@dataclass(frozen=True)
class Mechanism:
    name: str
    p: float = 0.0
    sigma: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in MECHANISMS:
            raise BatchboundError(
                f"unknown mechanism {self.name!r}; choose from dropconnect(p=..), sgld(sigma=..), "
                "quantize"
            )
        if self.name == "dropconnect" and not 0 <= self.p < 1:
            raise BatchboundError(f"dropconnect p must be in [0, 1), got {self.p}")
        if self.name == "sgld" and not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise BatchboundError(f"sgld sigma must be >= 0, got {self.sigma}")


def parse_mechanism(text: str) -> Mechanism:
    spec = parse_spec(text)
    options = {"dropconnect": {"p"}, "sgld": {"sigma"}, "quantize": set()}
    if spec.name not in options:
        Mechanism(spec.name)  # raises with the list of choices
    unknown = sorted(set(spec.kwargs) - options[spec.name])
    missing = sorted(options[spec.name] - set(spec.kwargs))
    if unknown or missing:
        needs = ", ".join(f"{k}=.." for k in sorted(options[spec.name])) or "no options"
        raise BatchboundError(f"mechanism {text!r}: {spec.name} takes {needs}")
    return Mechanism(spec.name, **{k: float(v) for k, v in spec.kwargs.items()})
