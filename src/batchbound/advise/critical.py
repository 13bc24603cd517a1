"""The critical batch measured along the pilot by short branches (Merrill et al. 2025).

From the pilot's own kept states (model and optimiser), short runs branch at B = B0·2^k,
each over the same number of examples E, at the rows' learning-rate rule; one more branch
at B0 with another data order measures how much a branch's loss decrease varies by chance.
With the rate near its best, McCandlish et al.'s model says a step at B makes the progress
of B/(B + B_crit) examples at B0's best, so over E examples the loss falls by c·E/(B + B_crit)
(small decreases) and the ratio of B's decrease to B0's is

    r(B) = (B0 + B_crit)/(B + B_crit),   so   B_crit = (r·B − B0)/(1 − r).

Per kept state, B_crit is the least-squares fit of r over the ladder; its interval is where
every rung's inversion, at r ± 2σ·√(B/B0) (σ from the two B0 branches, at least
``MIN_SPREAD``; a rung of B takes B0/B as many steps), agrees (or their union when they
do not). Past the pilot, the central trajectory stays where the last point is (the
plateau Merrill et al. measure); low stays at the last point's low end; high grows from
the last point's high end as the noise-scale trajectory grows (``trajectory.py``).
``iterations.py`` turns these into k(B) with the tuned-rate relation.

This is the measurement of *this* run the noise scale n·Δ − 1 only approximates (for
language models it underestimates it; Merrill et al.): the rows predict from it, and show the
noise scale's prediction beside it (``combine``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from batchbound.advise.iterations import Pilot
from batchbound.data import Dataset
from batchbound.errors import BatchboundError
from batchbound.train.config import TrainConfig
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Parts, Trainer

MIN_SPREAD = 0.1  # the least relative spread of a branch's decrease assumed (short runs)
MIN_STEPS = 2  # steps the largest rung must take
MAX_RUNGS = 4  # B0 .. 8·B0
EVAL_EXAMPLES = 4096  # the branches' loss is evaluated on a fixed subset of this many
CAP = 8  # B_crit above CAP × the largest rung cannot be told apart: capped there


@dataclass(frozen=True)
class BranchPlan:
    """What the branches will cost, said before they start."""

    ladder: tuple[int, ...]  # B0·2^k
    examples: int  # per branch
    points: int
    planned_examples: int  # K·B0 of the plan

    @property
    def branches(self) -> int:
        return self.points * (len(self.ladder) + 1)  # + the B0 replicate

    @property
    def total_examples(self) -> int:
        return self.branches * self.examples

    def seconds(self, step: Callable[[int], float]) -> float:
        """Training seconds, from the step time at each rung."""
        per_point = sum(self.examples // b * step(b) for b in self.ladder)
        per_point += self.examples // self.ladder[0] * step(self.ladder[0])
        return self.points * per_point

    def text(self, step: Callable[[int], float]) -> str:
        return (f"branches: {self.points} pilot states × {len(self.ladder) + 1} runs of "
                f"{self.examples} examples at B = {', '.join(map(str, self.ladder))} (B0 "
                f"twice), {self.total_examples} examples = "
                f"{100 * self.total_examples / self.planned_examples:.3g} % of the plan: about "
                f"{self.seconds(step):.3g} s, plus 2 loss evaluations per run")


def plan_branches(b0: int, n: int, largest: int, budget_examples: int, planned_examples: int,
                  points: int) -> BranchPlan:
    """The ladder and the examples per branch that fit ``budget_examples``; BatchboundError
    when not even B0 and 2·B0 can take MIN_STEPS steps each."""
    top = min(largest, n)
    for rungs in range(MAX_RUNGS, 1, -1):
        ladder = tuple(b0 << k for k in range(rungs) if b0 << k <= top)
        if len(ladder) < 2:
            continue
        examples = budget_examples // (points * (len(ladder) + 1))
        if examples >= MIN_STEPS * ladder[-1]:
            return BranchPlan(ladder, examples, points, planned_examples)
    raise BatchboundError(
        f"the branch budget ({budget_examples} examples, the plan's budget less the pilot) "
        f"cannot run {points} × 3 branches of {MIN_STEPS} steps at B = {2 * b0}: raise "
        "--budget, lower --pilot-fraction, or use --critical-batch noise")


@dataclass(frozen=True)
class CriticalPoint:
    iteration: int
    critical_batch: float  # B_crit fitted
    low: float
    high: float
    spread: float  # σ of r, from the two B0 branches (at least MIN_SPREAD)
    decrease: dict[int, float]  # batch -> loss decrease over the branch (B0: the mean of 2)

    def to_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "critical_batch": self.critical_batch,
                "interval": [self.low, self.high], "spread": self.spread,
                "loss_decrease": {str(b): v for b, v in self.decrease.items()}}


def invert(ratio: float, batch: int, b0: int, cap: float) -> float:
    """B_crit from r(B) = (B0 + B_crit)/(B + B_crit), clipped to [0, cap]."""
    if ratio >= 1:
        return cap
    if ratio * batch <= b0:
        return 0.0
    return min((ratio * batch - b0) / (1 - ratio), cap)


def fit_point(decrease: dict[int, float], b0: int, spread: float, iteration: int
              ) -> CriticalPoint:
    """B_crit and its interval from one state's branch decreases (see the module
    docstring). BatchboundError when B0's branch made no progress."""
    base = decrease[b0]
    if not (math.isfinite(base) and base > 0):
        raise BatchboundError(f"the branch at B0 = {b0} from iteration {iteration} made no "
                              "progress (its loss did not fall): the critical batch cannot be "
                              "measured there; lengthen the pilot or use --critical-batch noise")
    rungs = [b for b in decrease if b != b0]
    cap = CAP * max(decrease)
    ratios = {b: (decrease[b] / base if math.isfinite(decrease[b]) else 0.0) for b in rungs}
    grid = np.concatenate([[0.0], np.geomspace(b0 / 64, cap, 400)])
    errors = [sum((ratios[b] - (b0 + c) / (b + c)) ** 2 for b in rungs) for c in grid]
    central = float(grid[int(np.argmin(errors))])
    # a rung of B takes B0/B as many steps as B0's: its decrease varies √(B/B0) times more
    lows = [invert(ratios[b] - 2 * spread * math.sqrt(b / b0), b, b0, cap) for b in rungs]
    highs = [invert(ratios[b] + 2 * spread * math.sqrt(b / b0), b, b0, cap) for b in rungs]
    low, high = max(lows), min(highs)
    if low > high:  # the rungs disagree beyond their noise: the union of what each says
        low, high = min(lows), max(highs)
    low, high = min(low, central), max(high, central)
    return CriticalPoint(iteration, central, low, high, spread, decrease)


