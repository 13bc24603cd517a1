"""Analyses: small pure functions over the store's DataFrames (``Store.frames(study)``).

Inputs are the long tables: ``runs`` (one row per run in the study, with its grid labels,
``role`` and ``status``), ``targets`` (key, name, reached, iteration, epoch), ``curves`` and
``diversity`` (key, iteration, epoch, metric, value). Models are grouped by ``model_label``
(plus ``strategy``, ``data`` and ``mechanism`` when a study varies them).

Censoring. A run that never reaches its target (it hit max_epochs, diverged or stagnated) is
kept, with its epochs and iterations set to +∞. Statistics over seeds use the median, which
is exact under this right-censoring while fewer than half the seeds are censored and +∞
otherwise; the mean of the reached runs is reported beside it with the censored count.

Definitions (thresholds are arguments with these defaults):

- **Threshold B\\*** ([width]): with e(B) the median epochs to target and b0 the smallest
  grid batch that reaches the target, B\\* is the largest B ≥ b0 such that every grid batch
  b in [b0, B] reaches it with e(b) ≤ growth · min_{b0 ≤ b' ≤ b} e(b'); growth = 1.5, i.e.
  past B\\* epochs-to-target have grown by more than half over the best smaller batch (or the
  target is missed). Misses below b0 (instability at small B) are skipped. NaN when no batch
  reaches the target.
- **Largest B within E epochs** ([width], Fig. 5): the largest grid B with e(B) ≤ E.
- **Speedup** ([inefficiency]): s(m; m0) = k(m0)/k(m) from median iterations k, m0 the smallest
  batch that reaches the target; ideal m/m0; efficiency s/(m/m0).
- **Regimes**: the local scaling exponent between neighbouring grid points,
  α = log(k(m_prev)/k(m)) / log(m/m_prev), is 1 for perfect scaling and 0 for none. A step is
  *linear* when α ≥ 0.8, *stagnant* when α < 0.1 (or k(m) = ∞), else *diminishing*.
  ``linear_until`` is the largest m up to which every step is linear; ``stagnation_from`` is
  the smallest m from which every following step is stagnant.
- **Critical batch size** (McCandlish et al.): fit S(B) = S_min(1 + B_crit/B), equivalent to
  (S/S_min − 1)(E/E_min − 1) = 1 with E = S·B and B_crit = E_min/S_min, by least squares on
  relative error. A run that reached the target is a point; a run that stopped without it
  (max_epochs) is censored: it only says S > the iterations it ran, and adds a residual only
  when the curve passes below that. Diverged runs say nothing about S at a working step size
  and are left out (counted). 95 % intervals by bootstrap over runs within each B; with one
  run per B the interval has no spread and says so (``one_run``). ``outside`` flags a B_crit
  below the smallest or above the largest batch that reached the target.
- **Loss threshold** ([inefficiency]): the lower quartile of all training-loss values recorded by
  the runs at the largest batch size with a run that did not diverge; k(m) is then the first
  iteration with loss ≤ it. Diverged runs never count as reaching it.

Diverged runs (status ``diverged``) count as misses (+∞) in the per-cell medians, like any
run that does not reach its target, and each table carries their count per cell.
- **Collapsed runs** (``mark_collapsed``): a run the trainer recorded ``complete`` whose last
  training accuracy is at chance (≤ 1/classes + 0.02, classification only) or whose training
  loss never falls below its first value did not train. Its status becomes ``collapsed``
  when the report reads the store (the store keeps ``complete``); it counts as a miss when
  it missed the target, is counted per cell, and is left out of every fit (B_crit, the loss
  threshold, Δ), as a diverged run is.
- **Degenerate B_crit**: a fit whose B_crit lies outside the grid's batches by more than
  ×2, or whose 95 % interval spans more than two orders of magnitude, or that stopped at the
  search bound (``critical_batch``'s ``degenerate`` says which); the report never shows it
  as a number on its own.
- **Grid edges** (``grid_edge``): a result at the smallest or largest batch of the grid (B*,
  the largest B within E, near-linear up to, stagnant from) or a tuned η at the top or
  bottom of its grid (``tuned_at_edge``) may lie beyond the grid; the report says so.
- **Δ per model**: averaged over training (every measurement of every run at the reference
  batch size up to the run's target, averaged per run, then over seeds) and at matched
  training loss ℓ\\* (Δ at the first measurement where the run's training loss ≤ ℓ\\*, with
  ℓ\\* the loss every model reached). Never one snapshot: near a stationary point ‖Σg‖ → 0
  and n·Δ blows up. Along the run ([diversity] Theorem 1 asks B ≤ δ·n·Δ(w) + 1 at every w
  the run visits): the minimum of n·Δ over the measurements up to the target and its value
  at the last measurement at or before the target's iteration (the run's end when it missed
  the target); measurements after the target are never used.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
from scipy.optimize import minimize_scalar

from batchbound.train.cadence import first_evaluations

MODEL_KEYS = ("data", "strategy", "mechanism", "model_label")
SHAPE_COLUMNS = ("depth", "width", "params")


def model_keys(runs: pd.DataFrame) -> list[str]:
    """The label columns that tell models apart in this table (those that vary, plus the
    model label)."""
    keys = [k for k in MODEL_KEYS if k in runs and (k == "model_label" or runs[k].nunique() > 1)]
    return keys or ["model_label"]


def display_names(frame: pd.DataFrame, keys: Sequence[str] | None = None) -> pd.Series:
    """Per row: the model label plus the other varying keys, e.g. ``L=3 K=30 · lsr``."""
    keys = [k for k in (keys or model_keys(frame)) if k != "model_label"]
    names = frame["model_label"].astype(str)
    for key in keys:
        names = names + " · " + frame[key].astype(str)
    return names


def short_strategies(runs: pd.DataFrame) -> pd.DataFrame:
    """Strategy specs shortened to their names (``lsr``) when the names alone are distinct."""
    if "strategy" not in runs:
        return runs
    full = runs["strategy"].dropna().unique()
    short = {s: s.split("(")[0] for s in full}
    if len(set(short.values())) != len(full):
        return runs
    if isinstance(runs["strategy"].dtype, pd.CategoricalDtype):  # renamed, order and NaN kept
        column = runs["strategy"].cat.remove_unused_categories()
        return runs.assign(strategy=column.cat.rename_categories(
            {c: short[c] for c in column.cat.categories}))
    return runs.assign(strategy=runs["strategy"].map(short).fillna(runs["strategy"]))


def in_spec_order(table: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """``table`` with every label column that ``runs`` orders (``Store.frames``: as the spec
    lists them) ordered the same way, values ``runs`` lacks last, and its rows stably sorted
    by them: a table built row by row holds plain strings in string order (r = 512 before
    r = 64), and so would every later sort or groupby of it."""
    out, ordered = table, []
    for column in MODEL_KEYS:
        if column not in table or column not in runs \
                or not isinstance(runs[column].dtype, pd.CategoricalDtype):
            continue
        ordered.append(column)
        if isinstance(table[column].dtype, pd.CategoricalDtype):
            continue
        known = list(runs[column].cat.categories)
        have = set(known)
        extra = [v for v in dict.fromkeys(table[column].dropna()) if v not in have]
        out = out.assign(**{column: pd.Categorical(table[column], categories=[*known, *extra],
                                                   ordered=True)})
    return out.sort_values(ordered, kind="stable") if ordered and len(out) else out


def finals(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs["role"] == "final"] if "role" in runs else runs


COLLAPSED = "collapsed"
CHANCE_MARGIN = 0.02  # "at chance": last training accuracy ≤ 1/classes + this


def collapsed_keys(runs: pd.DataFrame, curves: pd.DataFrame,
                   chance: Mapping[str, float | None] | None = None) -> set[str]:
    """Keys of the runs recorded ``complete`` that did not train: the last training
    accuracy at chance (``chance[data label]``, 1/classes; None or absent: not checked) or
    a training loss never below its first recorded value."""
    complete = runs[runs["status"] == "complete"] if "status" in runs else runs
    mine = curves[curves["key"].isin(set(complete["key"]))].sort_values("iteration")
    out: set[str] = set()
    losses = mine[mine["metric"] == "train_loss"].groupby("key")["value"]
    for key, values in losses:
        values = values.to_numpy(float)
        if len(values) >= 2 and not np.nanmin(values[1:]) < values[0]:
            out.add(str(key))
    data = complete["data"] if "data" in complete else pd.Series("", complete.index)
    level = {str(k): (chance or {}).get(str(d)) for k, d in zip(complete["key"], data,
                                                                strict=True)}
    last = mine[mine["metric"] == "train_acc"].groupby("key")["value"].last()
    for key, value in last.items():
        at = level.get(str(key))
        if at is not None and float(value) <= at + CHANCE_MARGIN:
            out.add(str(key))
    return out


def mark_collapsed(runs: pd.DataFrame, curves: pd.DataFrame,
                   chance: Mapping[str, float | None] | None = None) -> pd.DataFrame:
    """``runs`` with the status of every collapsed run (``collapsed_keys``) set to
    ``collapsed``; the store keeps ``complete``."""
    keys = collapsed_keys(runs, curves, chance)
    if not keys:
        return runs
    return runs.assign(status=runs["status"].where(~runs["key"].isin(keys), COLLAPSED))


def _trained(runs: pd.DataFrame) -> pd.Series:
    """Runs that neither diverged nor collapsed: the only ones any fit may use."""
    if "status" not in runs:
        return pd.Series(True, runs.index)
    return ~runs["status"].isin(["diverged", COLLAPSED])


def per_run_to_target(runs: pd.DataFrame, targets: pd.DataFrame,
                      target: str | None = None) -> pd.DataFrame:
    """One row per final run: its labels, ``reached``, ``epochs`` and ``iterations`` to
    ``target`` (the first target when None), +∞ when not reached, and ``first_eval``: reached
    by the run's first evaluation, so the true epochs may be anything below the recorded
    ones."""
    final = finals(runs)
    if target is None:
        names = targets[targets["key"].isin(final["key"])]["name"]
        target = names.iloc[0] if len(names) else None
    chosen = targets[targets["name"] == target][["key", "reached", "epoch", "iteration"]]
    out = final.merge(chosen, on="key", how="left")
    reached = out["reached"].fillna(0).astype(bool)
    out["reached"] = reached
    out["diverged"] = (out["status"] == "diverged") if "status" in out else False
    out["collapsed"] = (out["status"] == COLLAPSED) if "status" in out else False
    out["epochs"] = np.where(reached, out["epoch"], np.inf).astype(float)
    out["iterations"] = np.where(reached, out["iteration"], np.inf).astype(float)
    out["ran_iterations"] = [_ran_iterations(f) for f in out.get("final_json", [None] * len(out))]
    out["target"] = target
    sizes = out["n_train"] if "n_train" in out else pd.Series(math.nan, out.index)
    second = np.array([_second_evaluation(c, n) for c, n in zip(
        out.get("config_json", [None] * len(out)), sizes, strict=True)])
    out["first_eval"] = reached.to_numpy() & (out["epochs"].to_numpy() < second - 1e-9)
    return out.drop(columns=["epoch", "iteration"])


def _second_evaluation(config_json: object, n_train: object) -> float:
    """The epoch of a run's second evaluation (NaN when it evaluates by iterations or its
    config does not say): a target is seen only at an evaluation, so one reached before the
    second was reached somewhere in (0, first evaluation]."""
    if not isinstance(config_json, str):
        return math.nan
    config = json.loads(config_json)
    every, growth = config.get("eval_every_epochs"), config.get("eval_growth")
    if not isinstance(every, (int, float)) or config.get("eval_every_iterations") is not None:
        return math.nan
    if config.get("batch_policy", "fixed") != "fixed":  # the step changes: take it as fine
        n_train = math.nan
    n = float(n_train) if isinstance(n_train, (int, float)) else math.nan
    step = float(config.get("batch_size", 0)) / n if n > 0 else 0.0
    return first_evaluations(float(every), growth, step)[1]


def _ran_iterations(final_json: object) -> float:
    """How many iterations a run trained (NaN when its final record does not say)."""
    if not isinstance(final_json, str):
        return math.nan
    value = json.loads(final_json).get("iterations")
    return float(value) if isinstance(value, (int, float)) else math.nan


def target_names(runs: pd.DataFrame, targets: pd.DataFrame) -> list[str]:
    """The targets the final runs were trained to, in the order the spec gives them."""
    names = targets[targets["key"].isin(finals(runs)["key"])]["name"]
    return list(dict.fromkeys(names))


def summarize_to_target(per_run: pd.DataFrame, value: str = "epochs") -> pd.DataFrame:
    """Per (model, B): median over seeds (censoring-aware), mean/std/min/max of reached runs,
    the number of runs, of runs stopped short of the target (censored), of diverged and of
    collapsed runs."""
    keys = [*model_keys(per_run), *[c for c in SHAPE_COLUMNS if c in per_run], "batch_size"]
    rows = []
    for group, frame in per_run.groupby(keys, sort=True, dropna=False):
        values = frame[value].to_numpy(dtype=float)
        finite = values[np.isfinite(values)]
        dead = np.zeros(len(frame), bool)
        for flag in ("diverged", "collapsed"):
            if flag in frame:
                dead |= frame[flag].to_numpy(bool)
        rows.append({
            **dict(zip(keys, group, strict=True)),
            "runs": len(values),
            "censored": int((~np.isfinite(values) & ~dead).sum()),
            "diverged": int(frame["diverged"].sum()) if "diverged" in frame else 0,
            "collapsed": int(frame["collapsed"].sum()) if "collapsed" in frame else 0,
            "first_eval": int(frame["first_eval"].sum()) if "first_eval" in frame else 0,
            "median": float(np.median(values)),
            "mean_reached": float(finite.mean()) if len(finite) else math.nan,
            "std_reached": float(finite.std(ddof=1)) if len(finite) > 1 else math.nan,
            "min": float(values.min()),
            "max": float(values.max()),
            **({"lr": float(frame["lr"].median())} if "lr" in frame else {}),
            **({"n_train": float(frame["n_train"].max())} if "n_train" in frame else {}),
        })
    return pd.DataFrame(rows)


def _by_model(summary: pd.DataFrame) -> tuple[list[tuple[tuple, pd.DataFrame]], list[str]]:
    keys = [*model_keys(summary), *[c for c in SHAPE_COLUMNS if c in summary]]
    return [(g if isinstance(g, tuple) else (g,), f.sort_values("batch_size"))
            for g, f in summary.groupby(keys, sort=True, dropna=False)], keys


def threshold_batch(summary: pd.DataFrame, growth: float = 1.5) -> pd.DataFrame:
    """[width]'s B* per model from an epochs summary (see the module docstring)."""
    groups, keys = _by_model(summary)
    return pd.DataFrame([{**dict(zip(keys, group, strict=True)),
                          "threshold_batch": b_star(frame["batch_size"], frame["median"], growth)}
                         for group, frame in groups])


