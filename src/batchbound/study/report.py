"""The study report: analyses → the answer, tables, figures and the papers' claims, as HTML
and Markdown.

``analyze(frames, spec)`` runs every analysis once and returns a ``StudyAnalysis``;
``claims(analysis)`` tests each registered claim (``batchbound.study.claims``) the study can
speak to; ``write_report(store, study, out_dir)`` writes ``report.html`` (self-contained:
the answer first, then figures embedded as base64 PNG, tables, spec, environment),
``summary.md`` (opening with ``## Answer``) and every figure as PNG and SVG under
``figures/``. This module only renders: every number comes from ``analysis``, ``claims``,
``answer`` or ``workers``.
"""

from __future__ import annotations

import base64
import errno
import html
import json
import math
import os
import platform
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from batchbound import kernels
from batchbound.errors import BatchboundError, FaultError
from batchbound.study import analysis as A
from batchbound.study.answer import GLOSSARY, answer_table, sentence
from batchbound.study.claims import (
    CONTRADICTED,
    INCONCLUSIVE,
    SUPPORTED,
    UNTESTABLE,
    Context,
    Finding,
    evaluate,
)
from batchbound.study.claims.registry import fmt
from batchbound.study.evidence import Evidence
from batchbound.study.experiments import Section, sections
from batchbound.study.figures import render_figures
from batchbound.study.references import REFERENCES
from batchbound.study.store import FINISHED, Store
from batchbound.study.workers import workers_table

__all__ = ["CONTRADICTED", "INCONCLUSIVE", "SUPPORTED", "UNTESTABLE", "analyze", "claims",
           "write_report"]


@dataclass
class StudyAnalysis:
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
            snapshots: dict[str, Any] | None = None) -> StudyAnalysis:
    frames = {**frames, "runs": A.short_strategies(frames["runs"])}
    runs = frames["runs"]
    train = spec.get("train", {})
    budget = train.get("epochs_budget") or train.get("max_epochs", 20) / 2
    targets = A.target_names(runs, frames["targets"])
    per_run = A.per_run_to_target(runs, frames["targets"], targets[0] if targets else None)
    epochs = A.summarize_to_target(per_run, "epochs")
    iterations = A.summarize_to_target(per_run, "iterations")
    speedups = A.speedup(iterations)
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
        loss_speedups=A.speedup(A.summarize_to_target(per_loss, "iterations")),
        along=A.diversity_along_training(runs, frames["diversity"]), diversity=diversity,
        delta_runs=delta_runs, targets=targets,
        # shown only for several targets; the first target's tables are the ones above
        by_target=target_table(runs, frames["targets"], targets, float(budget))
        if len(targets) > 1 else pd.DataFrame(),
    )
    out.shapes = shape_table(out)
    out.snapshots = snapshots or {}
    out.sections = sections(out)
    return out


def target_table(runs: pd.DataFrame, targets: pd.DataFrame, names: list[str],
                 budget: float) -> pd.DataFrame:
    """Per model and target: B*, the largest B within E epochs, near-linear up to, and
    B_crit with its 95 % interval; one block per target the runs were trained to."""
    blocks = []
    for name in names:
        per_run = A.per_run_to_target(runs, targets, name)
        epochs = A.summarize_to_target(per_run, "epochs")
        keys = [*A.model_keys(epochs), *[c for c in A.SHAPE_COLUMNS if c in epochs]]
        table = A.threshold_batch(epochs).merge(A.largest_batch_within(epochs, budget),
                                                on=keys, how="outer")
        speedups = A.speedup(A.summarize_to_target(per_run, "iterations"))
        if len(speedups):
            table = table.merge(A.regime_boundaries(speedups), on=keys, how="left")
        crit = A.critical_batch(per_run)
        crit_keys = [k for k in A.model_keys(per_run) if k in table]
        if len(crit):
            table = table.merge(crit[[*crit_keys, "b_crit", "low", "high", "outside"]],
                                on=crit_keys, how="left")
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
        table = table.merge(a.critical[[*crit_keys, "b_crit", "low", "high"]], on=crit_keys,
                            how="left")
    else:
        table = table.assign(b_crit=math.nan, low=math.nan, high=math.nan)
    sort = [c for c in ("depth", "width") if c in table and table[c].notna().all()]
    return table.sort_values(sort or keys).reset_index(drop=True)


# ---- claims ---------------------------------------------------------------------------------
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
        sections={s.key: s for s in a.sections})
    order = list(REFERENCES)
    return sorted(evaluate(context), key=lambda f: order.index(f.source))


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


