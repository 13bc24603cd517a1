"""The statistics behind the report's verdicts: a bootstrap over runs, and exact permutation
tests for rank correlations.

A draw resamples the final runs with replacement within each (model, batch size) cell, the
unit the study repeats over random seeds. Every per-model quantity (the median epochs and
iterations per cell, and from them B*, the largest batch within E epochs, the scaling
exponents α; the mean Δ over the reference batch's runs) is recomputed from the draw, by the
same functions the tables use. Row 0 of every array is the data itself; rows 1… are draws.
Intervals are the 2.5th and 97.5th percentiles of the draws, taken without interpolation
(``inverted_cdf``) so that a miss (+∞) never turns into NaN.

With one run per cell every draw equals the data: the interval has no spread, and a verdict
resting on it says so instead of claiming support.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from batchbound.spec import parse_spec
from batchbound.study import analysis as A

DRAWS = 400
LEVEL = 0.95
LABELS = ("model_label", "depth", "width", "params", "strategy", "data", "mechanism",
          "n_train")


@dataclass(frozen=True)
class Model:
    """One model's cells: its labels, its batch sizes (ascending), and per draw the
    median epochs and iterations of every cell (shape (1 + draws, cells)) and the mean Δ of
    its reference-batch runs (shape (1 + draws,), NaN when not measured)."""

    name: str
    labels: dict[str, object]
    batches: np.ndarray
    epochs: np.ndarray
    iterations: np.ndarray
    delta: np.ndarray


def _medians(values: np.ndarray, draws: int, rng: np.random.Generator) -> np.ndarray:
    """The cell's median in the data (row 0) and in each draw of its runs."""
    picks = rng.integers(0, len(values), size=(draws, len(values)))
    return np.concatenate([[np.median(values)], np.median(values[picks], axis=1)])


def own_stream(*values: np.ndarray) -> np.random.Generator:
    """A generator seeded by the values themselves: the same cell always gets the same draws,
    and two cells get independent ones. One fixed seed for every cell resampled each cell
    at the same positions, which coupled the cells' draws and made an interval across them
    (a rank correlation over r) look far narrower than it is."""
    # little-endian float64 with −0 as 0, so equal numbers give equal streams everywhere
    digest = zlib.crc32(b"".join((np.asarray(v, "<f8") + 0.0).tobytes() for v in values))
    return np.random.default_rng([0, digest])


def bootstrap_units(units: list[np.ndarray],
                    statistic: Callable[[np.ndarray], float] = np.mean, draws: int = DRAWS,
                    rng: np.random.Generator | None = None) -> np.ndarray:
    """``statistic`` of the pooled values (row 0) and of each bootstrap draw (NaN when empty),
    for values that come in dependent groups (the two runs of a pair): each draw resamples
    whole units, so the interval rests on the number of units, not of values."""
    units = [np.asarray(u, float) for u in units if len(u)]
    rng = rng if rng is not None else own_stream(*units)
    if not units:
        return np.full(draws + 1, math.nan)
    picks = rng.integers(0, len(units), size=(draws, len(units)))
    return np.array([statistic(np.concatenate(units)),
                     *[statistic(np.concatenate([units[i] for i in p])) for p in picks]])


def means(values: np.ndarray, draws: int = DRAWS, rng: np.random.Generator | None = None
          ) -> np.ndarray:
    """The mean (row 0) and its value in each bootstrap draw of the values, vectorised."""
    values = np.asarray(values, float)
    rng = rng if rng is not None else own_stream(values)
    if not len(values):
        return np.full(draws + 1, math.nan)
    picks = rng.integers(0, len(values), size=(draws, len(values)))
    return np.concatenate([[values.mean()], values[picks].mean(axis=1)])


