"""Claims of "On the Computational Inefficiency of Large Batch Sizes for Stochastic Gradient
Descent" (arXiv 1811.12941, 2018): speedup in iterations is linear, then diminishing, then
stagnant; where it stagnates does not depend on the data set size; no learning-rate
strategy keeps it linear."""

from __future__ import annotations

import itertools
import math

import numpy as np

from batchbound.study import analysis as A
from batchbound.study.claims.registry import (
    UNTESTABLE,
    Context,
    Finding,
    against_batch,
    all_models,
    directional,
    fmt,
    one_run_note,
    register_claim,
    span,
)
from batchbound.study.evidence import LEVEL, Model, interval
from batchbound.study.experiments.generalization import per_cell_draws

SOURCE = "inefficiency"
LINEAR, STAGNANT = 0.8, 0.1  # the regimes' α thresholds (analysis.speedup)


def _steps(model: Model, row: int, max_epochs: float | None) -> list[float]:
    """α of each step; a step into a miss bounded by the budget (analysis.alphas)."""
    n = model.labels.get("n_train")
    budgets = A.iteration_budgets(model.batches, float(n) if n else None, max_epochs)
    return A.alphas(model.batches, model.iterations[row], budgets)


def _first_last(model: Model, row: int, max_epochs: float | None) -> tuple[float, float]:
    """The first and the last step's α; a last step into a miss is censored, its bound
    (at most log(k_prev/K)/log(m/m_prev), K = max_epochs·n/m) stands in for it."""
    steps = _steps(model, row, max_epochs)
    return (steps[0], steps[-1]) if len(steps) >= 2 else (math.nan, math.nan)


@register_claim(SOURCE, needs=("batch_size",))
def three_regimes(context: Context) -> Finding:
    claim = ("Speedup in iterations is near-linear for small batches, then diminishes, then "
             "stagnates: the scaling exponent α of the first step is consistent with linear "
             f"(α ≥ {LINEAR}), that of the last step with stagnation (α < {STAGNANT}), and α "
             "falls between them.")
    parts, verdicts = [], []
    max_epochs = context.spec.get("train", {}).get("max_epochs")
    for model in context.evidence.models:
        rows = [_first_last(model, r, max_epochs) for r in range(context.evidence.draws + 1)]
        first = np.array([a for a, _ in rows])
        last = np.array([b for _, b in rows])
        if math.isnan(first[0]):
            parts.append(f"{model.name}: fewer than 3 batch sizes from the first that reaches "
                         "the target")
            verdicts.append(UNTESTABLE)
            continue
        with np.errstate(invalid="ignore"):  # −∞ − (−∞): a draw with no finite step
            drop = first - last
        low_first, high_first = interval(first)
        low_last, high_last = interval(last)
        low_drop, high_drop = interval(drop)
        # a censored last step gives bounds: α_last at most, the fall at least, so they can
        # support stagnation (conservatively) but never contradict it
        censored = not np.isfinite(model.iterations[:, -1]).all()
        shows = high_first >= LINEAR and low_last < STAGNANT and low_drop > 0
        verdicts.append(directional(context, shows, high_drop <= 0 and not censored))
        at_most, at_least = ("≤ ", "≥ ") if censored else ("", "")
        if math.isnan(high_last):  # every draw's last two batches missed: no bound at all
            last_text = "last α unknown (the last two batches missed the target)"
        else:
            last_text = (f"last α {at_most}{fmt(last[0])} {span(low_last, high_last)}, fall "
                         f"{at_least}{span(low_drop, high_drop)}")
        parts.append(f"{model.name}: first α {fmt(first[0])} {span(low_first, high_first)}, "
                     + last_text
                     + (f" (B = {fmt(float(model.batches[-1]))} missed the target within "
                        f"{fmt(max_epochs)} epochs in some or all draws: censored, its α "
                        "bounded by the budget)" if censored else ""))
    return Finding(SOURCE, claim, all_models(verdicts), "; ".join(parts) + " (95 % intervals)."
                   + one_run_note(context))


