"""Which figures a study's report shows, with their captions, drawn by ``plots``.

``figures(a)`` takes a ``summary.StudyAnalysis`` and lists (file stem, caption, draw) for
every figure its data supports; ``render_figures`` writes each as PNG and SVG. Panels that
are compared share one colour scale, and every title names what its panel shows.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from batchbound.files import write_through
from batchbound.study import analysis as A

if TYPE_CHECKING:  # for the annotation only
    from batchbound.study.summary import StudyAnalysis

Figure = tuple[str, str, Callable[[Any], None]]
NOT_REACHED = ("Grey: not reached within max_epochs; red: every run diverged; "
               "'div k/n': k of the cell's n runs diverged; 'coll k/n': k collapsed (did not "
               "train; left out of every fit).")


def heatmap_rows(epochs: pd.DataFrame, runs: pd.DataFrame) -> str:
    """The heatmap's rows: depth, unless two model families share the study (a cnn1d's
    depth is no fc's hidden layers: "depth L (hidden layers)" would misname it), or depth
    does not tell the models apart; then the models by name."""
    from batchbound.study import plots as P

    return "model_label" if len(families(runs)) > 1 else P.shape_axis(epochs, "depth")


def families(runs: pd.DataFrame) -> set[str]:
    """The model families of a study's runs: a spec's name before "(" (a user's
    "mymodels:factory" has none)."""
    return {str(m).split("(")[0] for m in runs["model"].dropna()} if "model" in runs else set()


def delta_axis(diversity: pd.DataFrame, runs: pd.DataFrame) -> str:
    """The Δ figure's x axis: the models by name when two families share the study (as the
    heatmap's rows), else depth or width, whichever varies and tells the models apart;
    by name when neither does (one model; two activations at one shape)."""
    if len(families(runs)) > 1:
        return "model_label"
    from batchbound.study import plots as P

    for column in ("depth", "width"):
        if column in diversity and diversity[column].notna().all() \
                and diversity[column].nunique() > 1 and P.shape_axis(diversity, column) == column:
            return column
    return "model_label"


def figures(a: StudyAnalysis) -> list[Figure]:
    """(file stem, caption, draw(fig)) for every figure the data supports."""
    from batchbound.study import plots as P

    out: list[Figure] = []
    rows = heatmap_rows(a.epochs, a.frames["runs"])
    max_epochs = float(a.spec.get("train", {}).get("max_epochs", 0)) or None
    target = a.targets[0] if a.targets else "the target"
    groups = A.model_keys(a.epochs)
    extra = [k for k in groups if k != "model_label"]
    parts = [(("",), a.epochs)] if not extra else list(a.epochs.groupby(extra))
    finite = a.epochs["median"].replace([np.inf, -np.inf], np.nan).dropna()
    scale = (float(finite.min()), float(finite.max())) if len(finite) else None
    colours = P.model_colours(a.epochs)  # one colour per model in every figure
    for name, part in parts:
        suffix = " · ".join(str(n) for n in (name if isinstance(name, tuple) else (name,)) if n)
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"epochs_heatmap-{suffix}" if suffix
                      else "epochs_heatmap").strip("_")
        out.append((stem, f"Epochs to {target}, {rows.replace('model_label', 'model')} "
                    "against B"
                    f"{' for ' + suffix if suffix else ''}, with the tuned step size η of "
                    "each cell [width, Figure 4]. " + NOT_REACHED
                    + (" Every panel shares one colour scale." if len(parts) > 1 else ""),
                    lambda fig, p=part, t=suffix: P.epochs_heatmap(
                        fig.add_subplot(), p, rows, max_epochs, scale=scale,
                        title=f"epochs to target{': ' + t if t else ''}")))
    out.append(("epochs_vs_batch", f"Epochs to {target} against B per model [width, "
                "Figure 3]. Bars span the runs; a line never crosses a batch size that missed "
                "the target; open ▲: not reached, red ✕: diverged.",
                lambda fig: P.epochs_vs_batch(fig.add_subplot(), a.epochs, max_epochs,
                                                colours)))
    if len(a.speedups):
        out.append(("speedup", f"Speedup s(m; m0) in iterations to {target}, with the linear "
                    "ideal [inefficiency, Figure 2]; red ✕ at the bottom: the median run missed "
                    "the target and some runs at that batch diverged (the heatmap counts "
                    "them).",
                    lambda fig: P.speedup_curves(fig.add_subplot(), a.speedups,
                                                 "speedup to the target", colours)))
    if len(a.loss_speedups):
        out.append(("speedup_loss_threshold", "Speedup to the loss threshold (the lower "
                    "quartile of the losses recorded at the largest batch whose runs did not "
                    "diverge) [inefficiency]. Diverged runs never count as reaching it.",
                    lambda fig: P.speedup_curves(fig.add_subplot(), a.loss_speedups,
                                                 "speedup to the loss threshold", colours)))
    surface = A.loss_surface(a.frames["runs"], a.frames["curves"])
    if len(surface):
        keys = A.model_keys(surface)
        models = list(surface.groupby(keys, sort=False))
        chosen = [models[0], models[-1]] if len(models) > 1 else models[:1]
        values = np.log10(surface["value"][surface["value"] > 0].astype(float))
        values = values[np.isfinite(values)]
        levels = np.linspace(values.min(), values.max(), 12) if len(values) > 1 else None

        def draw(fig: Any, chosen: list = chosen) -> None:
            # one above the other, as wide as every other figure: side by side made an
            # 11-inch image that an 800 px page shrank to 63 %, its text with it
            fig.set_size_inches(6.4, 4.2 * len(chosen))
            for i, (name, part) in enumerate(chosen):
                title = " · ".join(map(str, name)) if isinstance(name, tuple) else str(name)
                P.loss_contour(fig.add_subplot(len(chosen), 1, i + 1), part,
                               f"training loss: {title}", levels=levels)

        out.append(("loss_contour", "Training loss over batch size and iterations for the "
                    f"{'first (top) and last (bottom) model' if len(chosen) > 1 else 'model'}"
                    ", on one colour scale [inefficiency, Figure 1]. Lighter is lower.", draw))
    if len(a.diversity) and len(a.along):
        how = A.delta_label(a.diversity)
        x = delta_axis(a.diversity, a.frames["runs"])
        against = {"depth": "against depth L", "width": "against width K",
                   "model_label": "per model (named: the study's models share no depth or "
                   "width axis)"}[x]
        out.append(("delta_vs_shape", "Gradient diversity Δ at every measurement (dots), its "
                    f"mean ({how}) and its value at matched training loss, {against} [width, "
                    "Figure 2a].",
                    lambda fig: P.delta_vs_shape(fig.add_subplot(), a.along, a.diversity, x,
                                                 how)))
        # the figure draws the smallest batch: a line needs two measurements of one run there
        # (runs that reach the target before their second measurement drew an empty plot)
        smallest = a.along[a.along["batch_size"] == a.along["batch_size"].min()]
        if (smallest.groupby("key").size() > 1).any():
            out.append(("delta_along_training", "Gradient diversity Δ against epoch at the "
                        "smallest batch size, one line per run: a shape stuck near a "
                        "stationary point shows Δ far above the others until it starts to "
                        "train.",
                        lambda fig: P.delta_along_training(fig.add_subplot(), a.along,
                                                           colours=colours)))
        out.append(("largest_batch_vs_delta", "Largest batch within E epochs and threshold "
                    "B* against Δ (at matched training loss when every shape reaches it, else "
                    f"{how}) [width, Figure 2c].",
                    lambda fig: P.largest_batch_vs_delta(fig.add_subplot(), a.shapes,
                                                         a.budget, how)))
    return out


def render_figures(a: StudyAnalysis, directory: Path) -> list[tuple[str, str, Path]]:
    """Draw every figure to ``directory`` as PNG and SVG (stale ones removed first)."""
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    for stale in [*directory.glob("*.png"), *directory.glob("*.svg")]:  # from an earlier report
        stale.unlink()
    out = []
    for stem, caption, draw in [*figures(a), *[f for s in a.sections for f in s.figures]]:
        fig = plt.figure(figsize=(6.4, 4.6), dpi=110)  # a draw may resize it
        try:
            draw(fig)
            fig.tight_layout()
            for suffix in (".png", ".svg"):  # each whole or not at all
                write_through(directory / f"{stem}{suffix}", fig.savefig)
        finally:
            plt.close(fig)
        out.append((stem, caption, directory / f"{stem}.png"))
    return out
