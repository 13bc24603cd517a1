"""Algorithmic stability per batch size ([diversity], "Gradient Diversity", Sec. 6 and
Figure 3).

Two training sets differ in one example (``neighbour_pair`` side 0 and side 1); the same
seed gives both runs the same changed example, initial weights and batch order, so the only
difference is that example. Their weights drift apart; the paper's measure is the
normalised distance √(‖w−w'‖²/(‖w‖²+‖w'‖²)), which it finds larger for larger batches
(Fig. 3a), and large batches show a wider spread of test accuracy (Fig. 3b/c). The runs keep
their weights every ``snapshot_every_epochs`` (``Store.snapshots``); pairs are matched on
(model, batch size, step size, seed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from batchbound.study.evidence import bootstrap_units, means
from batchbound.study.experiments.frames import finals, transform_of
from batchbound.study.experiments.registry import Section, register_experiment

if TYPE_CHECKING:  # the bundle's module imports this one
    from batchbound.study.summary import StudyAnalysis


def side(data_label: str) -> int | None:
    spec = transform_of(data_label)
    if spec is None or spec.name != "neighbour_pair":
        return None
    return int(spec.kwargs.get("side", 0))


def normalised_distance(w: np.ndarray, v: np.ndarray) -> np.ndarray:
    """√(‖w−v‖²/(‖w‖²+‖v‖²)) row by row, in float64."""
    w, v = np.asarray(w, np.float64), np.asarray(v, np.float64)
    return np.sqrt(((w - v) ** 2).sum(-1) / ((w**2).sum(-1) + (v**2).sum(-1)))


def pair_distances(runs: pd.DataFrame, snapshots: dict[str, tuple[np.ndarray, np.ndarray]]
                   ) -> pd.DataFrame:
    """Per pair and snapshot epoch: model, batch_size, seed, epoch, distance."""
    rows = []
    runs = runs.assign(side=runs["data"].map(side))
    for (model, batch, _lr, seed), pair in runs.groupby(["model", "batch_size", "lr", "seed"]):
        keys = dict(zip(pair["side"], pair["key"], strict=False))
        if set(keys) != {0, 1} or not all(k in snapshots for k in keys.values()):
            continue
        (e0, w0), (e1, w1) = snapshots[keys[0]], snapshots[keys[1]]
        common = min(len(e0), len(e1))  # same schedule: the same epochs, in order
        if not np.allclose(e0[:common], e1[:common]):
            continue
        rows += [(model, int(batch), int(seed), float(e), float(d)) for e, d in
                 zip(e0[:common], normalised_distance(w0[:common], w1[:common]), strict=True)]
    return pd.DataFrame(rows, columns=["model", "batch_size", "seed", "epoch", "distance"])


@register_experiment
def stability(a: StudyAnalysis) -> Section | None:
    sides = {label: side(label) for label in a.frames["runs"]["data"].unique()}
    if set(sides.values()) != {0, 1} or not a.snapshots:
        return None
    runs = finals(a)
    distances = pair_distances(runs, a.snapshots)
    if distances.empty:
        return None
    last = distances.sort_values("epoch").groupby(["batch_size", "seed"]).last()
    cells = runs.groupby("batch_size")
    table = pd.DataFrame({
        "pairs": last.groupby(level="batch_size").size(),
        "final distance mean": last.groupby(level="batch_size")["distance"].mean(),
        "final distance sd": last.groupby(level="batch_size")["distance"].std(),
        "test acc mean": cells["final_test_acc"].mean(),
        "test acc sd": cells["final_test_acc"].std(),
        "test acc range": cells["final_test_acc"].max() - cells["final_test_acc"].min(),
        "runs": cells.size(),
    }).reset_index()
    curve = distances.groupby(["batch_size", "epoch"], as_index=False)["distance"].median()
    draws = {int(b): means(part["distance"].to_numpy(float))
             for b, part in last.reset_index().groupby("batch_size")}
    # the two runs of a pair share seed, weights and batch order: the pair is the unit
    spread = {int(b): bootstrap_units(
        [pair["final_test_acc"].dropna().to_numpy(float) for _, pair in part.groupby("seed")],
        lambda v: float(np.std(v, ddof=1)) if len(v) > 1 else np.nan)
        for b, part in cells}

    def draw(fig: Any) -> None:
        from batchbound.study.plots import legend

        # two panels one above the other, as wide as every other figure (side by side, an
        # 800 px page shrank the 11-inch image and its text to 63 %, as the loss contours)
        fig.set_size_inches(6.4, 8.4)
        left, right = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
        for batch, part in curve.groupby("batch_size"):
            left.plot(part["epoch"], part["distance"], marker=".", label=f"B = {batch}")
        left.set_xlabel("passes over the data")
        left.set_ylabel("normalised distance (median over seeds)")
        left.set_title("neighbouring data sets drift apart")
        legend(left, fontsize=8)
        for i, (_, part) in enumerate(cells):
            values = part["final_test_acc"].dropna()
            right.scatter([i] * len(values), values, alpha=0.7)
        right.set_xticks(range(len(cells)), [str(b) for b, _ in cells])
        right.set_xlabel("batch size B")
        right.set_ylabel("final test accuracy, every run")
        right.set_title("spread of test accuracy")

    return Section(
        key="stability", title="Stability of mini-batch SGD", source="diversity",
        text=("Pairs of runs on training sets that differ in one example, with the same "
              "seed (same changed example, initial weights and batch order) and the same step "
              "size; the distance is √(‖w−w'‖²/(‖w‖²+‖w'‖²)) between their weights after "
              "each pass. The test accuracy spread is over every run at that batch size "
              "(both sides, every seed); its interval resamples pairs, the independent unit."),
        tables=[("Per batch size: distance at the end and spread of test accuracy", table)],
        figures=[("stability", "Normalised distance between the models trained on "
                  "neighbouring data sets against passes, per B (top) and the final test "
                  "accuracy of every run per B (bottom) [diversity, Figure 3].", draw)],
        data={"distance": draws, "spread": spread,
              "pairs": {int(b): len(part) for b, part in last.reset_index().groupby("batch_size")},
              "spread_pairs": {int(b): part["seed"].nunique() for b, part in cells}},
    )
