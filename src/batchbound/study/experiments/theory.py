"""Deep linear networks on Gaussian data against [width]'s Theorem 3 ("The Effect of
Network Width on the Performance of Large-batch Training", Sec. 4 and Figure 2).

Theorem 3 bounds ρ = E[nΣ‖∇f_i‖²]/E‖Σ∇f_i‖², the expected batch-size bound n·Δ, from below
for an L-layer linear network with N(0,1) weights and inputs: it grows with the width and
falls with the depth (``batchbound.theory.linear_network_rho_bound``). The section applies
to a study of ``linear`` networks only: per shape, the measured n·Δ at initialisation (the
theorem's setting: every run's first measurement) and averaged over training, beside the
bound, and the largest batch within the epoch budget (Fig. 2b). The theorem has one output
unit; with several outputs the bound is shown as the theorem states it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from batchbound.spec import parse_spec
from batchbound.study.evidence import means
from batchbound.study.experiments.registry import Section, register_experiment
from batchbound.theory import linear_network_rho_bound

if TYPE_CHECKING:  # the bundle's module imports this one
    from batchbound.study.summary import StudyAnalysis


def input_dim(data_label: str) -> int:
    from batchbound.study.adapter import load_data
    from batchbound.study.spec import DataSpec

    dataset, _, transform = data_label.partition(" | ")
    return int(math.prod(load_data(DataSpec(dataset, transform or None)).input_shape))


@register_experiment
def theory(a: StudyAnalysis) -> Section | None:
    runs = a.frames["runs"]
    families = {parse_spec(m).name for m in runs["model"].unique()}
    if families != {"linear"} or a.along.empty or runs["data"].nunique() != 1:
        return None

    d = input_dim(str(runs["data"].iloc[0]))
    along = a.along.sort_values("epoch")
    first = along.groupby("key").first()  # each run's measurement at initialisation
    rows, at_init, counts = [], {}, {}
    for label, part in first.groupby("model_label"):
        depth, width = int(part["depth"].iloc[0]), int(part["width"].iloc[0])
        bound = linear_network_rho_bound(d, [width] * depth) if depth and width > 1 else math.nan
        at_init[label] = (bound, means(part["batch_bound"].to_numpy(float)))
        counts[label] = len(part)
        rows.append({"model_label": label, "depth": depth, "width": width,
                     "n·Δ at init": float(part["batch_bound"].mean()),
                     "Theorem 3 bound": bound})
    table = pd.DataFrame(rows)
    keys = ["model_label"]
    if len(a.diversity):
        table = table.merge(a.diversity[[*keys, "bound_mean"]].rename(
            columns={"bound_mean": "n·Δ averaged over training"}), on=keys, how="left")
    if len(a.largest):
        largest = a.largest.groupby("model_label")["largest_batch"].first()
        table[f"largest B ≤ {a.budget:g} ep"] = table["model_label"].map(largest)
    table = table.sort_values(["depth", "width"]).reset_index(drop=True)

    def draw(fig: Any) -> None:
        from batchbound.study.plots import legend

        ax = fig.add_subplot()
        for _, row in table.iterrows():
            ax.scatter(row["Theorem 3 bound"], row["n·Δ at init"], color="C0")
            ax.annotate(row["model_label"], (row["Theorem 3 bound"], row["n·Δ at init"]),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        finite = table[["Theorem 3 bound", "n·Δ at init"]].replace([np.inf], np.nan).dropna()
        if len(finite):
            top = float(finite.to_numpy().max()) * 1.1
            ax.plot([0, top], [0, top], color="grey", ls=":", label="measured = bound")
        ax.set_xlabel("Theorem 3 lower bound on E[n·Δ]")
        ax.set_ylabel("measured n·Δ at initialisation (mean over runs)")
        ax.set_title("deep linear networks: measured bound against the theorem")
        legend(ax, fontsize=8)

    return Section(
        key="theory", title="Deep linear networks against Theorem 3", source="width",
        text=(f"Linear networks on Gaussian inputs (d = {d}); the theorem's ρ bound per shape "
              "(L = depth + 1 weight matrices of width K) beside the measured n·Δ at "
              "initialisation (each run's first measurement, the theorem's setting when the "
              "models use init=normal: N(0, init_std²) weights, the N(0,1) setting up to a "
              "common scale of student and teacher) and averaged over training."),
        tables=[("Per shape: measured n·Δ and Theorem 3's bound", table)],
        figures=[("theory_bound", "Measured n·Δ at initialisation against Theorem 3's lower "
                  "bound per shape [width, Theorem 3 and Figure 2].", draw)],
        data={"at_init": at_init, "runs": counts},
    )
