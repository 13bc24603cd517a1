"""What a study measured for one model, as plain data for ``batchbound.advise``.

The study room never imports advise: the command line (``advise --from-study``, ``report``)
reads these plain dicts here and hands them to ``advise.advise_from_study`` and
``advise.workers.workers_table``. Per model (and learning-rate strategy):

- ``batches``, ``iterations``: the median over seeds of the iterations to the study's first
  target at each grid batch (None when the median run missed it), with ``lrs`` the rate the
  final runs used there, and ``b_crit``, ``s_min`` from McCandlish et al.'s S(B) fitted to
  the model's reached runs (None without a fit);
- ``step_sizes``, ``step_seconds``: one worker's recorded seconds per iteration (data,
  compute, optimiser step), median per micro-batch over the model's final runs;
- ``batch_bound`` (n·Δ over the reference runs), ``n``, ``target``, a final run's
  ``config``, and ``ran``: the (B, η) pairs the model's final runs used.

Collapsed runs (``analysis.mark_collapsed``) are marked first and stay out of the fit, as in
the report.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from batchbound.errors import BatchboundError
from batchbound.models.user import refuse_module
from batchbound.study import analysis as A
from batchbound.study.plan import data_info
from batchbound.study.spec import DataSpec
from batchbound.study.store import Store

STEP_PHASES = ("data_per_iteration", "compute_per_iteration", "step_per_iteration")
FINISHED = ("complete", "diverged", A.COLLAPSED)


def chance_levels(labels: list[str]) -> dict[str, float | None]:
    """Per data label, the accuracy of chance (1/classes) for a classification set, None
    for another task or a set this machine cannot load (its runs are then checked for
    collapse by their loss alone)."""
    out: dict[str, float | None] = {}
    for label in labels:
        dataset, _, transform = str(label).partition(" | ")
        try:
            info = data_info(DataSpec(dataset, transform or None))
        except Exception:  # a report may be made where the data is not
            out[label] = None
            continue
        out[label] = 1.0 / info.d_out if info.task == "classification" and info.d_out > 1 \
            else None
    return out


def read_frames(store_path: str | Path, study: str | None) -> tuple[str, dict[str, Any]]:
    """(the study's name, its frames) from the store; ``study`` may be None when the store
    holds one."""
    if not Path(store_path).is_file():
        raise BatchboundError(f"study store {store_path} does not exist")
    with Store(store_path, readonly=True) as store:
        names = store.studies()
        if study is None:
            if len(names) != 1:
                raise BatchboundError(f"{store_path} holds studies {names}; name one (--study)")
            study = names[0]
        return study, store.frames(study)


def marked_runs(frames: dict[str, Any]) -> pd.DataFrame:
    """The runs with strategies shortened and collapsed runs marked."""
    runs = A.short_strategies(frames["runs"])
    chance = chance_levels(list(runs["data"].dropna().unique())) if "data" in runs else {}
    return A.mark_collapsed(runs, frames["curves"], chance)


def load_advice_input(store_path: str | Path, study: str | None = None,
                      model: str | None = None, strategy: str | None = None) -> dict[str, Any]:
    """``advice_input`` for one model read from a store (``advise --from-study``)."""
    name, frames = read_frames(store_path, study)
    return advice_input(frames, name, model, strategy)


def advice_input(frames: dict[str, Any], study: str, model: str | None = None,
                 strategy: str | None = None) -> dict[str, Any]:
    """The plain data of one ``model`` (a display name such as ``L=2 K=30``; needed when the
    study has several) and ``strategy`` (needed when it ran several); see the module doc."""
    runs = marked_runs(frames)
    per_run = A.per_run_to_target(runs, frames["targets"])
    done = per_run[per_run["status"].isin(FINISHED)]
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
    trained = mine[mine["status"] != A.COLLAPSED]  # collapsed runs: counted as misses
    summary = A.summarize_to_target(mine, "iterations").sort_values("batch_size")
    lrs = mine.groupby("batch_size")["lr"].median()
    b_crit, s_min = _fit(trained)
    iterations = [float(k) if math.isfinite(k) else None for k in summary["median"]]
    if not any(k is not None for k in iterations):
        raise BatchboundError(f"no batch size of {chosen!r} reached the target in {study!r}")
    configs = {k: json.loads(c) for k, c in zip(mine["key"], mine["config_json"], strict=True)}
    for config in configs.values():  # a study names families only: a module is an edit
        refuse_module(config.get("model"), f"the store's study {study!r}",
                      "a study's runs name model families only, so this store was edited")
    timings = frames["timings"][frames["timings"]["key"].isin(configs)]
    sizes, seconds = _recorded_step(timings, configs)
    diversity = A.diversity_summary(runs[runs["key"].isin(configs)], frames["diversity"],
                                    frames["curves"])
    bound = float(diversity["bound_mean"].iloc[0]) if len(diversity) else math.nan
    return {
        "study": study, "model": chosen,
        "strategy": strategy if strategy else (
            str(mine["strategy"].iloc[0]) if "strategy" in mine else None),
        "target": str(per_run["target"].iloc[0]), "n": int(mine["n_train"].iloc[0]),
        "batches": [int(b) for b in summary["batch_size"]], "iterations": iterations,
        "lrs": [float(lrs[b]) for b in summary["batch_size"]],
        "b_crit": b_crit, "s_min": s_min, "step_sizes": sizes, "step_seconds": seconds,
        "batch_bound": bound if math.isfinite(bound) else None,
        "config": next(iter(configs.values())),
        "ran": sorted({(float(b), float(lr)) for b, lr in zip(mine["batch_size"], mine["lr"],
                                                             strict=True)}),
    }


def advice_inputs(frames: dict[str, Any], study: str
                  ) -> list[tuple[str, dict[str, Any] | str]]:
    """(label, ``advice_input`` or why there is none) for every model and strategy of the
    study: what the report's workers table is made from."""
    runs = marked_runs(frames)
    per_run = A.per_run_to_target(runs, frames["targets"])
    final = A.in_spec_order(per_run[per_run["status"].isin(FINISHED)], runs)
    if final.empty:
        return []
    keys = [k for k in A.model_keys(final) if k != "strategy"]
    names = A.display_names(final, keys)
    strategies = final["strategy"] if "strategy" in final else pd.Series([None] * len(final))
    several = strategies.nunique() > 1
    out: list[tuple[str, dict[str, Any] | str]] = []
    for name, strategy in dict.fromkeys(zip(names, strategies, strict=True)):  # spec order
        label = f"{name} · {strategy}" if several else name
        try:
            out.append((label, advice_input(frames, study, name,
                                            strategy if several else None)))
        except BatchboundError as exc:
            out.append((label, str(exc)))
    return out


def _fit(trained: pd.DataFrame) -> tuple[float | None, float | None]:
    """(B_crit, S_min) of this model's reached runs, or (None, None) without a fit."""
    fit = A.critical_batch(trained, by=[], bootstrap=0) if len(trained) else pd.DataFrame()
    if not len(fit) or fit["at_bound"].iloc[0]:
        return None, None
    b_crit = float(fit["b_crit"].iloc[0])
    # S_min for this model alone (the joint fit's per-model S_min is not kept)
    reached = trained[np.isfinite(trained["iterations"])]
    return b_crit, float(np.median(reached["iterations"] / (1 + b_crit / reached["batch_size"])))


def _recorded_step(timings: pd.DataFrame, configs: dict[str, dict[str, Any]]
                   ) -> tuple[list[int], list[float]]:
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
    return sizes, [statistics.median(by_micro[m]) for m in sizes]
