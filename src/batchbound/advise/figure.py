"""Time to target against workers (log-log): the predicted best per P, the ideal line
T(1)/P, and n·Δ marked (with one example per worker, B = P: no more than n·Δ workers can
keep the per-example progress)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import FuncFormatter, NullFormatter

# workers and batches are counts: 1, 2, 4 … 1024, not 2^0 … 2^10
COUNT = FuncFormatter(lambda value, _: f"{value:g}")


def plot_advice(advice: Any, path: str | Path) -> Path:
    if not advice.on_seconds:
        return _plot_iterations(advice, path)
    rows = advice.best_rows
    workers = [r.workers for r in rows]
    seconds = [r.seconds_to_target for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ideal = [seconds[0] / p for p in workers]
    ax.plot(workers, ideal, "--", color="0.55", label="ideal: T(1)/P")
    ax.plot(workers, seconds, "o-", color="C0", label="predicted (best batch per P)")
    for r in rows:  # the last label left of its point: right of it, it ran off the figure
        last = r is rows[-1] and len(rows) > 1
        ax.annotate(f"B={r.batch_size}", (r.workers, r.seconds_to_target),
                    textcoords="offset points", xytext=(-5, 6) if last else (5, 6),
                    ha="right" if last else "left", fontsize=8)
    rec = advice.recommended
    ax.plot([rec.workers], [rec.seconds_to_target], "*", color="C3", markersize=14,
            label=f"recommended: P={rec.workers}, B={rec.batch_size}")
    bound = advice.batch_bound
    if not math.isfinite(bound):
        ax.plot([], [], " ", label="n·Δ not measured")
    elif workers[0] <= bound <= max(workers[-1], 2) * 4:
        ax.axvline(bound, color="C2", linestyle=":", label=f"n·Δ = {bound:.3g}")
    else:
        ax.plot([], [], " ", label=f"n·Δ = {bound:.3g} (off the axis)")
    if advice.workers_stop_paying:
        ax.axvline(advice.workers_stop_paying, color="C1", alpha=0.5,
                   label=f"workers stop paying past P={advice.workers_stop_paying}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(COUNT)
    ax.set_xlabel("workers P")
    ax.set_ylabel("predicted seconds to target")
    ax.set_title("Predicted time to the goal against workers", fontsize=10)
    return _save(fig, ax, path)


def _plot_iterations(advice: Any, path: str | Path) -> Path:
    """Without trusted seconds: predicted iterations (and interval) against the batch on one
    worker, the recommended batch starred."""
    rows = [r for r in advice.rows if r.workers == 1 and math.isfinite(r.iterations)]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    batches = [r.batch_size for r in rows]
    ax.fill_between(batches, [r.iterations_interval[0] for r in rows],
                    [r.iterations_interval[1] for r in rows], color="C0", alpha=0.2,
                    label="interval")
    ax.plot(batches, [r.iterations for r in rows], "o-", color="C0",
            label="predicted iterations")
    rec = advice.recommended
    ax.plot([rec.batch_size], [rec.iterations], "*", color="C3", markersize=14,
            label=f"recommended: B={rec.batch_size} (seconds not trusted here)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(COUNT)
    ax.set_xlabel("batch size B")
    ax.set_ylabel("predicted iterations to the goal")
    ax.set_title("Predicted iterations against the batch size", fontsize=10)
    return _save(fig, ax, path)


def _save(fig: Any, ax: Any, path: str | Path) -> Path:
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.margins(x=0.06, y=0.12)  # a label above the top point stays inside the axes
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
