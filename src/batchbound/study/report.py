"""The study report: analyses → tables, figures and the seeds' claims, as HTML and Markdown.

``analyze(frames, spec)`` runs every analysis once and returns a ``StudyAnalysis``;
``claims(analysis)`` states each seed claim the data can test with a verdict and numbers;
``write_report(store, study, out_dir)`` writes ``report.html`` (self-contained: figures
embedded as base64 PNG, tables, spec, environment), ``summary.md`` and every figure as PNG
and SVG under ``figures/``.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import platform
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from batchbound.study import analysis as A
from batchbound.study.store import Store
from batchbound.study.workers import workers_table

SUPPORTED, NOT_SUPPORTED, UNTESTABLE = "supported", "not supported", "not testable here"


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
    shapes: pd.DataFrame = field(default_factory=pd.DataFrame)


def analyze(frames: dict[str, pd.DataFrame], spec: dict[str, Any]) -> StudyAnalysis:
    frames = {**frames, "runs": A.short_strategies(frames["runs"])}
    runs = frames["runs"]
    train = spec.get("train", {})
    budget = train.get("epochs_budget") or train.get("max_epochs", 20) / 2
    per_run = A.per_run_to_target(runs, frames["targets"])
    epochs = A.summarize_to_target(per_run, "epochs")
    iterations = A.summarize_to_target(per_run, "iterations")
    speedups = A.speedup(iterations)
    loss_thresholds = A.loss_threshold(runs, frames["curves"])
    per_loss = A.per_run_to_loss(runs, frames["curves"], loss_thresholds)
    diversity = A.diversity_summary(runs, frames["diversity"], frames["curves"])
    out = StudyAnalysis(
        spec=spec, frames=frames, budget=float(budget), per_run=per_run, epochs=epochs,
        iterations=iterations, thresholds=A.threshold_batch(epochs),
        largest=A.largest_batch_within(epochs, budget), speedups=speedups,
        regimes=A.regime_boundaries(speedups) if len(speedups) else pd.DataFrame(),
        critical=A.critical_batch(per_run), critical_joint=A.critical_batch(per_run, by=[]),
        loss_thresholds=loss_thresholds,
        loss_speedups=A.speedup(A.summarize_to_target(per_loss, "iterations")),
        along=A.diversity_along_training(runs, frames["diversity"]), diversity=diversity,
    )
    out.shapes = shape_table(out)
    return out


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
@dataclass(frozen=True)
class Claim:
    seed: str
    claim: str
    verdict: str
    evidence: str


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if math.isinf(value):
            return "∞"
        return f"{value:.3g}"
    return str(value)


def _pairs(table: pd.DataFrame, x: str, y: str) -> str:
    return ", ".join(f"{_fmt(a)}→{_fmt(b)}" for a, b in zip(table[x], table[y], strict=True))


def _correlation_claim(seed: str, claim: str, table: pd.DataFrame, x: str, y: str,
                       sign: int, rank_y: str | None = None) -> Claim:
    """Spearman sign test of x against y; ``rank_y`` ranks in place of ``y`` (shown as is)."""
    if x not in table or y not in table or table[x].nunique() < 3:
        return Claim(seed, claim, UNTESTABLE, f"needs at least 3 distinct {x} values")
    ranked = rank_y or y
    rho = A.spearman(table[x], table[ranked])
    evidence = f"{x}→{y}: {_pairs(table, x, y)}; Spearman ρ = {_fmt(rho)}"
    if math.isnan(rho):
        finite = table[[x, ranked]].replace([np.inf, -np.inf], np.nan).dropna()
        why = ("too few finite values" if len(finite) < 3
               else f"{y} does not vary" if finite[ranked].nunique() == 1
               else f"{x} does not vary")
        return Claim(seed, claim, UNTESTABLE, f"{evidence} ({why})")
    return Claim(seed, claim, SUPPORTED if sign * rho > 0 else NOT_SUPPORTED, evidence)


def claims(a: StudyAnalysis) -> list[Claim]:
    out = []
    shapes = a.shapes
    max_b = a.epochs["batch_size"].max() if len(a.epochs) else math.nan
    # seed 000: a threshold exists for every shape
    b_star = shapes["threshold_batch"] if "threshold_batch" in shapes else pd.Series(dtype=float)
    # B* is NaN only for a shape that never reaches the target: it says nothing of B*
    trains = b_star.notna()
    has = trains & (b_star < max_b)
    if len(b_star):
        verdict = (UNTESTABLE if not trains.any()
                   else SUPPORTED if has[trains].all() else NOT_SUPPORTED)
        never = int((~trains).sum())
        out.append(Claim(
            "000", "For every network there is a threshold B* beyond which epochs to target "
            "grow (here: by more than 1.5× the best smaller batch, or the target is missed).",
            verdict,
            "B* per model: " + ", ".join(
                f"{m}: {_fmt(b)}" for m, b in zip(A.display_names(shapes), b_star, strict=True))
            + f"; largest batch tried {max_b:g}; {int(has.sum())}/{int(trains.sum())}"
            " shapes that reach the target have B* below it"
            + (f"; {never} never reach the target at any B (left out)" if never else "")))
    out.append(_correlation_claim(
        "000", "The batch-size threshold B* decreases with depth at a fixed parameter count.",
        shapes, "depth", "threshold_batch", -1))
    out.append(_correlation_claim(
        "000", f"Wider networks allow a larger batch within E = {a.budget:g} epochs "
        "(Figure 5).", shapes, "width", "largest_batch", +1))
    # wider needs fewer epochs at the same large batch
    if "width" in a.epochs and a.epochs["width"].notna().all():
        counts = a.epochs.groupby("batch_size")["median"].apply(
            lambda v: int(np.isfinite(np.asarray(v, float)).sum()))
        large = a.epochs[a.epochs["batch_size"] == counts[counts >= 3].index.max()] \
            if (counts >= 3).any() else pd.DataFrame()
        if len(large):
            # a miss (∞) ranks as the slowest; a finite stand-in keeps it in the ranking
            ranked = large.assign(epochs=large["median"],
                                  epochs_rank=large["median"].clip(upper=np.finfo(float).max))
            claim = _correlation_claim(
                "000", f"At the same large batch (B = {int(large['batch_size'].iloc[0])}), "
                "wider networks need fewer epochs.", ranked.sort_values("width"), "width",
                "epochs", -1, rank_y="epochs_rank")
            out.append(claim)
    if len(shapes) and shapes["delta_mean"].notna().any():
        # Δ at matched training loss is robust to a shape stuck near a stationary point
        # (where ‖Σg‖ → 0 inflates the average over training); fall back to the average.
        matched = shapes["delta_matched"].notna().all()
        column, how = ("delta_matched", "at matched training loss") if matched else \
            ("delta_mean", "averaged over training")
        out.append(_correlation_claim(
            "000", f"Gradient diversity Δ ({how}) grows with width at a fixed parameter count "
            "(Figure 2a).", shapes, "width", column, +1))
        out.append(_correlation_claim(
            "000", f"The largest workable batch grows with gradient diversity Δ ({how}) "
            "(Figure 2c).", shapes, column, "largest_batch", +1))
    # seed 003: three regimes
    if len(a.regimes):
        reg = a.regimes
        three = reg["stagnation_from"].notna() & (reg["linear_until"] < max_b)
        out.append(Claim(
            "003", "Speedup in iterations is near-linear for small batches, then diminishes, "
            "then stagnates (α ≥ 0.8 linear, α < 0.1 stagnant).",
            SUPPORTED if three.all() else NOT_SUPPORTED,
            "; ".join(f"{m}: linear until {_fmt(float(l))}, stagnant from {_fmt(float(s))}"
                      for m, l, s in zip(A.display_names(reg), reg["linear_until"],
                                         reg["stagnation_from"], strict=True))))
    # seed 002 / McCandlish: the bound n·Δ is the right scale for B
    if len(shapes) and shapes["bound_mean"].notna().any() and "b_crit" in shapes:
        bound = "bound_matched" if shapes["bound_matched"].notna().any() else "bound_mean"
        ok = shapes[shapes["b_crit"].notna() & shapes[bound].notna()]
        if len(ok):
            ratio = ok["b_crit"] / ok[bound]
            within = ((ratio >= 0.25) & (ratio <= 4)).all()
            out.append(Claim(
                "002", "Set the batch size ≈ n·Δ: the fitted critical batch size is within a "
                f"factor of 4 of the measured bound n·Δ ({bound.replace('bound_', '')}).",
                SUPPORTED if within else NOT_SUPPORTED,
                "; ".join(f"{m}: B_crit {_fmt(float(b))} vs n·Δ {_fmt(float(n))}"
                          for m, b, n in zip(A.display_names(ok), ok["b_crit"], ok[bound],
                                             strict=True))))
    runs = a.frames["runs"]
    if len(a.regimes) and "data" in a.regimes and a.regimes["data"].nunique() > 1:
        sizes = runs.groupby("data")["n_train"].first()
        if sizes.nunique() > 1:
            reg = a.regimes.assign(n=a.regimes["data"].map(sizes))
            points = reg["stagnation_from"].dropna()
            same = len(points) == len(reg) and points.max() <= 2 * points.min()
            out.append(Claim(
                "003", "The batch size where speedup stagnates does not depend on the data set "
                "size (here: equal within one doubling across sizes, Figure 4).",
                SUPPORTED if same else NOT_SUPPORTED,
                "; ".join(f"n = {int(n)}: stagnant from {_fmt(float(b))}"
                          for n, b in zip(reg["n"], reg["stagnation_from"], strict=True))))
    if "strategy" in a.speedups and a.speedups["strategy"].nunique() > 1:
        best = a.speedups.groupby("strategy")["speedup"].max()
        linear = a.regimes.groupby("strategy")["linear_until"].max()
        out.append(Claim(
            "003", "No learning-rate strategy (BLR, LSR, SRSR) keeps linear speedup up to the "
            "largest batch size.", SUPPORTED if (linear < max_b).all() else NOT_SUPPORTED,
            "; ".join(f"{s}: best speedup {_fmt(float(best[s]))}, linear until "
                      f"{_fmt(float(linear[s]))}" for s in best.index)))
    return out


# ---- figures --------------------------------------------------------------------------------
def figures(a: StudyAnalysis) -> list[tuple[str, str, Callable[[Any], None]]]:
    """(file stem, caption, draw(fig)) for every figure the data supports."""
    from batchbound.study import plots as P

    out: list[tuple[str, str, Callable[[Any], None]]] = []
    rows = P.shape_axis(a.epochs, "depth")
    max_epochs = float(a.spec.get("train", {}).get("max_epochs", 0)) or None
    groups = A.model_keys(a.epochs)
    extra = [k for k in groups if k != "model_label"]
    parts = [(("",), a.epochs)] if not extra else list(a.epochs.groupby(extra))
    for name, part in parts:
        suffix = "-".join(str(n) for n in (name if isinstance(name, tuple) else (name,)) if n)
        stem = f"epochs_heatmap{'-' + suffix if suffix else ''}"
        out.append((re.sub(r"[^A-Za-z0-9_.-]+", "_", stem).strip("_"),
                    f"Epochs to target, {rows} against B{' (' + suffix + ')' if suffix else ''}"
                    " (seed 000, Figure 4). Grey: not reached within max_epochs.",
                    lambda fig, p=part: P.epochs_heatmap(fig.add_subplot(), p, rows,
                                                         max_epochs)))
    out.append(("epochs_vs_batch", "Epochs to target against B per model (seed 000, Figure 3)."
                " Bars span the seeds.",
                lambda fig: P.epochs_vs_batch(fig.add_subplot(), a.epochs, max_epochs)))
    if len(a.speedups):
        out.append(("speedup", "Speedup s(m; m0) in iterations to the target, with the linear "
                    "ideal (seed 003, Figure 2).",
                    lambda fig: P.speedup_curves(fig.add_subplot(), a.speedups)))
    if len(a.loss_speedups):
        out.append(("speedup_loss_threshold", "Speedup to seed 003's loss threshold (the "
                    "lower quartile of the losses the largest batch reaches).",
                    lambda fig: P.speedup_curves(fig.add_subplot(), a.loss_speedups)))
    surface = A.loss_surface(a.frames["runs"], a.frames["curves"])
    if len(surface):
        keys = A.model_keys(surface)
        models = list(surface.groupby(keys, sort=False))
        chosen = [models[0], models[-1]] if len(models) > 1 else models[:1]

        def draw(fig: Any, chosen: list = chosen) -> None:
            for i, (name, part) in enumerate(chosen):
                title = name[-1] if isinstance(name, tuple) else name
                P.loss_contour(fig.add_subplot(1, len(chosen), i + 1), part,
                               f"training loss: {title}")

        out.append(("loss_contour", "Training loss over batch size and iterations for the "
                    "first and last model (seed 003, Figure 1). Lighter is lower.", draw))
    if len(a.diversity) and len(a.along):
        x = "depth" if a.diversity["depth"].notna().all() else "width"
        out.append(("delta_vs_shape", "Gradient diversity Δ at every measurement along "
                    "training (dots), its average over training and its value at matched "
                    "training loss (seed 000, Figure 2a).",
                    lambda fig: P.delta_vs_shape(fig.add_subplot(), a.along, a.diversity, x)))
        out.append(("delta_along_training", "Gradient diversity Δ against epoch at the "
                    "smallest batch size, one line per seed: a shape stuck near a stationary "
                    "point shows Δ far above the others until it starts to train.",
                    lambda fig: P.delta_along_training(fig.add_subplot(), a.along)))
        out.append(("largest_batch_vs_delta", "Largest workable batch and threshold B* "
                    "against Δ (at matched training loss when every shape reaches it, else "
                    "averaged over training) (seed 000, Figure 2c).",
                    lambda fig: P.largest_batch_vs_delta(fig.add_subplot(), a.shapes,
                                                         a.budget)))
    return out


def render_figures(a: StudyAnalysis, directory: Path) -> list[tuple[str, str, Path]]:
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    for stale in [*directory.glob("*.png"), *directory.glob("*.svg")]:  # from an earlier report
        stale.unlink()
    out = []
    for stem, caption, draw in figures(a):
        wide = stem == "loss_contour"
        fig = plt.figure(figsize=(11 if wide else 6.4, 4.6), dpi=110)
        try:
            draw(fig)
            fig.tight_layout()
            fig.savefig(directory / f"{stem}.png")
            fig.savefig(directory / f"{stem}.svg")
        finally:
            plt.close(fig)
        out.append((stem, caption, directory / f"{stem}.png"))
    return out


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
            "cores": str(os.cpu_count()), "device": device,
            "generated": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


# ---- writers --------------------------------------------------------------------------------
SHAPE_COLUMNS = {"model_label": "model", "depth": "depth", "width": "width",
                 "delta_mean": "Δ (avg)", "bound_mean": "B = nΔ (avg)",
                 "delta_matched": "Δ (matched loss)", "bound_matched": "nΔ (matched)",
                 "threshold_batch": "B*", "largest_batch": "largest B ≤ E ep",
                 "b_crit": "B_crit", "low": "B_crit 16%", "high": "B_crit 84%"}


def shape_summary(a: StudyAnalysis) -> pd.DataFrame:
    cols = [c for c in SHAPE_COLUMNS if c in a.shapes]
    extra = [k for k in A.model_keys(a.shapes) if k != "model_label"]
    return a.shapes[[*extra, *cols]].rename(columns=SHAPE_COLUMNS)


def critical_text(a: StudyAnalysis) -> str:
    if a.critical_joint.empty:
        return "not enough reached runs to fit (need 3 batch sizes)"
    row = a.critical_joint.iloc[0]
    note = " (at the search bound: not identified)" if row["at_bound"] else ""
    return (f"B_crit = {row['b_crit']:.0f} (bootstrap 16–84%: {row['low']:.0f}–"
            f"{row['high']:.0f}, {int(row['points'])} runs){note}")


def _md_table(frame: pd.DataFrame) -> str:
    cols = list(frame.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, row in frame.iterrows():
        cells = (_fmt(v) if not isinstance(v, (int, str)) else str(v) for v in row)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


WORKERS_TEXT = (
    "For each model, the time-optimal batch per worker count on the machine that wrote this "
    "report, as `batchbound advise --from-study` computes it: the iterations to the target "
    "this study measured (the fitted B_crit interpolates between grid batches; nothing "
    "outside the grid), one worker's step from the runs' recorded times, and the all-reduce "
    "timed here running the trainer's step on P local processes. ← marks the recommendation: "
    "the fewest workers past which doubling saves less than 10 %.")


def markdown(a: StudyAnalysis, study: str, figure_paths: list[tuple[str, str, Path]],
             found: list[Claim], workers: pd.DataFrame | None = None) -> str:
    counts = a.frames["runs"].groupby(["role", "status"]).size()
    description = a.spec.get("description", "")
    lines = [f"# Study {study}", "", *([description, ""] if description else []),
             "Runs: " + ", ".join(f"{r} {s}: {n}" for (r, s), n in counts.items()), "",
             *(["## How many workers", "", WORKERS_TEXT, "", _md_table(workers.fillna("")), ""]
               if workers is not None and len(workers) else []),
             "## Per shape", "", _md_table(shape_summary(a)), "",
             f"E = {a.budget:g} epochs. Critical batch size of the study (one B_crit for all "
             f"shapes): {critical_text(a)}.", "", "## The seeds' claims", ""]
    for c in found:
        lines.append(f"- **{c.verdict}** (seed {c.seed}): {c.claim} {c.evidence}.")
    lines += ["", "## Figures", ""]
    for stem, caption, path in figure_paths:
        lines.append(f"![{stem}](figures/{path.name}) {caption}")
        lines.append("")
    return "\n".join(lines) + "\n"


CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222}table{border-collapse:collapse;font-size:13px;margin:1em 0}td,th{border:1px solid
#ccc;padding:3px 7px;text-align:right}th{background:#f2f2f2}figure{margin:1.5em 0}
figcaption{font-size:13px;color:#555}.supported{color:#176317}.not{color:#a31515}
.untestable{color:#777}pre{background:#f7f7f7;padding:1em;overflow:auto;font-size:12px}"""


