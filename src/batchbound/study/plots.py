"""Plots of a study's analyses. Every function draws on the ``ax`` it is given and never
creates a figure; batch-size axes are log2. Inputs are the analysis tables."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm
from matplotlib.ticker import FuncFormatter, MaxNLocator

PLAIN = FuncFormatter(lambda value, _: f"{value:g}")

from batchbound.study.analysis import display_names, model_keys  # noqa: E402


def _groups(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(display name, rows sorted by B) per model; names carry every key that varies."""
    keys = [*model_keys(frame), *[c for c in ("depth", "width") if c in frame]]
    sort = [c for c in ("depth", "width") if c in frame] or keys
    names = display_names(frame)
    out = []
    for _, part in frame.sort_values(sort).groupby(keys, sort=False, dropna=False):
        out.append((names[part.index[0]], part.sort_values("batch_size")))
    return out


def _log2_batch_axis(ax: Axes, batches: list[int] | np.ndarray) -> None:
    ax.set_xscale("log", base=2)
    batches = sorted({int(b) for b in batches})
    ax.set_xticks(batches)
    ax.set_xticklabels([str(b) for b in batches], rotation=45 if len(batches) > 6 else 0)
    ax.minorticks_off()
    ax.set_xlabel("batch size B (log2)")


def shape_axis(frame: pd.DataFrame, preferred: str) -> str:
    """``preferred`` (depth or width) when it names each model uniquely, else model_label:
    two models at one depth (two families, two activations) must not share a row."""
    if preferred not in frame or not frame[preferred].notna().all():
        return "model_label"
    unique = frame.groupby(preferred)["model_label"].nunique().max() == 1
    return preferred if unique else "model_label"


def epochs_heatmap(ax: Axes, summary: pd.DataFrame, rows: str = "depth",
                   budget: float | None = None) -> None:
    """Median epochs to target as a heatmap: ``rows`` (depth or width) against B. Cells the
    target was never reached in (censored) show '>E' in grey."""
    label = {"depth": "depth L (hidden layers)", "width": "width K"}.get(rows, rows)
    key = shape_axis(summary, rows)
    table = summary.pivot_table(index=key, columns="batch_size", values="median",
                                aggfunc="median")
    values = table.to_numpy(float)
    finite = values[np.isfinite(values)]
    masked = np.ma.masked_invalid(values)
    cmap = plt.get_cmap("viridis").with_extremes(bad="#cccccc")
    norm = LogNorm(vmin=max(finite.min(), 1e-2), vmax=max(finite.max(), 1e-2 * 1.01)) \
        if len(finite) else None
    image = ax.imshow(masked, aspect="auto", cmap=cmap, norm=norm, origin="lower")
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            v = values[i, j]
            text = (f">{budget:g}" if budget else "miss") if not math.isfinite(v) else f"{v:.1f}"
            bright = norm is not None and math.isfinite(v) and norm(v) > 0.6
            ax.text(j, i, text, ha="center", va="center", fontsize=8,
                    color="black" if bright or not math.isfinite(v) else "white")
    ax.set_xticks(range(len(table.columns)), [str(c) for c in table.columns],
                  rotation=45 if len(table.columns) > 6 else 0)
    ax.set_yticks(range(len(table.index)), [str(i) for i in table.index])
    ax.set_xlabel("batch size B")
    ax.set_ylabel(label if key == rows else "model")
    ax.set_title("epochs to target (median over seeds)")
    bar = ax.figure.colorbar(image, ax=ax, label="epochs (log scale)")
    bar.ax.yaxis.set_major_formatter(PLAIN)
    bar.ax.yaxis.set_minor_formatter(PLAIN)


def epochs_vs_batch(ax: Axes, summary: pd.DataFrame, budget: float | None = None) -> None:
    """Median epochs to target against B, one line per model; the error bars span the
    seeds; censored points are drawn as open triangles at the epoch budget."""
    for label, part in _groups(summary):
        finite = part[np.isfinite(part["median"])]
        line, = ax.plot(finite["batch_size"], finite["median"], "o-", label=label)
        low = finite["median"] - finite["min"]
        high = (finite["max"].where(np.isfinite(finite["max"]), finite["median"])
                - finite["median"])
        ax.errorbar(finite["batch_size"], finite["median"], yerr=[low, high], fmt="none",
                    ecolor=line.get_color(), alpha=0.6, capsize=2)
        missed = part[~np.isfinite(part["median"])]
        if budget and len(missed):
            ax.plot(missed["batch_size"], [budget] * len(missed), "^", mfc="none",
                    color=line.get_color())
    if budget:
        ax.axhline(budget, color="grey", ls=":", lw=1)
        ax.text(0.01, 0.99, "open ▲ at max epochs: not reached", transform=ax.transAxes,
                va="top", fontsize=7, color="grey")
    _log2_batch_axis(ax, summary["batch_size"].unique())
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(PLAIN)
    ax.yaxis.set_minor_formatter(PLAIN)
    ax.set_ylabel("epochs to target (log)")
    ax.set_title("epochs to target against batch size")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")


