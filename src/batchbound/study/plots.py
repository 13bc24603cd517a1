"""Plots of a study's analyses. Every function draws on the ``ax`` it is given and never
creates a figure; batch-size axes are log2. Inputs are the analysis tables."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm
from matplotlib.lines import Line2D
from matplotlib.ticker import Formatter, FuncFormatter, MaxNLocator

PLAIN = FuncFormatter(lambda value, _: f"{value:g}")


def _loss_of_level(level: float, _: object) -> str:
    """A log10-loss level as the loss itself, 3 significant digits: 1.58, not 0.20 (nor
    "-0.00", as the level of a loss of 1 a hair below zero read)."""
    return f"{10 ** level:.3g}"


LOSS = FuncFormatter(_loss_of_level)

from batchbound.study.analysis import display_names, model_keys  # noqa: E402


class MinorLabels(Formatter):
    """A minor log tick's label: every one where the axis spans less than a decade (6 … 15
    epochs has one power of ten: "10" alone names no other height), else only at 2 and 5
    times a power of ten (every minor tick labelled overprints its neighbours). One instance
    per axis: it reads its own axis' span."""

    def __call__(self, value: float, pos: int | None = None) -> str:
        if value <= 0:
            return ""
        low, high = sorted(self.axis.get_view_interval()) if self.axis else (1.0, 1e9)
        if low > 0 and high / low < 10:
            return f"{value:g}"
        return f"{value:g}" if round(value / 10 ** math.floor(math.log10(value))) in (2, 5) \
            else ""


def wrapped_title(ax: Axes, text: str) -> None:
    """The title broken into lines that fit the axes' width: a long data label
    (``fashion-mnist | neighbour_pair(side=0)``) on one line runs off the figure."""
    size = plt.rcParams["axes.titlesize"]
    points = ax.get_position().width * ax.figure.get_figwidth() * 72
    chars = max(20, int(points / (0.55 * matplotlib.font_manager.FontProperties(
        size=size).get_size_in_points())))
    ax.set_title(textwrap.fill(text, chars))


def legend(ax: Axes, handles: list | None = None, **kwargs: object) -> None:
    """The legend of what ``ax`` labels (and ``handles``), or none when nothing is labelled:
    ``ax.legend()`` then prints matplotlib's "No artists with labels" warning on the
    user's terminal, or draws an empty box."""
    drawn = [*ax.get_legend_handles_labels()[0], *(handles or [])]
    if drawn:
        ax.legend(handles=drawn, **kwargs)


Colour = Callable[[pd.DataFrame, int], str]


def model_colours(frame: pd.DataFrame) -> Colour:
    """colour(rows of one model, i): one colour per model of ``frame`` (the study's every
    model), the same in every figure that draws it. A figure whose table lacks a model (none
    of its runs reached the target) must not hand that model's colour to the next one."""
    keys = model_keys(frame)
    names = {name: f"C{i % 10}" for i, (name, _) in enumerate(_groups(frame))}

    def colour(part: pd.DataFrame, i: int) -> str:
        if all(k in part for k in keys):
            return names.get(display_names(part.iloc[:1], keys).iloc[0], f"C{i % 10}")
        return f"C{i % 10}"

    return colour


def _by_index(part: pd.DataFrame, i: int) -> str:
    return f"C{i % 10}"


