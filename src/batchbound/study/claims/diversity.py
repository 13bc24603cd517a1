"""Claims of "Gradient Diversity: a Key Ingredient for Scalable Distributed Learning"
(AISTATS 2018), tested on its experiments' sections: replication widens the large-batch gap,
DropConnect buys time, and large batches are less stable."""

from __future__ import annotations

import numpy as np

from batchbound.study.claims.registry import (
    Context,
    Finding,
    against_batch,
    all_models,
    correlation,
    directional,
    fmt,
    one_run_note,
    register_claim,
)
from batchbound.study.evidence import interval

SOURCE = "diversity"


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
    return correlation(context, SOURCE, claim, factors, gaps, +1, "r",
                       f"e({large})/e({small})")


@register_claim(SOURCE, needs=("section:replication",))
def replication_raises_loss_ratio(context: Context) -> Finding:
    data = context.sections["replication"].data
    small, large = data["small"], data["large"]
    claim = (f"The training loss of the large batch over the small one's after the same "
             f"number of passes, L(B={large})/L(B={small}), grows with r [Figure 2].")
    factors = {f"r={r}": float(r) for r in data["log_ratio"]}
    ratios = {f"r={r}": 10 ** draws for r, draws in data["log_ratio"].items()}
    return correlation(context, SOURCE, claim, factors, ratios, +1, "r",
                       "geometric-mean loss ratio")


@register_claim(SOURCE, needs=("section:timing",))
def mechanism_saves_time(context: Context) -> Finding:
    data = context.sections["timing"].data
    claim = ("A diversity-inducing mechanism (here each non-plain setting) reaches every "
             "training-accuracy target in fewer seconds than plain mini-batch SGD, each at "
             "its best (γ, B) [Table 1].")
    settings = sorted({m for m, _ in data["draws"] if m != "none"})
    verdicts, parts = [], []
    for mechanism in settings:
        for target in data["targets"]:
            base, mine = data["draws"][("none", target)], data["draws"][(mechanism, target)]
            with np.errstate(invalid="ignore", divide="ignore"):
                gain = 1 - mine / base
            low, high = interval(gain)
            verdicts.append(directional(context, low > 0, high < 0))
            parts.append(f"{mechanism} {target}: gain {fmt(100 * gain[0])} % "
                         f"[{fmt(100 * low)}, {fmt(100 * high)}]")
    return Finding(SOURCE, claim, all_models(verdicts),
                   "; ".join(parts) + " (95 % bootstrap intervals over seeds)."
                   + one_run_note(context))


@register_claim(SOURCE, needs=("section:stability",))
def larger_batch_less_stable(context: Context) -> Finding:
    claim = ("Larger batches are less stable: the normalised distance between the models "
             "trained on neighbouring data sets, at the end, grows with B [Figure 3a].")
    return against_batch(context, SOURCE, claim, context.sections["stability"].data["distance"],
                         +1, "distance")


@register_claim(SOURCE, needs=("section:stability",))
def larger_batch_wider_test_spread(context: Context) -> Finding:
    claim = ("Larger batches vary more in how they generalise: the standard deviation of the "
             "final test accuracy over runs grows with B [Figure 3b/c].")
    return against_batch(context, SOURCE, claim, context.sections["stability"].data["spread"],
                         +1, "test-accuracy sd")