# ---- writers --------------------------------------------------------------------------------
SHAPE_COLUMNS = {"model_label": "model", "depth": "depth", "width": "width",
                 "delta_mean": "Δ (avg)", "bound_mean": "n·Δ (avg)",
                 "delta_matched": "Δ (matched loss)", "bound_matched": "n·Δ (matched)",
                 "threshold_batch": "B*", "largest_batch": "largest B ≤ E ep",
                 "b_crit": "B_crit", "low": "B_crit 2.5%", "high": "B_crit 97.5%"}
TARGET_COLUMNS = {"target": "target", "model_label": "model", "runs": "runs",
                  "reached": "reached", "threshold_batch": "B*",
                  "largest_batch": "largest B ≤ E ep", "linear_until": "near-linear up to",
                  "stagnation_from": "stagnant from", "b_crit": "B_crit",
                  "low": "B_crit 2.5%", "high": "B_crit 97.5%", "outside": "B_crit flag"}
VERDICT_CSS = {SUPPORTED: "supported", CONTRADICTED: "not", INCONCLUSIVE: "inconclusive"}
VERDICT_RULE = (
    "A claim is supported only when the 95 % interval of its effect (a bootstrap over the "
    "runs in each cell; for rank correlations also an exact permutation test at 5 %) "
    "excludes no effect in the claimed direction; contradicted when it excludes no effect in "
    "the other direction; inconclusive otherwise; not testable with the reason. A claim is "
    "shown only for a study that varies what it speaks about.")
WORKERS_TEXT = (
    "The time-optimal batch per worker count on the machine that wrote this report, as "
    "`batchbound advise --from-study` computes it: the iterations to the target this study "
    "measured (the fitted B_crit interpolates between grid batches; nothing outside the "
    "grid), one worker's step from the runs' recorded times, and the all-reduce timed here "
    "running the trainer's step on P local processes. ← marks the recommendation: the "
    "fewest workers past which doubling saves less than 10 %.")


def shape_summary(a: StudyAnalysis) -> pd.DataFrame:
    cols = [c for c in SHAPE_COLUMNS if c in a.shapes]
    extra = [k for k in A.model_keys(a.shapes) if k != "model_label"]
    return a.shapes[[*extra, *cols]].rename(columns=SHAPE_COLUMNS)


def target_summary(a: StudyAnalysis) -> pd.DataFrame:
    extra = [k for k in A.model_keys(a.by_target) if k != "model_label"]
    cols = [c for c in TARGET_COLUMNS if c in a.by_target]
    return a.by_target[[cols[0], *extra, *cols[1:]]].rename(columns=TARGET_COLUMNS)


def critical_text(a: StudyAnalysis) -> str:
    if a.critical_joint.empty:
        return "not enough reached runs to fit (need 3 batch sizes)"
    row = a.critical_joint.iloc[0]
    spread = ("one run per batch: the interval has no spread" if row["one_run"] else
              f"95 % bootstrap interval {row['low']:.0f}–{row['high']:.0f}")
    notes = [f"{int(row['points'])} runs reached the target",
             *([f"{int(row['censored'])} censored"] if row["censored"] else []),
             *([f"{int(row['diverged'])} diverged, left out"] if row["diverged"] else [])]
    flag = (" (at the search bound: not identified)" if row["at_bound"] else
            f" ({row['outside']} the batches that reached the target: an extrapolation)"
            if row["outside"] else "")
    return f"B_crit = {row['b_crit']:.0f} ({spread}; {', '.join(notes)}){flag}"


def unfinished(a: StudyAnalysis) -> str | None:
    """The report's warning when no run has finished (all failed, pending or stopped):
    every table is then empty, which must not read as "no batch size reaches the target"."""
    runs = a.frames["runs"]
    if runs["status"].isin(FINISHED).any():
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


def _cell(value: Any) -> str:
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if math.isnan(value):
            return "n/a"
        if math.isinf(value):
            return "miss" if value > 0 else "−∞"
        return fmt(value)
    return str(value)


def _md_table(frame: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * frame.shape[1]]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(_cell(v).replace("|", "\\|") for v in row) + " |")
    return "\n".join(lines)


def _cite(key: str) -> str:
    return f"[{key}]" if key else ""