def speedup_curves(ax: Axes, speedups: pd.DataFrame) -> None:
    """s(m; m0) per model with the linear ideal m/m0 (dashed)."""
    for label, part in _groups(speedups):
        ok = part[part["speedup"] > 0]
        ax.plot(ok["batch_size"], ok["speedup"], "o-", label=label)
    m0 = speedups["batch_size"].min()
    batches = np.array(sorted(speedups["batch_size"].unique()), float)
    ax.plot(batches, batches / m0, "k--", lw=1, label="linear ideal m/m0")
    _log2_batch_axis(ax, batches)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(PLAIN)
    ax.set_ylabel("speedup s(m; m0) = k(m0)/k(m) (log2)")
    ax.set_title("speedup in iterations to target")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def loss_contour(ax: Axes, surface: pd.DataFrame, title: str = "") -> None:
    """Training loss over (B, iterations) on a log scale, as seed 003's Figure 1; one model's
    rows from ``analysis.loss_surface``. Lighter is lower."""
    batches = sorted(surface["batch_size"].unique())
    top = max(float(surface["iteration"].max()), 2.0)
    grid = np.unique(np.geomspace(1, top, 60).round())
    z = np.full((len(grid), len(batches)), np.nan)
    for j, batch in enumerate(batches):
        part = surface[surface["batch_size"] == batch].sort_values("iteration")
        x, y = part["iteration"].to_numpy(float), part["value"].to_numpy(float)
        ok = np.isfinite(y) & (y > 0)
        if ok.sum() < 2:
            continue
        inside = grid <= x[ok].max()
        z[inside, j] = np.interp(np.log(grid[inside]), np.log(np.maximum(x[ok], 1)),
                                 np.log10(y[ok]))
    if np.isfinite(z).sum() < 4:
        ax.text(0.5, 0.5, "not enough curve data", ha="center", transform=ax.transAxes)
        return
    levels = np.linspace(np.nanmin(z), np.nanmax(z), 12)
    filled = ax.contourf(batches, grid, np.ma.masked_invalid(z), levels=levels,
                         cmap="viridis_r")
    ax.figure.colorbar(filled, ax=ax, label="log10 training loss", format="%.2f")
    _log2_batch_axis(ax, batches)
    ax.set_yscale("log")
    ax.set_ylabel("iterations (log)")
    ax.set_title(title or "training loss over (B, iterations)")


def delta_vs_shape(ax: Axes, along: pd.DataFrame, summary: pd.DataFrame,
                   x: str = "depth") -> None:
    """Δ at every measurement along training (dots coloured by epoch) against depth or
    width, with the per-model average over training (line)."""
    if along.empty:
        ax.text(0.5, 0.5, "no Δ measurements", ha="center", transform=ax.transAxes)
        return
    reference = summary["batch_size"].iloc[0] if len(summary) else along["batch_size"].min()
    part = along[along["batch_size"] == reference]
    dots = ax.scatter(part[x], part["diversity"], c=part["epoch"], cmap="plasma", s=14,
                      alpha=0.8)
    ax.figure.colorbar(dots, ax=ax, label="epoch of measurement")
    mean = summary.sort_values(x)
    ax.plot(mean[x], mean["delta_mean"], "k-o", label="average over training")
    if mean["delta_matched"].notna().any():
        ax.plot(mean[x], mean["delta_matched"], "s--", color="tab:green",
                label=f"at matched loss {mean['matched_loss'].iloc[0]:.3g}")
    ax.set_yscale("log")
    ax.set_xlabel({"depth": "depth L (hidden layers)", "width": "width K"}.get(x, x))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # depths and widths are integers
    ax.set_ylabel("gradient diversity Δ (log)")
    ax.set_title(f"Δ along training (B = {reference})")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def delta_along_training(ax: Axes, along: pd.DataFrame, batch_size: int | None = None) -> None:
    """Δ against epoch for each model at one batch size (the smallest by default): one thin
    line per run, so plateaus (Δ blowing up near a stationary point) stay visible."""
    if along.empty:
        ax.text(0.5, 0.5, "no Δ measurements", ha="center", transform=ax.transAxes)
        return
    batch_size = batch_size or int(along["batch_size"].min())
    part = along[along["batch_size"] == batch_size]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, model) in enumerate(_groups(part)):
        colour = colours[i % len(colours)]
        for j, (_, run) in enumerate(model.groupby("key")):
            run = run.sort_values("epoch")
            ax.plot(run["epoch"], run["diversity"], "-", color=colour, lw=1, alpha=0.8,
                    label=name if j == 0 else None)
    ax.set_yscale("log")
    if (part["epoch"] > 0).all():  # log epochs keep short runs legible beside long ones
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(PLAIN)
    ax.set_xlabel("epoch (log)" if ax.get_xscale() == "log" else "epoch")
    ax.set_ylabel("gradient diversity Δ (log)")
    ax.set_title(f"Δ along training, B = {batch_size} (one line per seed)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def largest_batch_vs_delta(ax: Axes, table: pd.DataFrame, budget: float | None = None) -> None:
    """Largest workable B (within the epoch budget) and B* against Δ, with the bound n·Δ for
    reference. Δ at matched training loss when every model has it (robust to a model stuck
    near a stationary point), else Δ averaged over training."""
    matched = "delta_matched" in table and table["delta_matched"].notna().all()
    x, bound, how = (("delta_matched", "bound_matched", "at matched training loss") if matched
                     else ("delta_mean", "bound_mean", "averaged over training"))
    table = table.sort_values(x)
    within = f"within {budget:g} epochs" if budget else "within E epochs"
    ax.plot(table[x], table["largest_batch"], "o-", label=f"largest B {within}")
    ax.plot(table[x], table["threshold_batch"], "s--", label="threshold B*")
    ax.plot(table[x], table[bound], ":", color="grey", label="n·Δ")
    for i, (name, (_, row)) in enumerate(zip(display_names(table), table.iterrows(),
                                             strict=True)):
        if math.isfinite(row["largest_batch"]):
            # alternate above/below so neighbours at equal B do not print over each other
            ax.annotate(name, (row[x], row["largest_batch"]), fontsize=7,
                        xytext=(3, 4 if i % 2 == 0 else -11), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(PLAIN)
    ax.set_xlabel(f"Δ {how} (log)")
    ax.set_ylabel("batch size (log2)")
    ax.set_title("largest workable batch against gradient diversity")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