def _stagnation(model: Model, row: int, max_epochs: float | None) -> float:
    """The smallest batch from which every following step is stagnant (NaN if none); a
    censored step counts only where its bound is stagnant."""
    first = next((i for i, k in enumerate(model.iterations[row]) if math.isfinite(k)), 0)
    return A.stagnation_start(model.batches[first:], _steps(model, row, max_epochs), STAGNANT)


@register_claim(SOURCE, needs=("n_train",))
def stagnation_ignores_data_size(context: Context) -> Finding:
    claim = ("The batch size where speedup stagnates does not depend on the data set size "
             "(equal within one doubling across sizes, Figure 4).")
    groups: dict[tuple, list[Model]] = {}
    for model in context.evidence.models:
        rest = tuple((k, v) for k, v in sorted(model.labels.items())
                     if k not in ("data", "n_train"))
        groups.setdefault(rest, []).append(model)
    groups = {k: v for k, v in groups.items() if len({m.labels["n_train"] for m in v}) > 1}
    if not groups:
        return Finding(SOURCE, claim, UNTESTABLE, "no model was trained on several sizes")
    parts, verdicts = [], []
    max_epochs = context.spec.get("train", {}).get("max_epochs")
    for models in groups.values():
        points = np.array([[_stagnation(m, r, max_epochs) for m in models]
                           for r in range(context.evidence.draws + 1)])
        spread = np.log2(np.nanmax(points, axis=1) / np.nanmin(points, axis=1))
        spread[np.isnan(points).any(axis=1)] = np.inf  # no stagnation in a draw: no evidence
        low, high = interval(spread)
        names = ", ".join(f"n = {m.labels['n_train']}: {fmt(p)}"
                          for m, p in zip(models, points[0], strict=True))
        if np.isnan(points[0]).any():
            parts.append(f"{names} (a size shows no stagnation in the grid)")
            verdicts.append(UNTESTABLE)
            continue
        verdicts.append(directional(context, high <= 1, low > 1))
        parts.append(f"{names}; doublings between them {fmt(spread[0])} {span(low, high)}")
    return Finding(SOURCE, claim, all_models(verdicts), "; ".join(parts) + " (95 % intervals)."
                   + one_run_note(context))


@register_claim(SOURCE, needs=("strategy", "batch_size"))
def no_strategy_keeps_linear(context: Context) -> Finding:
    claim = ("No learning-rate strategy (BLR, LSR, SRSR) keeps linear speedup up to the "
             f"largest batch: its efficiency s(m)/(m/m0) there stays below {LINEAR}.")
    parts, verdicts = [], []
    for model in context.evidence.models:
        def efficiency(m: Model, row: int) -> float:
            k = m.iterations[row]
            first = next((i for i, v in enumerate(k) if math.isfinite(v)), None)
            if first is None:
                return 0.0
            return float(k[first] / k[-1] / (m.batches[-1] / m.batches[first]))

        values = np.array([efficiency(model, r) for r in range(context.evidence.draws + 1)])
        low, high = interval(values)
        verdicts.append(directional(context, high < LINEAR, low >= LINEAR))
        parts.append(f"{model.name}: {fmt(values[0])} {span(low, high)} at B = "
                     f"{fmt(float(model.batches[-1]))}")
    return Finding(SOURCE, claim, all_models(verdicts), "Efficiency at the largest batch (95 % "
                   "interval): " + "; ".join(parts) + "." + one_run_note(context))


