"""Learning-rate strategies ([inefficiency]'s BLR, LSR and SRSR, and any rule registered in
``lr_rules.py``), with optional warm-up and decay.

A strategy maps (current batch size m, fractional epoch e) to a learning rate, given the base
learning rate η0 from the config:

- ``blr``: η(m) = η0 for every batch size (the baseline learning rate).
- ``lsr(base_batch=m0, warmup_epochs=W)``: η(m) = η0·m/m0 (linear scaling rule).
- ``srsr(base_batch=m0, warmup_epochs=W)``: η(m) = η0·√(m/m0) (square-root scaling rule).

Warm-up (Goyal et al., as used by [inefficiency] for LSR): for e < W the rate ramps linearly from
η0 at e = 0 to the scaled rate at e = W, η = η0 + (η(m) − η0)·e/W; from e = W on it is η(m).
Decay, applied on top, is either ``decay=step`` with ``milestones=[e1,e2,...]`` and
``gamma`` (multiply by gamma at each milestone epoch passed) or ``decay=cosine`` over
``decay_epochs`` (η·½(1+cos(π·min(e/E,1)))). The batch size m may change during a run
(adaptive batch size); the rate follows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchbound.errors import BatchboundError
from batchbound.spec import check_options, did_you_mean, parse_spec
from batchbound.train.lr_rules import LR_RULES, rules_help

DECAYS = ("none", "step", "cosine")


@dataclass(frozen=True)
class Strategy:
    name: str
    base_batch: int = 1
    warmup_epochs: float = 0.0
    decay: str = "none"
    milestones: tuple[float, ...] = ()
    gamma: float = 0.1
    decay_epochs: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in LR_RULES:
            raise BatchboundError(
                f"unknown learning-rate strategy {self.name!r}{did_you_mean([self.name], LR_RULES)}"
                f"; choose from {', '.join(LR_RULES)}"
                " (e.g. blr, lsr(base_batch=32,warmup_epochs=5), srsr(base_batch=32))"
            )
        if self.base_batch < 1:
            raise BatchboundError(f"strategy base_batch must be >= 1, got {self.base_batch}")
        if self.warmup_epochs < 0:
            raise BatchboundError(f"warmup_epochs must be >= 0, got {self.warmup_epochs}")
        if self.decay not in DECAYS:
            raise BatchboundError(f"unknown decay {self.decay!r}; choose from {', '.join(DECAYS)}")
        if self.decay == "step" and not self.milestones:
            raise BatchboundError("decay=step needs milestones=[epoch,...]")
        if self.decay == "cosine" and self.decay_epochs <= 0:
            raise BatchboundError("decay=cosine needs decay_epochs > 0")
        if not 0 < self.gamma <= 1:
            raise BatchboundError(f"decay gamma must be in (0, 1], got {self.gamma}")

    def scale(self, batch_size: int) -> float:
        """The batch-size factor applied to η0 once warm-up is over (``lr_rules.py``)."""
        return LR_RULES[self.name].scale(batch_size / self.base_batch)

    def lr(self, base_lr: float, batch_size: int, epoch: float) -> float:
        target = base_lr * self.scale(batch_size)
        if self.warmup_epochs > 0 and epoch < self.warmup_epochs:
            rate = base_lr + (target - base_lr) * epoch / self.warmup_epochs
        else:
            rate = target
        return rate * self.decay_factor(epoch)

    def decay_factor(self, epoch: float) -> float:
        if self.decay == "step":
            return self.gamma ** sum(1 for m in self.milestones if epoch >= m)
        if self.decay == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(epoch / self.decay_epochs, 1.0)))
        return 1.0


def strategy_help() -> str:
    """The strategies' help, from the registry as it is now (a later rule is listed)."""
    forms = [f"{name}(base_batch=B0,warmup_epochs=W)" if rule.needs_base_batch else name
             for name, rule in LR_RULES.items()]
    return f"{' | '.join(forms)}, optional decay=step|cosine ({rules_help()})"


def parse_strategy(text: str) -> Strategy:
    """``blr``, ``lsr(base_batch=32,warmup_epochs=5)``, ``srsr(base_batch=32,decay=cosine,
    decay_epochs=100)``; raises BatchboundError naming the bad part."""
    spec = parse_spec(text)
    check_options(f"strategy {spec.name!r}", spec.kwargs, sorted(
        ("base_batch", "warmup_epochs", "decay", "milestones", "gamma", "decay_epochs")))
    kwargs = dict(spec.kwargs)
    rule = LR_RULES.get(spec.name)
    if rule is not None and rule.needs_base_batch and "base_batch" not in kwargs:
        raise BatchboundError(
            f"strategy {spec.name} needs base_batch=B0 (the batch η0 is for), e.g. "
            f"{spec.name}(base_batch=32)"
        )
    if "milestones" in kwargs:
        milestones = kwargs["milestones"]
        kwargs["milestones"] = tuple(
            float(m) for m in (milestones if isinstance(milestones, list) else [milestones])
        )
    try:
        return Strategy(name=spec.name, **kwargs)
    except TypeError as exc:
        raise BatchboundError(f"strategy {text!r}: {exc}") from None
