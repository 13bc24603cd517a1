"""Claims of "Scaling-up SGD with mini-batches" (lecture slides): the one-sample gradient
norms at the end of training, E[OSG], grow with the batch size (its ImageNet table)."""

from __future__ import annotations

from batchbound.study.claims.registry import Context, Finding, against_batch, register_claim
from batchbound.study.experiments.generalization import per_cell_draws

SOURCE = "slides"


@register_claim(SOURCE, needs=("section:generalization",))
def osg_grows_with_batch(context: Context) -> Finding:
    claim = ("At the end of training, the mean squared one-sample gradient norm E[OSG] grows "
             "with the batch size.")
    runs = context.sections["generalization"].data["runs"]
    if "final_osg_mean" not in runs:
        return Finding(SOURCE, claim, "not testable", "the runs did not record E[OSG]")
    strategies = sorted(runs["strategy"].unique())
    first = strategies[0]  # the base learning rate when present: one η for every B
    finding = against_batch(context, SOURCE, claim,
                            per_cell_draws(runs, "final_osg_mean", first), +1, "E[OSG]")
    return Finding(SOURCE, claim, finding.verdict, f"{first}: {finding.evidence}")