def html_page(a: StudyAnalysis, study: str, figure_paths: list[tuple[str, str, Path]],
              found: list[Claim], env: dict[str, str], workers: pd.DataFrame | None = None
              ) -> str:
    e = html.escape

    def table(frame: pd.DataFrame) -> str:
        return frame.to_html(index=False, float_format=lambda v: _fmt(float(v)), border=0,
                             na_rep="n/a")

    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Study {e(study)}"
             f"</title><style>{CSS}</style></head><body>",
             f"<h1>Study {e(study)}</h1><p>{e(a.spec.get('description', ''))}</p>",
             *(["<section id='workers'><h2>How many workers</h2>"
                f"<p>{e(WORKERS_TEXT.replace('`', ''))}</p>",
                table(workers.fillna("")), "</section>"]
               if workers is not None and len(workers) else []),
             "<h2>Per shape</h2>", table(shape_summary(a)),
             f"<p>E = {a.budget:g} epochs. Study critical batch size: "
             f"{e(critical_text(a))}.</p>", "<h2>The seeds' claims</h2><ul>"]
    for c in found:
        css = {SUPPORTED: "supported", NOT_SUPPORTED: "not"}.get(c.verdict, "untestable")
        parts.append(f"<li><b class='{css}'>{e(c.verdict)}</b> (seed {e(c.seed)}): "
                     f"{e(c.claim)} <br><small>{e(c.evidence)}</small></li>")
    parts.append("</ul><h2>Figures</h2>")
    for stem, caption, path in figure_paths:
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f"<figure id='{e(stem)}'><img alt='{e(stem)}' style='max-width:100%' "
                     f"src='data:image/png;base64,{data}'><figcaption>{e(caption)}"
                     "</figcaption></figure>")
    parts += ["<h2>Tables</h2><h3>Epochs to target (per model and B)</h3>", table(a.epochs),
              "<h3>Speedup</h3>", table(a.speedups) if len(a.speedups) else "<p>none</p>",
              "<h3>Regimes</h3>", table(a.regimes) if len(a.regimes) else "<p>none</p>",
              "<h3>Critical batch size per model</h3>",
              table(a.critical) if len(a.critical) else "<p>not enough data</p>",
              "<h3>Loss thresholds (seed 003)</h3>", table(a.loss_thresholds),
              "<h3>Gradient diversity</h3>",
              table(a.diversity) if len(a.diversity) else "<p>no measurements</p>",
              "<h2>Study spec</h2>", f"<pre>{e(json.dumps(a.spec, indent=2))}</pre>",
              "<h2>Environment</h2>", "<table>" + "".join(
                  f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in env.items())
              + "</table>", "</body></html>"]
    return "\n".join(parts)


@dataclass(frozen=True)
class ReportPaths:
    html: Path
    markdown: Path
    figures: list[Path]
    analysis: StudyAnalysis


def write_report(store_path: str | Path, study: str | None, out_dir: str | Path,
                 max_workers: int | None = None) -> ReportPaths:
    """Analyse ``study`` in the store (the only one when None) and write the report; its
    workers table goes up to ``max_workers`` (this machine's cores by default)."""
    with Store(store_path) as store:
        if study is None:
            names = store.studies()
            if len(names) != 1:
                from batchbound.errors import BatchboundError

                raise BatchboundError(f"{store_path} holds studies {names}; name one")
            study = names[0]
        spec, frames = store.study_spec(study), store.frames(study)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    a = analyze(frames, spec)
    figure_paths = render_figures(a, out / "figures")
    found = claims(a)
    workers = workers_table(store_path, study, a.per_run, max_workers)
    (out / "summary.md").write_text(markdown(a, study, figure_paths, found, workers))
    (out / "report.html").write_text(html_page(a, study, figure_paths, found, environment(),
                                               workers))
    shape_summary(a).to_csv(out / "shapes.csv", index=False)
    return ReportPaths(out / "report.html", out / "summary.md",
                       [p for _, _, p in figure_paths], a)