def measure(states: Sequence[tuple[int, float, dict, dict]], config: TrainConfig,
            data: Dataset, device: torch.device, plan: BranchPlan, lr: Callable[[int], float],
            parts: Parts | None = None, log: Callable[[str], None] = lambda _: None
            ) -> list[CriticalPoint]:
    """Branch from the last ``plan.points`` kept states (iteration, epoch, model state,
    optimiser state) and fit B_crit at each."""
    if len(states) < plan.points:
        raise BatchboundError(f"the pilot kept {len(states)} states, the branches need "
                              f"{plan.points}; lengthen the pilot")
    b0 = plan.ladder[0]
    subset = min(data.n_train, EVAL_EXAMPLES)
    out = []
    for iteration, _, model_state, optimizer_state in states[-plan.points:]:
        decrease = {}
        for batch in plan.ladder:
            decrease[batch] = branch(config, data, device, model_state, optimizer_state, batch,
                                     lr(batch), plan.examples // batch, subset, parts)
        again = branch(config.replace(seed=config.seed + 1), data, device, model_state,
                       optimizer_state, b0, lr(b0), plan.examples // b0, subset, parts)
        first = decrease[b0]
        mean = (first + again) / 2
        spread = MIN_SPREAD
        if math.isfinite(mean) and mean > 0:
            spread = max(abs(first - again) / mean / math.sqrt(2), MIN_SPREAD)
        decrease[b0] = mean
        point = fit_point(decrease, b0, spread, iteration)
        log(f"branches at iteration {iteration}: critical batch {point.critical_batch:.3g} "
            f"({point.low:.3g}–{point.high:.3g})")
        out.append(point)
    return out


def branch(config: TrainConfig, data: Dataset, device: torch.device,
           model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any], batch: int,
           lr: float, steps: int, subset: int, parts: Parts | None) -> float:
    """Train-loss decrease (on a fixed subset) over ``steps`` steps at ``batch`` from the
    state (−inf when the branch diverges)."""
    run = config.replace(batch_size=batch, lr=lr, strategy="blr", targets=(),
                         max_iterations=steps, max_epochs=None, eval_every_epochs=None,
                         eval_every_iterations=steps, eval_growth=None,
                         diversity_every_epochs=None, online_diversity="off",
                         micro_batch=None, eval_subset=subset if subset < data.n_train else None)
    trainer = Trainer(run, DistContext(device=device), dataset=data, parts=parts)
    trainer.model.load_state_dict(model_state)
    saved = copy.deepcopy(optimizer_state)
    for group in saved["param_groups"]:
        group["lr"] = lr
    trainer.optimizer.load_state_dict(saved)
    result = trainer.run()
    losses = [v for _, _, _, v in result.curve("train_loss")]
    if result.status == "diverged" or not math.isfinite(losses[-1]):
        return -math.inf
    return losses[0] - losses[-1]


def trajectories(points: Sequence[CriticalPoint], noise: Pilot, batch_size: int, lr: float,
                 pilot_iterations: int, planned: int) -> tuple[Pilot, Pilot, Pilot]:
    """(central, low, high) B_crit over the plan (see the module docstring); ``noise`` is the
    noise scale's central trajectory, whose growth past the pilot the high end follows."""
    its = [p.iteration for p in points]
    after = [t for t in noise.bound_iterations if t > pilot_iterations]
    base = max(noise.noise_scale(pilot_iterations), 1e-12)
    growth = [max(noise.noise_scale(t) / base, 1.0) for t in after]

    def pilot(values: list[float], beyond: list[float]) -> Pilot:
        return Pilot(batch_size, lr, planned, tuple(its + after),
                     tuple(1.0 + max(v, 0.0) for v in values + beyond))

    last = points[-1]
    return (pilot([p.critical_batch for p in points], [last.critical_batch for _ in after]),
            pilot([p.low for p in points], [last.low for _ in after]),
            pilot([p.high for p in points], [last.high * g for g in growth]))


@dataclass(frozen=True)
class Combined:
    """One batch's iterations: from the branches, with the noise scale's beside it."""

    iterations: float
    interval: tuple[float, float]
    noise_iterations: float
    noise_interval: tuple[float, float]
    disagree: bool  # the two intervals do not overlap: the interval spans both


def combine(branch: float, branch_interval: tuple[float, float], noise: float,
            noise_interval: tuple[float, float]) -> Combined:
    (blo, bhi), (nlo, nhi) = branch_interval, noise_interval
    disagree = bhi < nlo or nhi < blo
    interval = (min(blo, nlo), max(bhi, nhi)) if disagree else (blo, bhi)
    return Combined(branch, interval, noise, noise_interval, disagree)


__all__ = ["BranchPlan", "Combined", "CriticalPoint", "combine", "fit_point", "invert",
           "measure", "plan_branches", "trajectories"]
