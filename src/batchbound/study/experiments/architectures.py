"""Architectures compared on one data set ([inefficiency], "On the Computational Inefficiency of
Large Batch Sizes", Sec. 4.4 and Figure 3 left).

The paper trains several architectures on CIFAR-10 and finds speedup curves of different
shapes: where speedup stops being near-linear depends on the architecture. The section
applies to any study whose models come from two or more families (fc, lenet, cnn1d, …): the
speedup curves side by side, a table of each architecture's regimes and B_crit, and the
claim's statistic, the efficiency s(B)/(B/m0) at the largest batch every architecture
reaches (``claims/inefficiency.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchbound.spec import parse_spec
from batchbound.study import analysis as A
from batchbound.study.experiments.registry import Section, register_experiment

if TYPE_CHECKING:  # the bundle's module imports this one
    from batchbound.study.summary import StudyAnalysis


def family(model_spec: str) -> str:
    return parse_spec(model_spec).name


@register_experiment
def architectures(a: StudyAnalysis) -> Section | None:
    runs = a.frames["runs"]
    families = {spec: family(spec) for spec in runs["model"].unique()}
    if len(set(families.values())) < 2 or a.speedups.empty:
        return None
    from batchbound.study import plots as P

    keys = A.model_keys(a.speedups)
    table = a.speedups.pivot_table(index=keys, columns="batch_size", values="speedup",
                                   aggfunc="first")
    table.columns = [f"s({b})" for b in table.columns]
    table = table.reset_index()
    if len(a.regimes):
        table = table.merge(a.regimes, on=[k for k in keys if k in a.regimes], how="left")
    if len(a.critical):
        crit = a.critical[[*[k for k in keys if k in a.critical], "b_crit", "low", "high"]]
        table = table.merge(crit.rename(columns={"low": "B_crit 2.5%", "high": "B_crit 97.5%"}),
                            on=[k for k in keys if k in crit], how="left")
    if "params" not in table:
        params = runs.groupby("model_label")["params"].first()
        table.insert(1, "params", table["model_label"].map(params))
    target = a.targets[0] if a.targets else "the target"
    return Section(
        key="architectures", title="Architectures on one data set", source="inefficiency",
        text=(f"{len(set(families.values()))} architectures "
              f"({', '.join(sorted(set(families.values())))}) on the same data, each reading "
              f"it in its own shape; speedup s(m; m0) in iterations to {target} from the "
              "smallest batch that reaches it. The paper's point is that the curve's shape "
              "(where it leaves the linear ideal) depends on the architecture."),
        tables=[("Speedup, regimes and B_crit per architecture", table)],
        figures=[("architectures_speedup", f"Speedup to {target} per architecture, with the "
                  "linear ideal [inefficiency, Figure 3 left].",
                  lambda fig: P.speedup_curves(fig.add_subplot(), a.speedups,
                                               "speedup per architecture",
                                               P.model_colours(a.epochs)))],
        data={"families": families},
    )
