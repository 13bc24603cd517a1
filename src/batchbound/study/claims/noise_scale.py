"""The bound n·Δ along the run as the scale of the batch size ("Gradient Diversity",
Theorem 1; "Scaling-up SGD with mini-batches", lecture slides: "set the batch size ≈ n·Δ";
McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"): the fitted critical
batch size lies within a factor of 4 of n·Δ along the run.

Theorem 1 asks B ≤ δ·n·Δ(w) + 1 at every w the run visits up to its target, so n·Δ is read
along the run (``analysis.diversity_runs``): its minimum over the measurements up to the
target and its value at the target's iteration, never an average over measurements after
the target.
"""

from __future__ import annotations

import math

from batchbound.study import analysis as A
from batchbound.study.claims.registry import (
    INCONCLUSIVE,
    UNTESTABLE,
    Context,
    Finding,
    all_models,
    directional,
    fmt,
    register_claim,
    span,
)

SOURCE = "diversity"
FACTOR = 4.0


@register_claim(SOURCE, needs=("diversity", "batch_size"))
def critical_batch_near_bound(context: Context) -> Finding:
    claim = (f"Theorem 1 ([slides]: set the batch size ≈ n·Δ): mini-batch SGD keeps serial "
             f"SGD's progress per example while B ≤ n·Δ(w) + 1 along the run, so the fitted "
             f"critical batch size B_crit lies between 1/{FACTOR:g} of the minimum of n·Δ "
             f"along the run to the target and {FACTOR:g}× its value at the target's "
             "iteration (smallest batch's runs; never measurements after the target).")
    crit, div = context.critical, context.diversity
    if crit.empty or div.empty or "bound_min" not in div:
        return Finding(SOURCE, claim, UNTESTABLE, "no model has a B_crit fit (it needs 3 "
                       "batch sizes that reach the target) beside n·Δ measured along its runs")
    keys = [k for k in A.model_keys(crit) if k in div]
    table = crit.merge(div, on=keys, how="inner")
    parts, verdicts = [], []
    for name, (_, row) in zip(A.display_names(table), table.iterrows(), strict=True):
        least, at_target, low, high = (row["bound_min"], row["bound_at_target"], row["low"],
                                       row["high"])
        if not (math.isfinite(least) and math.isfinite(at_target) and math.isfinite(low)):
            verdicts.append(UNTESTABLE)
            parts.append(f"{name}: not measured")
            continue
        text = (f"{name}: B_crit {fmt(row['b_crit'])} {span(low, high)} vs n·Δ along the run: "
                f"minimum {fmt(least)}, at the target {fmt(at_target)} (runs that reached "
                f"it: {row['runs_reached']})")
        if row.get("degenerate"):
            verdicts.append(INCONCLUSIVE)
            parts.append(text + f" (degenerate fit: {row['degenerate']})")
            continue
        if row["outside"] or row["at_bound"]:
            verdicts.append(INCONCLUSIVE)
            parts.append(text + " (B_crit outside the batches that reached the target)")
            continue
        floor, ceiling = min(least, at_target) / FACTOR, max(least, at_target) * FACTOR
        inside = floor <= low and high <= ceiling
        apart = high < floor or low > ceiling
        verdicts.append(INCONCLUSIVE if row["one_run"] else directional(context, inside, apart))
        parts.append(text + (" (one run per batch: no spread)" if row["one_run"] else ""))
    return Finding(SOURCE, claim, all_models(verdicts), "; ".join(parts) + " (95 % intervals).")
