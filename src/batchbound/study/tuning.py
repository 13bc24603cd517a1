"""Step-size tuning rules: pure functions over a table of tuning-run summaries.

The summary table has one row per tuning run with columns ``cell`` (what η is chosen for),
``lr``, ``seed``, ``status``, ``final_loss`` (last evaluated training loss; ∞ for a diverged
run) and ``iterations`` (iterations to the first target; NaN when not reached).

- ``lowest_loss_2_epochs`` ([width]): the η with the lowest training loss after the short
  tuning runs, averaged over tuning seeds.
- ``fewest_steps`` (Shallue et al.): the η whose runs reach the target in the fewest
  iterations (median over tuning seeds; a miss counts as ∞). If no η reaches it, the lowest
  final loss decides. Ties go to the smaller η, the stabler choice.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from batchbound.errors import BatchboundError


def final_loss(curves: pd.DataFrame, status: str) -> float:
    """Last evaluated training loss of one run's curves; ∞ if it diverged or never evaluated."""
    if status == "diverged":
        return math.inf
    losses = curves[curves["metric"] == "train_loss"]
    if losses.empty:
        return math.inf
    value = losses.sort_values("iteration")["value"].iloc[-1]
    return math.inf if value is None or not np.isfinite(value) else float(value)


def choose_step_sizes(summary: pd.DataFrame, rule: str) -> dict[Any, float]:
    """The chosen η per cell under ``rule``."""
    if summary.empty:
        return {}
    chosen = {}
    for cell, rows in summary.groupby("cell", sort=False):
        per_lr = rows.groupby("lr").agg(
            loss=("final_loss", lambda v: float(np.mean(np.asarray(v, dtype=float)))),
            steps=("iterations", lambda v: float(np.median(
                np.where(np.isnan(np.asarray(v, dtype=float)), np.inf, v)))),
        ).reset_index()
        if rule == "lowest_loss_2_epochs":
            order = per_lr.sort_values(["loss", "lr"], kind="stable")
        elif rule == "fewest_steps":
            order = per_lr.sort_values(["steps", "loss", "lr"], kind="stable")
        else:
            raise BatchboundError(f"unknown tuning rule {rule!r}")
        chosen[cell] = float(order["lr"].iloc[0])
    return chosen
