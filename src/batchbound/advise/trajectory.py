"""The noise scale along the planned run: measured over a short pilot, extrapolated past it.

The pilot trains the first fraction of the plan at B0 and, at every step, folds the cheap
estimate the step already has (two-batch from micro-batches, or per-example norms) into raw
pairs (M2, C) (``batchbound.diversity.online``). Here:

1. **Segments.** The pilot's steps are cut into a few segments of ≥ 20 steps; each gives
   B_noise = n·Δ − 1 as the ratio of its mean M2 to its mean ‖G‖² (McCandlish et al.'s
   ratio of averages) with a delta-method standard error, and the mean batch loss.
2. **The trend** (McCandlish et al.: B_noise ≈ tr(Σ)/‖G‖², and ‖G‖² falls with the loss, so
   B_noise·L stays roughly constant while the loss falls; Merrill et al. 2025: the critical
   batch rises, then plateaus). κ = B_noise·L is averaged over the pilot's later segments
   (the first is the initialisation's transient), the loss is fitted as a power law
   L(t) ∝ t^(−p) over them (0 ≤ p ≤ 1), and past the pilot

   - central: B_noise(t) = κ(t) / L(t), the loss continuing on its fitted power law and κ
     on its own trend over the segments after the first, κ(t) ∝ t^r (a least-squares fit of
     log κ on log t over at least two of them, else r = 0; r clipped to [0, 1 − p]). A rise
     within one standard error of none (the segments' own errors carried through the fit)
     is not used: κ stays constant, the simpler model the pilot cannot tell apart (the
     one-standard-error rule of model selection).
     McCandlish et al.'s κ is constant; on language models it grows while the loss falls
     slowly (the critical batch rising well past B_noise·L, Merrill et al. 2025), and the
     pilot sees the start of that rise. A falling κ is read as
     the start's transient (the critical batch does not fall as training goes on: r ≥ 0),
     and B_noise grows no faster than the high trajectory's t (r ≤ 1 − p);
   - low (the most steps at a large batch): κ − 2·SE at the pilot's last loss, constant (the
     noise scale plateaus where the pilot ended);
   - high (the fewest steps): κ + 2·SE, growing in proportion to t (the loss falling as fast
     as 1/t, the fastest this trend allows).

   Over the pilot itself, low and high shift the measured segments by ∓ 2 standard errors of
   their common level (the segments' errors combined).
3. Each trajectory is a ``Pilot`` over the planned iterations; ``iterations.py`` turns it into
   k(B), so the central trajectory gives the prediction and the other two its interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from batchbound.advise.iterations import Pilot
from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError

MIN_SEGMENT_STEPS = 20
MAX_SEGMENTS = 10
EXTRAPOLATED_POINTS = 24  # where B_noise is set past the pilot (geometric in t)


@dataclass(frozen=True)
class Step:
    """One pilot step: its iteration (1-based), batch loss, and raw M2 and C estimates."""

    iteration: int
    loss: float
    m2: float
    cross: float


@dataclass(frozen=True)
class Segment:
    start: int  # first iteration (1-based) in the segment
    end: int  # last
    noise: float  # B_noise = n·Δ − 1
    se: float
    loss: float  # mean batch loss

    @property
    def middle(self) -> float:
        return (self.start + self.end) / 2


def segments(steps: Sequence[Step], n: int, sampling: str = "without_replacement"
             ) -> list[Segment]:
    """Cut the pilot's steps into segments of ≥ MIN_SEGMENT_STEPS; a segment whose mean ‖G‖²
    is not positive (all noise) is merged into the next. BatchboundError when even the
    whole pilot cannot tell the gradient from its noise."""
    if len(steps) < MIN_SEGMENT_STEPS:
        raise BatchboundError(f"the pilot has {len(steps)} estimated steps; need at least "
                              f"{MIN_SEGMENT_STEPS}: raise --pilot-fraction")
    count = max(1, min(MAX_SEGMENTS, len(steps) // MIN_SEGMENT_STEPS))
    edges = np.linspace(0, len(steps), count + 1).astype(int)
    out: list[Segment] = []
    pending: list[Step] = []
    for a, b in pairwise(edges):
        pending += steps[a:b]
        made = segments_of(pending, n, sampling)
        if made:
            out += made
            pending = []
    if pending and out:  # a noisy tail joins the last good segment
        last = out.pop()
        merged = [s for s in steps if s.iteration >= last.start]
        out += segments_of(merged, n, sampling) or [last]
    if not out:
        raise BatchboundError(
            f"over the pilot's {len(steps)} steps the gradient's signal was below its noise "
            "(the estimated ‖G‖² is not positive): B_noise cannot be estimated; raise "
            "--pilot-fraction or the pilot's batch (--batch-size), or use --estimator norms "
            "(per-example norms: the Euclidean noise scale, also under Adam)")
    return out


def segments_of(steps: Sequence[Step], n: int, sampling: str) -> list[Segment]:
    """One segment over all of ``steps`` (its ‖G‖² may still be non-positive: then none)."""
    estimate = OnlineDiversity(n, decay=None, sampling=sampling)
    for step in steps:
        estimate.update(step.m2, step.cross)
    if not (math.isfinite(estimate.batch_bound) and estimate.gradient_sq_norm > 0):
        return []
    return [Segment(steps[0].iteration, steps[-1].iteration, max(estimate.noise_scale, 0.0),
                    estimate.batch_bound_se, float(np.mean([s.loss for s in steps])))]


@dataclass(frozen=True)
class Trajectory:
    """B_noise along the planned run: ``central`` predicts, ``low`` and ``high`` bound."""

    central: Pilot
    low: Pilot
    high: Pilot
    segments: tuple[Segment, ...]
    kappa: float  # B_noise·L over the pilot's later segments
    kappa_se: float
    loss_exponent: float  # p in L(t) ∝ t^(−p)
    kappa_growth: float  # r in κ(t) ∝ t^r past the pilot, in [0, 1 − p]
    final_loss: tuple[float, float, float]  # extrapolated loss at the plan's end: central, lo, hi
    assumption: str
    lag: float = 0.0  # steps the optimiser took to build up its steady step (step_lag)
    kappa_trend: tuple[float, float] = (0.0, 0.0)  # r as fitted over the pilot, its SE


def extrapolate(segs: Sequence[Segment], pilot_iterations: int, planned_iterations: int,
                batch_size: int, lr: float, lag: float = 0.0) -> Trajectory:
    """The three trajectories over ``planned_iterations`` (see the module docstring).
    ``lag``: the steps by which the optimiser's summed step trails its steady step from the
    start (``train.optimizers.step_lag``: μ/(1 − μ) for SGD's heavy ball, 0 for plain SGD
    and Adam); the loss trend and the growth past the pilot run on t − lag, the time the
    optimiser has actually been moving at its steady rate."""
    later = list(segs[1:]) if len(segs) > 2 else list(segs)
    below = next((s for s in later if not s.loss > 0), None)
    if below is not None and planned_iterations > pilot_iterations:
        # κ = B_noise·L takes ‖G‖² to fall with a loss whose minimum is 0: at L ≤ 0 its sign
        # flips (low and high trade places) and near 0 B_noise = κ/L runs off
        raise BatchboundError(
            f"the pilot's mean batch loss over steps {below.start}–{below.end} was "
            f"{below.loss:.4g}, not above 0: the noise scale is extrapolated past the pilot as "
            "B_noise·L ≈ κ (McCandlish et al.: ‖G‖² falls with a loss whose minimum is 0), "
            "which such a loss does not follow; shift the loss to a minimum of 0, or give a "
            "target instead of a plan (the pilot then runs to it: nothing is extrapolated)")
    products = np.array([s.noise * s.loss for s in later])
    errors = np.array([max(s.se, 1e-12) * s.loss for s in later])
    weights = 1.0 / errors**2
    kappa = float(np.sum(weights * products) / np.sum(weights))
    spread = float(np.std(products, ddof=1) / math.sqrt(len(products))) if len(later) > 1 else 0
    kappa_se = max(math.sqrt(1.0 / float(np.sum(weights))), spread)
    exponent, loss_end = _loss_trend(later, pilot_iterations, lag)
    fitted, fitted_se = _kappa_trend(segs[1:], lag)
    growth = min(fitted, max(1.0 - exponent, 0.0)) if fitted > fitted_se else 0.0
    tp, k = pilot_iterations, planned_iterations

    def moved(t: float) -> float:  # (t − lag)/(tp − lag): the growth past the pilot
        return _moving(t, lag) / _moving(tp, lag)
    measured_its = [round(s.middle) for s in segs]
    grid = _grid(tp, k)
    base = kappa / loss_end

    def pilot(measured: list[float], beyond: list[float]) -> Pilot:
        its = measured_its + grid
        bounds = [1.0 + max(b, 0.0) for b in measured + beyond]
        return Pilot(batch_size, lr, k, tuple(its), tuple(bounds))

    shift = _level_error(segs)
    central = pilot([s.noise for s in segs],
                    [base * moved(t) ** (exponent + growth) for t in grid])
    low = pilot([s.noise * (1 - 2 * shift) for s in segs],
                [(kappa - 2 * kappa_se) / loss_end for _ in grid])
    high = pilot([s.noise * (1 + 2 * shift) for s in segs],
                 [(kappa + 2 * kappa_se) / loss_end * moved(t) for t in grid])
    ratio = moved(k)
    final = (loss_end * ratio ** -exponent, loss_end / ratio, loss_end)
    assumption = (
        f"B_noise measured over the pilot's {tp} steps ("
        + (f"{len(segs)} segments, ± two standard errors of their level" if len(segs) > 1
           else "one segment, ± two standard errors of its level")
        + f") and extrapolated to the plan's {k} as B_noise·L ≈ κ = "
        f"{kappa:.3g} ± "
        f"{kappa_se:.2g} (McCandlish et al.) with the training loss continuing its pilot "
        f"trend L ∝ t^−{exponent:.2f}"
        + (f" and κ its rise over the pilot, κ ∝ t^{growth:.2f} (fitted {fitted:.2f} ± "
           f"{fitted_se:.2f}; the critical batch growing as on language models, Merrill et al. "
           f"2025)" if growth > 0 else "")
        + (f" (κ's rise over the pilot, t^{fitted:.2f} ± {fitted_se:.2f}, is within one "
           f"standard error of none: κ held constant)" if 0 < fitted <= fitted_se else "")
        + (f" (t counted from {lag:.3g} steps in: the optimiser's momentum builds up its "
           f"steady step over the first steps)" if lag > 0 else "")
        + "; the interval runs from B_noise staying where the "
        "pilot ended (a plateau, Merrill et al. 2025) to B_noise growing in proportion to "
        "t (the loss falling as 1/t)" if k > tp else
        f"B_noise measured over the whole run to the target ({k} steps, {len(segs)} segments, "
        f"± two standard errors of their level)")
    return Trajectory(central, low, high, tuple(segs), kappa, kappa_se, exponent, growth,
                      final, assumption, lag, (fitted, fitted_se))


def _level_error(segs: Sequence[Segment]) -> float:
    """The relative standard error of the pilot's noise scale as one level: the segments'
    errors combined as independent, relative to their mean (capped at 1/2, so that the low
    trajectory stays positive)."""
    mean = float(np.mean([s.noise for s in segs]))
    if mean <= 0:
        return 0.5
    error = math.sqrt(sum(s.se**2 for s in segs)) / len(segs)
    return min(error / mean, 0.5)


def _loss_trend(later: Sequence[Segment], pilot_iterations: int, lag: float = 0.0
                ) -> tuple[float, float]:
    """(p, L at the pilot's end) from a least-squares fit of log L on log(t − lag);
    p in [0, 1]."""
    t = np.array([_moving(s.middle, lag) for s in later], dtype=float)
    loss = np.array([s.loss for s in later], dtype=float)
    if len(later) < 2 or np.any(loss <= 0) or np.ptp(t) == 0:  # no spread in time (all
        return 0.0, float(loss[-1])  # within the optimiser's lag): no trend to fit
    slope, intercept = np.polyfit(np.log(t), np.log(loss), 1)
    exponent = float(min(max(-slope, 0.0), 1.0))
    end = float(math.exp(intercept + slope * math.log(_moving(pilot_iterations, lag)))) \
        if exponent > 0 else float(loss[-1])
    return exponent, end


def _kappa_trend(after_first: Sequence[Segment], lag: float) -> tuple[float, float]:
    """(r, its standard error) in κ ∝ (t − lag)^r from a least-squares fit of log(B_noise·L)
    on log(t − lag) over the segments after the first, each counted once (their standard
    errors grow with their values, so weighting by them would favour the lowest); the
    standard error carries each segment's relative error of B_noise through the fit. (0, 0)
    with fewer than two such segments (a rise out of the first segment is the start's
    transient, not a trend: on a held-out LSTM it read r = 0.9 from two segments and
    over-read the gain ×1.5) or a zero noise scale."""
    products = [s.noise * s.loss for s in after_first]
    if len(after_first) < 2 or min(products) <= 0:
        return 0.0, 0.0
    t = np.log([_moving(s.middle, lag) for s in after_first])
    centred = t - t.mean()
    spread = float(np.sum(centred**2))
    if spread == 0:  # every segment within the optimiser's lag: one time, no trend
        return 0.0, 0.0
    slope = float(np.sum(centred * np.log(products)) / spread)
    relative = np.array([s.se / s.noise for s in after_first])
    return slope, float(math.sqrt(np.sum(centred**2 * relative**2)) / spread)


def _moving(t: float, lag: float) -> float:
    """Steps at the optimiser's steady rate by step t (at least one)."""
    return max(t - lag, 1.0)


def _grid(pilot_iterations: int, planned_iterations: int) -> list[int]:
    """Iterations past the pilot where the extrapolated B_noise is set (geometric)."""
    if planned_iterations <= pilot_iterations:
        return []
    points = np.geomspace(pilot_iterations, planned_iterations, EXTRAPOLATED_POINTS + 1)[1:]
    return sorted({max(pilot_iterations + 1, round(p)) for p in points})
