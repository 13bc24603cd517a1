"""Iterations to the target at batch size B, predicted from a pilot run at B0.

The model (McCandlish et al. 2018, *An Empirical Model of Large-Batch Training*) is SGD on a
local quadratic: with learning rate ε at batch B, one step lowers the loss by

    ΔL(ε, B) = ε‖G‖² − ε²/2 · (GᵀHG + tr(HΣ)/B).

Write x = ε/ε_max with ε_max = ‖G‖²/GᵀHG, and B_noise = tr(HΣ)/GᵀHG, taken as the simple noise
scale n·Δ − 1 (H ∝ I; DESIGN.md). Relative to its best value, the step's progress is

    p(x, B) = 2x − x²·(1 + B_noise/B),   best at x = 1/(1 + B_noise/B), where p = 1/(1 + B_noise/B).

The pilot's rate η0 is taken to be the best one at B0, so x0 = 1/(1 + B_noise/B0). A rule for
the learning rate at B gives η(B) = s(B)·η0, hence x = s(B)·x0, and each pilot step at B0
stands for p(x0, B0)/p(x, B) steps at B. Summed along the pilot, with B_noise(t) interpolated
between the exact measurements, this gives k(B). The strategies (``strategies()``: ``noise`` and
every rule registered in train/lr_rules.py, read when used; ``blr``, ``lsr`` and ``srsr`` are
the trainer's, after warm-up):

- ``noise``: each pilot step stands for (1 + B_noise/B)/(1 + B_noise/B0) steps at B, McCandlish
  et al.'s S(B)/S(B0) with the rate near its best at every step. The rate the rows give is
  s = (1 + B_lo/B0)/(1 + B_lo/B), B_lo the smallest B_noise along the trajectory: the best
  constant rate where B_noise is B_lo (McCandlish's ε_opt), never past the best rate at any
  step (s grows with B_noise for B > B0); with SGD momentum μ, B_lo is taken (1 + μ) times
  over (``lr_scale``). Checked against real runs (benchmarks/advise.py):
  at that constant rate, runs took about as many steps as the tuned-rate relation predicts,
  where the quadratic model's penalty for a constant rate overestimated them by 1.4–2×.
- ``lsr``: s = B/B0 (linear scaling). Progress vanishes for B ≥ 2·B0 + B_noise: there the model
  predicts no convergence (k = ∞, marked), as linear scaling past the noise scale diverges.
- ``srsr``: s = √(B/B0) (square-root scaling); past the model's best rate, as ``lsr``.
- ``blr``: s = 1 (one rate for every batch). A larger batch then saves at most half the
  steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from batchbound.errors import BatchboundError
from batchbound.train.lr_rules import LR_RULES, lr_rule

NOISE = "noise"  # advise's own strategy; the others are train/lr_rules.py's


def strategies() -> tuple[str, ...]:
    """``noise`` and the registered rules, read now (a rule registered after import counts)."""
    return (NOISE, *LR_RULES)


@dataclass(frozen=True)
class Pilot:
    """What the prediction needs from a pilot run at ``batch_size`` (B0) with rate ``lr``:
    the iterations it took to the target, and exact n·Δ at some of its iterations."""

    batch_size: int
    lr: float
    iterations: int
    bound_iterations: tuple[int, ...]  # where n·Δ was measured
    batch_bounds: tuple[float, ...]  # n·Δ there (≥ 1)

    def __post_init__(self) -> None:
        if self.iterations < 1:
            raise BatchboundError(f"the pilot took {self.iterations} iterations; need >= 1")
        if not self.batch_bounds or len(self.batch_bounds) != len(self.bound_iterations):
            raise BatchboundError("the pilot has no exact n·Δ measurement to predict from")
        bad = [b for b in self.batch_bounds if not (math.isfinite(b) and b >= 1 - 1e-9)]
        if bad:
            raise BatchboundError(
                f"the pilot's n·Δ must be finite and >= 1, got {bad[0]!r} (a zero gradient?)")

    def noise_scale(self, iteration: float) -> float:
        """B_noise = n·Δ − 1 at a pilot iteration, linear between measurements and constant
        beyond the first and last."""
        its, bounds = self.bound_iterations, self.batch_bounds
        if iteration <= its[0]:
            return max(bounds[0] - 1.0, 0.0)
        for k in range(1, len(its)):
            (i0, b0), (i1, b1) = (its[k - 1], bounds[k - 1]), (its[k], bounds[k])
            if iteration <= i1:
                w = (iteration - i0) / (i1 - i0) if i1 > i0 else 1.0
                return max(b0 + w * (b1 - b0) - 1.0, 0.0)
        return max(bounds[-1] - 1.0, 0.0)

    def noise_scales(self) -> np.ndarray:
        """B_noise at each pilot step t = 0 .. iterations−1 (read-only), ``noise_scale`` at
        each, computed once: a plan has up to millions of steps, read by every batch's
        prediction (one Python call per step took minutes for the rows of a long plan)."""
        return self._noise_scales

    @cached_property
    def _noise_scales(self) -> np.ndarray:
        t = np.arange(self.iterations, dtype=np.float64)
        its = np.asarray(self.bound_iterations, dtype=np.float64)
        bounds = np.asarray(self.batch_bounds, dtype=np.float64)
        k = np.clip(np.searchsorted(its, t, side="left"), 1, max(len(its) - 1, 1))
        if len(its) == 1:
            values = np.full_like(t, bounds[0] - 1.0)
        else:  # noise_scale's arithmetic, in its order: the same values to the last bit
            i0, i1, b0, b1 = its[k - 1], its[k], bounds[k - 1], bounds[k]
            with np.errstate(divide="ignore", invalid="ignore"):  # i1 = i0 only where
                values = b0 + (t - i0) / (i1 - i0) * (b1 - b0) - 1.0  # replaced below
            values = np.where(t <= its[0], bounds[0] - 1.0, values)
            values = np.where(t > its[-1], bounds[-1] - 1.0, values)
        values = np.maximum(values, 0.0)
        values.flags.writeable = False
        return values

    def lowest_noise_scale(self) -> float:
        return max(min(self.batch_bounds) - 1.0, 0.0)

    def mean_batch_bound(self) -> float:
        """n·Δ averaged over the pilot's steps."""
        return 1.0 + _in_order(self.noise_scales()) / self.iterations


