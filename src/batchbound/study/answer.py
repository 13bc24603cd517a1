"""The report's answer: per model, how large the batch can be and how many workers pay, in
one sentence and one small table, with a glossary of every batch number the report uses.

Everything here is read off the analyses (``report.StudyAnalysis``) and the workers table
(``workers.workers_table``); nothing is computed twice.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from batchbound.study import analysis as A
from batchbound.study.claims.registry import fmt

GLOSSARY = (
    ("n·Δ", "the bound on the batch size from gradient diversity Δ over n training examples: "
     "up to B ≈ n·Δ a step of B examples does about B times the work of one", "diversity"),
    ("near-linear up to", "the largest batch up to which every doubling still cuts the "
     "iterations to the target almost in half (local scaling exponent α ≥ 0.8)",
     "inefficiency"),
    ("stagnant from", "the batch from which larger batches no longer cut the iterations "
     "(α < 0.1)", "inefficiency"),
    ("B_crit", "the critical batch size of the fit S(B) = S_min(1 + B_crit/B): the batch "
     "where training needs twice the fewest iterations and twice the fewest examples",
     "mccandlish"),
    ("B*", "the largest batch before epochs to the target grow by more than half over the "
     "best smaller batch", "width"),
    ("largest B within E epochs", "the largest batch that reaches the target within the "
     "epoch budget E", "width"),
    ("loss threshold", "the lower quartile of the training losses recorded at the largest "
     "batch whose runs did not diverge; the iterations to reach it give a second speedup "
     "curve", "inefficiency"),
    ("η", "the step size each cell trained with, tuned by the study's rule", "width"),
    ("diverged", "a run whose loss went non-finite or above 10× its first loss; it counts "
     "as a miss and is left out of the loss threshold and the B_crit fit", ""),
)


def _recommended(workers: pd.DataFrame | None, name: str) -> pd.Series | None:
    if workers is None or workers.empty or "model" not in workers:
        return None
    mine = workers[(workers["model"] == name) & (workers["recommended"] == "←")]
    return mine.iloc[0] if len(mine) else None


def answer_table(a: Any, workers: pd.DataFrame | None) -> pd.DataFrame:
    """One row per model: near-linear up to, stagnant from, B_crit with its 95 % interval
    and flags, n·Δ with how it was measured, the time-optimal workers and batch here, and
    the diverged runs."""
    keys = A.model_keys(a.per_run)
    names = A.display_names(a.per_run)
    how = A.delta_label(a.diversity)
    rows = []
    for _, frame in a.per_run.groupby(keys, sort=True, dropna=False):
        first = frame.iloc[0]
        name = str(names[frame.index[0]])
        match = {k: first[k] for k in keys}
        regime = _row(a.regimes, match)
        crit = _row(a.critical, match)
        div = _row(a.diversity, match)
        rec = _recommended(workers, name)
        rows.append({
            "model": name,
            "first reached": _first_reached(a.speedups, match),
            "near-linear up to": regime["linear_until"] if regime is not None else math.nan,
            "stagnant from": regime["stagnation_from"] if regime is not None else math.nan,
            "B_crit": crit["b_crit"] if crit is not None else math.nan,
            "B_crit 95 %": _interval(crit),
            "n·Δ": div["bound_mean"] if div is not None else math.nan,
            "n·Δ measured": how,
            "workers": rec["workers"] if rec is not None else math.nan,
            "batch": rec["batch"] if rec is not None else math.nan,
            "s to target": rec["s to target"] if rec is not None else math.nan,
            "diverged runs": f"{int(frame['diverged'].sum())} of {len(frame)}",
        })
    return pd.DataFrame(rows)


def _first_reached(speedups: pd.DataFrame, match: dict[str, Any]) -> float:
    """The speedup's m0: the smallest batch whose median run reaches the target."""
    base = _row(speedups[speedups["ideal"] == 1] if len(speedups) else speedups, match)
    return float(base["batch_size"]) if base is not None else math.nan


def _row(table: pd.DataFrame, match: dict[str, Any]) -> pd.Series | None:
    if table is None or table.empty:
        return None
    mask = np.ones(len(table), bool)
    for key, value in match.items():
        if key in table:
            mask &= (table[key].astype(str) == str(value)).to_numpy()
    return table[mask].iloc[0] if mask.any() else None


def _interval(crit: pd.Series | None) -> str:
    if crit is None:
        return "no fit"
    if crit["one_run"]:
        text = "no spread (one run per batch)"
    elif math.isnan(crit["low"]):
        text = "n/a"
    else:
        text = f"{crit['low']:.3g}–{crit['high']:.3g}"
    if crit["outside"]:
        text += f"; {crit['outside']} the batches that reached the target"
    return text


def sentence(row: pd.Series, target: str) -> str:
    """The answer for one model in words."""
    def num(value: float) -> str:
        return fmt(float(value)) if isinstance(value, (int, float)) and math.isfinite(value) \
            else "n/a"

    parts = [f"**{row['model']}**: "]
    linear, first = row["near-linear up to"], row["first reached"]
    if not math.isfinite(linear):
        parts.append(f"no batch size reaches {target}")
    elif linear > first:
        parts.append(f"to {target}, speedup stays near-linear from B = {num(first)} up to "
                     f"B = {num(linear)}")
    else:
        parts.append(f"to {target}, no doubling past B = {num(first)} (the smallest batch that "
                     "reaches it) is near-linear")
    if math.isfinite(row["B_crit"]):
        parts.append(f"; the critical batch size is {num(row['B_crit'])} "
                     f"({row['B_crit 95 %']})")
    if math.isfinite(row["n·Δ"]):
        parts.append(f"; n·Δ is {num(row['n·Δ'])} ({row['n·Δ measured']})")
    if math.isfinite(row["workers"]):
        workers = int(row["workers"])
        parts.append(f"; on this machine {workers} worker{'s' if workers > 1 else ''} at "
                     f"B = {int(row['batch'])} {'reach' if workers > 1 else 'reaches'} it "
                     f"fastest ({num(row['s to target'])} s)")
    return "".join(parts) + f". Diverged runs: {row['diverged runs']}."
