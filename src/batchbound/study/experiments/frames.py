"""Small readers the experiments share: the transform in a data label, the final runs with
their recorded end-of-training values, and curves resampled on a common grid of passes."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from batchbound.spec import Spec, parse_spec
from batchbound.study.analysis import COLLAPSED

if TYPE_CHECKING:  # the bundle's module imports this one
    from batchbound.study.summary import StudyAnalysis


def transform_of(data_label: str) -> Spec | None:
    """``"digits | replicate(r=2)"`` → Spec('replicate', {'r': 2}); a plain data set → None."""
    _, bar, transform = str(data_label).partition(" | ")
    return parse_spec(transform) if bar else None


def finals(a: StudyAnalysis) -> pd.DataFrame:
    """Final runs that finished (complete, diverged or collapsed), with their ``final``
    values as columns prefixed ``final_`` (test_acc, osg_mean, linear_error, …)."""
    runs = a.frames["runs"]
    runs = runs[(runs["role"] == "final")
                & runs["status"].isin(["complete", "diverged", COLLAPSED])]
    values = [json.loads(text) if isinstance(text, str) and text else {}
              for text in runs["final_json"]]
    extra = pd.DataFrame(values, index=runs.index).add_prefix("final_")
    return pd.concat([runs, extra.apply(pd.to_numeric, errors="coerce")], axis=1)


def curve_on_grid(a: StudyAnalysis, keys: pd.Series, metric: str, grid: np.ndarray) -> pd.DataFrame:
    """One row per run key, one column per pass in ``grid``: ``metric`` interpolated
    linearly in epochs between evaluations; NaN past the run's last evaluation."""
    curves = a.frames["curves"]
    curves = curves[(curves["metric"] == metric) & curves["key"].isin(set(keys))]
    rows = {}
    for key, part in curves.groupby("key"):
        part = part.sort_values("epoch")
        x, y = part["epoch"].to_numpy(float), part["value"].to_numpy(float)
        rows[key] = np.where(grid <= x.max(), np.interp(grid, x, y), np.nan)
    return pd.DataFrame.from_dict(rows, orient="index", columns=grid)
