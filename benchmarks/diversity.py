"""Benchmark: per-example squared norms + gradient sum, relative to a plain forward+backward.

For each case (same model, same batch, one process) every engine is timed after a warm-up
and divided by the time of a plain forward+backward
(``loss.backward()`` of the summed loss). Engines: batchbound's hooks, vmap and loop engines,
BackPACK's BatchL2Grad and Opacus's GradSampleModule (norms from ``grad_sample``) when
installed. Each engine's S = Σ‖g_i‖² is compared with the loop engine's (max relative error).

Peak memory: the resident set size is sampled every millisecond by a thread
(/proc/self/statm) while the engine runs once; the column is the peak above the RSS just
before the run. So that freed tensors return to the OS and the RSS tracks live memory, it is
measured in a child process with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc) set; the timings
are taken without it (it slows allocation-heavy passes, LeNet-5's plain pass 2×).

    python benchmarks/diversity.py            # the full table (a few minutes)
    python benchmarks/diversity.py --quick    # 3 rounds, slow engines timed on 32 examples
    python benchmarks/diversity.py --json     # the tables as JSON on stdout

A second table times ``measure()`` end to end (checks, chunking, accumulation) against a
plain forward+backward over the same chunks (``--measure-cases``).

Fast engines (plain, hooks, BackPACK) are timed interleaved on the full batch; the slow ones
(vmap, loop, Opacus) once, on ``--slow-batch`` examples, scaled linearly to the batch. S is
checked on the first 64 examples, on a float64 copy of the model, against the loop engine
(relative error: anything above ~1e-12 is the engine's error, not rounding). One torch
thread by default, for stable timings on a shared machine (``--threads``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from batchbound import kernels
from batchbound.diversity import PreparedStats, measure

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_models import CASES, BasicBlock, Case, classification_loss

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# ---------------------------------------------------------------- engines
# Each engine factory gets (model, x, y, per-example loss) and returns a step () -> S.
Loss = Callable[[Tensor, Tensor], Tensor]


def plain_engine(model: nn.Module, x: Tensor, y: Tensor, loss: Loss) -> Callable[[], float]:
    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss(model(x), y).sum().backward()
        return float("nan")

    return step


def batchbound_engine(name: str) -> Callable[..., Callable[[], float]]:
    """One PreparedStats per model, as a training loop keeps it: the model is checked on the
    warm-up call; ``measure`` end to end (below) pays that check on every call."""

    def factory(model: nn.Module, x: Tensor, y: Tensor, loss: Loss) -> Callable[[], float]:
        stats_of = PreparedStats(model, loss, engine=name)

        def step() -> float:
            return stats_of(x, y).S

        return step

    return factory


def backpack_engine(model: nn.Module, x: Tensor, y: Tensor, loss: Loss) -> Callable[[], float]:
    from backpack import backpack, extend
    from backpack.extensions import BatchL2Grad

    if loss is not classification_loss:
        raise NotImplementedError("BackPACK's losses take (n, classes) outputs only")
    residual = any(isinstance(m, BasicBlock) for m in model.modules())
    net = extend(copy.deepcopy(model), use_converter=residual)
    summed = extend(nn.CrossEntropyLoss(reduction="sum"))

    def step() -> float:
        net.zero_grad(set_to_none=True)
        with backpack(BatchL2Grad()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # BackPACK's full-backward-hook notice
            summed(net(x), y).backward()
        return float(sum(p.batch_l2.sum() for p in net.parameters()))

    return step


def opacus_engine(model: nn.Module, x: Tensor, y: Tensor, loss: Loss) -> Callable[[], float]:
    from opacus import GradSampleModule

    # Opacus records activations only in train mode; these models have no dropout, and
    # BatchNorm (the ResNet) is refused by Opacus anyway.
    net = GradSampleModule(copy.deepcopy(model).train(), loss_reduction="sum")

    def step() -> float:
        net.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Opacus's full-backward-hook notice
            loss(net(x), y).sum().backward()
        n = x.shape[0]
        return float(sum(p.grad_sample.reshape(n, -1).square().sum() for p in net.parameters()))

    return step


ENGINES: dict[str, Callable[..., Callable[[], float]]] = {
    "plain fwd+bwd": plain_engine,
    "batchbound hooks": batchbound_engine("hooks"),
    "batchbound vmap": batchbound_engine("vmap"),
    "batchbound loop": batchbound_engine("loop"),
    "BackPACK BatchL2Grad": backpack_engine,
    "Opacus GradSampleModule": opacus_engine,
}
SLOW = {"batchbound vmap", "batchbound loop", "Opacus GradSampleModule"}


# ---------------------------------------------------------------- measurement


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


def peak_rss_above_start(step: Callable[[], float]) -> int:
    """Peak RSS above the starting RSS while ``step`` runs once (sampled every ms)."""
    start = rss_bytes()
    peak = start
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_bytes())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        step()
    finally:
        done.set()
        thread.join()
    return max(0, max(peak, rss_bytes()) - start)


@dataclass
class Row:
    case: str
    engine: str
    timed_batch: int
    seconds: float | None
    ratio: float | None
    peak_mb: float | None
    rel_err_S: float | None
    note: str = ""


def run_case(case: Case, repeats: int, slow_batch: int, engines: list[str]) -> list[Row]:
    """Fast engines are timed interleaved (one run of each per round, ``repeats`` rounds, the
    median kept), so load changes on a shared machine hit them alike. Slow engines run once
    after a warm-up on ``slow_batch`` examples, scaled linearly to the case's batch."""
    torch.manual_seed(0)
    model = case.build().eval()
    x, y = case.inputs(case.batch)
    # S is checked on a float64 copy against the loop engine's, on the first examples: an
    # error there is the engine's, not float32 rounding.
    check = min(64, case.batch)
    model64 = copy.deepcopy(model).double()
    x64 = (x.double() if x.is_floating_point() else x)[:check]
    reference = batchbound_engine("loop")(model64, x64, y[:check], case.loss)()
    rows: dict[str, Row] = {}
    steps: dict[str, Callable[[], float]] = {}
    for name in engines:
        batch = min(slow_batch, case.batch) if name in SLOW else case.batch
        try:
            s = ENGINES[name](model64, x64, y[:check], case.loss)()
            steps[name] = ENGINES[name](model, x[:batch], y[:batch], case.loss)
            steps[name]()  # warm-up
        except Exception as exc:  # a comparison library that cannot handle this model
            rows[name] = Row(case.name, name, batch, None, None, None, None, f"{exc}"[:100])
            continue
        err = None if s != s else abs(s - reference) / abs(reference)
        rows[name] = Row(case.name, name, batch, None, None, None, err)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            if name in SLOW and times[name]:
                continue
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    for name, values in times.items():
        row = rows[name]
        row.seconds = statistics.median(values) * case.batch / row.timed_batch
        if row.timed_batch != case.batch:
            row.note = f"timed on {row.timed_batch} examples, scaled"
    plain = rows["plain fwd+bwd"].seconds
    for row in rows.values():
        if row.seconds is not None and plain:
            row.ratio = row.seconds / plain
    return list(rows.values())