def _groups(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(display name, rows sorted by B) per model; names carry every key that varies."""
    keys = [*model_keys(frame), *[c for c in ("depth", "width") if c in frame]]
    sort = [c for c in ("depth", "width") if c in frame] or keys
    names = display_names(frame)
    out = []
    for _, part in frame.sort_values(sort).groupby(keys, sort=False, dropna=False):
        out.append((names[part.index[0]], part.sort_values("batch_size")))
    return out


def log2_batch_axis(ax: Axes, batches: list[int] | np.ndarray) -> None:
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


DIVERGED = "#d62728"
SPAN = 1.5  # the narrowest colour scale of a heatmap: its top 1.5 times its bottom


def epochs_heatmap(ax: Axes, summary: pd.DataFrame, rows: str = "depth",
                   budget: float | None = None, scale: tuple[float, float] | None = None,
                   title: str = "epochs to target") -> None:
    """Median epochs to target as a heatmap: ``rows`` (depth or width) against B, with the
    tuned η under each value. Cells that never reached the target show '>E' in grey, cells
    whose every run diverged 'diverged' in red; 'div k/n' counts diverged runs, 'coll k/n'
    collapsed ones. ``scale``
    (min, max) shares one colour scale across panels."""
    label = {"depth": "depth L (hidden layers)", "width": "width K",
             "model_label": "model"}.get(rows, rows)
    key = shape_axis(summary, rows)

    table = summary.pivot_table(index=key, columns="batch_size", values="median",
                                aggfunc="median", dropna=False)

    def pivot(column: str) -> np.ndarray:
        if column not in summary:
            return np.full(table.shape, np.nan)
        return (summary.pivot_table(index=key, columns="batch_size", values=column,
                                    aggfunc="median", dropna=False)
                .reindex(index=table.index, columns=table.columns).to_numpy(float))

    values, lrs = table.to_numpy(float), pivot("lr")
    diverged, collapsed, runs = pivot("diverged"), pivot("collapsed"), pivot("runs")
    finite = values[np.isfinite(values)]
    low, high = scale or ((finite.min(), finite.max()) if len(finite) else (1.0, 1.0))
    low = max(low, 1e-2)
    if high < low * SPAN:  # 1.00 and 1.02 epochs must not be the scale's two ends
        middle = math.sqrt(low * max(high, low))
        low, high = middle / math.sqrt(SPAN), middle * math.sqrt(SPAN)
    norm = LogNorm(vmin=low, vmax=high)
    colours = plt.get_cmap("viridis").with_extremes(bad="#cccccc")
    image = ax.imshow(np.ma.masked_invalid(values), aspect="auto", cmap=colours, norm=norm,
                      origin="lower")
    all_diverged = np.nan_to_num(diverged) >= np.nan_to_num(runs, nan=np.inf)
    if all_diverged.any():
        ax.imshow(np.ma.masked_where(~all_diverged, np.ones_like(values)), aspect="auto",
                  cmap=plt.matplotlib.colors.ListedColormap([DIVERGED]), origin="lower",
                  alpha=0.55)
    size = 8.5 if values.size <= 30 else 6.5  # large cells, legible text; many, small
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            v = values[i, j]
            if all_diverged[i, j]:
                text = "diverged"
            elif math.isfinite(v):
                text = f"{v:.1f}"
            else:
                text = f">{budget:g}" if budget else "miss"
            if math.isfinite(lrs[i, j]):
                text += f"\nη {lrs[i, j]:g}"
            if np.nan_to_num(diverged[i, j]) > 0 and not all_diverged[i, j]:
                text += f"\ndiv {int(diverged[i, j])}/{int(runs[i, j])}"
            if np.nan_to_num(collapsed[i, j]) > 0:
                text += f"\ncoll {int(collapsed[i, j])}/{int(runs[i, j])}"
            bright = math.isfinite(v) and norm(v) > 0.6
            ax.text(j, i, text, ha="center", va="center", fontsize=size,
                    color="black" if bright or not math.isfinite(v) else "white")
    ax.set_xticks(range(len(table.columns)), [str(c) for c in table.columns],
                  rotation=45 if len(table.columns) > 6 else 0)
    ax.set_yticks(range(len(table.index)), [str(i) for i in table.index])
    ax.set_xlabel("batch size B")
    ax.set_ylabel(label if key == rows else "model")
    bar = ax.figure.colorbar(image, ax=ax, label="epochs (log scale)")
    wrapped_title(ax, f"{title} (median over runs)")  # after the colour bar took its width
    bar.ax.yaxis.set_major_formatter(PLAIN)
    bar.ax.yaxis.set_minor_formatter(MinorLabels())


def _segments(frame: pd.DataFrame, column: str) -> list[pd.DataFrame]:
    """Runs of consecutive batch sizes whose ``column`` is finite and positive: a line is
    drawn within each, never across a batch size that missed."""
    ok = np.isfinite(frame[column].to_numpy(float)) & (frame[column].to_numpy(float) > 0)
    out, start = [], None
    for i, good in enumerate([*ok, False]):
        if good and start is None:
            start = i
        elif not good and start is not None:
            out.append(frame.iloc[start:i])
            start = None
    return out


def epochs_vs_batch(ax: Axes, summary: pd.DataFrame, budget: float | None = None,
                    colours: Colour = _by_index) -> None:
    """Median epochs to target against B, one line per model; the error bars span the
    seeds; censored points are drawn as open triangles at the epoch budget, and said so in
    the legend (a note written inside the axes ran into those markers)."""
    groups = _groups(summary)
    marks = {"censored": False, "diverged": False}
    for i, (label, part) in enumerate(groups):
        colour = colours(part, i)
        segments = _segments(part, "median")
        for j, segment in enumerate(segments):
            ax.plot(segment["batch_size"], segment["median"], "o-", color=colour,
                    label=label if j == 0 else None)
        finite = part[np.isfinite(part["median"])]
        low = finite["median"] - finite["min"]
        high = (finite["max"].where(np.isfinite(finite["max"]), finite["median"])
                - finite["median"])
        ax.errorbar(finite["batch_size"], finite["median"], yerr=[low, high], fmt="none",
                    ecolor=colour, alpha=0.6, capsize=2)
        missed = part[~np.isfinite(part["median"])]
        if budget and len(missed):
            # side by side, not on top of each other: one small offset per model
            shift = 2 ** (0.12 * (i - (len(groups) - 1) / 2))
            dead = missed["diverged"] >= missed["runs"] if "diverged" in missed else \
                np.zeros(len(missed), bool)
            # a model with no line is named by its markers: else nothing says whose they are
            ax.plot(missed["batch_size"][~dead] * shift, [budget] * int((~dead).sum()), "^",
                    mfc="none", color=colour,
                    label=f"{label}: never reached" if not segments else None)
            ax.plot(missed["batch_size"][dead] * shift, [budget] * int(dead.sum()), "x",
                    color=DIVERGED, ms=7, mew=2)
            marks["censored"] |= bool((~dead).any())
            marks["diverged"] |= bool(dead.any())
    handles = []
    if budget:
        ax.axhline(budget, color="grey", ls=":", lw=1, label=f"max epochs ({budget:g})")
        if marks["censored"]:
            handles.append(Line2D([], [], ls="none", marker="^", mfc="none", color="grey",
                                  label="not reached (drawn at max epochs)"))
        if marks["diverged"]:
            handles.append(Line2D([], [], ls="none", marker="x", color=DIVERGED, ms=7, mew=2,
                                  label="every run diverged (at max epochs)"))
    log2_batch_axis(ax, summary["batch_size"].unique())
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(PLAIN)
    ax.yaxis.set_minor_formatter(MinorLabels())
    ax.set_ylabel("epochs to target (log)")
    ax.set_title("epochs to target against batch size")
    legend(ax, handles, fontsize=7)
    ax.grid(alpha=0.3, which="both")


def speedup_curves(ax: Axes, speedups: pd.DataFrame, title: str = "speedup",
                   colours: Colour = _by_index) -> None:
    """s(m; m0) per model with the linear ideal m/m0 (dashed); no line across a batch size
    that missed; a red ✕ on the bottom edge where the median missed and some runs diverged."""
    bottom = ax.get_xaxis_transform()
    for i, (label, part) in enumerate(_groups(speedups)):
        for j, segment in enumerate(_segments(part, "speedup")):
            ax.plot(segment["batch_size"], segment["speedup"], "o-", color=colours(part, i),
                    label=label if j == 0 else None)
        if "diverged" in part:
            dead = part[(part["diverged"] > 0) & (part["speedup"] == 0)]
            ax.plot(dead["batch_size"], [0.03] * len(dead), "x", color=DIVERGED, ms=7, mew=2,
                    transform=bottom, label="diverged" if len(dead) and i == 0 else None)
    m0 = speedups["batch_size"].min()
    batches = np.array(sorted(speedups["batch_size"].unique()), float)
    ax.plot(batches, batches / m0, "k--", lw=1, label="linear ideal m/m0")
    log2_batch_axis(ax, batches)
    ax.set_yscale("log", base=2)
    ax.yaxis.set_major_formatter(PLAIN)
    ax.set_ylabel("speedup s(m; m0) = k(m0)/k(m) (log2)")
    ax.set_title(title)
    legend(ax, fontsize=7)
    ax.grid(alpha=0.3)


def loss_contour(ax: Axes, surface: pd.DataFrame, title: str = "",
                 levels: np.ndarray | None = None) -> None:
    """Training loss over (B, iterations) on a log scale, as [inefficiency]'s Figure 1; one model's
    rows from ``analysis.loss_surface``. Lighter is lower. ``levels`` (log10 loss) shares
    one scale across panels."""
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
    if levels is None:
        levels = np.linspace(np.nanmin(z), np.nanmax(z), 12)
    filled = ax.contourf(batches, grid, np.ma.masked_invalid(z), levels=levels,
                         cmap="viridis_r")
    ax.figure.colorbar(filled, ax=ax, label="training loss (log scale)", format=LOSS)
    log2_batch_axis(ax, batches)
    ax.set_yscale("log")
    ax.set_ylabel("iterations (log)")
    wrapped_title(ax, title or "training loss over (B, iterations)")


def delta_vs_shape(ax: Axes, along: pd.DataFrame, summary: pd.DataFrame,
                   x: str = "depth", how: str = "averaged over training") -> None:
    """Δ at every measurement along training (dots coloured by epoch) against depth or
    width, with the per-model average over training (line). ``x = "model_label"`` (two
    model families: a cnn1d's depth is no fc's hidden layers) puts each model at its own
    named position, unjoined: models of two families are no sequence."""
    if along.empty:
        ax.text(0.5, 0.5, "no Δ measurements", ha="center", transform=ax.transAxes)
        return
    reference = summary["batch_size"].iloc[0] if len(summary) else along["batch_size"].min()
    part = along[along["batch_size"] == reference]
    named = x == "model_label"
    order = [str(m) for m in dict.fromkeys(summary.sort_values(
        [c for c in ("depth", "width", "model_label") if c in summary])["model_label"])]

    def position(frame: pd.DataFrame) -> pd.Series:
        return frame["model_label"].astype(str).map(order.index) if named else frame[x]

    epochs = part["epoch"].unique()
    if len(epochs) > 1:
        dots = ax.scatter(position(part), part["diversity"], c=part["epoch"], cmap="plasma",
                          s=14, alpha=0.8)
        ax.figure.colorbar(dots, ax=ax, label="epoch of measurement")
    else:  # one epoch (Δ at initialisation only): a colour bar would span -0.1 … 0.1
        ax.scatter(position(part), part["diversity"], color="tab:purple", s=14, alpha=0.8,
                   label=f"each run, epoch {epochs[0]:g}")
    mean = summary if named else summary.sort_values(x)
    style = "o" if named else "-o"
    ax.plot(position(mean), mean["delta_mean"], "k" + style, label=f"mean, {how}")
    if mean["delta_matched"].notna().any():
        ax.plot(position(mean), mean["delta_matched"], "s" + ("" if named else "--"),
                color="tab:green", label=f"at matched loss {mean['matched_loss'].iloc[0]:.3g}")
    ax.set_yscale("log")
    if named:
        ax.set_xticks(range(len(order)), order, rotation=15 if len(order) > 1 else 0,
                      ha="right" if len(order) > 1 else "center", fontsize=8)
        ax.set_xlim(-0.5, len(order) - 0.5)
        ax.set_xlabel("model")
        ax.set_title(f"Δ per model (B = {reference})")
    else:
        ax.set_xlabel({"depth": "depth L (hidden layers)", "width": "width K"}.get(x, x))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # depths, widths: integers
        ax.set_title(f"Δ along training (B = {reference})")
    ax.set_ylabel("gradient diversity Δ (log)")
    legend(ax, fontsize=7)
    ax.grid(alpha=0.3)


def delta_along_training(ax: Axes, along: pd.DataFrame, batch_size: int | None = None,
                         colours: Colour = _by_index) -> None:
    """Δ against epoch for each model at one batch size (the smallest by default): one thin
    line per run, so plateaus (Δ blowing up near a stationary point) stay visible."""
    if along.empty:
        ax.text(0.5, 0.5, "no Δ measurements", ha="center", transform=ax.transAxes)
        return
    batch_size = batch_size or int(along["batch_size"].min())
    part = along[along["batch_size"] == batch_size]
    for i, (name, model) in enumerate(_groups(part)):
        colour = colours(model, i)
        for j, (_, run) in enumerate(model.groupby("key")):
            run = run.sort_values("epoch")
            # a run measured once (it reached the target first) is a dot, not an empty line
            ax.plot(run["epoch"], run["diversity"], "-" if len(run) > 1 else ".",
                    color=colour, lw=1, alpha=0.8, label=name if j == 0 else None)
    ax.set_yscale("log")
    if (part["epoch"] > 0).all():  # log epochs keep short runs legible beside long ones
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(PLAIN)
    ax.set_xlabel("epoch (log)" if ax.get_xscale() == "log" else "epoch")
    ax.set_ylabel("gradient diversity Δ (log)")
    ax.set_title(f"Δ along training, B = {batch_size} (one line per seed)")
    legend(ax, fontsize=7)
    ax.grid(alpha=0.3)


def largest_batch_vs_delta(ax: Axes, table: pd.DataFrame, budget: float | None = None,
                           how: str = "averaged over training") -> None:
    """Largest workable B (within the epoch budget) and B* against Δ, with the bound n·Δ for
    reference. Δ at matched training loss when every model has it (robust to a model stuck
    near a stationary point), else Δ averaged over training."""
    matched = "delta_matched" in table and table["delta_matched"].notna().all()
    x, bound, how = (("delta_matched", "bound_matched", "at matched training loss") if matched
                     else ("delta_mean", "bound_mean", how))
    table = table.sort_values(x)
    within = f"within {budget:g} epochs" if budget else "within E epochs"

    def none(column: str) -> str:  # a legend entry with nothing drawn says why
        return "" if np.isfinite(table[column].to_numpy(float)).any() else ": no model"

    ax.plot(table[x], table["largest_batch"], "o-",
            label=f"largest B {within}{none('largest_batch')}")
    ax.plot(table[x], table["threshold_batch"], "s--",
            label=f"threshold B*{none('threshold_batch')}")
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
    legend(ax, fontsize=7)
    ax.grid(alpha=0.3)