def markdown(a: StudyAnalysis, study: str, figure_paths: list[tuple[str, str, Path]],
             found: list[Finding], workers: pd.DataFrame | None = None) -> str:
    counts, failed = run_counts(a)
    target = a.targets[0] if a.targets else "the target"
    answer = answer_table(a, workers)
    shown = workers.astype(object).fillna("") if workers is not None else None
    lines = [f"## Answer — study {study}", "",
             *([f"**{unfinished(a)}**", ""] if unfinished(a) else []),
             *([f"**{failed} runs failed**: every number below leaves them out; rerun the "
                "study to retry them.", ""] if failed else []),
             *[sentence(row, target) + "\n" for _, row in answer.iterrows()],
             _md_table(answer), "",
             *(["### How many workers", "", WORKERS_TEXT, "", _md_table(shown), ""]
               if shown is not None and len(shown) else []),
             "### Glossary", "",
             *[f"- **{term}**: {text}{' ' + _cite(src) if src else ''}."
               for term, text, src in GLOSSARY], "",
             f"# Study {study}", "", *([a.spec["description"], ""]
                                       if a.spec.get("description") else []),
             f"Runs: {counts}.", "", "## Per shape", "", _md_table(shape_summary(a)), "",
             f"E = {a.budget:g} epochs. Critical batch size of the study (one B_crit for all "
             f"shapes): {critical_text(a)}.", ""]
    if len(a.targets) > 1:
        lines += ["## Every target", "", _md_table(target_summary(a)), ""]
    lines += ["## The papers' claims", "", VERDICT_RULE, ""]
    for c in found:
        lines.append(f"- **{c.verdict}** {_cite(c.source)}: {c.claim} {c.evidence}")
    in_sections = {stem for s in a.sections for stem, _, _ in s.figures}
    for section in a.sections:
        lines += ["", f"## {section.title} {_cite(section.source)}", "", section.text, ""]
        for stem, caption, path in figure_paths:
            if stem in {f[0] for f in section.figures}:
                lines += [f"![{stem}](figures/{path.name}) {caption}", ""]
        for caption, frame in section.tables:
            lines += [f"**{caption}**", "", _md_table(frame), ""]
        lines += [f"- **{c.verdict}** {_cite(c.source)}: {c.claim} {c.evidence}"
                  for c in found if c.section == section.key]
    lines += ["", "## Figures", ""]
    for stem, caption, path in figure_paths:
        if stem not in in_sections:
            lines += [f"![{stem}](figures/{path.name}) {caption}", ""]
    lines += ["## References", "", *[f"- [{k}] {v}" for k, v in REFERENCES.items()]]
    return "\n".join(lines) + "\n"


CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222}table{border-collapse:collapse;font-size:13px;margin:1em 0}td,th{border:1px solid
#ccc;padding:3px 7px;text-align:right}th{background:#f2f2f2}figure{margin:1.5em 0}
figcaption{font-size:13px;color:#555}.supported{color:#176317}.not{color:#a31515}
.inconclusive{color:#8a6d00}.untestable{color:#777}#answer{background:#f4f8fc;border:1px solid
#c9dbee;padding:0.5em 1.2em 1em;border-radius:6px}.failed{background:#fdecea;border:1px solid
#e6a29c;padding:0.6em 1em}table.glossary td{text-align:left}
table.glossary th{text-align:left;white-space:nowrap}
pre{background:#f7f7f7;padding:1em;font-size:12px;white-space:pre-wrap;word-break:break-all}"""


def _bold(text: str) -> str:
    """Escape, then turn the sentence's **name** into <b>name</b>."""
    return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", html.escape(text))


def html_page(a: StudyAnalysis, study: str, figure_paths: list[tuple[str, str, Path]],
              found: list[Finding], env: dict[str, str], workers: pd.DataFrame | None = None
              ) -> str:
    e = html.escape

    def table(frame: pd.DataFrame) -> str:
        head = "".join(f"<th>{e(str(c))}</th>" for c in frame.columns)
        body = "".join("<tr>" + "".join(f"<td>{e(_cell(v))}</td>" for v in row) + "</tr>"
                       for row in frame.itertuples(index=False))
        return f"<table><tr>{head}</tr>{body}</table>"

    def figure(stem: str, caption: str, path: Path) -> str:
        data = base64.b64encode(path.read_bytes()).decode()
        return (f"<figure id='{e(stem)}'><img alt='{e(stem)}' style='max-width:100%' "
                f"src='data:image/png;base64,{data}'><figcaption>{e(caption)}"
                "</figcaption></figure>")

    def verdict(c: Finding) -> str:
        css = VERDICT_CSS.get(c.verdict, "untestable")
        return (f"<li><b class='{css}'>{e(c.verdict)}</b> {cite.get(c.source, '')}: "
                f"{e(c.claim)} <br><small>{e(c.evidence)}</small></li>")

    counts, failed = run_counts(a)
    target = a.targets[0] if a.targets else "the target"
    answer = answer_table(a, workers)
    cite = {k: f"<a href='#ref-{k}'>[{k}]</a>" for k in REFERENCES}
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Study {e(study)}"
             f"</title><style>{CSS}</style></head><body>",
             f"<h1>Study {e(study)}</h1><p>{e(a.spec.get('description', ''))}</p>",
             "<section id='answer'><h2>Answer</h2>",
             *([f"<p class='failed'><b>{e(unfinished(a) or '')}</b></p>"] if unfinished(a)
               else []),
             *([f"<p class='failed'><b>{failed} runs failed</b>: every number below leaves "
                "them out; rerun the study to retry them.</p>"] if failed else []),
             *[f"<p>{_bold(sentence(row, target))}</p>" for _, row in answer.iterrows()],
             table(answer)]
    if workers is not None and len(workers):
        parts += ["<section id='workers'><h3>How many workers</h3>",
                  f"<p>{e(WORKERS_TEXT.replace('`', ''))}</p>",
                  table(workers.astype(object).fillna("")), "</section>"]
    parts += ["<h3>Glossary</h3><table class='glossary'>",
              *[f"<tr><th>{e(term)}</th><td>{e(text)} {cite.get(src, '')}</td></tr>"
                for term, text, src in GLOSSARY], "</table></section>",
              f"<p>Runs: {e(counts)}.</p>",
              "<h2>Per shape</h2>", table(shape_summary(a)),
              f"<p>E = {a.budget:g} epochs. Study critical batch size: "
              f"{e(critical_text(a))}.</p>"]
    if len(a.targets) > 1:
        parts += ["<h2 id='targets'>Every target</h2>", table(target_summary(a))]
    parts += ["<h2 id='claims'>The papers' claims</h2>", f"<p><small>{e(VERDICT_RULE)}"
              "</small></p><ul>"]
    parts += [verdict(c) for c in found]
    parts.append("</ul>")
    in_sections = {stem for s in a.sections for stem, _, _ in s.figures}
    for section in a.sections:
        stems = {f[0] for f in section.figures}
        parts += [f"<section id='{e(section.key)}'><h2>{e(section.title)} "
                  f"{cite.get(section.source, '')}</h2><p>{e(section.text)}</p>",
                  *[figure(*f) for f in figure_paths if f[0] in stems]]
        for caption, frame in section.tables:
            parts += [f"<h3>{e(caption)}</h3>", table(frame)]
        mine = [verdict(c) for c in found if c.section == section.key]
        parts += [f"<ul>{''.join(mine)}</ul>" if mine else "", "</section>"]
    parts.append("<h2>Figures</h2>")
    parts += [figure(*f) for f in figure_paths if f[0] not in in_sections]
    parts += ["<h2>Tables</h2><h3>Epochs to target per model and B (η: the tuned step size; "
              "censored: stopped short of the target; diverged: left out of fits)</h3>",
              table(a.epochs),
              "<h3>Speedup</h3>", table(a.speedups) if len(a.speedups) else "<p>none</p>",
              "<h3>Regimes</h3>", table(a.regimes) if len(a.regimes) else "<p>none</p>",
              "<h3>Critical batch size per model</h3>",
              table(a.critical) if len(a.critical) else "<p>not enough data</p>",
              "<h3>Loss thresholds (diverged runs left out)</h3>", table(a.loss_thresholds),
              "<h3>Gradient diversity</h3>",
              table(a.diversity) if len(a.diversity) else "<p>no measurements</p>",
              "<h2>Study spec</h2>", f"<pre>{e(json.dumps(a.spec, indent=2))}</pre>",
              "<h2>Environment</h2>", "<table>" + "".join(
                  f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in env.items())
              + "</table>", "<h2>References</h2><ul>",
              *[f"<li id='ref-{k}'>[{k}] {e(v)}</li>" for k, v in REFERENCES.items()],
              "</ul></body></html>"]
    return "\n".join(parts)


@dataclass(frozen=True)
class ReportPaths:
    html: Path
    markdown: Path
    figures: list[Path]
    analysis: StudyAnalysis
    failed: int = 0


def write_report(store_path: str | Path, study: str | None, out_dir: str | Path,
                 max_workers: int | None = None) -> ReportPaths:
    """Analyse ``study`` in the store (the only one when None) and write the report; its
    workers table goes up to ``max_workers`` (this machine's cores by default)."""
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
    workers = workers_table(store_path, study, a.per_run, max_workers)
    with _writing(out):  # the folder deleted or made read-only meanwhile: one clear line
        figure_paths = render_figures(a, out / "figures")
        (out / "summary.md").write_text(markdown(a, study, figure_paths, found, workers))
        (out / "report.html").write_text(html_page(a, study, figure_paths, found,
                                                   environment(), workers))
        shape_summary(a).to_csv(out / "shapes.csv", index=False)
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
