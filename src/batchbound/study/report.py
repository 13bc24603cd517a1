"""The study report: analyses → the answer, tables, figures and the papers' claims, as HTML
and Markdown.

``analyze`` and ``claims`` (``summary.py``, re-exported here) run every analysis once and
test each registered claim (``batchbound.study.claims``) the study can speak to;
``write_report(store, study, out_dir)`` writes ``report.html`` (self-contained:
the answer first, then figures embedded as base64 PNG, tables, spec, environment),
``summary.md`` (opening with ``## Answer``) and every figure as PNG and SVG under
``figures/``. This module only renders: every number comes from the analyses
(``summary.py``: the bundle ``StudyAnalysis`` and the claims), ``answer`` or ``workers``.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from batchbound import kernels
from batchbound.errors import BatchboundError, FaultError
from batchbound.files import write_through, write_whole
from batchbound.study import analysis as A
from batchbound.study import document as D
from batchbound.study.answer import EDGE, GLOSSARY, answer_table, answers, sentence
from batchbound.study.claims import (
    CONTRADICTED,
    INCONCLUSIVE,
    SUPPORTED,
    UNTESTABLE,
    Finding,
)
from batchbound.study.claims.registry import fmt
from batchbound.study.columns import columns_shown
from batchbound.study.figures import render_figures
from batchbound.study.measured import advice_inputs
from batchbound.study.store import FINISHED, Store
from batchbound.study.summary import StudyAnalysis, analyze, claims, tuned_edges

__all__ = ["CONTRADICTED", "INCONCLUSIVE", "SUPPORTED", "UNTESTABLE", "analyze", "claims",
           "write_report"]


# ---- environment ----------------------------------------------------------------------------
def environment() -> dict[str, str]:
    import numpy
    import torch

    from batchbound import __version__

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"batchbound": __version__, "python": platform.python_version(),
            "torch": torch.__version__, "numpy": numpy.__version__,
            "pandas": pd.__version__, "platform": platform.platform(), "cpu": cpu,
            "cores": str(os.cpu_count()), "device": device, "kernels": kernels.describe(),
            "generated": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


# ---- the document ---------------------------------------------------------------------------
SHAPE_COLUMNS = {"model_label": "model", "depth": "depth", "width": "width",
                 "delta_mean": "Δ (avg)", "bound_mean": "n·Δ (avg)",
                 "delta_matched": "Δ (matched loss)", "bound_matched": "n·Δ (matched)",
                 "bound_min": "n·Δ min to target", "bound_at_target": "n·Δ at target",
                 "threshold_batch": "B*", "largest_batch": "largest B ≤ E ep",
                 "b_crit": "B_crit", "low": "B_crit 2.5%", "high": "B_crit 97.5%"}
TARGET_COLUMNS = {"target": "target", "model_label": "model", "runs": "runs",
                  "reached": "reached", "threshold_batch": "B*",
                  "largest_batch": "largest B ≤ E ep", "linear_until": "near-linear up to",
                  "stagnation_from": "stagnant from", "b_crit": "B_crit",
                  "low": "B_crit 2.5%", "high": "B_crit 97.5%", "outside": "B_crit flag"}
VERDICT_RULE = (
    "A claim is supported only when the 95 % interval of its effect (a bootstrap over the "
    "runs in each cell; for rank correlations also an exact permutation test at 5 %) "
    "excludes no effect in the claimed direction; contradicted when it excludes no effect in "
    "the other direction; inconclusive otherwise; not testable with the reason. n is the "
    "number of independent units the interval resamples (seeds per cell; pairs for "
    "stability). A claim is shown only for a study that varies what it speaks about; where "
    "the study's setting differs from the paper's, the difference is written beside it.")
WORKERS_TEXT = (
    "The time-optimal batch per worker count on the machine that wrote this report, as "
    "`batchbound advise --from-study` computes it: the iterations to the target this study "
    "measured (the fitted B_crit interpolates between grid batches; nothing outside the "
    "grid), one worker's step from the runs' recorded times, and the all-reduce timed here "
    "running the trainer's step on P local processes. ← marks the recommendation: the "
    "fewest workers past which doubling saves less than 10 %. A (B, η) no run used is "
    "marked interpolated.")
EDGE_NOTE = f" ({EDGE})"


def _grid(a: StudyAnalysis) -> list[float]:
    return sorted(a.epochs["batch_size"].astype(float).unique()) if len(a.epochs) else []


def _mark_edges(frame: pd.DataFrame, column: str, grid: list[float],
                edges: tuple[str, ...] = ("smallest", "largest")) -> None:
    """Write "at the grid edge" beside the values of ``column`` at those ends of the grid."""
    if column in frame:
        frame[column] = [f"{fmt(float(v))}{EDGE_NOTE}" if A.grid_edge(float(v), grid) in edges
                         else v for v in frame[column]]


def _mark_degenerate(frame: pd.DataFrame) -> None:
    """A degenerate B_crit is written as such, never as a number alone."""
    if "degenerate" in frame and "b_crit" in frame:
        frame["b_crit"] = [f"degenerate ({fmt(float(b))}: {why})" if why else b
                           for b, why in zip(frame["b_crit"], frame["degenerate"].fillna(""),
                                             strict=True)]


def shape_summary(a: StudyAnalysis, marked: bool = True) -> pd.DataFrame:
    """The per-shape table; ``marked``: grid edges and degenerate fits written beside the
    numbers (the report), else numbers with flag columns (shapes.csv)."""
    table = a.shapes.copy()
    grid = _grid(a)
    if marked:
        _mark_edges(table, "threshold_batch", grid)
        _mark_edges(table, "largest_batch", grid, ("largest",))
        _mark_degenerate(table)
    else:
        for column in ("threshold_batch", "largest_batch"):
            if column in table:
                table[f"{column} grid edge"] = [A.grid_edge(float(v), grid)
                                                for v in table[column]]
    cols = [c for c in SHAPE_COLUMNS if c in table]
    extra = [k for k in A.model_keys(table) if k != "model_label"]
    flags = [] if marked else [c for c in table if c.endswith("grid edge") or c == "degenerate"]
    return table[[*extra, *cols, *flags]].rename(columns=SHAPE_COLUMNS)


def target_summary(a: StudyAnalysis) -> pd.DataFrame:
    table = a.by_target.copy()
    grid = _grid(a)
    _mark_edges(table, "threshold_batch", grid)
    _mark_edges(table, "largest_batch", grid, ("largest",))
    _mark_edges(table, "linear_until", grid, ("largest",))
    _mark_edges(table, "stagnation_from", grid, ("smallest",))
    _mark_degenerate(table)
    extra = [k for k in A.model_keys(table) if k != "model_label"]
    cols = [c for c in TARGET_COLUMNS if c in table]
    return table[[cols[0], *extra, *cols[1:]]].rename(columns=TARGET_COLUMNS)


def tuned_edges_text(a: StudyAnalysis) -> str | None:
    edges = tuned_edges(a)
    if edges.empty:
        return None
    lr = a.spec.get("lr", {})
    grid = ", ".join(fmt(float(g)) for g in lr.get("grid", []))
    edges = edges.assign(_name=A.display_names(edges).to_numpy())
    cells = "; ".join(
        f"{name}: η {fmt(float(eta))} ({edge} of the grid) at B = "
        + ", ".join(str(int(b)) for b in part["batch_size"])
        for (name, eta, edge), part in edges.groupby(["_name", "lr", "edge"], sort=False))
    base = " (tuned at the smallest batch only, then scaled by the strategy)" \
        if lr.get("tune_at") == "base_batch" else ""
    return (f"Tuned η {EDGE} (grid {grid}; a better η may lie beyond it){base}: {cells}.")


def critical_text(a: StudyAnalysis) -> str:
    if a.critical_joint.empty:
        return "not enough reached runs to fit (need 3 batch sizes)"
    row = a.critical_joint.iloc[0]
    spread = ("one run per batch: the interval has no spread" if row["one_run"] else
              f"95 % bootstrap interval {row['low']:.0f}–{row['high']:.0f}")
    notes = [f"{int(row['points'])} runs reached the target",
             *([f"{int(row['censored'])} censored"] if row["censored"] else []),
             *([f"{int(row['diverged'])} diverged, left out"] if row["diverged"] else []),
             *([f"{int(row['collapsed'])} collapsed, left out"]
               if row.get("collapsed", 0) else [])]
    if row.get("degenerate"):
        return (f"degenerate fit ({row['degenerate']}; the fit's value {fmt(row['b_crit'])} "
                f"identifies no critical batch size; {', '.join(notes)})")
    flag = (" (at the search bound: not identified)" if row["at_bound"] else
            f" ({row['outside']} the batches that reached the target: an extrapolation)"
            if row["outside"] else "")
    return f"B_crit = {row['b_crit']:.0f} ({spread}; {', '.join(notes)}){flag}"


def spec_text(value: Any, indent: int = 0) -> str:
    """The spec as JSON, a list of plain values on one line ("batch_sizes": [16, 32, 64]):
    one value a line made the spec three screens long."""
    pad = "  " * (indent + 1)
    if isinstance(value, dict) and value:
        items = [f"{pad}{json.dumps(k, ensure_ascii=False)}: {spec_text(v, indent + 1)}"
                 for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * indent + "}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        items = [f"{pad}{spec_text(v, indent + 1)}" for v in value]
        return "[\n" + ",\n".join(items) + "\n" + "  " * indent + "]"
    return json.dumps(value, ensure_ascii=False)


def unfinished(a: StudyAnalysis) -> str | None:
    """The report's warning when no run has finished (all failed, pending or stopped):
    every table is then empty, which must not read as "no batch size reaches the target"."""
    runs = a.frames["runs"]
    if runs["status"].isin([*FINISHED, A.COLLAPSED]).any():
        return None
    held = ", ".join(f"{n} {status}" for status, n in runs["status"].value_counts().items())
    return (f"No run has finished yet ({held}): nothing below is measured; run `batchbound "
            "study run` to finish the study.")


def run_counts(a: StudyAnalysis) -> tuple[str, int]:
    """"final complete: 71, final diverged: 13, …" and the number of failed runs."""
    runs = a.frames["runs"]
    counts = runs.groupby(["role", "status"]).size()
    failed = int((runs["status"] == "failed").sum())
    return ", ".join(f"{r} {s}: {n}" for (r, s), n in counts.items()), failed


def document(a: StudyAnalysis, study: str, figure_paths: list[tuple[str, str, Path]],
             found: list[Finding], env: dict[str, str], workers: pd.DataFrame | None = None
             ) -> tuple[list[Any], list[Any], list[Any]]:
    """The report's blocks: (head, answer, body). The HTML shows them in that order;
    summary.md opens with the answer."""
    counts, failed = run_counts(a)
    target = a.targets[0] if a.targets else "the target"
    rows = answers(a, workers)
    head: list[Any] = [D.Heading(1, f"Study {study}"),
                       *([D.Text(a.spec["description"])] if a.spec.get("description") else [])]
    answer: list[Any] = [
        D.Heading(2, f"Answer — study {study}"),
        *([D.Text(f"**{unfinished(a)}**", "warning")] if unfinished(a) else []),
        *([D.Text(f"**{failed} runs failed**: every number below leaves them out; rerun the "
                  "study to retry them.", "warning")] if failed else []),
        *[D.Text(sentence(row, target)) for row in rows],
        D.Table(answer_table(rows))]
    if workers is not None and len(workers):
        answer.append(D.Section("workers", [D.Heading(3, "How many workers"),
                                            D.Text(WORKERS_TEXT.replace("`", "")),
                                            D.Table(workers.astype(object).fillna(""))]))
    answer += [D.Heading(3, "Glossary"), D.Pairs(GLOSSARY)]
    edges = tuned_edges_text(a)
    body: list[Any] = [
        D.Text(f"Runs: {counts}."), D.Heading(2, "Per shape"), D.Table(shape_summary(a)),
        D.Text(f"E = {a.budget:g} epoch{'' if a.budget == 1 else 's'}. Critical batch size of "
               f"the study (one B_crit for all shapes): {critical_text(a)}."),
        *([D.Text(edges)] if edges else [])]
    if len(a.targets) > 1:
        body += [D.Heading(2, "Every target", anchor="targets"), D.Table(target_summary(a))]
    body += [D.Heading(2, "The papers' claims", anchor="claims"),
             D.Text(VERDICT_RULE, "small"), D.Verdicts(tuple(found))]
    in_sections = {stem for s in a.sections for stem, _, _ in s.figures}
    for section in a.sections:
        stems = {f[0] for f in section.figures}
        blocks: list[Any] = [D.Heading(2, section.title, cite=section.source),
                             D.Text(section.text),
                             *[D.Figure(*f) for f in figure_paths if f[0] in stems]]
        for caption, frame in section.tables:
            blocks += [D.Heading(3, caption), D.Table(frame)]
        blocks.append(D.Verdicts(tuple(c for c in found if c.section == section.key)))
        body.append(D.Section(section.key, blocks))
    epochs = a.epochs.copy()
    if len(edges_frame := tuned_edges(a)):
        keys = [k for k in edges_frame.columns if k not in ("lr", "edge")]
        epochs = epochs.merge(edges_frame.drop(columns="lr").rename(
            columns={"edge": "η at grid edge"}), on=keys, how="left").fillna(
            {"η at grid edge": ""})
    tables = [epochs, a.speedups, a.regimes, a.critical, a.loss_thresholds, a.diversity]
    body += [D.Heading(2, "Figures"),
             *[D.Figure(*f) for f in figure_paths if f[0] not in in_sections],
             D.Heading(2, "Tables"),
             D.Heading(3, "Epochs to target per model and B (η: the tuned step size; censored: "
                       "stopped short of the target; diverged and collapsed: left out of fits; "
                       "first_eval: reached by the first evaluation, so the true epochs lie "
                       "lower)"),
             D.Table(epochs),
             D.Heading(3, "Speedup"), D.Table(a.speedups),
             D.Heading(3, "Regimes"), D.Table(a.regimes),
             D.Heading(3, "Critical batch size per model"),
             D.Table(a.critical, "not enough data"),
             D.Heading(3, "Loss thresholds (diverged and collapsed runs left out)"),
             D.Table(a.loss_thresholds),
             D.Heading(3, "Gradient diversity"), D.Table(a.diversity, "no measurements"),
             D.Heading(3, "What each column holds"),
             D.Text("The tables above are the analyses' own, under the column names "
                    "batchbound study export writes to CSV.", "small"),
             D.Pairs(columns_shown(tables)),
             D.Heading(2, "Study spec"), D.Pre(spec_text(a.spec)),
             D.Heading(2, "Environment"), D.Pairs(tuple((k, v, "") for k, v in env.items())),
             D.Heading(2, "References"), D.References()]
    return head, [D.Section("answer", answer)], body


def markdown(a: StudyAnalysis, study: str, figure_paths: list[tuple[str, str, Path]],
             found: list[Finding], workers: pd.DataFrame | None = None,
             env: dict[str, str] | None = None) -> str:
    head, answer, body = document(a, study, figure_paths, found, env or environment(), workers)
    return D.to_markdown([*answer, *head, *body])


def html_page(a: StudyAnalysis, study: str, figure_paths: list[tuple[str, str, Path]],
              found: list[Finding], env: dict[str, str], workers: pd.DataFrame | None = None
              ) -> str:
    head, answer, body = document(a, study, figure_paths, found, env, workers)
    return D.to_html([*head, *answer, *body], f"Study {study}")


@dataclass(frozen=True)
class ReportPaths:
    html: Path
    markdown: Path
    figures: list[Path]
    analysis: StudyAnalysis
    failed: int = 0


Workers = Callable[[list[tuple[str, dict[str, Any] | str]], int | None], pd.DataFrame]


def write_report(store_path: str | Path, study: str | None, out_dir: str | Path,
                 max_workers: int | None = None, workers: Workers | None = None
                 ) -> ReportPaths:
    """Analyse ``study`` in the store (the only one when None) and write the report. Its
    "how many workers" table is ``workers(inputs, max_workers)`` with the study's measured
    data per model (``measured.advice_inputs``): ``batchbound.advise.workers.workers_table``
    gives it (the command line passes it; the study room does not import advise), up to
    ``max_workers`` (this machine's cores by default). Without ``workers`` the report has
    no such table."""
    with Store(store_path, readonly=True) as store:
        if study is None:
            names = store.studies()
            if len(names) != 1:
                raise BatchboundError(f"{store_path} holds studies {names}; name one")
            study = names[0]
        spec, frames = store.study_spec(study), store.frames(study)
        kept = frames.get("snapshots", pd.DataFrame())
        snapshots = store.snapshots(list(kept["key"].unique())) if len(kept) else {}
    if frames["runs"].empty:  # nothing to analyse: the tables would have no columns
        raise BatchboundError(f"study {study} has no runs in {store_path}: nothing to report; "
                              "run `batchbound study run` first")
    out = Path(out_dir)
    with _writing(out):  # an unwritable folder fails now, before the analyses
        out.mkdir(parents=True, exist_ok=True)
    a = analyze(frames, spec, snapshots)
    found = claims(a)
    table = workers(advice_inputs(frames, study), max_workers) if workers else None
    with _writing(out):  # the folder deleted or made read-only meanwhile: one clear line
        figure_paths = render_figures(a, out / "figures")
        env = environment()
        # each file whole or not at all: a full disk or a kill keeps the earlier report's
        write_whole(out / "summary.md", markdown(a, study, figure_paths, found, table, env))
        write_whole(out / "report.html", html_page(a, study, figure_paths, found, env, table))
        shapes = shape_summary(a, marked=False)
        write_through(out / "shapes.csv", lambda tmp: shapes.to_csv(tmp, index=False))
    return ReportPaths(out / "report.html", out / "summary.md",
                       [p for _, _, p in figure_paths], a, run_counts(a)[1])


@contextmanager
def _writing(out: Path) -> Iterator[None]:
    """A failed write of the report's files as one line naming the folder: a FaultError
    when the disk is full or failing (the report is made again once there is room), else a
    BatchboundError (the folder deleted or made read-only meanwhile)."""
    try:
        yield
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        kind = FaultError if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO) \
            else BatchboundError
        raise kind(f"cannot write the report to {out}: {exc.strerror or exc}{where}") from None