def b_star(batches: Sequence[float], epochs: Sequence[float], growth: float = 1.5) -> float:
    """B* of one model from its median epochs per batch size, batches ascending."""
    best, out = math.inf, math.nan
    for batch, e in zip(batches, epochs, strict=True):
        if not math.isfinite(e):
            if math.isfinite(best):
                break
            continue  # misses below the first batch that reaches: small-B instability
        best = min(best, e)
        if e > growth * best:
            break
        out = float(batch)
    return out


def largest_within(batches: Sequence[float], epochs: Sequence[float], budget: float) -> float:
    """The largest batch whose median epochs to target is ≤ budget (NaN if none)."""
    ok = [b for b, e in zip(batches, epochs, strict=True) if e <= budget]
    return float(max(ok)) if ok else math.nan


def alphas(batches: Sequence[float], iterations: Sequence[float],
           budgets: Sequence[float] | None = None) -> list[float]:
    """The local scaling exponent of each step from the first batch that reaches the target:
    α = log(k_prev/k)/log(m/m_prev). A step into a miss is censored: with ``budgets`` (the
    iterations each batch had, max_epochs·n/m) its α is at most log(k_prev/K)/log(m/m_prev),
    and that bound stands in for it; without, or out of a miss, NaN (never −∞: a miss within
    a budget is not evidence of stagnation)."""
    pairs = list(zip(batches, iterations, strict=True))
    first = next((i for i, (_, k) in enumerate(pairs) if math.isfinite(k)), None)
    if first is None:
        return []
    out = []
    for i in range(first, len(pairs) - 1):
        (b0, k0), (b1, k1) = pairs[i], pairs[i + 1]
        if math.isfinite(k0) and math.isfinite(k1):
            out.append(math.log(k0 / k1) / math.log(b1 / b0))
        elif math.isfinite(k0) and budgets is not None and budgets[i + 1] > 0:
            out.append(math.log(k0 / budgets[i + 1]) / math.log(b1 / b0))
        else:
            out.append(math.nan)
    return out


