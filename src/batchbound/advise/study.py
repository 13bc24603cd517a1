"""What ``advise --from-study`` takes from a study: measured iterations and step times.

The study hands them over as plain data (``batchbound.study.measured``; advise never reads a
store), turned here into the prediction. For one model (and one learning-rate strategy):

- **k(B)**: the median over seeds of the iterations to the study's first target at each grid
  batch (∞ when the median run missed it). Between grid points, McCandlish et al.'s
  S(B) = S_min(1 + B_crit/B) fitted to the model's reached runs (``analysis.critical_batch``)
  interpolates: k(B) = S(B)·r(B), with r = measured/fitted at the two neighbouring grid
  points, interpolated linearly in log B, so k passes through every measurement. Without a
  fit (fewer than 3 batch sizes reached), k is interpolated linearly in log–log. Nothing is
  extrapolated: outside the grid, or between a batch that missed and its neighbour, k is ∞
  and the batch is never advised.
- **The learning rate at B**: the rate the study's final runs used at each grid batch (tuned,
  or carried by the strategy), geometric between grid points.
- **The step**: one worker's recorded seconds per iteration (data, compute, optimiser step),
  median per micro-batch over the model's final runs. The runs record no forward alone, so
  overlap assumes it is a third of the step.
- Collapsed runs (``study.analysis.mark_collapsed``) count as misses and stay out of the fit.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

from batchbound.advise.timing import ComputeCurve


@dataclass(frozen=True)
class MeasuredIterations:
    batches: tuple[int, ...]
    iterations: tuple[float, ...]  # median over seeds; inf: the median run missed
    lrs: tuple[float, ...]
    b_crit: float  # NaN without a fit
    s_min: float

    def fitted(self, batch: float) -> float:
        return self.s_min * (1.0 + self.b_crit / batch)

    def at(self, batch: int) -> float:
        """k(B); ∞ outside the grid or next to a missed grid batch (see the module doc)."""
        bs, ks = self.batches, self.iterations
        if batch < bs[0] or batch > bs[-1]:
            return math.inf
        i = bisect.bisect_left(bs, batch)
        if bs[i] == batch:
            return ks[i]
        (b0, k0), (b1, k1) = (bs[i - 1], ks[i - 1]), (bs[i], ks[i])
        if not (math.isfinite(k0) and math.isfinite(k1)):
            return math.inf
        w = math.log(batch / b0) / math.log(b1 / b0)
        if math.isfinite(self.b_crit):
            r0, r1 = k0 / self.fitted(b0), k1 / self.fitted(b1)
            return self.fitted(batch) * r0 ** (1 - w) * r1**w
        return k0 ** (1 - w) * k1**w

    def lr(self, batch: int) -> float:
        bs, lrs = self.batches, self.lrs
        i = min(max(bisect.bisect_left(bs, batch), 1), len(bs) - 1)
        if batch <= bs[0] or len(bs) == 1:
            return lrs[0]
        if batch >= bs[-1]:
            return lrs[-1]
        w = math.log(batch / bs[i - 1]) / math.log(bs[i] / bs[i - 1])
        return lrs[i - 1] ** (1 - w) * lrs[i] ** w


@dataclass(frozen=True)
class StudySource:
    """One model of a study, as advise needs it."""

    study: str
    model: str  # the display name
    strategy: str | None
    target: str
    n: int
    iterations: MeasuredIterations
    step: ComputeCurve  # one worker, from the runs' recorded timings
    batch_bound: float  # n·Δ averaged over the reference runs (NaN when never measured)
    config: dict[str, Any]  # a final run's train config: to time P local workers

    @classmethod
    def from_input(cls, data: dict[str, Any]) -> StudySource:
        """From ``batchbound.study.measured.advice_input``'s plain dict."""
        def number(value: float | None) -> float:
            return math.nan if value is None else float(value)

        iterations = MeasuredIterations(
            tuple(data["batches"]), tuple(math.inf if k is None else float(k)
                                          for k in data["iterations"]),
            tuple(data["lrs"]), number(data["b_crit"]), number(data["s_min"]))
        steps = tuple(data["step_seconds"])
        step = ComputeCurve(tuple(data["step_sizes"]), steps, tuple(t / 3 for t in steps))
        return cls(study=data["study"], model=data["model"], strategy=data["strategy"],
                   target=data["target"], n=int(data["n"]), iterations=iterations, step=step,
                   batch_bound=number(data["batch_bound"]), config=dict(data["config"]))

    def describe(self) -> dict[str, Any]:
        it = self.iterations
        return {"name": self.study, "model": self.model, "strategy": self.strategy,
                "target": self.target, "grid": list(it.batches),
                "iterations": [k if math.isfinite(k) else None for k in it.iterations],
                "b_crit": it.b_crit if math.isfinite(it.b_crit) else None}
