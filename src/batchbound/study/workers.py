"""The report's "how many workers" table: ``advise --from-study`` for every model of a study.

Per model (and learning-rate strategy): the time-optimal batch for P = 1, 2, … up to this
machine's cores, from the study's measured iterations and recorded step times, with the
all-reduce timed here (``batchbound.advise.advise_from_study``). A model that cannot be
advised (no batch reached the target, no recorded step times) gets one row saying why. A
row whose (B, η) no run of the model used says "interpolated".
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from batchbound.errors import BatchboundError
from batchbound.study import analysis as A
from batchbound.study.answer import INTERPOLATED

COLUMNS = ["model", "workers", "batch", "lr", "iterations", "s/iteration", "s to target",
           "speedup", "recommended", "note"]


def workers_table(store_path: str | Path, study: str, per_run: pd.DataFrame,
                  max_workers: int | None = None) -> pd.DataFrame:
    from batchbound.advise import advise_from_study

    final = per_run[per_run["status"].isin(["complete", "diverged", A.COLLAPSED])]
    if final.empty:
        return pd.DataFrame(columns=COLUMNS)
    keys = [k for k in A.model_keys(final) if k != "strategy"]
    names = A.display_names(final, keys)
    strategies = final["strategy"] if "strategy" in final else pd.Series([None] * len(final))
    several = strategies.nunique() > 1
    rows = []
    used = final.assign(_name=names.to_numpy(), _strategy=strategies.to_numpy())
    for name, strategy in sorted(set(zip(names, strategies, strict=True)), key=str):
        mine = used[(used["_name"] == name) & (used["_strategy"] == strategy)] \
            if strategy is not None else used[used["_name"] == name]
        ran = list(zip(mine["batch_size"].astype(float), mine["lr"].astype(float), strict=True))
        label = f"{name} · {strategy}" if several else name
        try:
            advice = advise_from_study(store_path, study=study, model=name,
                                       strategy=strategy if several else None,
                                       max_workers=max_workers)
        except BatchboundError as exc:
            rows.append({"model": label, "note": f"not advised: {exc}"})
            continue
        busy = advice.extra.get("timing_warning")
        for r in advice.rows:
            notes = ["" if math.isfinite(r.iterations) else "not reached",
                     "" if _ran(ran, r.batch_size, r.lr) else
                     f"{INTERPOLATED}: no run used this (B, η)",
                     f"timing machine busy ({busy}): seconds uncertain" if busy else ""]
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