def iteration_budgets(batches: Sequence[float], n_train: float | None,
                      max_epochs: float | None) -> list[float] | None:
    """The iterations each batch had (max_epochs·n/m), or None when either is unknown."""
    if not n_train or not max_epochs:
        return None
    return [float(max_epochs) * float(n_train) / float(b) for b in batches]


def largest_batch_within(summary: pd.DataFrame, epochs: float) -> pd.DataFrame:
    """Largest grid B whose median epochs to target is ≤ ``epochs`` (NaN if none)."""
    groups, keys = _by_model(summary)
    return pd.DataFrame([{**dict(zip(keys, group, strict=True)), "epochs_budget": epochs,
                          "largest_batch": largest_within(frame["batch_size"], frame["median"],
                                                          epochs)}
                         for group, frame in groups])


def speedup(summary: pd.DataFrame, linear: float = 0.8, stagnant: float = 0.1,
            max_epochs: float | None = None) -> pd.DataFrame:
    """s(m; m0) per model from an iterations summary, with the ideal, efficiency, local
    exponent α and the regime of the step into each m. A step into a miss is "censored":
    with ``max_epochs`` (and the summary's ``n_train``) its α is the budget's bound, and
    "stagnant" only when that bound is."""
    groups, keys = _by_model(summary)
    rows = []
    for group, frame in groups:
        reached = frame[np.isfinite(frame["median"])]
        if reached.empty:
            continue
        m0 = int(reached["batch_size"].iloc[0])
        k0 = float(reached["median"].iloc[0])
        n = float(frame["n_train"].iloc[0]) if "n_train" in frame else None
        budgets = iteration_budgets(frame["batch_size"].tolist(), n, max_epochs)
        steps = [math.nan, *alphas(frame["batch_size"], frame["median"], budgets)]
        tail = frame[frame["batch_size"] >= m0]
        diverged = tail["diverged"] if "diverged" in tail else [0] * len(tail)
        for batch, k, alpha, dead in zip(tail["batch_size"], tail["median"], steps, diverged,
                                         strict=True):
            if not math.isfinite(k):  # a bound at most: stagnant only if the bound is
                regime = "stagnant" if alpha < stagnant else "censored"
            elif math.isnan(alpha):  # m0, or a step out of a miss
                regime = ""
            else:
                regime = ("linear" if alpha >= linear else "stagnant" if alpha < stagnant
                          else "diminishing")
            s = k0 / k if math.isfinite(k) else 0.0
            rows.append({**dict(zip(keys, group, strict=True)), "batch_size": int(batch),
                         "iterations": k, "speedup": s, "ideal": batch / m0,
                         "efficiency": s / (batch / m0), "alpha": alpha, "regime": regime,
                         "diverged": int(dead)})
    return pd.DataFrame(rows)


