"""Generalisation per batch size, measured at the final weights w* ([inefficiency], "On the
Computational Inefficiency of Large Batch Sizes", Table 2 and Figure 2 right; [slides]'s
E[OSG], "Scaling-up SGD with mini-batches").

Applies to a study whose runs recorded end-of-training probes (``final_probes`` in the
study's ``[train]``; see ``batchbound.train.probes``): per learning-rate strategy and batch
size, the mean over seeds of the test accuracy, of the linear-approximation error of the
loss along one step of the run's own update from w*, and of E[OSG] = (1/n)Σ‖∇f_i(w*)‖².
The claims (``claims/inefficiency.py``, ``claims/slides.py``) read the per-seed values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from batchbound.study.evidence import means
from batchbound.study.experiments.frames import finals
from batchbound.study.experiments.registry import Section, register_experiment

if TYPE_CHECKING:  # the bundle's module imports this one
    from batchbound.study.summary import StudyAnalysis

PROBES = {"final_test_acc": "test acc", "final_train_acc": "train acc",
          "final_linear_error": "linear-approx. error", "final_osg_mean": "E[OSG]"}


@register_experiment
def generalization(a: StudyAnalysis) -> Section | None:
    runs = finals(a)
    probes = [c for c in ("final_linear_error", "final_osg_mean") if c in runs]
    if not probes or runs[probes].notna().sum().sum() == 0:
        return None
    from batchbound.study.plots import legend, log2_batch_axis

    columns = [c for c in PROBES if c in runs]
    cells = runs.groupby(["strategy", "batch_size"])
    table = cells[columns].agg(["mean", "std"])
    table.columns = [f"{PROBES[c]} {'mean' if s == 'mean' else 'sd'}" for c, s in table.columns]
    table = table.join(cells.size().rename("runs")).join(
        cells["status"].apply(lambda s: int((s == "diverged").sum())).rename("diverged"))
    table = table.reset_index()
    epochs = a.spec.get("train", {}).get("max_epochs")

    def draw(fig: Any) -> None:
        # two panels one above the other, as wide as every other figure (side by side, an
        # 800 px page shrank the 11-inch image and its text to 63 %, as the loss contours)
        fig.set_size_inches(6.4, 8.4)
        left, right = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
        for i, (strategy, part) in enumerate(table.groupby("strategy")):
            part, color = part.sort_values("batch_size"), f"C{i}"  # one colour per strategy
            b = part["batch_size"]
            if "test acc mean" in part:
                left.errorbar(b, part["test acc mean"], yerr=part["test acc sd"].fillna(0),
                              marker="o", capsize=3, color=color, label=f"{strategy}")
            if "linear-approx. error mean" in part:
                right.plot(b, part["linear-approx. error mean"], marker="s", color=color,
                           label=f"{strategy}: linear-approx. error")
            if "E[OSG] mean" in part:
                right.plot(b, part["E[OSG] mean"], marker="^", ls="--", color=color,
                           label=f"{strategy}: E[OSG]")
            dead = part[part["diverged"] > 0]
            left.scatter(dead["batch_size"], [0.0] * len(dead), marker="x", color="red",
                         zorder=5, label=f"{strategy}: runs diverged" if len(dead) else None)
        for ax in (left, right):
            log2_batch_axis(ax, sorted(table["batch_size"].unique()))
            legend(ax, fontsize=8)
        left.set_ylabel("test accuracy at the end")
        left.set_title(f"test accuracy after {epochs:g} epochs" if epochs else "test accuracy")
        right.set_yscale("log")
        right.set_title("at the final weights w*")

    return Section(
        key="generalization", title="Generalisation at the end of training",
        source="inefficiency",
        text=("Every run trains the same number of epochs; at its final weights w* it "
              "records the test accuracy, the error |L(w*−s) − L(w*) + ⟨g_B, s⟩| of the "
              "linear approximation along s, one step of the run's own update on a "
              "mini-batch of its batch size at its final step size (mean of 8 mini-batches), "
              "and E[OSG], the mean squared one-sample gradient norm over the training set. "
              "Cells: mean and standard deviation over seeds; diverged runs are counted and "
              "kept (their accuracy is what they reached)."),
        tables=[("Per strategy and batch size, at the end of training", table)],
        figures=[("generalization", "Test accuracy (top) and, at w*, the linear-"
                  "approximation error and E[OSG] (bottom) against B per strategy "
                  "[inefficiency, Table 2 and Figure 2 right; slides, E[OSG]].", draw)],
        data={"runs": runs[["strategy", "batch_size", "seed", "status", *columns]]},
    )


def per_cell_draws(runs: pd.DataFrame, column: str, strategy: str | None = None
                   ) -> dict[int, np.ndarray]:
    """{64: bootstrap means over seeds} for one strategy's cells (what the claims test)."""
    part = runs if strategy is None else runs[runs["strategy"] == strategy]
    return {int(b): means(cell[column].dropna().to_numpy(float))
            for b, cell in part.groupby("batch_size") if cell[column].notna().any()}