@register_claim(SOURCE, needs=("section:architectures",))
def speedup_shape_depends_on_architecture(context: Context) -> Finding:
    claim = ("The shape of the speedup curve depends on the architecture [Figure 3 left]: at "
             "the largest batch every architecture reaches, the efficiency s(B)/(B/m0) of at "
             "least two architectures differs.")
    models = [m for m in context.evidence.models if len(m.batches)]
    batches = sorted(set.intersection(*[set(m.batches) for m in models]))
    reached = [b for b in batches
               if all(np.isfinite(m.iterations[0][list(m.batches).index(b)]) for m in models)]
    if len(reached) < 2 or reached[0] != batches[0]:
        return Finding(SOURCE, claim, UNTESTABLE, "needs two batch sizes, the smallest "
                       "included, that every architecture reaches")
    m0, top = reached[0], reached[-1]

    def efficiency(model: Model) -> np.ndarray:
        index = list(model.batches)
        return (model.iterations[:, index.index(m0)] / model.iterations[:, index.index(top)]
                / (top / m0))

    eff = {m.name: efficiency(m) for m in models}
    pairs = list(itertools.combinations(eff, 2))
    tail = (1 - LEVEL) / 2 / len(pairs)  # Bonferroni over the pairs
    parts, apart = [], False
    for one, two in pairs:
        log_ratio = np.log(eff[one][1:] / eff[two][1:])
        low, high = np.quantile(log_ratio[np.isfinite(log_ratio)], [tail, 1 - tail],
                                method="inverted_cdf")
        apart |= bool(low > 0 or high < 0)
        parts.append(f"{one} / {two}: {fmt(float(eff[one][0] / eff[two][0]))} "
                     f"{span(float(np.exp(low)), float(np.exp(high)))}")
    text = (f"efficiency at B = {fmt(top)} from m0 = {fmt(m0)}: "
            + ", ".join(f"{n} {fmt(v[0])}" for n, v in eff.items())
            + f"; ratios with 95 % intervals (Bonferroni over {len(pairs)} pairs): "
            + "; ".join(parts) + "."
            + one_run_note(context))
    return Finding(SOURCE, claim, directional(context, apart, False), text)


def _per_strategy(context: Context, column: str, sign: int, claim: str, name: str,
                  strategies: list[str] | None = None, diverged_as: float | None = None
                  ) -> Finding:
    """A rank correlation of B with a per-run end-of-training value, per strategy; the
    verdict holds for every strategy tested. ``diverged_as`` replaces a diverged run's
    value (else it keeps what it recorded, NaN when its weights are not finite)."""
    runs = context.sections["generalization"].data["runs"]
    if column not in runs:
        return Finding(SOURCE, claim, UNTESTABLE, f"the runs did not record {name}")
    if diverged_as is not None:
        runs = runs.assign(**{column: runs[column].mask(runs["status"] == "diverged",
                                                        diverged_as)})
    found = []
    for strategy in strategies or sorted(runs["strategy"].unique()):
        found.append((strategy, against_batch(context, SOURCE, claim,
                                              per_cell_draws(runs, column, strategy), sign,
                                              name)))
    verdict = all_models([f.verdict for _, f in found])
    return Finding(SOURCE, claim, verdict,
                   " ".join(f"{s}: {f.evidence}" for s, f in found))


@register_claim(SOURCE, needs=("section:generalization",))
def test_accuracy_falls_with_batch(context: Context) -> Finding:
    return _per_strategy(context, "final_test_acc", -1,
                         "After the same number of epochs, test accuracy falls as the batch "
                         "grows, under every learning-rate strategy [Table 2].", "test accuracy")


@register_claim(SOURCE, needs=("section:generalization",))
def linear_error_grows_with_batch(context: Context) -> Finding:
    runs = context.sections["generalization"].data["runs"]
    scaled = sorted(s for s in runs["strategy"].unique() if str(s).startswith("lsr"))
    claim = ("Under the linear scaling rule, the error of the linear approximation of the loss "
             "along one step from the final weights grows with the batch size [Figure 2 "
             "right]; a diverged run counts as an unbounded error (ranked last).")
    if not scaled:
        return Finding(SOURCE, claim, UNTESTABLE, "the study has no LSR runs")
    return _per_strategy(context, "final_linear_error", +1, claim, "linear-approx. error",
                         scaled, diverged_as=math.inf)