class Evidence:
    """Bootstrap draws of every model in a study (``per_run`` from
    ``analysis.per_run_to_target``; ``delta_runs`` from ``analysis.diversity_runs`` with the
    column ``delta`` chosen by the caller)."""

    def __init__(self, per_run: pd.DataFrame, delta_runs: pd.DataFrame | None = None,
                 draws: int = DRAWS, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.draws = draws
        keys = [*A.model_keys(per_run), *[c for c in A.SHAPE_COLUMNS if c in per_run]]
        names = A.display_names(per_run)
        deltas = delta_runs if delta_runs is not None and len(delta_runs) else None
        self.models: list[Model] = []
        self.cell_sizes: list[int] = []
        for _, frame in per_run.groupby(keys, sort=True, dropna=False):
            cells = frame.groupby("batch_size", sort=True)
            batches = np.array([b for b, _ in cells], float)
            epochs = np.stack([_medians(c["epochs"].to_numpy(float), draws, rng)
                               for _, c in cells], axis=1)
            iterations = np.stack([_medians(c["iterations"].to_numpy(float), draws, rng)
                                   for _, c in cells], axis=1)
            self.cell_sizes += [len(c) for _, c in cells]
            delta = np.full(draws + 1, math.nan)
            if deltas is not None:
                mine = deltas[deltas["key"].isin(frame["key"].unique())]
                delta = means(mine["delta"].dropna().to_numpy(float), draws, rng)
            first = frame.iloc[0]
            labels = {k: first[k] for k in LABELS if k in frame}
            if "model" in frame:
                labels["family"] = parse_spec(str(first["model"])).name
            self.models.append(Model(
                str(names[frame.index[0]]), labels,
                batches, epochs, iterations, delta))

    @property
    def one_run(self) -> bool:
        """Every cell holds one run: the draws have no spread."""
        return max(self.cell_sizes, default=1) == 1

    def varies(self, label: str) -> int:
        """How many distinct values of ``label`` the models take."""
        return len({m.labels.get(label) for m in self.models if label in m.labels})

    def per_model(self, statistic: Callable[[Model, int], float]) -> dict[str, np.ndarray]:
        """``statistic(model, row)`` for every row (data, then draws), per model."""
        return {m.name: np.array([statistic(m, r) for r in range(self.draws + 1)])
                for m in self.models}


def interval(values: np.ndarray) -> tuple[float, float]:
    """The 95 % percentile interval of the draws (row 0, the data, left out)."""
    draws = np.asarray(values, float)[1:]
    draws = draws[~np.isnan(draws)]
    if not len(draws):
        return math.nan, math.nan
    tail = (1 - LEVEL) / 2
    low, high = np.quantile(draws, [tail, 1 - tail], method="inverted_cdf")
    return float(low), float(high)


def rank_correlation(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's ρ with misses (+∞) ranked last; 0 when either side does not vary (no
    evidence either way), NaN with fewer than 3 pairs."""
    a, b = np.asarray(x, float), np.asarray(y, float)
    ok = ~(np.isnan(a) | np.isnan(b))
    if ok.sum() < 3:
        return math.nan
    ra, rb = pd.Series(a[ok]).rank().to_numpy(), pd.Series(b[ok]).rank().to_numpy()
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def permutation_p(x: Sequence[float], y: Sequence[float], sign: int) -> float:
    """One-sided p-value of ρ(x, y) in the direction ``sign``: the share of the orderings
    of y (all of them up to 8 points, exact; else 20 000 drawn) whose ρ is at least as
    extreme as the data's."""
    a, b = np.asarray(x, float), np.asarray(y, float)
    ok = ~(np.isnan(a) | np.isnan(b))
    a, b = a[ok], b[ok]
    observed = sign * rank_correlation(a, b)
    if math.isnan(observed):
        return math.nan
    if len(b) <= 8:
        orders: object = itertools.permutations(range(len(b)))
    else:
        rng = np.random.default_rng(0)
        orders = (rng.permutation(len(b)) for _ in range(20_000))
    hits = total = 0
    for order in orders:
        total += 1
        hits += sign * rank_correlation(a, b[list(order)]) >= observed - 1e-12
    return hits / total