def regime_boundaries(speedups: pd.DataFrame) -> pd.DataFrame:
    """Per model: ``linear_until`` and ``stagnation_from`` (NaN when the grid shows none)."""
    keys = [k for k in speedups.columns if k in (*MODEL_KEYS, *SHAPE_COLUMNS)]
    rows = []
    for group, frame in speedups.groupby(keys, sort=True, dropna=False):
        frame = frame.sort_values("batch_size")
        batches, regimes = frame["batch_size"].tolist(), frame["regime"].tolist()
        linear_until = batches[0]
        for batch, regime in zip(batches[1:], regimes[1:], strict=True):
            if regime != "linear":
                break
            linear_until = batch
        stagnation_from = stagnation_start(batches, frame["alpha"].tolist()[1:])
        group = group if isinstance(group, tuple) else (group,)
        rows.append({**dict(zip(keys, group, strict=True)), "linear_until": linear_until,
                     "stagnation_from": stagnation_from})
    return pd.DataFrame(rows)


def stagnation_start(batches: Sequence[float], steps: Sequence[float],
                     stagnant: float = 0.1) -> float:
    """The smallest batch from which every following step is stagnant (α < ``stagnant``);
    ``steps[i]`` is the α of the step from batches[i] to batches[i + 1]. NaN if none."""
    out = math.nan
    for i in range(len(steps) - 1, -1, -1):
        if not steps[i] < stagnant:
            break
        out = float(batches[i])
    return out


