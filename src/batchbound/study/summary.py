"""The study's analyses, run once: ``analyze(frames, spec)`` → ``StudyAnalysis``, the bundle
every table, figure, experiment section, answer and claim reads, and ``claims(analysis)``,
the papers' claims tested on it. The report (``report.py``) only renders what is here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from batchbound.study import analysis as A
from batchbound.study.claims import Context, Finding, evaluate
from batchbound.study.evidence import Evidence
from batchbound.study.experiments import Section, sections
from batchbound.study.measured import chance_levels
from batchbound.study.references import REFERENCES

__all__ = ["StudyAnalysis", "analyze", "claims", "shape_table", "target_table", "tuned_edges"]


@dataclass
class StudyAnalysis:
    """Every analysis of one study, computed once by ``analyze``: the tables per run, per
    cell and per model (analysis.py's functions, in the spec's order), the per-shape table,
    and the papers' other experiments (``sections``). Renderers only read it."""

    spec: dict[str, Any]
    frames: dict[str, pd.DataFrame]
    budget: float
    per_run: pd.DataFrame
    epochs: pd.DataFrame
    iterations: pd.DataFrame
    thresholds: pd.DataFrame
    largest: pd.DataFrame
    speedups: pd.DataFrame
    regimes: pd.DataFrame
    critical: pd.DataFrame
    critical_joint: pd.DataFrame
    loss_thresholds: pd.DataFrame
    loss_speedups: pd.DataFrame
    along: pd.DataFrame
    diversity: pd.DataFrame
    delta_runs: pd.DataFrame = field(default_factory=pd.DataFrame)
    targets: list[str] = field(default_factory=list)
    by_target: pd.DataFrame = field(default_factory=pd.DataFrame)
    shapes: pd.DataFrame = field(default_factory=pd.DataFrame)
    sections: list[Section] = field(default_factory=list)  # the papers' other experiments
    snapshots: dict[str, Any] = field(default_factory=dict)  # Store.snapshots of the runs


def analyze(frames: dict[str, pd.DataFrame], spec: dict[str, Any],
            snapshots: dict[str, Any] | None = None,
            chance: dict[str, float | None] | None = None) -> StudyAnalysis:
    """Every analysis of the study. Runs that collapsed (``analysis.mark_collapsed``; the
    accuracy of chance per data label from ``chance``, by default ``chance_levels``) are
    marked first, so that every table counts them and no fit uses them."""
    runs = A.short_strategies(frames["runs"])
    if chance is None:
        chance = chance_levels(list(runs["data"].dropna().unique())) if "data" in runs else {}
    frames = {**frames, "runs": A.mark_collapsed(runs, frames["curves"], chance)}
    runs = frames["runs"]
    train = spec.get("train", {})
    budget = train.get("epochs_budget") or train.get("max_epochs", 20) / 2
    targets = A.target_names(runs, frames["targets"])
    per_run = A.per_run_to_target(runs, frames["targets"], targets[0] if targets else None)
    epochs = A.summarize_to_target(per_run, "epochs")
    iterations = A.summarize_to_target(per_run, "iterations")
    max_epochs = train.get("max_epochs")
    speedups = A.speedup(iterations, max_epochs=max_epochs)
    loss_thresholds = A.loss_threshold(runs, frames["curves"])
    per_loss = A.per_run_to_loss(runs, frames["curves"], loss_thresholds)
    cadence = float(train.get("diversity_every_epochs") or 0.0)
    diversity = A.diversity_summary(runs, frames["diversity"], frames["curves"],
                                    targets=frames["targets"], cadence=cadence)
    delta_runs = A.diversity_runs(runs, frames["diversity"], frames["curves"],
                                  frames["targets"])
    out = StudyAnalysis(
        spec=spec, frames=frames, budget=float(budget), per_run=per_run, epochs=epochs,
        iterations=iterations, thresholds=A.threshold_batch(epochs),
        largest=A.largest_batch_within(epochs, budget), speedups=speedups,
        regimes=A.regime_boundaries(speedups) if len(speedups) else pd.DataFrame(),
        critical=A.critical_batch(per_run), critical_joint=A.critical_batch(per_run, by=[]),
        loss_thresholds=loss_thresholds,
        loss_speedups=A.speedup(A.summarize_to_target(per_loss, "iterations"),
                                max_epochs=max_epochs),
        along=A.diversity_along_training(runs, frames["diversity"]), diversity=diversity,
        delta_runs=delta_runs, targets=targets,
        # shown only for several targets; the first target's tables are the ones above
        by_target=target_table(runs, frames["targets"], targets, float(budget), max_epochs)
        if len(targets) > 1 else pd.DataFrame(),
    )
    for name, value in vars(out).items():
        if isinstance(value, pd.DataFrame) and name != "per_run":
            setattr(out, name, A.in_spec_order(value, runs))
    out.shapes = A.in_spec_order(shape_table(out), runs)
    out.snapshots = snapshots or {}
    out.sections = sections(out)
    return out


