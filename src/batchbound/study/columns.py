"""What each column of the report's Tables section holds (the analyses' own column names, as
``study export`` writes them to CSV): the report lists those its tables show, under
"Tables". The definitions are ``analysis``'s (its module docstring has the details)."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

COLUMNS: dict[str, str] = {
    "model_label": "the model's name (L, K: see the glossary)",
    "data": "the data set and its transform, where the study varies it",
    "strategy": "the learning-rate strategy, where the study varies it",
    "mechanism": "the diversity-inducing mechanism, where the study varies it",
    "depth": "L: hidden layers (fc, linear) or the family's own depth",
    "width": "K: units per hidden layer (fc, linear) or the family's own width",
    "params": "the model's weights",
    "batch_size": "B (the Gradient diversity table: the reference batch Δ was measured at)",
    "runs": "runs in the cell (seeds)",
    "censored": "runs that stopped short of the target (not diverged or collapsed)",
    "diverged": "runs of the cell that diverged (a miss; left out of every fit)",
    "collapsed": "runs of the cell that collapsed (did not train; left out of every fit)",
    "first_eval": "runs that reached the target by their first evaluation (their epochs are "
                  "an upper bound)",
    "median": "median epochs to the target over the runs; miss: the median run missed it",
    "mean_reached": "mean epochs to the target over the runs that reached it",
    "std_reached": "their standard deviation (n/a with fewer than two)",
    "min": "fewest epochs to the target over the runs",
    "max": "most epochs to the target over the runs; miss: a run missed it",
    "lr": "the step size η the cell trained with (median over its runs)",
    "n_train": "n: the training examples",
    "η at grid edge": "the tuned η lies at the top or bottom of its grid",
    "iterations": "k(m): median iterations to the target at batch m; miss: the median run "
                  "missed it",
    "speedup": "s(m; m0) = k(m0)/k(m), m0 the smallest batch that reaches the target; 0 "
               "where the median run missed it",
    "ideal": "the linear ideal m/m0",
    "efficiency": "speedup/ideal",
    "alpha": "α: the local scaling exponent from the previous batch, "
             "log(k(m_prev)/k(m))/log(m/m_prev); 1 is perfect scaling, 0 none",
    "regime": "the step into this batch: linear (α ≥ 0.8), diminishing, stagnant (α < 0.1), "
              "or censored (the median run missed: α is only bounded, and the bound does not "
              "show stagnation); empty at m0",
    "linear_until": "near-linear up to (see the glossary)",
    "stagnation_from": "stagnant from (see the glossary)",
    "b_crit": "B_crit of the fit S(B) = S_min(1 + B_crit/B)",
    "s_min": "S_min: the fit's fewest iterations, at B → ∞ (n/a for a fit over several "
             "models)",
    "e_min": "E_min = S_min·B_crit: the fit's fewest examples, at B → 0",
    "points": "runs that reached the target: the fit's points",
    "low": "B_crit's 2.5th bootstrap percentile (runs resampled within each batch)",
    "high": "B_crit's 97.5th bootstrap percentile",
    "one_run": "every batch has one run: the interval has no spread",
    "at_bound": "the fit stopped at its search range: B_crit not identified",
    "outside": "B_crit lies below or above the batches that reached the target",
    "degenerate": "why the fit identifies no B_crit (empty when it does)",
    "threshold": "the loss threshold (see the glossary)",
    "from_batch": "the batch whose runs' losses set the threshold",
    "diverged_left_out": "runs that diverged or collapsed, left out of the threshold",
    "delta_mean": "Δ averaged over each run's measurements up to its target, then over the "
                  "runs",
    "delta_std": "delta_mean's standard deviation over the runs",
    "bound_mean": "n·delta_mean",
    "measurements": "Δ measurements, all runs together",
    "matched_loss": "ℓ*: the training loss every model reached",
    "delta_matched": "Δ at the first measurement where the training loss is ≤ ℓ* (mean over "
                     "runs)",
    "bound_matched": "n·delta_matched",
    "measured_to": "the shortest span of measurements over the runs, in epochs",
    "over_training": "every run's measurements span its run to the target: only then is "
                     "delta_mean an average over training",
    "bound_min": "n·Δ's minimum along the run up to the target (mean over runs)",
    "bound_at_target": "n·Δ at the last measurement at or before the target, the run's end "
                       "when it missed (mean over runs)",
    "runs_reached": "runs that reached the target; the others' values run to their end",
}


def columns_shown(frames: Iterable[pd.DataFrame]) -> tuple[tuple[str, str, str], ...]:
    """(name, meaning, "") for every column of ``frames`` that ``COLUMNS`` explains, in the
    order the tables first show them (the rows of a ``document.Pairs``)."""
    seen: dict[str, None] = {}
    for frame in frames:
        seen.update(dict.fromkeys(c for c in frame.columns if c in COLUMNS))
    return tuple((name, COLUMNS[name], "") for name in seen)
