"""A micro-batch below the first one the model's step runs at (a BatchNorm1d model at one
example) is timed as impossible (``ComputeCurve`` gives inf): no answer recommends it, the
busy machine's answer on iterations alone included."""

from __future__ import annotations

import math

from batchbound.advise.answer import candidate_rows, on_iterations
from batchbound.advise.iterations import Pilot, minimum_iterations, predict_iterations
from batchbound.advise.timing import ComputeCurve

SIZES = (256, 512, 1024, 4096)  # the step runs from 256 examples on
CURVE = ComputeCurve(SIZES, tuple(2e-4 + 1e-5 * m for m in SIZES),
                     tuple(1e-4 + 3e-6 * m for m in SIZES))


def test_the_busy_answer_never_picks_a_micro_batch_the_model_cannot_step_at() -> None:
    pilot = Pilot(16, 0.1, 200, (0, 100), (101.0, 101.0))  # B_noise = 100: critical B ≈ 100
    rows = []
    for p in (1, 2):
        rows += candidate_rows(p, 60_000, 4096, CURVE, 0.0, "none",
                               lambda b: predict_iterations(pilot, b), lambda b: 0.1)
    assert any(r.compute_seconds == math.inf for r in rows)  # the rows below 256 examples
    chosen = on_iterations(rows, minimum_iterations(pilot))
    for row in (r for r in rows if r.best):
        assert math.ceil(row.batch_size / row.workers) >= SIZES[0], row
    assert chosen.workers == 1 and chosen.batch_size == 256  # the smallest that runs


def test_no_runnable_row_leaves_that_worker_count_without_a_best() -> None:
    pilot = Pilot(16, 0.1, 200, (0, 100), (101.0, 101.0))
    rows = candidate_rows(1, 60_000, 4096, CURVE, 0.0, "none",
                          lambda b: predict_iterations(pilot, b), lambda b: 0.1)
    rows += candidate_rows(2, 300, 4096, CURVE, 0.0, "none",  # P = 2: m ≤ 150 only
                           lambda b: predict_iterations(pilot, b), lambda b: 0.1)
    on_iterations(rows, minimum_iterations(pilot))
    assert [r.workers for r in rows if r.best] == [1]