def target_table(runs: pd.DataFrame, targets: pd.DataFrame, names: list[str],
                 budget: float, max_epochs: float | None = None) -> pd.DataFrame:
    """Per model and target: B*, the largest B within E epochs, near-linear up to, and
    B_crit with its 95 % interval; one block per target the runs were trained to."""
    blocks = []
    for name in names:
        per_run = A.per_run_to_target(runs, targets, name)
        epochs = A.summarize_to_target(per_run, "epochs")
        keys = [*A.model_keys(epochs), *[c for c in A.SHAPE_COLUMNS if c in epochs]]
        table = A.threshold_batch(epochs).merge(A.largest_batch_within(epochs, budget),
                                                on=keys, how="outer")
        speedups = A.speedup(A.summarize_to_target(per_run, "iterations"),
                             max_epochs=max_epochs)
        if len(speedups):
            table = table.merge(A.regime_boundaries(speedups), on=keys, how="left")
        crit = A.critical_batch(per_run)
        crit_keys = [k for k in A.model_keys(per_run) if k in table]
        if len(crit):
            table = table.merge(crit[[*crit_keys, "b_crit", "low", "high", "outside",
                                      "degenerate"]], on=crit_keys, how="left")
        reached = per_run.groupby(A.model_keys(per_run))["reached"].agg(["sum", "size"])
        table = table.merge(reached.rename(columns={"sum": "reached", "size": "runs"})
                            .reset_index(), on=A.model_keys(per_run), how="left")
        blocks.append(table.assign(target=name))
    return pd.concat(blocks, ignore_index=True) if blocks else pd.DataFrame()


def shape_table(a: StudyAnalysis) -> pd.DataFrame:
    """Per model: depth, width, Δ, n·Δ, B*, largest B within E, B_crit (the demo's table)."""
    keys = [*A.model_keys(a.epochs), *[c for c in A.SHAPE_COLUMNS if c in a.epochs]]
    table = a.thresholds.merge(a.largest, on=keys, how="outer")
    if len(a.diversity):
        table = table.merge(a.diversity.drop(columns=["batch_size"]), on=keys, how="left")
    else:
        table = table.assign(delta_mean=math.nan, bound_mean=math.nan, delta_matched=math.nan,
                             bound_matched=math.nan)
    if len(a.critical):
        crit_keys = [k for k in A.model_keys(a.per_run) if k in table]
        table = table.merge(a.critical[[*crit_keys, "b_crit", "low", "high", "degenerate"]],
                            on=crit_keys, how="left")
    else:
        table = table.assign(b_crit=math.nan, low=math.nan, high=math.nan)
    sort = [c for c in ("depth", "width") if c in table and table[c].notna().all()]
    return table.sort_values(sort or keys).reset_index(drop=True)


def claims(a: StudyAnalysis) -> list[Finding]:
    """Every registered claim this study can speak to, tested on bootstrap draws."""
    delta_how = A.delta_label(a.diversity)
    matched = len(a.diversity) and a.diversity["delta_matched"].notna().all()
    column = "delta_matched_run" if matched else "delta_run"
    deltas = a.delta_runs.rename(columns={column: "delta"}) if len(a.delta_runs) else None
    if matched:
        delta_how = f"at matched training loss, {delta_how.replace('averaged ', '')}"
    context = Context(
        evidence=Evidence(a.per_run, deltas), budget=a.budget,
        max_batch=float(a.epochs["batch_size"].max()) if len(a.epochs) else math.nan,
        critical=a.critical, diversity=a.diversity, delta_how=delta_how,
        sections={s.key: s for s in a.sections}, spec=a.spec, diversity_runs=a.delta_runs)
    order = list(REFERENCES)
    return sorted(evaluate(context), key=lambda f: order.index(f.source))


def tuned_edges(a: StudyAnalysis) -> pd.DataFrame:
    """The tuned cells whose η is at the top or bottom of the tuning grid (with
    ``tune_at = "base_batch"`` only the smallest batch was tuned)."""
    lr = a.spec.get("lr", {})
    if lr.get("tuning", "lowest_loss_2_epochs") == "none":
        return pd.DataFrame()
    edges = A.tuned_at_edge(a.frames["runs"], [float(g) for g in lr.get("grid", [])])
    if lr.get("tune_at") == "base_batch" and len(edges):
        edges = edges[edges["batch_size"] == edges["batch_size"].min()]
    return edges