def run_peaks(case: Case, slow_batch: int, engines: list[str]) -> dict[str, float]:
    """Each engine's peak RSS above the pre-run RSS, in MB, on the batch it is timed on (a
    process of its own: see ``peaks_in_child``)."""
    torch.manual_seed(0)
    model = case.build().eval()
    x, y = case.inputs(case.batch)
    peaks = {}
    for name in engines:
        batch = min(slow_batch, case.batch) if name in SLOW else case.batch
        try:
            step = ENGINES[name](model, x[:batch], y[:batch], case.loss)
            step()  # warm-up
            peaks[name] = peak_rss_above_start(step) / 2**20
        except Exception:  # noted by the timing run
            continue
    return peaks


def peaks_in_child(argv: list[str]) -> dict[str, dict[str, float]]:
    """Peak memory from a child process with glibc's mmap threshold at 64 KiB, so that freed
    tensors go back to the OS and the RSS tracks live memory. Timings are taken without it:
    it makes every large allocation fault its pages in again (LeNet-5's plain pass ran 2×
    slower under it, flattering every ratio to it)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--peaks-only"],
                         env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------- measure() end to end
# What a user calls: ``measure`` over a data set in chunks, the model checked anew on every
# call (the probe at two batch sizes, the per-example loop on two examples), against a plain
# forward+backward over the same chunks.
MEASURE_SIZES = {"mlp": (4096, 256), "lenet": (2048, 256), "resnet": (512, 64), "gpt": (512, 32),
                 "hf-gpt2": (512, 32), "hf-llama": (512, 32)}


@dataclass
class MeasureRow:
    case: str
    examples: int
    chunk: int
    plain_seconds: float
    measure_seconds: float
    ratio: float
    cpu_ratio: float  # the same in process CPU time, which other jobs disturb less
    fallback: list[str]
    # Minor page faults per call (median; None where the platform does not count them):
    # glibc hands large tensors out as fresh pages, and a pass that faults on them can take
    # 1.5x as long, so a ratio depends on which side faulted (docs/benchmarks.md).
    plain_faults: int | None = None
    measure_faults: int | None = None


def _minor_faults() -> int | None:
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_measure(case: Case, examples: int, chunk: int, repeats: int) -> MeasureRow:
    torch.manual_seed(0)
    model = case.build().eval()
    x, y = case.inputs(examples)

    def plain() -> None:
        for start in range(0, examples, chunk):
            model.zero_grad(set_to_none=True)
            case.loss(model(x[start : start + chunk]), y[start : start + chunk]).sum().backward()

    def whole() -> list[str]:
        report = measure(model, (x, y), case.loss, chunk_size=chunk)
        return list(report.extra["fallback_parameters"])

    fallback = whole()  # warm-up
    plain()
    times: dict[str, list[float]] = {"plain": [], "measure": []}
    cpu: dict[str, list[float]] = {"plain": [], "measure": []}
    faults: dict[str, list[int]] = {"plain": [], "measure": []}
    for _ in range(repeats):
        for name, run in (("plain", plain), ("measure", whole)):
            f0 = _minor_faults()
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            f1 = _minor_faults()
            if f0 is not None and f1 is not None:
                faults[name].append(f1 - f0)
    p, m = statistics.median(times["plain"]), statistics.median(times["measure"])
    cpu_ratio = statistics.median(cpu["measure"]) / statistics.median(cpu["plain"])
    counted = [round(statistics.median(faults[k])) if faults[k] else None
               for k in ("plain", "measure")]
    return MeasureRow(case.name, examples, chunk, p, m, m / p, cpu_ratio, fallback, *counted)


def print_measure_table(rows: list[MeasureRow]) -> None:
    print("| case | examples / chunk | plain fwd+bwd s | measure() s | × plain | × plain, CPU "
          "| page faults, plain / measure() | fallback |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        faults = "n/a" if r.plain_faults is None else f"{r.plain_faults} / {r.measure_faults}"
        print(f"| {r.case} | {r.examples} / {r.chunk} | {r.plain_seconds:.3f} | "
              f"{r.measure_seconds:.3f} | {r.ratio:.2f} | {r.cpu_ratio:.2f} | {faults} | "
              f"{', '.join(r.fallback) or 'none'} |")


def print_table(rows: list[Row]) -> None:
    print("| case | engine | × plain | ms | peak MB | rel. err. S | note |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = "n/a" if r.ratio is None else f"{r.ratio:.2f}"
        ms = "n/a" if r.seconds is None else f"{1e3 * r.seconds:.0f}"
        peak = "n/a" if r.peak_mb is None else f"{r.peak_mb:.0f}"
        err = "" if r.rel_err_S is None else f"{r.rel_err_S:.0e}"
        print(f"| {r.case} | {r.engine} | {ratio} | {ms} | {peak} | {err} | {r.note} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9, help="timing rounds (median kept)")
    parser.add_argument("--quick", action="store_true", help="3 rounds, slow engines on 32")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    parser.add_argument("--threads", type=int, default=1, help="torch threads; default 1")
    parser.add_argument(
        "--slow-batch", type=int, default=128, help="examples the slow engines are timed on"
    )
    parser.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help="comma-separated subset of: " + ", ".join(ENGINES),
    )
    parser.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES)
    )
    parser.add_argument("--peaks-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--measure-cases", default="mlp,lenet,gpt,hf-gpt2,hf-llama",
        help="cases to time measure() end to end on (comma-separated, or 'none'); sizes: "
        + ", ".join(f"{k} {n} examples in chunks of {c}" for k, (n, c) in MEASURE_SIZES.items()),
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    keys = [c.strip() for c in args.cases.split(",") if c.strip()]
    measure_keys = [] if args.measure_cases == "none" else [
        c.strip() for c in args.measure_cases.split(",") if c.strip()]
    for chosen in (keys, measure_keys):
        if any(k not in CASES for k in chosen):
            parser.error(f"unknown cases {chosen}; choose from {list(CASES)}")
    engines = [e.strip() for e in args.engines.split(",")]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        parser.error(f"unknown engines {unknown}; choose from {list(ENGINES)}")
    if "plain fwd+bwd" not in engines:
        engines.insert(0, "plain fwd+bwd")
    repeats = 3 if args.quick else args.repeats
    slow_batch = 32 if args.quick else args.slow_batch
    if args.peaks_only:
        print(json.dumps({k: run_peaks(CASES[k], slow_batch, engines) for k in keys}))
        return 0
    rows: list[Row] = []
    for case in (CASES[k] for k in keys):
        rows += run_case(case, repeats, slow_batch, engines)
        print(f"done: {case.name}", file=sys.stderr)
    if keys:
        peaks = peaks_in_child(["--cases", ",".join(keys), "--engines", ",".join(engines),
                                "--slow-batch", str(slow_batch)])
        by_name = {CASES[k].name: v for k, v in peaks.items()}
        for row in rows:
            row.peak_mb = by_name.get(row.case, {}).get(row.engine)
    measured = []
    for key in measure_keys:
        examples, chunk = MEASURE_SIZES[key]
        measured.append(run_measure(CASES[key], examples, chunk, repeats))
        print(f"done: measure() on {CASES[key].name}", file=sys.stderr)
    if args.json:
        print(json.dumps({"engines": [asdict(r) for r in rows],
                          "measure": [asdict(r) for r in measured]}, indent=2))
    else:
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
            f"{kernels.describe()}, median of {repeats} interleaved rounds; peak MB = RSS peak "
            "above the pre-run RSS (in a child process, mmap threshold 64 KiB)"
        )
        print_table(rows)
        if measured:
            print(f"\nmeasure() end to end, median of {repeats} interleaved rounds")
            print_measure_table(measured)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
