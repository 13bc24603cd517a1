"""Adaptive batch size ([slides]: "set the batch size ≈ n·Δ").

``adaptive(delta=δ, min=b_min, max=b_max, every=k)`` resets the global batch size every k
iterations to B = clip(⌊δ·n·Δ̂(w)⌋ + 1, b_min, b_max), the bound of [diversity]'s Lemma 1 with
the measured diversity Δ̂ in place of Δ_S(w). The learning rate then follows the strategy
for the new B (see schedule.py). ``fixed`` keeps the configured batch size.

``warmup(max=M, every=K, fraction=f, lr=noise|blr|lsr|srsr|...)``, batch-size warmup
(Merrill et al. 2025, *Critical Batch Size Revisited*): the batch starts at the configured B0
and, every K iterations, doubles once when twice the batch is still within a fraction f of
the online estimate of the noise scale B_noise (less its standard error), never past M and
never down; the rate changes by the named rule (``BatchPolicy.lr_change``: ``noise``, or any
rule registered in lr_rules.py, the trainer's vocabulary). It decides from
the trainer's cheap online estimate (two-batch from micro-batches or ranks, or per-example
norms), so deciding costs a few scalars; B grows in whole micro-batches (accumulation).

``pick=time`` chooses instead by the model ``batchbound advise`` uses: with B_noise =
n·Δ̂ − 1, a step at B makes 1/(1 + B_noise/B) of the progress of an infinitely large batch
(McCandlish et al. 2018), so the time per unit of progress is t(B)·(1 + B_noise/B), t(B)
the seconds of one iteration at B on P workers. The policy picks the B = P·2^k in
[min, max] that minimises it; t is timed once, at the first adaptation, and agreed across
ranks (``Trainer.step_cost``).

The Δ̂ measurements (or the online monitor's work) the policy depends on are part of its
training time: they count in the run's seconds and its targets' seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from batchbound.errors import BatchboundError
from batchbound.spec import check_options, parse_spec
from batchbound.train.lr_rules import LR_RULES, lr_rule

SOURCES = ("exact", "online")
PICKS = ("bound", "time", "warmup")
NOISE = "noise"  # warmup's own rate rule; the others are lr_rules.py's, read when used
TRIGGERS = ("branch", "noise")  # warmup: the branch test (default) or the noise scale
AUTO = "auto"  # the branch trigger's rate rule unless named: srsr (η0·√(B/B0))
# the branch trigger's first test after BRANCH_EVERY·B0 examples, the next ones at doubling
# example counts (train/branch_trend.py); a test's branches: BRANCH_STEPS steps at 4B, each
# rung over the same BRANCH_STEPS·4B examples (3 rungs: 1.75·4·BRANCH_STEPS steps at B's size)
BRANCH_EVERY = 100
BRANCH_STEPS = 2
NOISE_EVERY = 50


@dataclass(frozen=True)
class BatchPolicy:
    """``adaptive`` is False for a fixed batch size; then the other fields are unused."""

    adaptive: bool = False
    delta: float = 1.0
    min: int = 1
    max: int = 1 << 30
    every: int = 100
    source: str = "exact"
    pick: str = "bound"
    fraction: float = 0.5  # warmup: double B when 2B ≤ fraction·(B_noise − its SE)
    lr: str = NOISE  # warmup: the rate's change when B doubles
    trigger: str = "noise"  # warmup: branch (the branch test) or noise (the noise scale)
    steps: int = BRANCH_STEPS  # branch trigger: steps of the largest branch (4B); E = steps·4B
    z: float = 1.0  # branch trigger: each rung's band ± z σ (z = 1: about 84 % one-sided)

    @property
    def warmup(self) -> bool:
        return self.adaptive and self.pick == "warmup"

    def __post_init__(self) -> None:
        if not self.adaptive:
            return
        if self.delta <= 0:
            raise BatchboundError(f"adaptive batch: delta must be > 0, got {self.delta}")
        if not 1 <= self.min <= self.max:
            raise BatchboundError(
                f"adaptive batch: need 1 <= min <= max, got min={self.min}, max={self.max}"
            )
        if self.every < 1:
            raise BatchboundError(f"adaptive batch: every must be >= 1 iteration, got {self.every}")
        if self.pick not in PICKS:
            raise BatchboundError(
                f"adaptive batch: unknown pick {self.pick!r}; choose from {', '.join(PICKS)}"
            )
        if not 0 < self.fraction <= 1:
            raise BatchboundError(f"warmup: fraction must be in (0, 1], got {self.fraction}")
        if self.trigger not in TRIGGERS:
            raise BatchboundError(f"warmup: unknown trigger {self.trigger!r}; choose from "
                                  f"{', '.join(TRIGGERS)}")
        if self.trigger == "branch":
            if self.lr == NOISE:
                raise BatchboundError("warmup(trigger=branch) tests a rate rule at 2B: lr= "
                                      "must be a strategy's rule (lsr, srsr, ...) or auto; "
                                      "lr=noise belongs to trigger=noise")
            lr_rule(self.lr, "lr rule", extra=(AUTO,))
            if self.steps < 1:
                raise BatchboundError(f"warmup: steps must be >= 1, got {self.steps}")
            if not self.z > 0:
                raise BatchboundError(f"warmup: z must be > 0, got {self.z}")
        else:
            lr_rule(self.lr, "lr rule", extra=(NOISE,))
        if self.source not in SOURCES:
            raise BatchboundError(
                f"adaptive batch: unknown source {self.source!r}; choose from {', '.join(SOURCES)}"
            )

    def batch_size(self, n: int, diversity: float) -> int:
        """B = clip(⌊δ·n·Δ̂⌋ + 1, min, max). A Δ̂ that is infinite or not positive comes
        from T → 0 (gradients that cancel, or vanish): the bound is then unlimited, so the
        upper end."""
        if not math.isfinite(diversity) or diversity <= 0:
            return self.max
        return int(min(max(math.floor(self.delta * n * diversity) + 1, self.min), self.max))

    def candidates(self, workers: int) -> list[int]:
        """B = P·2^k within [min, max] (at least one: the multiple of P nearest min)."""
        out, batch = [], workers
        while batch <= self.max:
            if batch >= self.min:
                out.append(batch)
            batch *= 2
        return out or [max(workers, self.min - self.min % workers)]

    def time_optimal(self, n: int, diversity: float, workers: int,
                     seconds: Callable[[int], float]) -> int:
        """The candidate B minimising t(B)·(1 + B_noise/B), B_noise = n·Δ̂ − 1 (the upper
        end when Δ̂ is infinite or not positive, as for the bound)."""
        candidates = self.candidates(workers)
        if not math.isfinite(diversity) or diversity <= 0:
            return candidates[-1]
        noise = max(n * diversity - 1.0, 0.0)
        return min(candidates, key=lambda b: seconds(b) * (1.0 + noise / b))


    def warmed(self, batch: int, noise: float, noise_se: float) -> int:
        """Batch-size warmup: ``batch`` doubled once when 2·batch ≤ fraction·(B_noise − its
        standard error), never past ``max``, never lowered (Merrill et al. 2025 raise the
        batch as the critical batch rises; here B_noise, McCandlish et al.'s estimate of it,
        read conservatively, and a fraction of it so that the examples a step spends stay
        within 1 + fraction of the fewest, E(B) = E_min·(1 + B/B_noise)). The trainer's
        estimate is an average over about the last 100 steps (``callbacks.WARM_DECAY``)."""
        if not math.isfinite(noise):
            return batch
        doubled = 2 * batch
        if doubled <= self.max and doubled <= self.fraction * (noise - max(noise_se, 0.0)):
            return doubled
        return batch

    def branch_rule(self) -> str:
        """The branch trigger's rate rule: the one named, else srsr (η0·√(B/B0)) for every
        optimiser. For SGD, McCandlish et al.'s best rate rises between constant (B ≫ B_noise)
        and linear (B ≪ B_noise), and a run tuned at B0 near its largest stable rate cannot
        take the linear rise: at 2B with lsr the fortunes GPT's branches ended at loss 200 against
        168 at B0, mnist5k fc's at 0.76 against 0.50 (issue 40), so the test said no to the
        rule, not to the batch. The square root is the middle of the two limits."""
        return self.lr if self.lr != AUTO else "srsr"

    def lr_change(self, old: int, new: int, noise: float, start: int) -> float:
        """The factor on the rate when B goes from ``old`` to ``new``, the run having started
        at B0 = ``start``: ``noise`` keeps it at McCandlish et al.'s best, ε(B) ∝
        1/(1 + B_noise/B); a registered rule s (lsr: B/B0, srsr: √(B/B0), blr: 1) moves it
        from s(old/B0) to s(new/B0), so the rate is s(B/B0)·η0 after any doublings."""
        rule = lr_rule(self.lr, "lr rule", extra=(NOISE,))
        if rule is not None:
            return rule.scale(new / start) / rule.scale(old / start)
        noise = max(noise, 0.0) if math.isfinite(noise) else 0.0
        return (1.0 + noise / old) / (1.0 + noise / new)


def parse_batch_policy(text: str) -> BatchPolicy:
    """``fixed`` or ``adaptive(delta=0.1,min=16,max=1024,every=50[,source=exact|online]
    [,pick=bound|time])``; with pick=time, delta is not used and may be left out."""
    spec = parse_spec(text)
    if spec.name == "warmup":
        check_options("warmup", spec.kwargs,
                      ("cadence", "every", "fraction", "lr", "max", "steps", "trigger", "z"))
        # the branch trigger's tests at doubling example counts (train/branch_trend.py): the
        # one cadence, named so that a stored run of the earlier every-K-steps one is not reused
        cadence = "cadence" in spec.kwargs
        if spec.kwargs.pop("cadence", "doubling") != "doubling":
            raise BatchboundError("warmup: cadence must be doubling (tests at every·B0·2^j "
                                  "examples)")
        # fraction and lr=noise are the noise trigger's: a spec naming them means that
        # trigger (as it did before the branch trigger became the default)
        noise_only = "fraction" in spec.kwargs or spec.kwargs.get("lr") == NOISE
        trigger = spec.kwargs.get("trigger", "noise" if noise_only else "branch")
        if trigger == "branch" and "fraction" in spec.kwargs:
            raise BatchboundError("warmup: fraction is the noise trigger's option; the branch "
                                  "trigger's are every, steps, z, lr and max")
        if trigger != "branch" and (cadence or {"steps", "z"} & set(spec.kwargs)):
            raise BatchboundError("warmup: steps, z and cadence are the branch trigger's "
                                  "options (trigger=branch)")
        defaults = ({"every": BRANCH_EVERY, "lr": AUTO} if trigger == "branch"
                    else {"every": NOISE_EVERY})
        return BatchPolicy(adaptive=True, source="online", pick="warmup", min=1,
                           **{"max": 1 << 30, **defaults, **spec.kwargs, "trigger": trigger})
    if spec.name == "fixed":
        if spec.kwargs:
            raise BatchboundError("batch policy 'fixed' takes no options")
        return BatchPolicy()
    if spec.name != "adaptive":
        raise BatchboundError(
            f"unknown batch policy {spec.name!r}; choose fixed, warmup(max=..,every=..,"
            f"trigger=branch|noise,steps=..,z=..,fraction=..,"
            f"lr={'|'.join((AUTO, NOISE, *LR_RULES))}) or adaptive(delta=..,"
            "min=..,max=..,every=..)"
        )
    check_options("adaptive batch", spec.kwargs,
                  ("delta", "every", "max", "min", "pick", "source"))
    needed = {"min", "max", "every"} | ({"delta"} if spec.kwargs.get("pick") != "time" else set())
    missing = sorted(needed - set(spec.kwargs))
    if missing:
        raise BatchboundError(f"adaptive batch needs {', '.join(missing)}")
    return BatchPolicy(adaptive=True, **spec.kwargs)
