"""Claims of "The Effect of Network Width on the Performance of Large-batch Training"
(NeurIPS 2018): a batch-size threshold exists, shrinks with depth and grows with width and
with gradient diversity."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from batchbound.study import analysis as A
from batchbound.study.claims import settings
from batchbound.study.claims.registry import (
    INCONCLUSIVE,
    SUPPORTED,
    UNTESTABLE,
    Context,
    Finding,
    correlation,
    fmt,
    one_run_note,
    register_claim,
    seeds_per_cell,
    span,
)
from batchbound.study.evidence import Model, interval

SOURCE = "width"


def _b_star(model: Model, row: int) -> float:
    return A.b_star(model.batches, model.epochs[row])


def _labels(context: Context, label: str) -> dict[str, float]:
    return {m.name: float(m.labels.get(label, math.nan)) for m in context.evidence.models}


@register_claim(SOURCE, needs=("batch_size",))
def threshold_exists(context: Context) -> Finding:
    claim = ("For every network there is a threshold B* beyond which epochs to target grow "
             "(by more than 1.5× the best smaller batch, or the target is missed).")
    b_star = context.evidence.per_model(_b_star)
    trains = {n: v for n, v in b_star.items() if not math.isnan(v[0])}
    if not trains:
        return Finding(SOURCE, claim, UNTESTABLE, "no model reaches the target at any batch")
    top = context.max_batch
    floor = min(float(m.batches[0]) for m in context.evidence.models if len(m.batches))
    bounds = {n: interval(v) for n, v in trains.items()}
    # a B* at the grid's smallest batch shows no flat part, one at its largest no growth:
    # either way the threshold may lie beyond the grid, so neither supports the claim
    inside = all(floor < low and high < top for low, high in bounds.values())
    never = len(b_star) - len(trains)
    verdict = INCONCLUSIVE if context.evidence.one_run or not inside else SUPPORTED
    text = ("B* (95 % interval) per model: " + "; ".join(
        f"{n}: {fmt(trains[n][0])} {span(*bounds[n])}{_edge(trains[n][0], bounds[n], floor, top)}"
        for n in trains)
        + f"; batches tried {fmt(floor)}–{fmt(top)}"
        + (f"; {never} model(s) never reach the target (left out)" if never else "")
        + "." + one_run_note(context))
    return Finding(SOURCE, claim, verdict, text)


def _edge(value: float, bounds: tuple[float, float], floor: float, top: float) -> str:
    """Where B* or its interval meets the grid's edges, and what that leaves unknown."""
    low, high = bounds
    notes = []
    if value <= floor:
        notes.append("at the grid edge: the smallest batch; no flat part measured, the "
                     "threshold may lie below the grid")
    elif low <= floor:
        notes.append("its interval reaches the grid edge, the smallest batch: the threshold "
                     "may lie below the grid")
    if value >= top:
        notes.append("at the grid edge: the largest batch; the threshold, if any, lies "
                     "beyond the grid")
    elif high >= top:
        notes.append("its interval reaches the grid edge, the largest batch: the threshold, "
                     "if any, may lie beyond the grid")
    return f" ({'; '.join(notes)})" if notes else ""


@register_claim(SOURCE, needs=("depth",))
def threshold_falls_with_depth(context: Context) -> Finding:
    return correlation(context, SOURCE, "The batch-size threshold B* decreases with depth at "
                       "a fixed parameter count.", _labels(context, "depth"),
                       context.evidence.per_model(_b_star), -1, "depth", "B*")


@register_claim(SOURCE, needs=("width",))
def wider_allows_larger_batch(context: Context) -> Finding:
    largest = context.evidence.per_model(
        lambda m, r: A.largest_within(m.batches, m.epochs[r], context.budget))
    return correlation(context, SOURCE, f"Wider networks allow a larger batch within E = "
                       f"{context.budget:g} epochs (Figure 5).", _labels(context, "width"),
                       largest, +1, "width", "largest B")


@register_claim(SOURCE, needs=("width", "batch_size"))
def wider_needs_fewer_epochs(context: Context) -> Finding:
    models = context.evidence.models
    common = set.intersection(*(set(m.batches) for m in models))
    # the largest batch at which at least 3 models reach the target
    reached = [b for b in sorted(common)
               if sum(math.isfinite(m.epochs[0][list(m.batches).index(b)]) for m in models) >= 3]
    claim = "At the same large batch, wider networks need fewer epochs to the target."
    if not reached:
        return Finding(SOURCE, claim, "not testable",
                       "no batch size at which 3 models reach the target")
    batch = reached[-1]
    epochs = context.evidence.per_model(
        lambda m, r: float(m.epochs[r][list(m.batches).index(batch)]))
    return correlation(context, SOURCE, f"At the same large batch (B = {batch:g}), wider "
                       "networks need fewer epochs to the target (a miss ranks slowest).",
                       _labels(context, "width"), epochs, -1, "width", "epochs")


def _delta(context: Context) -> dict[str, np.ndarray]:
    return {m.name: m.delta for m in context.evidence.models}


@register_claim(SOURCE, needs=("width", "diversity"))
def diversity_grows_with_width(context: Context) -> Finding:
    found = correlation(context, SOURCE, f"Gradient diversity Δ ({context.delta_how}) grows "
                        "with width at a fixed parameter count (Figure 2a).",
                        _labels(context, "width"), _delta(context), +1, "width", "Δ")
    return replace(found, differs=settings.gaussian_linear(context.spec))


@register_claim(SOURCE, needs=("model_label", "diversity"))
def largest_batch_grows_with_diversity(context: Context) -> Finding:
    largest = context.evidence.per_model(
        lambda m, r: A.largest_within(m.batches, m.epochs[r], context.budget))
    delta = {m.name: float(m.delta[0]) for m in context.evidence.models}
    return correlation(context, SOURCE, f"The largest batch within E = {context.budget:g} "
                       f"epochs grows with gradient diversity Δ ({context.delta_how}) "
                       "(Figure 2c).", delta, largest, +1, "Δ", "largest B")


@register_claim(SOURCE, needs=("section:theory",))
def theorem3_orders_shapes(context: Context) -> Finding:
    claim = ("Theorem 3: for linear networks on Gaussian data the bound n·Δ at initialisation "
             "follows the theorem's ρ bound across shapes (wider larger, deeper smaller).")
    at_init = context.sections["theory"].data["at_init"]
    bounds = {n: b for n, (b, _) in at_init.items() if math.isfinite(b)}
    found = correlation(context, SOURCE, claim, bounds,
                        {n: draws for n, (_, draws) in at_init.items()}, +1,
                        "Theorem 3 bound", "measured n·Δ at init")
    counts = list(context.sections["theory"].data.get("runs", {}).values())
    return replace(found, differs=settings.gaussian_linear(context.spec),
                   n=seeds_per_cell(counts, "runs", "per shape") if counts else "")
