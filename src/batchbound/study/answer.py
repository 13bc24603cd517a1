"""The report's answer: per model, how large the batch can be and how many workers pay, in
one sentence and one small table, with a glossary of every batch number the report uses.

Everything here is read off the analyses (``summary.StudyAnalysis``) and the workers table
(``workers.workers_table``); nothing is computed twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from batchbound.study import analysis as A
from batchbound.study.claims.registry import fmt

if TYPE_CHECKING:  # for the annotation only
    from batchbound.study.summary import StudyAnalysis

GLOSSARY = (
    ("L, K", "in a model's name (L=2 K=29): its depth and width; for fc and linear nets the "
     "hidden layers and the units in each, for other families their own convention (lenet, "
     "resnet: the head's)", "width"),
    ("first reached", "the smallest batch whose median run reaches the target: the m0 every "
     "speedup is measured from", "inefficiency"),
    ("s to target", "seconds to the target at the recommended workers and batch on the machine "
     "that wrote the report: the iterations the study measured times the step timed there",
     ""),
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
    ("collapsed", "a run recorded complete whose training accuracy ends at chance or whose "
     "training loss never falls below its start: it did not train; counted, and left out of "
     "every fit", ""),
    ("at the grid edge", "a result at the smallest or largest batch tried, or a tuned η at "
     "the top or bottom of its grid: the true value may lie beyond the grid", ""),
    ("at the first evaluation", "a batch whose runs (most of them) reached the target by "
     "their first evaluation: the target was crossed somewhere before it, so its epochs are "
     "an upper bound and a speedup from it is not measured (evaluate more often)", ""),
    ("degenerate", "a B_crit fit outside the grid by more than ×2, or whose 95 % interval "
     "spans more than two orders of magnitude: it identifies no critical batch size", ""),
    ("interpolated", "a recommended batch or step size that no run of the study used: read "
     "off the fit between grid points, not measured", ""),
    ("n", "the number of independent units a verdict rests on: seeds per cell, or pairs of "
     "runs for stability", ""),
)


EDGE = "at the grid edge"
FIRST_EVAL = "at the first evaluation"
INTERPOLATED = "interpolated"


@dataclass(frozen=True)
class Answer:
    """One model's answer, read off the analyses: numbers (NaN when unknown) and the marks
    that qualify them (grid edges, a degenerate fit, an interpolated recommendation)."""

    model: str
    grid: tuple[float, float]  # the smallest and largest batch of the study
    first: float  # the smallest batch whose median run reaches the target
    linear: float  # near-linear up to
    stagnant: float  # stagnant from
    b_crit: float
    interval: str  # B_crit's 95 % interval in words
    degenerate: str  # why the B_crit fit identifies nothing ("" when it does)
    bound: float  # n·Δ
    bound_how: str
    workers: float
    batch: float
    lr: float
    seconds: float
    interpolated: bool  # no run used the recommended (B, η)
    diverged: str  # "k of n"
    collapsed: str  # "k of n"
    first_eval: tuple[float, ...] = ()  # batches whose runs reached the target at once

    def edge(self, value: float) -> str:
        """"smallest"/"largest" when ``value`` is at that end of the grid."""
        return A.grid_edge(value, self.grid)

    def linear_edge(self) -> str:
        """Near-linear up to the largest batch (it may go on), or no near-linear doubling
        from the smallest (a near-linear range may lie below the grid)."""
        if self.linear > self.first:
            return "largest" if self.edge(self.linear) == "largest" else ""
        return "smallest" if self.edge(self.first) == "smallest" else ""


def _recommended(workers: pd.DataFrame | None, name: str) -> pd.Series | None:
    if workers is None or workers.empty or "model" not in workers:
        return None
    mine = workers[(workers["model"] == name) & (workers["recommended"] == "←")]
    return mine.iloc[0] if len(mine) else None


def answers(a: StudyAnalysis, workers: pd.DataFrame | None) -> list[Answer]:
    """One answer per model: near-linear up to, stagnant from, B_crit with its 95 %
    interval and flags, n·Δ with how it was measured, the time-optimal workers, batch and
    η here, and the diverged and collapsed runs."""
    keys = A.model_keys(a.per_run)
    names = A.display_names(a.per_run)
    how = A.delta_label(a.diversity)
    batches = a.per_run["batch_size"].astype(float) if len(a.per_run) else pd.Series([math.nan])
    grid = (float(batches.min()), float(batches.max()))
    out = []
    for _, frame in a.per_run.groupby(keys, sort=True, dropna=False):
        first = frame.iloc[0]
        name = str(names[frame.index[0]])
        match = {k: first[k] for k in keys}
        regime = _row(a.regimes, match)
        crit = _row(a.critical, match)
        div = _row(a.diversity, match)
        rec = _recommended(workers, name)

        def pick(row: pd.Series | None, column: str) -> float:
            return float(row[column]) if row is not None and column in row else math.nan

        collapsed = int(frame["collapsed"].sum()) if "collapsed" in frame else 0
        out.append(Answer(
            model=name, grid=grid, first=_first_reached(a.speedups, match),
            linear=pick(regime, "linear_until"), stagnant=pick(regime, "stagnation_from"),
            b_crit=pick(crit, "b_crit"), interval=_interval(crit),
            degenerate=str(crit["degenerate"]) if crit is not None and "degenerate" in crit
            else "",
            bound=pick(div, "bound_mean"), bound_how=how,
            workers=pick(rec, "workers"), batch=pick(rec, "batch"), lr=pick(rec, "lr"),
            seconds=pick(rec, "s to target"),
            interpolated=rec is not None and INTERPOLATED in str(rec.get("note", "")),
            diverged=f"{int(frame['diverged'].sum())} of {len(frame)}",
            collapsed=f"{collapsed} of {len(frame)}", first_eval=_at_first_eval(frame)))
    return out


def _at_first_eval(frame: pd.DataFrame) -> tuple[float, ...]:
    """The batches where most runs reached the target by their first evaluation."""
    if "first_eval" not in frame:
        return ()
    share = frame.groupby("batch_size")["first_eval"].mean()
    return tuple(float(b) for b, s in share.items() if s > 0.5)


def _num(value: float) -> str:
    return fmt(float(value)) if isinstance(value, (int, float)) and math.isfinite(value) \
        else "n/a"


def _edged(value: float, edge: str) -> str:
    return f"{_num(value)} ({EDGE})" if edge and math.isfinite(value) else _num(value)


def _early(r: Answer, batch: float, text: str) -> str:
    return f"{text} ({FIRST_EVAL})" if batch in r.first_eval else text


def answer_table(rows: list[Answer]) -> pd.DataFrame:
    """The answers as the report's table: one row per model, marks written beside the
    numbers they qualify; a degenerate B_crit is shown as such, never as a number alone."""
    return pd.DataFrame([{
        "model": r.model,
        "first reached": _early(r, r.first, _num(r.first)),
        "near-linear up to": _early(r, r.linear, _edged(r.linear, r.linear_edge())),
        "stagnant from": _edged(r.stagnant, r.edge(r.stagnant)),
        "B_crit": f"degenerate ({_num(r.b_crit)}: {r.degenerate})" if r.degenerate
        else _num(r.b_crit),
        "B_crit 95 %": r.interval,
        "n·Δ": _num(r.bound),
        "n·Δ measured": r.bound_how,
        "workers": _num(r.workers),
        "batch": f"{_num(r.batch)} ({INTERPOLATED})" if r.interpolated else _num(r.batch),
        "η": f"{_num(r.lr)} ({INTERPOLATED})" if r.interpolated else _num(r.lr),
        "s to target": _num(r.seconds),
        "diverged runs": r.diverged,
        "collapsed runs": r.collapsed,
    } for r in rows])


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
        text = f"{fmt(float(crit['low']))}–{fmt(float(crit['high']))}"
    if crit["outside"]:
        text += f"; {crit['outside']} the batches that reached the target"
    return text


def sentence(r: Answer, target: str) -> str:
    """The answer for one model in words."""
    parts = [f"**{r.model}**: "]
    if not math.isfinite(r.linear):
        parts.append(f"no batch size reaches {target}")
    elif r.linear > r.first:
        edge = (f" ({EDGE}: it may stay near-linear beyond the largest batch tried)"
                if r.edge(r.linear) == "largest" else "")
        parts.append(f"to {target}, speedup stays near-linear from B = {_num(r.first)} up to "
                     f"B = {_num(r.linear)}{edge}")
    else:
        edge = (f" ({EDGE}: a near-linear range, if any, lies below the smallest batch tried)"
                if r.edge(r.first) == "smallest" else "")
        parts.append(f"to {target}, no doubling past B = {_num(r.first)} (the smallest batch "
                     f"that reaches it) is near-linear{edge}")
    if r.first_eval:
        batches = ", ".join(_num(b) for b in r.first_eval)
        parts.append(f" ({FIRST_EVAL} at B = {batches}: the target was crossed before the "
                     "first evaluation, so these epochs are upper bounds and the speedup "
                     "between them is not measured)")
    if math.isfinite(r.stagnant) and r.edge(r.stagnant) == "smallest":
        parts.append(f"; it is stagnant from the smallest batch tried ({EDGE})")
    if r.degenerate:
        parts.append(f"; the critical-batch fit is degenerate ({r.degenerate}): no critical "
                     "batch size is identified")
    elif math.isfinite(r.b_crit):
        parts.append(f"; the critical batch size is {_num(r.b_crit)} ({r.interval})")
    if math.isfinite(r.bound):
        parts.append(f"; n·Δ is {_num(r.bound)} ({r.bound_how})")
    if math.isfinite(r.workers):
        workers = int(r.workers)
        made = (f", η {_num(r.lr)} ({INTERPOLATED}: no run used this batch and step size)"
                if r.interpolated else "")
        parts.append(f"; on this machine {workers} worker{'s' if workers > 1 else ''} at "
                     f"B = {int(r.batch)}{made} {'reach' if workers > 1 else 'reaches'} it "
                     f"fastest ({_num(r.seconds)} s)")
    collapsed = "" if r.collapsed.startswith("0 ") else (
        f" Collapsed runs (accuracy at chance or loss never below its start; left out of "
        f"every fit): {r.collapsed}.")
    return "".join(parts) + f". Diverged runs: {r.diverged}.{collapsed}"
