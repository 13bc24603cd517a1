"""Data replication ([diversity], "Gradient Diversity", Sec. 6 and Figure 2).

``replicate(r)`` keeps a random 1/r of the training set and repeats it r times: n stays the
same while gradient diversity drops. The paper measures the harm of a large batch by the
ratio of its training loss to a small batch's after the same number of passes, and finds
that the ratio grows with r. Here: that ratio against passes per r (median over seeds of
each seed's ratio; both runs share the seed), epochs to target per (r, B), Δ per r, and the
claims' statistics (``claims/diversity.py``): the loss ratio's geometric mean over passes,
bootstrapped over seeds, and the gap e(B_max)/e(B_min) in epochs to target.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from batchbound.study.evidence import means
from batchbound.study.experiments.frames import curve_on_grid, finals, transform_of
from batchbound.study.experiments.registry import Section, register_experiment

if TYPE_CHECKING:  # the bundle's module imports this one
    from batchbound.study.summary import StudyAnalysis

PASS_STEP = 0.25


def replication_factor(data_label: str) -> int | None:
    """r of a data label: 1 for plain data, r for ``replicate(r=..)``, None otherwise."""
    spec = transform_of(data_label)
    if spec is None:
        return 1
    if spec.name != "replicate":
        return None
    return int(spec.kwargs["r"])


def loss_ratios(a: StudyAnalysis, small: int, large: int) -> pd.DataFrame:
    """Per (data, seed, pass): L_large/L_small (training loss), both runs with that seed."""
    runs = finals(a)
    runs = runs[runs["batch_size"].isin([small, large])]
    top = float(a.spec.get("train", {}).get("max_epochs", 10))
    grid = np.arange(PASS_STEP, top + 1e-9, PASS_STEP)
    curves = curve_on_grid(a, runs["key"], "train_loss", grid)
    rows = []
    for (data, seed), part in runs.groupby(["data", "seed"]):
        by_batch = dict(zip(part["batch_size"], part["key"], strict=False))
        if small in by_batch and large in by_batch and by_batch[small] in curves.index \
                and by_batch[large] in curves.index:
            ratio = curves.loc[by_batch[large]] / curves.loc[by_batch[small]]
            rows += [(data, seed, p, v) for p, v in ratio.items() if np.isfinite(v) and v > 0]
    return pd.DataFrame(rows, columns=["data", "seed", "passes", "ratio"])


@register_experiment
def replication(a: StudyAnalysis) -> Section | None:
    runs = a.frames["runs"]
    labels = list(dict.fromkeys(runs["data"]))
    factors = {label: replication_factor(label) for label in labels}
    if len(labels) < 2 or None in factors.values() or len(set(factors.values())) < 2:
        return None
    batches = sorted(a.epochs["batch_size"].unique())
    if len(batches) < 2:
        return None
    small, large = int(batches[0]), int(batches[-1])
    per_seed = loss_ratios(a, small, large).assign(r=lambda f: f["data"].map(factors))
    ratios = per_seed.groupby(["r", "passes"], as_index=False)["ratio"].median()
    # the claim's statistic per seed: the geometric mean of the ratio over passes
    logs = per_seed.assign(log=np.log10(per_seed["ratio"])).groupby(["r", "seed"])["log"].mean()
    log_draws = {r: means(part.to_numpy(float)) for r, part in logs.groupby(level="r")}
    epochs = a.epochs.assign(r=a.epochs["data"].map(factors))
    table = epochs.pivot_table(index="r", columns="batch_size", values="median",
                               aggfunc="first")
    table.columns = [f"epochs B={b}" for b in table.columns]
    table["gap e(B_max)/e(B_min)"] = (table[f"epochs B={large}"] / table[f"epochs B={small}"])
    mean_ratio = (10 ** logs.groupby(level="r").mean()).rename(
        f"L(B={large})/L(B={small}), geometric mean over passes")
    table = table.join(mean_ratio)
    if len(a.diversity):
        delta = a.diversity.assign(r=a.diversity["data"].map(factors)).groupby("r")
        table = table.join(delta["delta_mean"].first().rename("Δ (avg)"))
        table = table.join(delta["bound_mean"].first().rename("n·Δ (avg)"))
    table = table.reset_index()
    target = a.targets[0] if a.targets else "the target"

    def draw(fig: Any) -> None:
        from batchbound.study import plots as P

        ax = fig.add_subplot()
        for r, part in ratios.groupby("r"):
            ax.plot(part["passes"], part["ratio"], marker=".", label=f"r = {r}")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(P.PLAIN)  # 1 and 10 alone name no ratio between them
        ax.yaxis.set_minor_formatter(P.MinorLabels())
        ax.set_xlabel("passes over the data")
        ax.set_ylabel(f"training loss, B={large} / B={small}")
        ax.set_title("large/small batch loss ratio per replication factor")
        P.legend(ax, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)  # off the lines

    return Section(
        key="replication", title="Data replication", source="diversity",
        text=(f"Each data set repeats a random 1/r of the training set r times (r = "
              f"{', '.join(str(r) for r in sorted(set(factors.values())))}); lower gradient "
              f"diversity should widen the gap between the large batch B = {large} and the "
              f"small batch B = {small}. The loss ratio is the median over seeds of each "
              f"seed's ratio after the same number of passes (both runs share the seed); "
              f"the gap is the ratio of the median epochs to {target}. At fixed weights n·Δ "
              f"of an r-replicated set equals m·Δ over its m = n/r distinct examples, which "
              f"stays near 1 + B_noise while m is well above B_noise: replication lowers "
              f"the diversity only once n/r comes down towards n·Δ, and the manipulation "
              f"check says whether it did."),
        tables=[("Per replication factor r", table)],
        figures=[("replication_loss_ratio", f"Training loss at B = {large} over B = {small} "
                  "against passes, per replication factor r [diversity, Figure 2]. Above 1: "
                  "the large batch is behind.", draw)],
        data={"factors": factors, "small": small, "large": large, "log_ratio": log_draws,
              "seeds": {int(r): len(part) for r, part in logs.groupby(level="r")}},
    )
