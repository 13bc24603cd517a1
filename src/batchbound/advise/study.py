"""What ``advise --from-study`` reads from a study: measured iterations and step times.

For one model (and one learning-rate strategy) of the study:

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
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from batchbound.advise.timing import ComputeCurve
from batchbound.errors import BatchboundError

STEP_PHASES = ("data_per_iteration", "compute_per_iteration", "step_per_iteration")


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

    def describe(self) -> dict[str, Any]:
        it = self.iterations
        return {"name": self.study, "model": self.model, "strategy": self.strategy,
                "target": self.target, "grid": list(it.batches),
                "iterations": [k if math.isfinite(k) else None for k in it.iterations],
                "b_crit": it.b_crit if math.isfinite(it.b_crit) else None}


def load_study_source(store_path: str | Path, study: str | None = None,
                      model: str | None = None, strategy: str | None = None) -> StudySource:
    """Read ``model`` (a display name such as ``L=2 K=30``; needed when the study has
    several) of ``study`` (needed when the store holds several) from the store."""
    from batchbound.study import analysis as A
    from batchbound.study.store import Store

    if not Path(store_path).is_file():
        raise BatchboundError(f"study store {store_path} does not exist")
    with Store(store_path, readonly=True) as store:
        names = store.studies()
        if study is None:
            if len(names) != 1:
                raise BatchboundError(f"{store_path} holds studies {names}; name one (--study)")
            study = names[0]
        frames = store.frames(study)
    runs = A.short_strategies(frames["runs"])
    per_run = A.per_run_to_target(runs, frames["targets"])
    done = per_run[per_run["status"].isin(["complete", "diverged"])]
    if done.empty:
        raise BatchboundError(f"study {study!r} has no finished final runs to advise from")
    if "strategy" in done and done["strategy"].nunique() > 1:
        options = sorted(done["strategy"].unique())
        if strategy is None:
            raise BatchboundError(f"study {study!r} ran strategies {options}; name one "
                                  "(--strategy)")
        if strategy not in options:
            raise BatchboundError(f"study {study!r} has no strategy {strategy!r}; it ran "
                                  f"{options}")
        done = done[done["strategy"] == strategy]
    names = A.display_names(done, [k for k in A.model_keys(done) if k != "strategy"])
    labels = sorted(names.unique())
    if model is None and len(labels) > 1:
        raise BatchboundError(f"study {study!r} has models {labels}; name one (--study-model)")
    chosen = model if model is not None else labels[0]
    if chosen not in labels:
        raise BatchboundError(f"study {study!r} has no model {chosen!r}; models: {labels}")
    mine = done[names == chosen]

    summary = A.summarize_to_target(mine, "iterations").sort_values("batch_size")
    lrs = mine.groupby("batch_size")["lr"].median()
    fit = A.critical_batch(mine, by=[], bootstrap=0) if len(mine) else pd.DataFrame()
    b_crit, s_min = math.nan, math.nan
    if len(fit) and not fit["at_bound"].iloc[0]:
        b_crit = float(fit["b_crit"].iloc[0])
        # S_min for this model alone (the joint fit's per-model S_min is not kept)
        reached = mine[np.isfinite(mine["iterations"])]
        s_min = float(np.median(reached["iterations"] / (1 + b_crit / reached["batch_size"])))
    iterations = MeasuredIterations(
        tuple(int(b) for b in summary["batch_size"]), tuple(float(k) for k in summary["median"]),
        tuple(float(lrs[b]) for b in summary["batch_size"]), b_crit, s_min)
    if not any(math.isfinite(k) for k in iterations.iterations):
        raise BatchboundError(f"no batch size of {chosen!r} reached the target in {study!r}")

    configs = {k: json.loads(c) for k, c in zip(mine["key"], mine["config_json"], strict=True)}
    timings = frames["timings"][frames["timings"]["key"].isin(configs)]
    step = _recorded_step(timings, configs)
    diversity = A.diversity_summary(runs[runs["key"].isin(configs)], frames["diversity"],
                                    frames["curves"])
    bound = float(diversity["bound_mean"].iloc[0]) if len(diversity) else math.nan
    first = next(iter(configs.values()))
    return StudySource(study=study, model=chosen, strategy=strategy if strategy else (
        str(mine["strategy"].iloc[0]) if "strategy" in mine else None),
        target=str(per_run["target"].iloc[0]), n=int(mine["n_train"].iloc[0]),
        iterations=iterations, step=step, batch_bound=bound, config=first)


def _recorded_step(timings: pd.DataFrame, configs: dict[str, dict[str, Any]]) -> ComputeCurve:
    by_micro: dict[int, list[float]] = {}
    wide = timings[timings["name"].isin(STEP_PHASES)].pivot_table(
        index="key", columns="name", values="seconds")
    for key, row in wide.iterrows():
        if row.isna().any() or len(row) < len(STEP_PHASES):
            continue
        config = configs[str(key)]
        micro = math.ceil(config["batch_size"] / config.get("workers", 1))
        by_micro.setdefault(micro, []).append(float(row.sum()))
    if not by_micro:
        raise BatchboundError("the study's runs recorded no step times (timings); rerun them "
                              "with this version of batchbound")
    sizes = sorted(by_micro)
    steps = tuple(statistics.median(by_micro[m]) for m in sizes)
    return ComputeCurve(tuple(sizes), steps, tuple(s / 3 for s in steps))
