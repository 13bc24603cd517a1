"""Claims of "Scaling-up SGD with mini-batches" (lecture slides): the one-sample gradient
norms at the end of training, E[OSG], grow with the batch size (its ImageNet table)."""

from __future__ import annotations

from batchbound.study.claims.registry import Context, Finding, correlation, register_claim

SOURCE = "slides"


@register_claim(SOURCE, needs=("section:generalization",))
def osg_grows_with_batch(context: Context) -> Finding:
    from batchbound.study.experiments.generalization import per_cell_draws

    claim = ("At the end of training, the mean squared one-sample gradient norm E[OSG] grows "
             "with the batch size.")
    runs = context.sections["generalization"].data["runs"]
    if "final_osg_mean" not in runs:
        return Finding(SOURCE, claim, "not testable", "the runs did not record E[OSG]")
    strategies = sorted(runs["strategy"].unique())
    first = strategies[0]  # the base learning rate when present: one η for every B
    cells = per_cell_draws(runs, "final_osg_mean", first)
    finding = correlation(context, SOURCE, claim, {k: b for k, (b, _) in cells.items()},
                          {k: d for k, (_, d) in cells.items()}, +1, "B", "E[OSG]")
    return Finding(SOURCE, claim, finding.verdict, f"{first}: {finding.evidence}")
