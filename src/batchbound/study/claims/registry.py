"""The claim registry: each claim of the papers a study can test, as one pure function.

A claim module registers its functions with ``@register_claim(source, needs=...)``. ``needs``
names the study dimensions the claim speaks about (labels that must take several values
across the models, or ``"batch_size"`` for several batch sizes, ``"diversity"`` for Δ
measured, ``"section:KEY"`` for an experiment section of ``batchbound.study.experiments``
the study's data supports); a study that does not vary them never shows the claim. The
function gets a ``Context`` and returns a ``Finding``, whose verdict is one of:

- ``supported``: the 95 % interval of the effect (bootstrap over runs; for rank
  correlations also an exact permutation test at 5 %) excludes no effect, in the claimed
  direction;
- ``contradicted``: it excludes no effect in the other direction;
- ``inconclusive``: neither (including a one-run-per-cell study, whose interval has no
  spread);
- ``not testable``: the data cannot speak to it, with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

from batchbound.study.evidence import Evidence, interval, permutation_p, rank_correlation

SHAPE_LABELS = ("depth", "width", "params")  # meaningful within one model family only
SUPPORTED, CONTRADICTED, INCONCLUSIVE, UNTESTABLE = (
    "supported", "contradicted", "inconclusive", "not testable")


@dataclass(frozen=True)
class Context:
    """What a claim may look at: the bootstrap draws and the study's fitted tables."""

    evidence: Evidence
    budget: float  # E of "largest B within E epochs"
    max_batch: float
    critical: pd.DataFrame = field(default_factory=pd.DataFrame)  # analysis.critical_batch
    diversity: pd.DataFrame = field(default_factory=pd.DataFrame)  # analysis.diversity_summary
    delta_how: str = "not measured"  # analysis.delta_label
    sections: dict[str, Any] = field(default_factory=dict)  # experiments' Sections by key
    spec: dict[str, Any] = field(default_factory=dict)  # the study spec, StudySpec.to_dict()
    diversity_runs: pd.DataFrame = field(default_factory=pd.DataFrame)  # A.diversity_runs


@dataclass(frozen=True)
class Finding:
    source: str  # a key of batchbound.study.references.REFERENCES
    claim: str
    verdict: str
    evidence: str
    section: str = ""  # the experiment section it speaks about, if any
    n: str = ""  # the independent units the verdict rests on, "n = 3 seeds per cell"
    differs: str = ""  # where the study's setting differs from the paper's, if it does


@dataclass(frozen=True)
class ClaimEntry:
    name: str
    source: str
    needs: tuple[str, ...]
    test: Callable[[Context], Finding]


CLAIMS: dict[str, ClaimEntry] = {}


def register_claim(source: str, needs: tuple[str, ...] = ()
                   ) -> Callable[[Callable[[Context], Finding]], Callable[[Context], Finding]]:
    def wrap(test: Callable[[Context], Finding]) -> Callable[[Context], Finding]:
        CLAIMS[test.__name__] = ClaimEntry(test.__name__, source, needs, test)
        return test
    return wrap


def applies(entry: ClaimEntry, context: Context) -> bool:
    """The study varies everything the claim speaks about."""
    for need in entry.needs:
        if need == "batch_size":
            if max((len(m.batches) for m in context.evidence.models), default=0) < 3:
                return False
        elif need == "diversity":
            if context.diversity.empty:
                return False
        elif need.startswith("section:"):
            if need.removeprefix("section:") not in context.sections:
                return False
        elif context.evidence.varies(need) < 2:
            return False
        elif need in SHAPE_LABELS and context.evidence.varies("family") > 1:
            return False  # a LeNet's width multiplier is no fc width: compare within a family
    return True


def evaluate(context: Context) -> list[Finding]:
    """Every registered claim the study can speak to, in registration order; a finding
    that does not name its independent units rests on the runs of each cell (seeds)."""
    out = []
    for entry in CLAIMS.values():
        if applies(entry, context):
            found = entry.test(context)
            out.append(replace(found, section=_section(entry),
                               n=found.n or seeds_per_cell(context.evidence.cell_sizes),
                               differs="" if found.verdict == UNTESTABLE else found.differs))
    return out


