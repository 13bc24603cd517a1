"""The critical batch measured along the pilot by short branches (Merrill et al. 2025).

From the pilot's end state (model and optimiser), short runs branch at B = B0·2^k, each over
the same E examples (the same examples, in the same order), at the rows' learning-rate rule;
B0's run is evaluated ``B0_EVALUATIONS`` times along the way, the others at their end, all on
one fixed subset. One more run at B0 with another data order measures the chance variation.

Merrill et al. compare losses after equal examples; here each run is read as the examples
B0 needed for the same loss: the B0 run's loss curve (made monotone by its running minimum)
is interpolated at B's final loss, giving e*(B), and r(B) = e*(B)/E, the share of B0's
progress per example that B keeps. With the rate near its best, McCandlish et al.'s model
says a step at B is worth B/(B + B_crit) examples at B0's best, so

    r(B) = (B0 + B_crit)/(B + B_crit),   so   B_crit = (r·B − B0)/(1 − r).

No linearity of the loss in the examples is assumed: only that B0's own curve measures
progress. B_crit is the least-squares fit of r over the rungs the model explains (a rung
that diverged or whose r is below B0/B is excluded and named; with none left the point is
only a bound, below the first rung, and advise calls the branches inconclusive: a bound is
no value to predict from); its interval's ends are the fits with every
rung's r shifted jointly by ∓2σ·√(B/B0) (σ: B0's two runs read against each other, n = 1
pair, at least ``MIN_SPREAD``; the rungs share B0's curve, so their errors are correlated
and are never intersected; train/branches.py). Every rung runs the same examples, a multiple of the
largest batch. Past the pilot, low stays at the low end (the plateau Merrill et al. see);
high grows from the high end as the noise-scale trajectory grows (``trajectory.py``); the
central trajectory lies half way between the two hypotheses in log: the measured value
times the square root of that growth (a pilot at 5 % of the plan is often still where the
critical batch rises). Before the first branch point the trajectory holds that point's value
(with one point: the end-of-pilot value), an assumption the answer states. ``iterations.py``
turns these into k(B) with the tuned-rate relation.

This is the measurement of *this* run that the noise scale n·Δ − 1 only approximates (for
language models it underestimates it; Merrill et al.). The rows predict from it and the noise
scale's prior together, each weighted by the precision of its interval, and show both beside
the result (``combine``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from batchbound.advise.iterations import Pilot
from batchbound.data import Dataset
from batchbound.errors import BatchboundError
from batchbound.train.branches import (
    B0_EVALUATIONS,
    CAP,
    MIN_SPREAD,
    CriticalPoint,
    branch_point,
    examples_ratio,
    fit_point,
    invert,
)
from batchbound.train.config import TrainConfig
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Parts, Trainer

# the math of one state's branches is train/branches.py's (shared with warmup's trigger)
# steps every rung must take (the largest rung takes the fewest): rungs of 2–6 steps read
# the transient after the branch starts, not the critical batch (fortunes GPT, AdamW: 2- and
# 3-step rungs ended above their start; docs/advise.md 2b); 10 is also the memory of
# momentum 0.9 and of Adam's β1 = 0.9
MIN_STEPS = 10
MAX_RUNGS = 4  # B0 .. 8·B0
EVAL_EXAMPLES = 4096  # the branches' loss is evaluated on a fixed subset of this many


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
                f"{self.seconds(step):.3g} s, plus {B0_EVALUATIONS + 1} loss evaluations for "
                f"each of B0's two runs and 2 for each other")


def plan_branches(b0: int, n: int, largest: int, budget_examples: int, planned_examples: int,
                  points: int) -> BranchPlan:
    """The ladder and the examples per branch that fit ``budget_examples``: the same for
    every rung, a multiple of the largest batch (every rung takes whole steps over exactly
    those examples, so r(B) is not biased by a rung seeing fewer); ``TooShort`` when not
    even B0 and 2·B0 can take MIN_STEPS steps each."""
    top = min(largest, n)
    for rungs in range(MAX_RUNGS, 1, -1):
        ladder = tuple(b0 << k for k in range(rungs) if b0 << k <= top)
        if len(ladder) < 2:
            continue
        # ladder = B0·2^k: its lcm is its largest batch
        examples = budget_examples // (points * (len(ladder) + 1)) // ladder[-1] * ladder[-1]
        if examples >= MIN_STEPS * ladder[-1]:
            return BranchPlan(ladder, examples, points, planned_examples)
    needed = points * 3 * MIN_STEPS * 2 * b0
    if top < 2 * b0:
        raise TooShort(f"the branches need 2·B0 = {2 * b0} examples in a batch, the data or "
                       f"the largest micro-batch allows {top}", needed)
    raise TooShort(
        f"the branch budget ({budget_examples} examples, the plan's budget less the pilot) "
        f"cannot run {points} × 3 branches of {MIN_STEPS} steps at B = {2 * b0} ({needed} "
        "examples): raise --budget, lower --pilot-fraction, or use --critical-batch noise",
        needed)


class TooShort(BatchboundError):
    """The budget cannot give every rung MIN_STEPS steps; ``needed``: the examples the
    smallest ladder (B0, 2·B0 and B0's replicate) would take."""

    def __init__(self, message: str, needed: int) -> None:
        super().__init__(message)
        self.needed = needed


class Inconclusive(BatchboundError):
    """The branches measured nothing the answer can use (B0's own run did not progress, no
    rung above B0 could be fitted, or the interval spans every value they can tell apart):
    advise says so and predicts from the noise scale instead."""


def measure(states: Sequence[tuple[int, float, dict, dict]], config: TrainConfig,
            data: Dataset, device: torch.device, plan: BranchPlan, lr: Callable[[int], float],
            parts: Parts | None = None, log: Callable[[str], None] = lambda _: None
            ) -> list[CriticalPoint]:
    """Branch from the last ``plan.points`` kept states (iteration, epoch, model state,
    optimiser state) and fit B_crit at each. ``Inconclusive`` when B0's own run made no
    progress (nothing to read the others against), a point is only a bound (no rung left to
    fit: "below 2·B0" is no value to predict from) or its interval spans everything."""
    if len(states) < plan.points:
        raise BatchboundError(f"the pilot kept {len(states)} states, the branches need "
                              f"{plan.points}; lengthen the pilot")
    b0 = plan.ladder[0]
    subset = min(data.n_train, EVAL_EXAMPLES)
    out = []
    for iteration, _, model_state, optimizer_state in states[-plan.points:]:
        def run(batch: int, evaluations: int, seed: int = config.seed,
                model_state: dict = model_state, optimizer_state: dict = optimizer_state
                ) -> list[tuple[int, float]]:
            steps = plan.examples // batch  # exact: examples is a multiple of every rung
            return [(i * batch, v) for i, v in branch(
                config.replace(seed=seed), data, device, model_state, optimizer_state, batch,
                lr(batch), steps, max(1, steps // evaluations), subset, parts, config.seed)]

        point = branch_point(run, plan.ladder, config.seed, iteration)
        if point is None:
            raise Inconclusive(
                f"the branch at B0 = {b0} from iteration {iteration} made no progress (its "
                "loss did not fall), so the others cannot be read against it")
        if point.below is not None:  # a bound is not a value the rows can predict from
            raise Inconclusive(
                f"at iteration {iteration} no branch above B0 = {b0} could be fitted (every "
                f"one outside the model or diverged), so they bound the critical batch below "
                f"{point.below} but measure no value to predict from; {point.text()}")
        top = CAP * max(point.ratios)
        if point.low <= 0 and point.high >= top:
            raise Inconclusive(
                f"at iteration {iteration} the branches' interval for the critical batch, "
                f"{point.low:.3g}–{point.high:.3g}, spans everything they can tell apart "
                f"(0 to {top:.3g}); {point.text()}")
        log(f"branches at iteration {iteration}: r(B) = "
            f"{', '.join(f'{r:.2f}' for r in point.ratios.values())}; {point.text()}")
        out.append(point)
    return out


def branch(config: TrainConfig, data: Dataset, device: torch.device,
           model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any], batch: int,
           lr: float, steps: int, every: int, subset: int, parts: Parts | None,
           subset_seed: int) -> list[tuple[int, float]]:
    """(iteration, train loss on a fixed subset) every ``every`` steps of ``steps`` at
    ``batch`` from the state, and at its end; a diverged run ends at +inf."""
    run = config.replace(batch_size=batch, lr=lr, strategy="blr", targets=(),
                         max_iterations=steps, max_epochs=None, eval_every_epochs=None,
                         eval_every_iterations=every, eval_growth=None,
                         diversity_every_epochs=None, online_diversity="off",
                         micro_batch=None, eval_subset=subset if subset < data.n_train else None)
    trainer = Trainer(run, DistContext(device=device), dataset=data, parts=parts)
    # every branch (the replicate's other data order too) is read on the pilot's subset: the
    # replicate's seed would pick another, and the subsets' difference would pass for chance
    # variation between B0's two runs
    trainer.eval_train = trainer.train_subset(subset, subset_seed)
    trainer.model.load_state_dict(model_state)
    saved = copy.deepcopy(optimizer_state)
    for group in saved["param_groups"]:
        group["lr"] = lr
    trainer.optimizer.load_state_dict(saved)
    result = trainer.run()
    curve = [(i, v) for i, _, _, v in result.curve("train_loss")]
    if result.status == "diverged":
        curve.append((steps, math.inf))
    return curve


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
    return (pilot([p.critical_batch for p in points],
                  [last.critical_batch * math.sqrt(g) for g in growth]),
            pilot([p.low for p in points], [last.low for _ in after]),
            pilot([p.high for p in points], [last.high * g for g in growth]))


@dataclass(frozen=True)
class Combined:
    """One batch's iterations: the branches' measurement and the noise scale's prior, joined
    by their precision, with both kept beside it."""

    iterations: float
    interval: tuple[float, float]
    noise_iterations: float
    noise_interval: tuple[float, float]
    disagree: bool  # the two intervals do not overlap: the interval spans both
    branch_iterations: float = math.nan
    branch_interval: tuple[float, float] = (math.nan, math.nan)
    branch_weight: float = 1.0  # the branches' share of the central value (in log)


def log_precision(interval: tuple[float, float]) -> float:
    """1/σ² of a ±2σ band in log: σ = ln(high/low)/4. 0 for a band with no lower end (it
    says nothing about how few steps), inf for a band of zero width."""
    low, high = interval
    if not (low > 0 and math.isfinite(high)):
        return 0.0
    sigma = math.log(high / low) / 4
    return math.inf if sigma <= 0 else 1.0 / sigma**2


def combine(branch: float, branch_interval: tuple[float, float], noise: float,
            noise_interval: tuple[float, float]) -> Combined:
    """The central value is the two estimates' mean in log, each weighted by its precision
    (``log_precision``): the noise scale is the prior, the branches the measurement, and a
    branch ladder too short to tell much (LeNet-5's one point at B_crit 12, 0–168, on a
    1875-step plan) no longer overrides a prior that knows more. The interval is the branches'
    (stretched to hold the central value), or spans both where they disagree."""
    (blo, bhi), (nlo, nhi) = branch_interval, noise_interval
    disagree = bhi < nlo or nhi < blo
    weight = _share(log_precision(branch_interval), log_precision(noise_interval))
    central = branch if weight == 1.0 else noise if weight == 0.0 else \
        math.exp(weight * math.log(branch) + (1 - weight) * math.log(noise))
    interval = (min(blo, nlo), max(bhi, nhi)) if disagree else (blo, bhi)
    interval = (min(interval[0], central), max(interval[1], central))
    return Combined(central, interval, noise, noise_interval, disagree, branch,
                    branch_interval, weight)


def _share(branch: float, noise: float) -> float:
    """The branches' weight from the two precisions: all of it where the noise scale's
    interval says nothing or the branches' is exact, none in the opposite cases."""
    if branch == noise:  # both exact, both silent, or equally precise
        return 0.5 if branch > 0 else 1.0
    if math.isinf(branch) or noise == 0:
        return 1.0
    if math.isinf(noise) or branch == 0:
        return 0.0
    return branch / (branch + noise)


__all__ = ["CAP", "MIN_SPREAD", "MIN_STEPS", "BranchPlan", "Combined", "CriticalPoint",
           "Inconclusive", "TooShort",
           "combine", "examples_ratio", "fit_point", "invert", "log_precision", "measure",
           "plan_branches",
           "trajectories"]
