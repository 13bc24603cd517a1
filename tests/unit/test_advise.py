"""The advise model: iterations against batch size, seconds per iteration, the answer, and
the cluster file, each against its closed form."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from batchbound.advise.answer import best_row, finish, worker_counts
from batchbound.advise.iterations import (
    Pilot,
    lr_scale,
    minimum_iterations,
    predict_iterations,
    strategies,
)
from batchbound.advise.timing import (
    Cluster,
    ComputeCurve,
    load_cluster,
    ring_allreduce_seconds,
)
from batchbound.errors import BatchboundError


def flat_pilot(noise: float, b0: int = 16, k0: int = 200) -> Pilot:
    return Pilot(b0, 0.1, k0, (0, k0 // 2), (noise + 1, noise + 1))


@pytest.mark.parametrize("rule", strategies())
def test_the_pilots_own_batch_takes_the_pilots_iterations(rule: str) -> None:
    pilot = Pilot(16, 0.1, 300, (0, 100, 250), (40.0, 90.0, 200.0))
    assert predict_iterations(pilot, 16, rule) == pytest.approx(300)


@pytest.mark.parametrize("batch", [1, 8, 32, 100, 1000, 10**6])
def test_noise_rule_with_a_constant_noise_scale_is_mccandlish_closed_form(batch: int) -> None:
    """S(B) = S_min·(1 + B_noise/B), through the pilot's (B0, k0)."""
    noise, b0, k0 = 63.0, 16, 200
    expected = k0 * (1 + noise / batch) / (1 + noise / b0)
    assert predict_iterations(flat_pilot(noise, b0, k0), batch) == pytest.approx(expected)


def test_noise_rule_falls_with_batch_and_stays_above_the_minimum() -> None:
    """S_min (the best rate at every step) bounds any one rate from below; it is reached
    when the noise scale does not change."""
    pilot = Pilot(16, 0.1, 300, (0, 100, 250), (40.0, 90.0, 200.0))
    ks = [predict_iterations(pilot, b) for b in (16, 64, 256, 1024, 10**7)]
    assert ks == sorted(ks, reverse=True) and all(math.isfinite(k) for k in ks)
    assert ks[-1] >= minimum_iterations(pilot)
    flat = flat_pilot(noise=63.0)
    assert predict_iterations(flat, 10**9) == pytest.approx(minimum_iterations(flat), rel=1e-6)


def test_linear_scaling_past_the_noise_scale_predicts_no_convergence() -> None:
    pilot = flat_pilot(noise=20.0, b0=16)
    assert math.isfinite(predict_iterations(pilot, 32, "lsr"))
    assert predict_iterations(pilot, 2 * 16 + 20, "lsr") == math.inf


def test_a_constant_rate_saves_at_most_half_the_steps() -> None:
    pilot = flat_pilot(noise=50.0, k0=200)
    assert predict_iterations(pilot, 10**6, "blr") >= 100 - 1e-9
    assert predict_iterations(pilot, 64, "blr") < 200


def test_noise_rule_rate_approaches_linear_scaling_for_small_batches() -> None:
    pilot = flat_pilot(noise=1000.0, b0=4)
    assert lr_scale("noise", 8, pilot) == pytest.approx(2.0, rel=0.01)
    assert lr_scale("noise", 10**7, pilot) == pytest.approx(1 + 1000 / 4, rel=0.01)