def seeds_per_cell(sizes: list[int], unit: str = "seeds", where: str = "per cell") -> str:
    """"n = 3 seeds per cell", or "n = 2–3 seeds per cell" when cells differ."""
    if not sizes:
        return f"n = 0 {unit}"
    low, high = min(sizes), max(sizes)
    count = f"{low}" if low == high else f"{low}–{high}"
    return f"n = {count} {unit} {where}".rstrip()


def _section(entry: ClaimEntry) -> str:
    return next((n.removeprefix("section:") for n in entry.needs
                 if n.startswith("section:")), "")


def fmt(value: float) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "miss" if value > 0 else "−∞"
    if float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))  # batch sizes print whole: 1024, not 1.02e+03
    text = f"{value:.3g}"
    if 1e3 <= abs(float(text)) < 1e6:  # 3 significant digits, written whole: 1950, not 1.95e+03
        return str(int(float(text)))
    return text


def span(low: float, high: float) -> str:
    return f"[{fmt(low)}, {fmt(high)}]"


def correlation(context: Context, source: str, claim: str, x: dict[str, float],
                y: dict[str, np.ndarray], sign: int, x_name: str, y_name: str) -> Finding:
    """Rank correlation of a fixed model property ``x`` with a per-draw quantity ``y``:
    supported when the 95 % bootstrap interval of ρ lies on the claimed side of 0 and the
    exact permutation test on the data rejects no correlation at 5 %."""
    names = [n for n in x if n in y and not math.isnan(x[n])]
    xs = np.array([x[n] for n in names], float)
    if len(set(xs)) < 3:
        return Finding(source, claim, UNTESTABLE, f"needs at least 3 distinct {x_name} "
                       f"values, the study has {len(set(xs))}")
    ys = np.stack([y[n] for n in names], axis=1)  # (rows, models)
    if np.isnan(ys[0]).sum() > len(names) - 3:
        return Finding(source, claim, UNTESTABLE, f"{y_name} is known for fewer than 3 models")
    rho = np.array([rank_correlation(xs, row) for row in ys])
    low, high = interval(rho)
    p = permutation_p(xs, ys[0], sign)
    pairs = ", ".join(f"{fmt(a)}→{fmt(b)}" for a, b in zip(xs, ys[0], strict=True))
    text = (f"{x_name}→{y_name}: {pairs}; Spearman ρ = {fmt(rho[0])}, 95 % interval "
            f"{span(low, high)} over {context.evidence.draws} bootstrap draws; one-sided "
            f"permutation p = {fmt(p)}.{one_run_note(context)}")
    near, far = sorted((sign * low, sign * high))  # the interval, in the claimed direction
    return Finding(source, claim, directional(context, near > 0 and p <= 0.05, far < 0), text)


def against_batch(context: Context, source: str, claim: str, draws: dict[int, np.ndarray],
                  sign: int, y_name: str) -> Finding:
    """``correlation`` of the batch size with a per-batch quantity given as bootstrap draws
    (row 0 the data), e.g. a mean over the seeds of each batch size."""
    return correlation(context, source, claim, {f"B={b}": float(b) for b in draws},
                       {f"B={b}": d for b, d in draws.items()}, sign, "B", y_name)


def directional(context: Context, supported: bool, contradicted: bool) -> str:
    """The verdict from an interval test, inconclusive when the draws cannot spread."""
    if context.evidence.one_run and (supported or contradicted):
        return INCONCLUSIVE
    return SUPPORTED if supported else CONTRADICTED if contradicted else INCONCLUSIVE


def all_models(verdicts: list[str]) -> str:
    """A claim about every model: supported only when it holds for each testable one."""
    testable = [v for v in verdicts if v != UNTESTABLE]
    if not testable:
        return UNTESTABLE
    if CONTRADICTED in testable:
        return CONTRADICTED
    return SUPPORTED if all(v == SUPPORTED for v in testable) else INCONCLUSIVE


def one_run_note(context: Context) -> str:
    return (" One run per cell: the intervals have no spread, so nothing is claimed."
            if context.evidence.one_run else "")