def lr_scale(strategy: str, batch_size: int, pilot: Pilot, momentum: float = 0.0) -> float:
    """s(B): the rate at B is s(B)·η0 (see the module docstring). With heavy-ball momentum μ
    the ``noise`` rule's noise-free limit is (1 + μ) times SGD's: on a quadratic, heavy ball
    is stable for η·λ < 2(1 + μ) where SGD needs η·λ < 2, while where noise limits the rate
    (B ≪ B_noise) momentum moves as SGD at η/(1 − μ) and the rule is unchanged:
    s = (1 + c·B_lo/B0)/(1 + c·B_lo/B), c = 1 + μ (docs/advise.md, "Momentum's rate")."""
    rule = lr_rule(strategy, "strategy", extra=(NOISE,))
    if rule is not None:
        return rule.scale(batch_size / pilot.batch_size)
    low = (1.0 + momentum) * pilot.lowest_noise_scale()
    return (1.0 + low / pilot.batch_size) / (1.0 + low / batch_size)


def steps_per_pilot_step(noise: float, b0: int, batch_size: int, scale: float) -> float:
    """How many steps at ``batch_size`` with rate scale·η0 equal one pilot step at ``b0``,
    when the noise scale is ``noise``; inf when the model predicts no progress."""
    x0 = 1.0 / (1.0 + noise / b0)
    x = scale * x0
    progress = 2.0 * x - x * x * (1.0 + noise / batch_size)
    return x0 / progress if progress > 0 else math.inf


def predict_iterations(pilot: Pilot, batch_size: int, strategy: str = "noise",
                       scale: float | None = None) -> float:
    """k(B): the pilot's steps, each weighted by ``steps_per_pilot_step``; at B = B0 this is
    the pilot's own count. Fractional; inf when some step makes no progress. ``scale``: the
    rate's s(B), when another trajectory than ``pilot`` set it."""
    if batch_size < 1:
        raise BatchboundError(f"batch size must be >= 1, got {batch_size}")
    scale = lr_scale(strategy, batch_size, pilot) if scale is None else scale
    noise = pilot.noise_scales()
    if strategy == "noise":  # the rate near its best at every step: S(B)/S(B0)
        return _in_order((1.0 + noise / batch_size) / (1.0 + noise / pilot.batch_size))
    # steps_per_pilot_step at every step, its arithmetic in its order
    x0 = 1.0 / (1.0 + noise / pilot.batch_size)
    x = scale * x0
    progress = 2.0 * x - x * x * (1.0 + noise / batch_size)
    if not np.all(progress > 0):
        return math.inf
    return _in_order(x0 / progress)


def minimum_iterations(pilot: Pilot) -> float:
    """S_min in steps: k(B) as B → ∞ under the ``noise`` rule, Σ_t 1/(1 + B_noise(t)/B0)."""
    return _in_order(1.0 / (1.0 + pilot.noise_scales() / pilot.batch_size))


def _in_order(values: np.ndarray) -> float:
    """The sum added one value after another, as a loop adds (not numpy's pairwise sum):
    the step-by-step predictions, and those recorded from them, to the last bit."""
    return float(np.add.accumulate(values)[-1]) if values.size else 0.0
