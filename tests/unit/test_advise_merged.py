"""The merged advise (issues 36, 37, 42): what the branches measured is said as measured (a
capped fit as a lower bound, the central trajectory as it is extrapolated), and the JSON is
strict (a diverged branch's infinite loss is null)."""

from __future__ import annotations

import json
import math

from batchbound.advise import Advice
from batchbound.advise.advice import _critical_text
from batchbound.advise.answer import Row
from batchbound.advise.critical import CAP, MIN_SPREAD, BranchPlan, fit_point


def _row() -> Row:
    return Row(workers=1, batch_size=16, lr=0.1, iterations=100.0,
               iterations_interval=(90.0, 110.0), seconds_per_iteration=math.nan,
               compute_seconds=math.nan, communication_seconds=math.nan,
               seconds_to_target=math.nan, seconds_interval=(math.nan, math.nan),
               speedup=math.nan, efficiency=math.nan, best=True)


def test_a_capped_fit_is_stated_as_a_lower_bound() -> None:
    plan = BranchPlan((16, 32, 64), 512, 1, 10_000)
    capped = fit_point({16: 1.0, 32: 1.0, 64: 1.0}, 16, MIN_SPREAD, 40)  # kept up everywhere
    text = _critical_text([capped], [_row()], plan)
    assert f"≥ {CAP * 64:.3g} (" in text and "lower bound" in text
    measured = fit_point({16: 1.0, 32: 0.6, 64: 0.35}, 16, MIN_SPREAD, 40)
    assert measured.high < CAP * 64
    plain = _critical_text([measured], [_row()], plan)
    assert "≥" not in plain and "lower bound" not in plain
    # the central value past the pilot is not said to stay put: it grows (critical.py)
    assert "stays at the last value" not in plain and "square root" in plain


def test_json_is_strict_with_a_diverged_branch() -> None:
    diverged = fit_point({16: 1.0, 32: 0.0}, 16, MIN_SPREAD, 40, {16: 1.2, 32: math.inf})
    row = _row()
    advice = Advice(30.0, [row], row, None, "", pilot={"kappa_se": math.nan},
                    extra={"branches": [diverged.to_dict()], "recommended_on": "iterations"})

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the JSON")

    out = json.loads(advice.to_json(), parse_constant=refuse)
    assert out["branches"][0]["final_loss"] == {"16": 1.2, "32": None}
    assert out["pilot"]["kappa_se"] is None and out["rows"][0]["speedup"] is None