def _fit_steps(batch: np.ndarray, steps: np.ndarray, group: np.ndarray,
               censored: np.ndarray | None = None) -> tuple[float, dict]:
    """Least squares on relative error of S = S_min,g (1 + B_c/B) with one B_c shared by
    all groups g. A censored point (S > steps) adds its residual only while the curve lies
    below it. For fixed B_c each S_min,g solves a small active-set problem (closed form per
    set). Returns (B_c, S_min per g)."""
    censored = np.zeros(len(batch), bool) if censored is None else censored
    names, codes = np.unique(group, return_inverse=True)
    onehot = np.eye(len(names))[codes]  # (points, groups)
    low, high = math.log(batch.min() / 1e3), math.log(batch.max() * 1e3)

    def fit(log_bc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Residual sums and S_min per group for each candidate log B_c (vectorised)."""
        w = (1 + np.exp(log_bc)[:, None] / batch[None, :]) / steps[None, :]  # (grid, points)
        active = np.broadcast_to(~censored, w.shape)
        for _ in range(len(batch) + 1):  # the active set only grows: this terminates
            a = ((w * active) @ onehot) / np.maximum((w**2 * active) @ onehot, 1e-300)
            ratio = (a @ onehot.T) * w  # predicted S over the recorded steps
            grown = active | (censored[None, :] & (ratio < 1))
            if (grown == active).all():
                break
            active = grown
        residual = np.where(active, (ratio - 1) ** 2, 0.0)
        return residual.sum(axis=1), a

    grid = np.linspace(low, high, 121)
    start = grid[int(np.argmin(fit(grid)[0]))]
    step = grid[1] - grid[0]
    best = minimize_scalar(lambda v: float(fit(np.array([v]))[0][0]),
                           bounds=(max(low, start - step), min(high, start + step)),
                           method="bounded", options={"xatol": 1e-4})
    a = fit(np.array([best.x]))[1][0]
    return math.exp(best.x), {name: float(a[i]) for i, name in enumerate(names)}


def critical_batch(per_run: pd.DataFrame, value: str = "iterations", by: Sequence[str] | None
                   = None, bootstrap: int = 200, seed: int = 0) -> pd.DataFrame:
    """Fit (S/S_min − 1)(E/E_min − 1) = 1 per model (``by`` = model keys) or jointly
    (``by=[]``: one B_crit for the study, one S_min per model). Reached runs are points,
    runs stopped short of the target are censored at the iterations they ran, diverged runs
    are left out (see the module docstring).

    Columns: b_crit, s_min (NaN for joint fits), e_min, points (reached), censored,
    diverged and collapsed (left out), low/high (2.5th/97.5th bootstrap percentiles,
    resampling runs within each batch size), one_run (every batch has one run: the interval
    has no spread), at_bound (the fit hit the search range: not identified), outside
    ("below" or "above" the batches that reached the target, else ""), degenerate (why the
    fit identifies no B_crit, else ""; see ``degenerate_fit``)."""
    keys = model_keys(per_run) if by is None else list(by)
    diverged = np.zeros(len(per_run), bool)
    for flag in ("diverged", "collapsed"):
        if flag in per_run:
            diverged |= per_run[flag].to_numpy(bool)
    ran = per_run["ran_iterations"] if "ran_iterations" in per_run \
        else pd.Series(math.nan, index=per_run.index)
    usable = per_run.assign(_censored=~np.isfinite(per_run[value]),
                            _steps=per_run[value].where(np.isfinite(per_run[value]), ran),
                            _diverged=diverged)
    rows = []
    grouped = [((), usable)] if not keys else usable.groupby(keys, sort=True, dropna=False)
    for group, everything in grouped:
        group = group if isinstance(group, tuple) else (group,)
        # each model's draws from its own stream: its interval does not move when the spec
        # adds, drops or reorders another model
        labels = [str(everything[k].iloc[0]) for k in MODEL_KEYS if k in everything] \
            if keys else []  # one joint fit: its own stream, whatever its first row
        rng = np.random.default_rng([seed, *(zlib.crc32(v.encode()) for v in labels)])
        frame = everything[~everything["_diverged"] & np.isfinite(everything["_steps"])]
        reached = frame[~frame["_censored"]]
        if reached["batch_size"].nunique() < 3:
            continue
        model_of = frame[model_keys(per_run)].astype(str).agg("|".join, axis=1).to_numpy()
        batch = frame["batch_size"].to_numpy(float)
        steps = frame["_steps"].to_numpy(float)
        censored = frame["_censored"].to_numpy(bool)
        bc, mins = _fit_steps(batch, steps, model_of, censored)
        draws = []
        cells = [np.flatnonzero((batch == b) & (model_of == m))
                 for b, m in sorted(set(zip(batch, model_of, strict=True)))]
        for _ in range(bootstrap):
            idx = np.concatenate([rng.choice(c, size=len(c)) for c in cells])
            if len(np.unique(batch[idx][~censored[idx]])) >= 3:
                draws.append(_fit_steps(batch[idx], steps[idx], model_of[idx],
                                        censored[idx])[0])
        s_min = next(iter(mins.values())) if len(mins) == 1 else math.nan
        edge = (batch.min() / 999, batch.max() * 999)
        hit = reached["batch_size"]
        low = float(np.percentile(draws, 2.5)) if draws else math.nan
        high = float(np.percentile(draws, 97.5)) if draws else math.nan
        at_bound = bool(bc <= edge[0] or bc >= edge[1])
        collapsed = everything["collapsed"].sum() if "collapsed" in everything else 0
        rows.append({**dict(zip(keys, group, strict=True)), "b_crit": bc, "s_min": s_min,
                     "e_min": s_min * bc, "points": len(reached),
                     "censored": int(censored.sum()),
                     "diverged": int(everything["_diverged"].sum() - collapsed),
                     "collapsed": int(collapsed),
                     "low": low, "high": high,
                     "one_run": bool(max(len(c) for c in cells) == 1),
                     "at_bound": at_bound,
                     "outside": "below" if bc < hit.min() else
                     "above" if bc > hit.max() else "",
                     "degenerate": degenerate_fit(bc, low, high, everything["batch_size"],
                                                  at_bound)})
    return pd.DataFrame(rows)


DEGENERATE_FACTOR = 2.0  # B_crit this far outside the grid identifies nothing
DEGENERATE_SPAN = 100.0  # an interval wider than this ratio (two orders of magnitude)


def degenerate_fit(b_crit: float, low: float, high: float, batches: Sequence[float],
                   at_bound: bool = False) -> str:
    """Why a B_crit fit identifies no critical batch size, or "" when it does: it hit the
    search bound, lies outside the grid's batches by more than ×2, or its 95 % interval
    spans more than two orders of magnitude."""
    grid = np.asarray(batches, float)
    if at_bound:
        return "the fit stopped at its search bound"
    if b_crit < grid.min() / DEGENERATE_FACTOR:
        return f"B_crit is below the smallest batch {fmt_batch(grid.min())} by more than ×2"
    if b_crit > grid.max() * DEGENERATE_FACTOR:
        return f"B_crit is above the largest batch {fmt_batch(grid.max())} by more than ×2"
    if low > 0 and high / low > DEGENERATE_SPAN:
        return "its 95 % interval spans more than two orders of magnitude"
    return ""


def fmt_batch(batch: float) -> str:
    return str(int(batch)) if float(batch).is_integer() else f"{batch:.3g}"


def grid_edge(value: float, batches: Sequence[float]) -> str:
    """"smallest" or "largest" when ``value`` is that batch of the grid, else ""."""
    grid = [float(b) for b in batches]
    if not grid or not math.isfinite(value):
        return ""
    return "smallest" if value <= min(grid) else "largest" if value >= max(grid) else ""


def tuned_at_edge(runs: pd.DataFrame, grid: Sequence[float]) -> pd.DataFrame:
    """The final runs' cells whose tuned η is the top or the bottom of the tuning grid
    (a better η may lie beyond it): model keys, batch_size, lr, edge ("top" or "bottom").
    Empty when the grid has one η."""
    final = finals(runs)
    keys = [*model_keys(final), "batch_size"]
    if len(grid) < 2 or final.empty:
        return pd.DataFrame(columns=[*keys, "lr", "edge"])
    cells = final.groupby(keys, sort=True, dropna=False)["lr"].median().reset_index()
    cells["edge"] = np.where(np.isclose(cells["lr"], max(grid)), "top",
                             np.where(np.isclose(cells["lr"], min(grid)), "bottom", ""))
    return cells[cells["edge"] != ""].reset_index(drop=True)


def loss_threshold(runs: pd.DataFrame, curves: pd.DataFrame, metric: str = "train_loss",
                   quantile: float = 0.25) -> pd.DataFrame:
    """[inefficiency]'s threshold per model: the lower quartile of the ``metric`` values recorded
    by the final runs at that model's largest batch size, diverged and collapsed runs left
    out (and the largest batch with a run that trained when none there did). NaN when
    that quartile is not below the loss those runs started from: an unstable largest batch
    (loss up, not 10× up) gives a threshold the untrained model meets, which measures
    nothing (and would make k(m) = 0)."""
    final = finals(runs)
    keys = model_keys(final)
    rows = []
    for group, everything in final.groupby(keys, sort=True, dropna=False):
        frame = everything[_trained(everything)]
        largest = frame[frame["batch_size"] == frame["batch_size"].max()]["key"]
        recorded = curves[(curves["key"].isin(largest)) & (curves["metric"] == metric)]
        recorded = recorded[np.isfinite(recorded["value"].astype(float))]
        values = _evenly_spaced(recorded, frame)
        starts = recorded.sort_values("iteration").groupby("key")["value"].first()
        threshold = float(np.quantile(values, quantile)) if len(values) else math.nan
        if len(starts) and not threshold < float(starts.min()):
            threshold = math.nan
        group = group if isinstance(group, tuple) else (group,)
        rows.append({**dict(zip(keys, group, strict=True)),
                     "threshold": threshold,
                     "from_batch": float(frame["batch_size"].max()) if len(frame) else math.nan,
                     "diverged_left_out": int((~_trained(everything)).sum())})
    return pd.DataFrame(rows)


def _evenly_spaced(recorded: pd.DataFrame, runs: pd.DataFrame) -> np.ndarray:
    """The recorded values, each geometric run's (``eval_growth``: most evaluations early)
    read instead at as many evenly spaced iterations, so that a quantile is one over
    training time, as for a run evaluated at a fixed cadence."""
    growth = {k: json.loads(c).get("eval_growth") if isinstance(c, str) else None
              for k, c in zip(runs["key"], runs.get("config_json", [None] * len(runs)),
                              strict=True)}
    out = []
    for key, curve in recorded.groupby("key", sort=False):
        curve = curve.sort_values("iteration")
        values = curve["value"].to_numpy(float)
        if growth.get(key) is not None and len(curve) > 1:
            steps = curve["iteration"].to_numpy(float)
            values = np.interp(np.linspace(steps[0], steps[-1], len(steps)), steps, values)
        out.append(values)
    return np.concatenate(out) if out else np.array([])


def per_run_to_loss(runs: pd.DataFrame, curves: pd.DataFrame, thresholds: pd.DataFrame,
                    metric: str = "train_loss") -> pd.DataFrame:
    """Like per_run_to_target, with k(m) the first iteration where ``metric`` ≤ the model's
    threshold (from loss_threshold); a diverged or collapsed run never reaches it."""
    final = finals(runs).merge(thresholds, on=model_keys(finals(runs)), how="left")
    rows = curves[curves["metric"] == metric]
    first = {}
    for key, frame in rows.groupby("key"):
        frame = frame.sort_values("iteration")
        first[key] = frame[["iteration", "epoch", "value"]].to_numpy(float)
    iterations, epochs = [], []
    usable = _trained(final).to_numpy()
    for key, threshold, ok in zip(final["key"], final["threshold"], usable, strict=True):
        data = first.get(key) if ok else None
        hit = None if data is None else np.flatnonzero(data[:, 2] <= threshold)
        if hit is None or not len(hit):
            iterations.append(math.inf)
            epochs.append(math.inf)
        else:
            iterations.append(data[hit[0], 0])
            epochs.append(data[hit[0], 1])
    status = final["status"] if "status" in final else pd.Series("", final.index)
    return final.assign(iterations=iterations, epochs=epochs, reached=np.isfinite(iterations),
                        diverged=(status == "diverged").to_numpy(),
                        collapsed=(status == COLLAPSED).to_numpy())


def loss_surface(runs: pd.DataFrame, curves: pd.DataFrame, metric: str = "train_loss"
                 ) -> pd.DataFrame:
    """Median (over seeds) ``metric`` per (model, B, iteration): [inefficiency]'s Figure 1 data."""
    final = finals(runs)
    keys = model_keys(final)
    rows = curves[curves["metric"] == metric].merge(final[["key", *keys, "batch_size"]],
                                                    on="key")
    return (rows.groupby([*keys, "batch_size", "iteration"], sort=True)["value"]
            .median().reset_index())


def diversity_along_training(runs: pd.DataFrame, diversity: pd.DataFrame) -> pd.DataFrame:
    """Δ and n·Δ at every measurement of every final run, with the run's labels."""
    final = finals(runs)
    wide = diversity[diversity["metric"].isin(["diversity", "batch_bound"])].pivot_table(
        index=["key", "iteration", "epoch"], columns="metric", values="value").reset_index()
    return wide.merge(final, on="key")


def diversity_runs(runs: pd.DataFrame, diversity: pd.DataFrame, curves: pd.DataFrame,
                   targets: pd.DataFrame | None = None, batch_size: int | None = None,
                   metric: str = "train_loss") -> pd.DataFrame:
    """Per final run at the reference batch size (the smallest by default) that trained
    (diverged and collapsed runs left out), from its measurements up to the first target
    (all of them when it missed the target; never one after it): Δ averaged over them
    (``delta_run``), the minimum of n·Δ (``bound_min_run``) and n·Δ at the last of them
    (``bound_at_target_run``); Δ at matched training loss ℓ* (``delta_matched_run``: the
    first measurement where the run's loss ≤ ℓ*, ℓ* the loss every model reached);
    ``measured_to`` (the epoch of the last measurement used), ``target_epoch`` (when it
    reached the first target; its last epoch when it did not) and ``reached``."""
    along = diversity_along_training(runs, diversity)
    if along.empty:
        return pd.DataFrame()
    reference = batch_size or int(along["batch_size"].min())
    along = along[(along["batch_size"] == reference) & _trained(along)]
    if along.empty:
        return pd.DataFrame()
    keys = [*model_keys(along), *[c for c in SHAPE_COLUMNS if c in along]]
    reached: dict[str, tuple[float, float]] = {}  # key -> (iteration, epoch) of the target
    if targets is not None and len(targets):
        name = target_names(runs, targets)[0]
        hit = targets[(targets["name"] == name) & (targets["reached"] == 1)]
        reached = {k: (float(i), float(e)) for k, i, e in
                   zip(hit["key"], hit["iteration"], hit["epoch"], strict=True)}
    limit = along["key"].map(lambda k: reached.get(k, (math.inf, math.inf))[0])
    along = along[along["iteration"] <= limit]
    losses = curves[(curves["metric"] == metric) & curves["key"].isin(along["key"])]
    # the loss each measurement was taken at: the latest evaluation at or before it
    at = pd.merge_asof(along.sort_values("iteration"),
                       losses[["key", "iteration", "value"]].rename(columns={"value": "loss"})
                       .sort_values("iteration"), on="iteration", by="key", direction="backward")
    per_model_best = at.groupby(keys, dropna=False)["loss"].min()
    matched = float(per_model_best.max()) if len(per_model_best) else math.nan
    hits = at[at["loss"] <= matched].groupby("key")["diversity"].first()
    out = at.groupby("key").agg(delta_run=("diversity", "mean"), measured_to=("epoch", "max"),
                                measurements=("diversity", "size"),
                                bound_min_run=("batch_bound", "min"),
                                bound_at_target_run=("batch_bound", "last")).reset_index()
    out = out.assign(delta_matched_run=out["key"].map(hits), matched_loss=matched)
    first = finals(runs).drop_duplicates("key").set_index("key")
    out = out.join(first[[*keys, "n_train"]], on="key").assign(batch_size=reference)
    ends = curves[curves["key"].isin(out["key"])].groupby("key")["epoch"].max()
    out["reached"] = out["key"].isin(set(reached))
    out["target_epoch"] = [reached[k][1] if k in reached else ends.get(k, math.nan)
                           for k in out["key"]]
    return out


def diversity_summary(runs: pd.DataFrame, diversity: pd.DataFrame, curves: pd.DataFrame,
                      batch_size: int | None = None, metric: str = "train_loss",
                      targets: pd.DataFrame | None = None, cadence: float = 0.0
                      ) -> pd.DataFrame:
    """Per model: Δ averaged over training and at matched training loss ℓ*, at the reference
    batch size (the smallest by default), with n·Δ for both.

    Columns: delta_mean, delta_std (over runs), bound_mean (n·delta_mean), measurements,
    matched_loss (ℓ*), delta_matched, bound_matched, measured_to (the shortest span of
    measurements over the runs, in epochs), over_training (True when every run's
    measurements reach within ``cadence`` epochs of its run to the target: only then is
    delta_mean an average over training), bound_min and bound_at_target (n·Δ along the run
    to the target, ``diversity_runs``; means over runs), runs_reached ("k of n" runs that
    reached the target; the others' values run to their end)."""
    per_run = diversity_runs(runs, diversity, curves, targets, batch_size, metric)
    if per_run.empty:
        return pd.DataFrame()
    keys = [*model_keys(per_run), *[c for c in SHAPE_COLUMNS if c in per_run]]
    rows = []
    for group, frame in per_run.groupby(keys, sort=True, dropna=False):
        n = float(frame["n_train"].iloc[0])
        delta = float(frame["delta_run"].mean())
        hits = frame["delta_matched_run"].dropna()
        delta_matched = float(hits.mean()) if len(hits) else math.nan
        # one cadence short of the target is covered (10 % slack: cadences round to whole
        # iterations); more than that is not an average over the run to the target
        covered = bool((frame["measured_to"] >= frame["target_epoch"] - 1.1 * cadence).all()
                       and (frame["measurements"] >= 2).all())
        group = group if isinstance(group, tuple) else (group,)
        rows.append({**dict(zip(keys, group, strict=True)),
                     "batch_size": int(frame["batch_size"].iloc[0]),
                     "delta_mean": delta,
                     "delta_std": float(frame["delta_run"].std(ddof=1)) if len(frame) > 1
                     else math.nan,
                     "bound_mean": n * delta, "measurements": int(frame["measurements"].sum()),
                     "matched_loss": float(frame["matched_loss"].iloc[0]),
                     "delta_matched": delta_matched, "bound_matched": n * delta_matched,
                     "measured_to": float(frame["measured_to"].min()),
                     "over_training": covered,
                     "bound_min": float(frame["bound_min_run"].mean()),
                     "bound_at_target": float(frame["bound_at_target_run"].mean()),
                     "runs_reached": f"{int(frame['reached'].sum())} of {len(frame)}"})
    return pd.DataFrame(rows)


def delta_label(summary: pd.DataFrame) -> str:
    """How the study's Δ may be described: "averaged over training" only when every
    model's measurements span its run to the target."""
    if summary.empty:
        return "not measured"
    if bool(summary["over_training"].all()):
        return "averaged over training"
    span = float(summary["measured_to"].min())
    return "at initialisation" if span == 0 else f"over the first {span:.2g} epochs only"
