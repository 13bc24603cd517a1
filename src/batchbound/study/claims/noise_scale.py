"""The bound n·Δ as the scale of the batch size ("Scaling-up SGD with mini-batches", lecture
slides; McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"): the fitted
critical batch size lies within a factor of 4 of n·Δ."""

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

SOURCE = "slides"
FACTOR = 4.0


@register_claim(SOURCE, needs=("diversity", "batch_size"))
def critical_batch_near_bound(context: Context) -> Finding:
    claim = (f"Set the batch size ≈ n·Δ: the fitted critical batch size B_crit is within a "
             f"factor of {FACTOR:g} of the measured bound n·Δ ({context.delta_how}).")
    crit, div = context.critical, context.diversity
    if crit.empty or div.empty:
        return Finding(SOURCE, claim, UNTESTABLE, "no model has a B_crit fit (it needs 3 "
                       "batch sizes that reach the target)")
    keys = [k for k in A.model_keys(crit) if k in div]
    table = crit.merge(div, on=keys, how="inner")
    bound = "bound_matched" if table["bound_matched"].notna().all() else "bound_mean"
    parts, verdicts = [], []
    for name, (_, row) in zip(A.display_names(table), table.iterrows(), strict=True):
        n_delta, low, high = row[bound], row["low"], row["high"]
        if not (math.isfinite(n_delta) and math.isfinite(low)):
            verdicts.append(UNTESTABLE)
            parts.append(f"{name}: not measured")
            continue
        text = f"{name}: B_crit {fmt(row['b_crit'])} {span(low, high)} vs n·Δ {fmt(n_delta)}"
        if row["outside"] or row["at_bound"]:
            verdicts.append(INCONCLUSIVE)
            parts.append(text + " (B_crit outside the batches that reached the target)")
            continue
        inside = n_delta / FACTOR <= low and high <= n_delta * FACTOR
        apart = high < n_delta / FACTOR or low > n_delta * FACTOR
        verdicts.append(INCONCLUSIVE if row["one_run"] else directional(context, inside, apart))
        parts.append(text + (" (one run per batch: no spread)" if row["one_run"] else ""))
    return Finding(SOURCE, claim, all_models(verdicts), "; ".join(parts) + " (95 % intervals).")