def test_momentum_raises_the_noise_rules_noise_free_limit_by_one_plus_mu() -> None:
    # heavy ball is stable for η·λ < 2(1 + μ), SGD for η·λ < 2; where noise limits the rate
    # (B ≪ B_noise) momentum moves as SGD at η/(1 − μ), so the rule's low-B end is unchanged
    pilot = flat_pilot(noise=100.0, b0=16)
    for batch in (4, 64, 1024, 10**7):
        assert lr_scale("noise", batch, pilot, momentum=0.9) == pytest.approx(
            (1 + 190 / 16) / (1 + 190 / batch), rel=1e-12)
        assert lr_scale("noise", batch, pilot, momentum=0.0) == lr_scale("noise", batch, pilot)
    huge = flat_pilot(noise=1e9, b0=16)
    assert lr_scale("noise", 64, huge, momentum=0.9) == pytest.approx(
        lr_scale("noise", 64, huge), rel=1e-6)
    limit = lr_scale("noise", 10**12, pilot, momentum=0.9) / lr_scale("noise", 10**12, pilot)
    assert limit == pytest.approx((1 + 190 / 16) / (1 + 100 / 16), rel=1e-6)
    assert lr_scale("lsr", 64, pilot, momentum=0.9) == 4.0  # a named rule is the user's


def test_a_pilot_without_a_finite_bound_is_refused() -> None:
    with pytest.raises(BatchboundError, match="finite"):
        Pilot(16, 0.1, 10, (0,), (math.inf,))


# ---------------------------------------------------------------- communication


def test_one_worker_has_no_communication() -> None:
    assert ring_allreduce_seconds(1, 10**9, 1e-3, 1e6) == 0.0


def test_infinite_bandwidth_leaves_only_latency_and_zero_with_none() -> None:
    assert ring_allreduce_seconds(8, 10**9, 5e-6, math.inf) == pytest.approx(14 * 5e-6)
    assert ring_allreduce_seconds(8, 10**9, 0.0, math.inf) == 0.0


def test_ring_allreduce_closed_form() -> None:
    p, b, alpha, beta = 4, 4_000_000, 1e-5, 1e9
    assert ring_allreduce_seconds(p, b, alpha, beta) == pytest.approx(
        2 * 3 * alpha + 2 * 3 / 4 * b / beta)


# ---------------------------------------------------------------- the answer

CURVE = ComputeCurve((1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096),
                     tuple(2e-4 + 1e-5 * m for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512,
                                                     1024, 4096)),
                     tuple(1e-4 + 3e-6 * m for m in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512,
                                                     1024, 4096)))


def answer(pilot: Pilot, cluster: Cluster, overlap: str = "none", n: int = 60_000):
    rows = []
    for p in worker_counts(cluster.max_workers):
        row = best_row(p, n, 4096, CURVE, cluster.allreduce_seconds(p, 4_000_000), overlap,
                       lambda b: predict_iterations(pilot, b), lambda b: 0.1)
        if row is not None:
            rows.append(row)
    recommended, stop = finish(rows)
    return rows, recommended, stop


def test_time_never_falls_below_minimum_steps_times_one_example() -> None:
    pilot = Pilot(16, 0.1, 500, (0, 200, 450), (30.0, 300.0, 3000.0))
    cluster = Cluster(bandwidth_bytes_per_s=math.inf, latency_s=0.0, max_workers=1024)
    rows, _, _ = answer(pilot, cluster)
    floor = minimum_iterations(pilot) * CURVE.step(1)
    assert len(rows) == 11 and all(r.seconds_to_target >= floor for r in rows)
    assert all(r.communication_seconds == 0 for r in rows)


def test_raising_the_bandwidth_never_lowers_where_workers_stop_paying() -> None:
    pilot = Pilot(16, 0.1, 500, (0, 200, 450), (30.0, 300.0, 3000.0))
    stops = []
    for gbytes in (0.1, 1, 10, 100, 1000, math.inf):
        cluster = Cluster(bandwidth_bytes_per_s=gbytes * 1e9, latency_s=5e-6,
                          max_workers=1024)
        stops.append(answer(pilot, cluster)[2])
    as_numbers = [math.inf if s is None else s for s in stops]
    assert as_numbers == sorted(as_numbers), stops


