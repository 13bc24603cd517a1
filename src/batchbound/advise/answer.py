"""The answer: for P = 1, 2, 4, … workers, the time-optimal batch and its seconds to target;
the recommended (P, B); and the worker count past which more workers stop paying.

Time to target at (P, B) = k(B) × t(P, B), with k from ``iterations.py`` and
t(P, B) = the step of one worker on ⌈B/P⌉ examples + the all-reduce (``timing.py``). The
candidate batches for P are B = P·m for m = 1, 2, 4, … within the micro-batch limit and n.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import pairwise
from typing import Any

from batchbound.advise.timing import ComputeCurve

STOP_PAYING = 0.10  # doubling P must save at least this share of the time


@dataclass
class Row:
    workers: int
    batch_size: int
    lr: float
    iterations: float  # inf: the model predicts no convergence
    seconds_per_iteration: float
    compute_seconds: float  # per iteration: one worker's step (data, fwd, bwd, optimiser)
    communication_seconds: float  # per iteration, the part not hidden by overlap
    seconds_to_target: float
    speedup: float = 1.0
    efficiency: float = 1.0
    iterations_interval: tuple[float, float] = (math.nan, math.nan)
    seconds_interval: tuple[float, float] = (math.nan, math.nan)
    best: bool = False  # the fastest batch for its worker count
    # with the critical batch measured by branches: the branches' and the noise scale's
    # predictions, the branches' share of the central value (critical.combine), and whether
    # the two intervals miss each other (the interval then spans both)
    noise_iterations: float = math.nan
    noise_interval: tuple[float, float] = (math.nan, math.nan)
    disagree: bool = False
    branch_iterations: float = math.nan
    branch_interval: tuple[float, float] = (math.nan, math.nan)
    branch_weight: float = math.nan
    # the iterations' interval before the model's own measured error is joined to it
    # (model_error.py): the estimator's sampling error and the extrapolation alone
    pilot_interval: tuple[float, float] = (math.nan, math.nan)

    def to_dict(self) -> dict[str, Any]:
        def plain(v: Any) -> Any:
            if isinstance(v, tuple):
                return [plain(x) for x in v]
            return None if isinstance(v, float) and not math.isfinite(v) else v

        return {k: plain(v) for k, v in asdict(self).items()}


def worker_counts(max_workers: int) -> list[int]:
    """1, 2, 4, … up to ``max_workers``, which is always included."""
    counts = [1 << k for k in range(max_workers.bit_length()) if 1 << k < max_workers]
    return [*counts, max_workers]


def iteration_seconds(curve: ComputeCurve, workers: int, batch_size: int,
                      communication: float, overlap: str) -> tuple[float, float, float]:
    """(seconds per iteration, compute, the communication not hidden)."""
    micro = math.ceil(batch_size / workers)
    step = curve.step(micro)
    if overlap == "backward":
        backward = max(step - curve.forward(micro), 0.0)
        exposed = max(communication - backward, 0.0)
    else:
        exposed = communication
    return step + exposed, step, exposed


def candidate_rows(workers: int, n: int, max_micro_batch: int, curve: ComputeCurve,
                   communication: float, overlap: str, iterations: Callable[[int], float],
                   lr: Callable[[int], float],
                   interval: Callable[[int], tuple[float, float]] | None = None,
                   timing_spread: float = 0.0) -> list[Row]:
    """Every batch B = P·m (m = 1, 2, 4, …) within the micro-batch limit and n, the fastest
    finite one marked ``best``. ``interval(B)``: the iterations' interval; the seconds'
    interval widens it by the step timing's relative spread."""
    rows = []
    micro = 1
    while micro <= max_micro_batch and workers * micro <= n:
        batch = workers * micro
        k = iterations(batch)
        per, compute, exposed = iteration_seconds(curve, workers, batch, communication, overlap)
        low, high = interval(batch) if interval is not None else (k, k)
        rows.append(Row(workers, batch, lr(batch), k, per, compute, exposed, k * per,
                        iterations_interval=(low, high),
                        seconds_interval=(low * per * (1 - timing_spread),
                                          high * per * (1 + timing_spread))))
        micro *= 2
    finite = [r for r in rows if math.isfinite(r.seconds_to_target)]
    if finite:
        min(finite, key=lambda r: r.seconds_to_target).best = True
    return rows


def best_row(workers: int, n: int, max_micro_batch: int, curve: ComputeCurve,
             communication: float, overlap: str, iterations: Callable[[int], float],
             lr: Callable[[int], float]) -> Row | None:
    """The batch B = P·m (m = 1, 2, 4, …) with the least predicted time; None when no
    candidate fits (P > n) or none converges."""
    rows = candidate_rows(workers, n, max_micro_batch, curve, communication, overlap,
                          iterations, lr)
    return next((r for r in rows if r.best), None)


def finish(rows: list[Row]) -> tuple[Row, int | None]:
    """Fill speedup and efficiency against one worker; return the recommended row and
    ``workers_stop_paying``: the smallest P whose doubling saves less than 10 % of the time
    (None if every doubling within the rows pays). The recommendation is that P's row, or
    the fastest row when more workers keep paying."""
    base = rows[0].seconds_to_target
    for row in rows:
        row.speedup = base / row.seconds_to_target
        row.efficiency = row.speedup / row.workers
    stop = None
    for row, doubled in pairwise(rows):
        if doubled.workers == 2 * row.workers and (
                doubled.seconds_to_target > (1 - STOP_PAYING) * row.seconds_to_target):
            stop = row.workers
            break
    if stop is not None:
        return next(r for r in rows if r.workers == stop), stop
    return min(rows, key=lambda r: r.seconds_to_target), None


CRITICAL = 2.0  # the critical batch: iterations twice the fewest any batch needs


def on_iterations(rows: list[Row], fewest: float) -> Row:
    """The answer when this machine's seconds cannot be trusted: every row's seconds, speedup
    and efficiency unknown (NaN), and per worker count the best batch the smallest whose
    predicted iterations are at most CRITICAL × ``fewest`` (S_min): McCandlish et al.'s
    critical batch, past which a doubled batch saves under a third of the iterations (at
    S = 2·S_min the examples are 2·E_min). Else the batch with the fewest iterations. The
    recommendation is that batch on one worker: which worker count pays is a question of
    seconds. The same pilot gives the same answer however busy the machine is. A batch
    whose micro-batch the model's step cannot run at (below the first size that ran:
    infinite compute) is never chosen."""
    runnable = {id(r) for r in rows if r.compute_seconds != math.inf}
    for row in rows:
        row.seconds_per_iteration = row.compute_seconds = math.nan
        row.communication_seconds = row.seconds_to_target = math.nan
        row.seconds_interval = (math.nan, math.nan)
        row.speedup = row.efficiency = math.nan
        row.best = False
    for workers in dict.fromkeys(r.workers for r in rows):
        own = [r for r in rows if r.workers == workers and math.isfinite(r.iterations)
               and id(r) in runnable]
        if not own:
            continue
        within = [r for r in own if r.iterations <= CRITICAL * fewest]
        choice = (min(within, key=lambda r: r.batch_size) if within
                  else min(own, key=lambda r: (r.iterations, r.batch_size)))
        choice.best = True
    return next(r for r in rows if r.best)
