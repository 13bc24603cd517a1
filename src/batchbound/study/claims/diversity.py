"""Claims of "Gradient Diversity: a Key Ingredient for Scalable Distributed Learning"
(AISTATS 2018), tested on its experiments' sections: replication widens the large-batch gap,
DropConnect buys time, and large batches are less stable."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from batchbound.study.claims import settings
from batchbound.study.claims.registry import (
    SUPPORTED,
    UNTESTABLE,
    Context,
    Finding,
    against_batch,
    all_models,
    correlation,
    directional,
    fmt,
    one_run_note,
    register_claim,
    seeds_per_cell,
)
from batchbound.study.evidence import interval, means

SOURCE = "diversity"


def _replication_lowers_diversity(context: Context) -> Finding:
    data = context.sections["replication"].data
    claim = ("Manipulation check: replicating the data r times lowers gradient diversity, "
             "n·Δ along the run (each run's mean over its measurements up to the target, at "
             "the smallest batch) falls with r.")
    runs = context.diversity_runs
    if runs.empty or "data" not in runs:
        return Finding(SOURCE, claim, UNTESTABLE, "Δ was not measured along the runs (set "
                       "diversity_every_epochs): the manipulation is unchecked")
    runs = runs.assign(r=runs["data"].map(data["factors"]),
                       bound=runs["n_train"] * runs["delta_run"]).dropna(subset=["r", "bound"])
    per_r = {f"r={int(r)}": part["bound"].to_numpy(float) for r, part in runs.groupby("r")}
    found = correlation(context, SOURCE, claim, {k: float(k[2:]) for k in per_r},
                        {k: means(v) for k, v in per_r.items()}, -1, "r", "n·Δ")
    return replace(found, n=seeds_per_cell([len(v) for v in per_r.values()], "seeds",
                                           "per r (runs at the smallest batch)"))


@register_claim(SOURCE, needs=("section:replication",))
def replication_lowers_diversity(context: Context) -> Finding:
    return _replication_lowers_diversity(context)


def _with_manipulation(context: Context, found: Finding) -> Finding:
    """A replication claim beside its manipulation check: when n·Δ is not shown to fall
    with r, the report says the manipulation failed (or went unchecked) beside the verdict."""
    check = _replication_lowers_diversity(context)
    notes = [settings.tuned_per_batch(context.spec)]
    if check.verdict != SUPPORTED:
        outcome = "is unchecked" if check.verdict == UNTESTABLE else "failed"
        notes.append(f"the manipulation {outcome}: n·Δ falling with r is {check.verdict}, so "
                     "this verdict says nothing about gradient diversity")
    per_r = context.evidence.cell_sizes
    return replace(found, differs="; ".join(n for n in notes if n),
                   n=found.n or seeds_per_cell(per_r, "seeds", "per (r, B)"))


@register_claim(SOURCE, needs=("section:replication",))
def replication_widens_gap(context: Context) -> Finding:
    data = context.sections["replication"].data
    small, large = data["small"], data["large"]
    claim = (f"Replicating the data r times (lower diversity) widens the gap between a large "
             f"and a small batch: e(B={large})/e(B={small}) grows with r.")
    factors: dict[str, float] = {}
    gaps: dict[str, np.ndarray] = {}
    for model in context.evidence.models:
        r = data["factors"].get(model.labels.get("data"))
        batches = list(model.batches)
        if r is None or small not in batches or large not in batches:
            continue
        factors[model.name] = float(r)
        gaps[model.name] = (model.epochs[:, batches.index(large)]
                            / model.epochs[:, batches.index(small)])
    return _with_manipulation(context, correlation(context, SOURCE, claim, factors, gaps, +1,
                                                   "r", f"e({large})/e({small})"))


@register_claim(SOURCE, needs=("section:replication",))
def replication_raises_loss_ratio(context: Context) -> Finding:
    data = context.sections["replication"].data
    small, large = data["small"], data["large"]
    claim = (f"The training loss of the large batch over the small one's after the same "
             f"number of passes, L(B={large})/L(B={small}), grows with r [Figure 2].")
    factors = {f"r={r}": float(r) for r in data["log_ratio"]}
    ratios = {f"r={r}": 10 ** draws for r, draws in data["log_ratio"].items()}
    found = correlation(context, SOURCE, claim, factors, ratios, +1, "r",
                        "geometric-mean loss ratio")
    pairs = list(data.get("seeds", {}).values())
    return _with_manipulation(context, replace(
        found, n=seeds_per_cell(pairs, "seeds", "per r (each a large/small pair)")
        if pairs else ""))


@register_claim(SOURCE, needs=("section:timing",))
def mechanism_saves_time(context: Context) -> Finding:
    data = context.sections["timing"].data
    claim = ("A diversity-inducing mechanism (here each non-plain setting) reaches every "
             "training-accuracy target in fewer seconds than plain mini-batch SGD, each at "
             "its best (η, B) [Table 1].")
    mechanisms = sorted({m for m, _ in data["draws"] if m != "none"})
    verdicts, parts = [], []
    for mechanism in mechanisms:
        for target in data["targets"]:
            base, mine = data["draws"][("none", target)], data["draws"][(mechanism, target)]
            with np.errstate(invalid="ignore", divide="ignore"):
                gain = 1 - mine / base
            low, high = interval(gain)
            verdicts.append(directional(context, low > 0, high < 0))
            parts.append(f"{mechanism} {target}: gain {fmt(100 * gain[0])} % "
                         f"[{fmt(100 * low)}, {fmt(100 * high)}]")
    seeds = list(data.get("seeds", {}).values())
    return Finding(SOURCE, claim, all_models(verdicts),
                   "; ".join(parts) + " (95 % bootstrap intervals over seeds)."
                   + one_run_note(context),
                   n=seeds_per_cell(seeds, "seeds", "per setting") if seeds else "",
                   differs=settings.mechanism_timing(context.spec))


@register_claim(SOURCE, needs=("section:stability",))
def larger_batch_less_stable(context: Context) -> Finding:
    claim = ("Larger batches are less stable: the normalised distance between the models "
             "trained on neighbouring data sets, at the end, grows with B [Figure 3a].")
    data = context.sections["stability"].data
    found = against_batch(context, SOURCE, claim, data["distance"], +1, "distance")
    return replace(found, differs=settings.stability(context.spec),
                   n=seeds_per_cell(list(data["pairs"].values()), "pairs", "per B"))


@register_claim(SOURCE, needs=("section:stability",))
def larger_batch_wider_test_spread(context: Context) -> Finding:
    claim = ("Larger batches vary more in how they generalise: the standard deviation of the "
             "final test accuracy over runs grows with B [Figure 3b/c].")
    data = context.sections["stability"].data
    found = against_batch(context, SOURCE, claim, data["spread"], +1, "test-accuracy sd")
    return replace(found, differs=settings.stability(context.spec),
                   n=seeds_per_cell(list(data["spread_pairs"].values()), "pairs", "per B"))