def test_rows_use_multiples_of_the_workers_and_speedup_is_against_one_worker() -> None:
    pilot = flat_pilot(noise=500.0)
    rows, recommended, stop = answer(pilot, Cluster(10e9, 5e-6, 64))
    assert [r.workers for r in rows] == [1, 2, 4, 8, 16, 32, 64]
    for r in rows:
        assert r.batch_size % r.workers == 0
        assert r.speedup == pytest.approx(rows[0].seconds_to_target / r.seconds_to_target)
        assert r.efficiency == pytest.approx(r.speedup / r.workers)
    assert recommended in rows
    if stop is not None:
        nxt = next(r for r in rows if r.workers == 2 * stop)
        this = next(r for r in rows if r.workers == stop)
        assert nxt.seconds_to_target > 0.9 * this.seconds_to_target


def test_overlap_hides_communication_behind_the_backward() -> None:
    pilot = flat_pilot(noise=500.0)
    slow = Cluster(1e8, 5e-6, 8)
    plain = answer(pilot, slow, "none")[0]
    hidden = answer(pilot, slow, "backward")[0]
    for a, b in zip(plain, hidden, strict=True):
        assert b.seconds_to_target <= a.seconds_to_target + 1e-12


# ---------------------------------------------------------------- the cluster file


def test_cluster_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text("[network]\nbandwidth_gbytes_per_s = 12.5\nlatency_us = 5\n"
                    "[cluster]\nmax_workers = 1024\n[device]\nexamples_per_second = 2e4\n")
    cluster = load_cluster(path)
    assert cluster.bandwidth_bytes_per_s == 12.5e9 and cluster.latency_s == 5e-6
    assert cluster.max_workers == 1024 and cluster.examples_per_second == 2e4


@pytest.mark.parametrize("text, message", [
    ("[network]\nlatency_us = 5\n[cluster]\nmax_workers = 4\n", "bandwidth_gbytes_per_s"),
    ("[network]\nbandwidth_gbytes_per_s = 'fast'\nlatency_us = 5\n[cluster]\nmax_workers = 4\n",
     "positive number"),
    ("[network]\nbandwidth_gbytes_per_s = 1\nlatency_us = 5\nspeed = 3\n"
     "[cluster]\nmax_workers = 4\n", "unknown key 'speed'"),
    ("[network]\nbandwidth_gbytes_per_s = 1\nlatency_us = 5\n[cluster]\nmax_workers = 2.5\n",
     "whole number"),
    ("not toml [", "not valid TOML"),
])
def test_bad_cluster_files_are_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    with pytest.raises(BatchboundError, match=message):
        load_cluster(path)


def test_micro_batches_above_the_timed_maximum_are_extrapolated() -> None:
    from batchbound.advise.timing import TIMED_MAX, ComputeCurve, micro_batch_sizes

    assert micro_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert micro_batch_sizes(60000)[-1] == TIMED_MAX
    curve = ComputeCurve((1024, 2048), (1.0, 2.0), (0.3, 0.6))
    assert curve.step(60000) == pytest.approx(60000 / 1024)  # linear past the largest timed


def test_timing_is_flagged_by_other_processes_not_by_its_own_work() -> None:
    """OtherWork counts the CPU another process takes while timing, and not what this
    process or a child it waited for used (the 1-minute load average counts both). Checked
    on CPU seconds, not on an idle machine: this process's and its child's own work is
    what the snapshot subtracts, whatever else runs beside it."""
    import subprocess
    import sys
    import time

    from batchbound.advise.timing import OtherWork, _snapshot, busy_reason

    def spin(cpu_seconds: float) -> None:  # CPU time, not wall time: the same under load
        end = time.process_time() + cpu_seconds
        while time.process_time() < end:
            pass

    if not OtherWork().known:
        pytest.skip("no /proc/stat here")
    before = _snapshot()
    subprocess.run([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                    "while time.process_time() < end: pass"], check=True)
    spin(0.5)
    after = _snapshot()
    own = after[2] - before[2]
    assert own >= 0.95  # this process's 0.5 s and the child's it waited for, both its own
    assert after[1] - before[1] >= own - 0.1  # the machine's count holds them (tick rounding)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        other = OtherWork()
        with other:
            time.sleep(1.0)  # this process idle: all the busy time is another's
    finally:
        hog.kill()
        hog.wait()
    assert other.cores is not None and other.cores > 0.3  # the hog, however busy the rest
    assert "cores busy while timing" in busy_reason(max(other.cores, 0.6), 1.0, 1.0)
    assert busy_reason(0.1, 1.0, 1.1) is None
    assert "timed 1e+03 ms, then 2e+03 ms" in busy_reason(0.1, 1.0, 2.0)


