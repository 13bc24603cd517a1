"""Learning-rate rules: how the rate scales with the batch size, one registration each.

A rule maps the ratio r = B/B0 of the batch to the base batch to the factor on η0. The
trainer's strategies (``schedule.py``: warm-up and decay on top), the study's strategy grid,
``advise``'s rows and batch-size warmup's rate (``adaptive.py``) all read this one registry
when they use it, never a copy taken at import, so a rule registered later (here or in a
plugin) is known to all of them, and their help lists it. Adding a rule is one function:

    @register_lr_rule("cbrt", "η0·(B/B0)^(1/3)")
    def cube_root(ratio: float) -> float:
        return ratio ** (1 / 3)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from batchbound.errors import BatchboundError

Scale = Callable[[float], float]


@dataclass(frozen=True)
class LRRule:
    name: str
    formula: str  # η(B) in words, for help and reports
    scale: Scale  # B/B0 → the factor on η0
    needs_base_batch: bool  # whether B0 (``base_batch``) must be given


LR_RULES: dict[str, LRRule] = {}


def register_lr_rule(name: str, formula: str, needs_base_batch: bool = True
                     ) -> Callable[[Scale], Scale]:
    def decorate(scale: Scale) -> Scale:
        if name in LR_RULES:
            raise ValueError(f"learning-rate rule {name!r} registered twice")
        LR_RULES[name] = LRRule(name, formula, scale, needs_base_batch)
        return scale

    return decorate


def lr_rule(name: str, what: str = "learning-rate rule", extra: tuple[str, ...] = ()
            ) -> LRRule | None:
    """The registered rule ``name``; None for one of the caller's own names in ``extra``;
    else a BatchboundError naming the choices, read from the registry now."""
    if name in LR_RULES:
        return LR_RULES[name]
    if name in extra:
        return None
    raise BatchboundError(f"unknown {what} {name!r}; choose from "
                          f"{', '.join((*extra, *LR_RULES))}")


def rules_help() -> str:
    """``blr: η0 (...); lsr: η0·B/B0 (...); ...``, for help texts."""
    return "; ".join(f"{rule.name}: {rule.formula}" for rule in LR_RULES.values())


@register_lr_rule("blr", "η0 (one rate for every batch size)", needs_base_batch=False)
def baseline(ratio: float) -> float:
    return 1.0


@register_lr_rule("lsr", "η0·B/B0 (linear scaling)")
def linear(ratio: float) -> float:
    return ratio


@register_lr_rule("srsr", "η0·√(B/B0) (square-root scaling)")
def square_root(ratio: float) -> float:
    return math.sqrt(ratio)
