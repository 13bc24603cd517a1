"""The report's "how many workers" table: ``advise_from_study`` for every model of a study.

Per model (and learning-rate strategy): the time-optimal batch for P = 1, 2, … up to this
machine's cores, from the study's measured iterations and recorded step times (handed over
as plain data by ``batchbound.study.measured.advice_inputs``), with the all-reduce timed
here. A model that cannot be advised gets one row saying why. A row whose (B, η) no run of
the model used says "interpolated" in its note (the report's Answer reads that word); a
busy timing machine is said once, in the note of the model's first row.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from batchbound.advise.advice import advise_from_study
from batchbound.errors import BatchboundError

COLUMNS = ["model", "workers", "batch", "lr", "iterations", "s/iteration", "s to target",
           "speedup", "recommended", "note"]
INTERPOLATED = "interpolated"


def workers_table(inputs: list[tuple[str, dict[str, Any] | str]],
                  max_workers: int | None = None) -> pd.DataFrame:
    """One block of rows per (label, advice input); a string input is why there is none."""
    rows: list[dict[str, Any]] = []
    for label, data in inputs:
        if isinstance(data, str):
            rows.append({"model": label, "note": f"not advised: {data}"})
            continue
        try:
            advice = advise_from_study(data, max_workers=max_workers)
        except BatchboundError as exc:
            rows.append({"model": label, "note": f"not advised: {exc}"})
            continue
        busy = advice.extra.get("timing_warning")
        ran = [tuple(pair) for pair in data.get("ran", [])]
        for i, r in enumerate(advice.rows):
            notes = ["" if math.isfinite(r.iterations) else "not reached",
                     "" if _ran(ran, r.batch_size, r.lr) else
                     f"{INTERPOLATED}: no run used this (B, η)",
                     f"timing machine busy ({busy}): every row's seconds uncertain"
                     if busy and i == 0 else ""]
            rows.append({"model": label, "workers": r.workers, "batch": r.batch_size,
                         "lr": r.lr, "iterations": r.iterations,
                         "s/iteration": r.seconds_per_iteration,
                         "s to target": r.seconds_to_target, "speedup": r.speedup,
                         "recommended": "←" if r is advice.recommended else "",
                         "note": "; ".join(n for n in notes if n)})
    return pd.DataFrame(rows, columns=COLUMNS)


def _ran(ran: list[tuple[float, float]], batch: float, lr: float) -> bool:
    """Some run of the model used this batch size and step size."""
    return any(b == float(batch) and math.isclose(eta, float(lr), rel_tol=1e-6)
               for b, eta in ran)
