"""Benchmark: per-example squared norms + gradient sum, relative to a plain forward+backward.

For each case (same model, same batch, one process) every engine is timed after a warm-up
and divided by the time of a plain forward+backward
(``loss.backward()`` of the summed loss). Engines: batchbound's hooks, vmap and loop engines,
BackPACK's BatchL2Grad and Opacus's GradSampleModule (norms from ``grad_sample``) when
installed. Each engine's S = Σ‖g_i‖² is compared with the loop engine's (max relative error).

Peak memory: the resident set size is sampled every millisecond by a thread
(/proc/self/statm) while the engine runs once; the column is the peak above the RSS just
before the run. So that freed tensors return to the OS and the RSS tracks live memory, the
script re-executes itself with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc) set.

    python benchmarks/diversity.py            # the full table (a few minutes)
    python benchmarks/diversity.py --quick    # 3 rounds, slow engines timed on 32 examples
    python benchmarks/diversity.py --json     # the table as JSON on stdout

Fast engines (plain, hooks, BackPACK) are timed interleaved on the full batch; the slow ones
(vmap, loop, Opacus) once, on ``--slow-batch`` examples, scaled linearly to the batch. S is
checked on the first 64 examples against the loop engine (relative error). One torch
thread by default, for stable timings on a shared machine (``--threads``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchbound.diversity import per_example_stats

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# ---------------------------------------------------------------- models


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def lenet5() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(400, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, 10),
    )


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def small_resnet() -> nn.Module:
    """ResNet-8 for 3×32×32 inputs: stem, one basic block per stage (16, 32, 64), head."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        BasicBlock(16, 16, 1),
        BasicBlock(16, 32, 2),
        BasicBlock(32, 64, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    batch: int


CASES = [
    Case("MLP 784-512-512-512-10", mlp, (1, 28, 28), 1024),
    Case("LeNet-5", lenet5, (1, 28, 28), 256),
    Case("ResNet-8 (BatchNorm, eval)", small_resnet, (3, 32, 32), 64),
]
CASE_KEYS = dict(zip(("mlp", "lenet", "resnet"), CASES, strict=True))


# ---------------------------------------------------------------- engines
# Each engine factory gets (model, x, y) and returns a step () -> S (a float).


def plain_engine(model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], float]:
    def step() -> float:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y, reduction="sum").backward()
        return float("nan")

    return step


def batchbound_engine(name: str) -> Callable[[nn.Module, Tensor, Tensor], Callable[[], float]]:
    def factory(model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], float]:
        def step() -> float:
            return per_example_stats(model, x, y, "cross_entropy", engine=name).S

        return step

    return factory


def backpack_engine(model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], float]:
    from backpack import backpack, extend
    from backpack.extensions import BatchL2Grad

    residual = any(isinstance(m, BasicBlock) for m in model.modules())
    net = extend(copy.deepcopy(model), use_converter=residual)
    loss = extend(nn.CrossEntropyLoss(reduction="sum"))

    def step() -> float:
        net.zero_grad(set_to_none=True)
        with backpack(BatchL2Grad()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # BackPACK's full-backward-hook notice
            loss(net(x), y).backward()
        return float(sum(p.batch_l2.sum() for p in net.parameters()))

    return step


def opacus_engine(model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], float]:
    from opacus import GradSampleModule

    # Opacus records activations only in train mode; these models have no dropout, and
    # BatchNorm (the ResNet) is refused by Opacus anyway.
    net = GradSampleModule(copy.deepcopy(model).train(), loss_reduction="sum")

    def step() -> float:
        net.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Opacus's full-backward-hook notice
            F.cross_entropy(net(x), y, reduction="sum").backward()
        n = x.shape[0]
        return float(sum(p.grad_sample.reshape(n, -1).square().sum() for p in net.parameters()))

    return step


ENGINES: dict[str, Callable[[nn.Module, Tensor, Tensor], Callable[[], float]]] = {
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
    x = torch.randn(case.batch, *case.input_shape)
    y = torch.randint(0, 10, (case.batch,))
    check = min(64, case.batch)  # S is checked against the loop engine on these examples
    reference = batchbound_engine("loop")(model, x[:check], y[:check])()
    rows: dict[str, Row] = {}
    steps: dict[str, Callable[[], float]] = {}
    for name in engines:
        batch = min(slow_batch, case.batch) if name in SLOW else case.batch
        try:
            s = ENGINES[name](model, x[:check], y[:check])()
            steps[name] = ENGINES[name](model, x[:batch], y[:batch])
            steps[name]()  # warm-up
            peak = peak_rss_above_start(steps[name]) / 2**20
        except Exception as exc:  # a comparison library that cannot handle this model
            rows[name] = Row(case.name, name, batch, None, None, None, None, f"{exc}"[:100])
            continue
        err = None if s != s else abs(s - reference) / abs(reference)
        rows[name] = Row(case.name, name, batch, None, None, peak, err)
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
        "--cases", default="mlp,lenet,resnet", help="comma-separated subset of: mlp, lenet, resnet"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    keys = [c.strip() for c in args.cases.split(",")]
    if any(k not in CASE_KEYS for k in keys):
        parser.error(f"unknown cases {keys}; choose from {list(CASE_KEYS)}")
    engines = [e.strip() for e in args.engines.split(",")]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        parser.error(f"unknown engines {unknown}; choose from {list(ENGINES)}")
    if "plain fwd+bwd" not in engines:
        engines.insert(0, "plain fwd+bwd")
    repeats = 3 if args.quick else args.repeats
    slow_batch = 32 if args.quick else args.slow_batch
    rows: list[Row] = []
    for case in (CASE_KEYS[k] for k in keys):
        rows += run_case(case, repeats, slow_batch, engines)
        print(f"done: {case.name}", file=sys.stderr)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of "
            f"{repeats} interleaved rounds; peak MB = RSS peak above the pre-run RSS"
        )
        print_table(rows)
    return 0


if __name__ == "__main__":
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None and sys.platform.startswith("linux"):
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    raise SystemExit(main())