# ---------------------------------------------------------------- timing you can trust


def test_interleaved_medians_time_each_action_and_settle_on_steady_actions() -> None:
    import time

    from batchbound.train.timing import MIN_ROUNDS, interleaved_medians

    calls = [0, 0]

    def short() -> None:
        calls[0] += 1
        time.sleep(0.001)

    def long() -> None:
        calls[1] += 1
        time.sleep(0.004)

    medians, _ = interleaved_medians([short, long], budget_s=0.5)
    assert 0.001 <= medians[0] < medians[1] and medians[1] >= 0.004
    assert min(calls) >= MIN_ROUNDS + 1  # a warm-up, then every round times both


def test_interleaved_rounds_alternate_their_order() -> None:
    import itertools

    from batchbound.train.timing import MIN_ROUNDS, interleaved_medians

    seen: list[str] = []
    interleaved_medians([lambda: seen.append("a"), lambda: seen.append("b")], budget_s=0.0)
    assert seen[:2] == ["a", "b"]  # one warm-up each
    runs = [(k, len(list(g))) for k, g in itertools.groupby(seen[2:])]
    rounds = len(runs) - 1  # a then b, b then a, a then b, ...: rounds + 1 runs
    cell = {k: seen[2:].count(k) // rounds for k in "ab"}  # a cell repeats a fast action
    assert rounds >= MIN_ROUNDS and [k for k, _ in runs][:3] == ["a", "b", "a"]
    assert runs[0][1] == cell["a"] > 1 and all(n == 2 * cell[k] for k, n in runs[1:-1])


@pytest.mark.parametrize("values", [[1.0, 2.0, 3.0], [3.0, 1.0, 2.0], [5.0, 4.0, 3.0, 9.0],
                                    [1.0, 5.0, 2.0, 2.0, 7.0, 0.5]])
def test_monotone_is_the_least_squares_non_decreasing_fit(values: list[float]) -> None:
    import itertools

    from batchbound.train.timing import monotone

    fit = monotone(values)
    assert len(fit) == len(values) and all(a <= b + 1e-12 for a, b in itertools.pairwise(fit))
    error = sum((a - b) ** 2 for a, b in zip(fit, values, strict=True))
    # the reference: a fine grid of non-decreasing candidates never does better
    grid = sorted({round(v, 3) for v in values} | {round(f, 3) for f in fit})
    for candidate in itertools.combinations_with_replacement(grid, len(values)):
        assert sum((a - b) ** 2 for a, b in zip(candidate, values, strict=True)) >= error - 1e-9


def test_a_step_slower_at_a_smaller_batch_is_named() -> None:
    from batchbound.train.timing import inverted

    assert inverted([1, 2, 4], [0.001, 0.0011, 0.002]) is None
    assert inverted([1, 2, 4], [0.0012, 0.001, 0.002]) is None  # within noise
    reason = inverted([1, 2, 4, 8], [0.186, 0.0016, 0.0096, 0.0019])  # the timings
    assert "micro-batch 1 timed 186 ms, slower than at 2" in reason


def test_untrusted_seconds_answer_on_iterations_alone_at_the_critical_batch() -> None:
    from batchbound.advise.answer import candidate_rows, on_iterations

    pilot = flat_pilot(noise=100.0)
    rows = []
    for p in (1, 2):
        rows += candidate_rows(p, 60_000, 4096, CURVE, 0.0, "none",
                               lambda b: predict_iterations(pilot, b), lambda b: 0.1)
    fewest = minimum_iterations(pilot)
    chosen = on_iterations(rows, fewest)
    assert chosen.workers == 1 and chosen.iterations <= 2 * fewest
    smaller = [r for r in rows if r.workers == 1 and r.batch_size < chosen.batch_size]
    assert smaller and all(r.iterations > 2 * fewest for r in smaller)
    assert 64 <= chosen.batch_size <= 128  # B_noise = 100: S = 2·S_min at B = 100
    assert all(math.isnan(r.seconds_to_target) and math.isnan(r.speedup) for r in rows)
    assert [r.workers for r in rows if r.best] == [1, 2]
    # the same rows timed anew (any other seconds) give the same answer
    again = []
    for p in (1, 2):
        again += candidate_rows(p, 60_000, 4096, ComputeCurve((1,), (9.0,), (3.0,)), 5.0,
                                "none", lambda b: predict_iterations(pilot, b), lambda b: 0.1)
    assert on_iterations(again, fewest).batch_size == chosen.batch_size


def test_the_pilots_rate_is_given_once() -> None:
    """advise(model, data, optimizer=..., lr=...): the optimizer's own rate when lr is not
    given, lr when the optimizer agrees or sets none, refused when both say different."""
    import torch

    from batchbound.advise.inputs import DEFAULT_LR, pilot_lr

    def sgd(params):
        return torch.optim.SGD(params, lr=0.03, momentum=0.9)

    assert pilot_lr(None, None) == DEFAULT_LR and pilot_lr(0.2, None) == 0.2
    assert pilot_lr(None, sgd) == 0.03 and pilot_lr(0.03, sgd) == 0.03
    with pytest.raises(BatchboundError, match=r"optimizer sets lr 0\.03 and lr=0\.1 was given"):
        pilot_lr(0.1, sgd)


def test_the_table_shows_b0_and_unknown_seconds_on_a_busy_machine() -> None:
    from batchbound.advise import Advice
    from batchbound.advise.answer import candidate_rows, on_iterations

    pilot = flat_pilot(noise=100.0)

    def rows():
        out = []
        for p in (1, 2):
            out += candidate_rows(p, 60_000, 4096, CURVE, 1e-3 * (p > 1), "none",
                                  lambda b: predict_iterations(pilot, b), lambda b: 0.1)
        return out

    timed = rows()
    best = [r for r in timed if r.best]
    recommended, stop = finish(best)
    record = {"batch_size": 16, "target": "the plan's loss", "final_loss": [0.5, 0.1, 0.9],
              "seconds": 1.5, "wall_seconds": 2.5, "iterations": 20, "minimum_iterations": 50}
    advice = Advice(batch_bound=101.0, rows=timed, recommended=recommended,
                    workers_stop_paying=stop, assumptions="", pilot=record)
    table = advice.table()
    b0 = next(line for line in table.splitlines() if "(B0)" in line)
    assert b0.startswith("| 1") and "| 16 |" in b0
    summary = advice.summary()
    assert "to the plan's loss" in summary and "s to the target" not in summary
    assert "0.5 (0.1–0.9)" in summary and "1.5 s (training only), 2.5 s in all" in summary
    busy = rows()
    chosen = on_iterations(busy, minimum_iterations(pilot))
    on_busy = Advice(101.0, busy, chosen, None, "", pilot=record,
                           extra={"recommended_on": "iterations", "timing_warning": "hog"})
    assert "unknown | unknown" in on_busy.table()
    assert on_busy.summary().startswith("the seconds cannot be trusted here (hog), so "
                                              "this answer is on iterations alone")


def test_the_step_timer_reports_the_mean_wait_the_run_pays() -> None:
    from batchbound.advise.step_timer import summarise

    # a heavy-tailed wait: one stall in ten; the run pays the mean, the median hides it
    waits = [0.001] * 9 + [0.011]
    row = summarise([32], {32: [0.002] * 9 + [0.020]}, {32: waits}, {32: [0.001] * 10})[0]
    assert row["communication"] == pytest.approx(0.002)  # mean: (9·1 + 11)/10 ms
    assert row["compute"] == pytest.approx(0.002)  # compute stays the median
    assert row["forward"] == pytest.approx(0.001)
