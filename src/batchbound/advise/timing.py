"""Seconds per iteration on P workers at global batch B: compute, communication, step.

- Compute: the trainer's own step (data, forward and backward, optimiser step) on a
  micro-batch of m = ⌈B/P⌉ examples, timed on this device at a few m in interleaved rounds
  (the median per m, non-decreasing in m: ``train.loop.time_steps``), on the torch threads
  training computes on (``kernels.threads()``), and interpolated linearly between the m timed
  (extrapolated beyond the largest from its last two points; at most TIMED_MAX examples are
  timed). The forward alone is timed too, so the backward's share is known for overlap.
- On P local workers: the trainer's real step run in lockstep by P gloo processes
  (``time_workers``), so the all-reduce is timed with the waiting for a slower peer that an
  all-reduce timed alone misses.
- Communication on a cluster: a ring all-reduce of b bytes, 2(P−1)·α + 2(P−1)/P · b/β.
- Overlap: ``"none"`` (batchbound's trainer: compute, then all-reduce, then step) adds
  them; ``"backward"`` (DDP's buckets) hides communication behind the backward,
  forward + max(backward, communication) + step.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from batchbound.advise.step_timer import PEER_FAILED
from batchbound.config import load_toml
from batchbound.data import Dataset
from batchbound.environment import usable_cores
from batchbound.errors import BatchboundError
from batchbound.train.config import TrainConfig
from batchbound.train.distributed import free_port
from batchbound.train.loop import Parts, time_steps
from batchbound.train.timing import inverted, monotone

OVERLAPS = ("none", "backward")


@dataclass(frozen=True)
class ComputeCurve:
    """Seconds of one worker's step against its micro-batch size m (timed at ``sizes``)."""

    sizes: tuple[int, ...]
    step_seconds: tuple[float, ...]  # data + forward + backward + optimiser step
    forward_seconds: tuple[float, ...]
    unsettled: str | None = None  # why these timings cannot be trusted, None when they can

    def _at(self, values: Sequence[float], m: float) -> float:
        sizes = self.sizes
        if m < sizes[0]:  # timed from the first size the model's step runs at (time_steps)
            return math.inf
        if len(sizes) == 1:
            return values[0] * m / sizes[0]
        k = next((i for i in range(1, len(sizes)) if m <= sizes[i]), len(sizes) - 1)
        s0, s1, v0, v1 = sizes[k - 1], sizes[k], values[k - 1], values[k]
        return max(v0 + (v1 - v0) * (m - s0) / (s1 - s0), 0.0)

    def step(self, m: float) -> float:
        return self._at(self.step_seconds, m)

    def forward(self, m: float) -> float:
        return min(self._at(self.forward_seconds, m), self.step(m))

    @classmethod
    def from_rate(cls, examples_per_second: float) -> ComputeCurve:
        """A described device: t(m) = m / rate, a third of it the forward."""
        return cls((1,), (1.0 / examples_per_second,), (1.0 / (3 * examples_per_second),))


@dataclass(frozen=True)
class Cluster:
    """``[network] bandwidth_gbytes_per_s, latency_us``, ``[cluster] max_workers``,
    optional ``[device] examples_per_second, max_micro_batch``."""

    bandwidth_bytes_per_s: float
    latency_s: float
    max_workers: int
    examples_per_second: float | None = None
    max_micro_batch: int | None = None

    def allreduce_seconds(self, workers: int, payload_bytes: int) -> float:
        return ring_allreduce_seconds(workers, payload_bytes, self.latency_s,
                                      self.bandwidth_bytes_per_s)


def ring_allreduce_seconds(workers: int, payload_bytes: int, latency_s: float,
                           bandwidth_bytes_per_s: float) -> float:
    """2(P−1)·α + 2(P−1)/P · b/β; 0 for one worker, and α alone for infinite bandwidth."""
    if workers <= 1:
        return 0.0
    steps = 2 * (workers - 1)
    return steps * latency_s + steps / workers * payload_bytes / bandwidth_bytes_per_s


def load_cluster(path: str | Path) -> Cluster:
    """Read and check a cluster file; a one-line BatchboundError names what is wrong."""
    data = load_toml(path, "cluster file")
    allowed = {"network": {"bandwidth_gbytes_per_s", "latency_us"}, "cluster": {"max_workers"},
               "device": {"examples_per_second", "max_micro_batch"}}
    for table, keys in data.items():
        if table not in allowed or not isinstance(keys, dict):
            raise BatchboundError(f"cluster file {path}: unknown table [{table}]; tables: "
                                  f"{', '.join(allowed)}")
        unknown = set(keys) - allowed[table]
        if unknown:
            raise BatchboundError(f"cluster file {path}: unknown key {sorted(unknown)[0]!r} in "
                                  f"[{table}]; keys: {', '.join(sorted(allowed[table]))}")

    def number(table: str, key: str, required: bool = True) -> float | None:
        value = data.get(table, {}).get(key)
        if value is None:
            if required:
                raise BatchboundError(f"cluster file {path} needs [{table}] {key}")
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                math.isfinite(value) and value > 0):
            raise BatchboundError(f"cluster file {path}: [{table}] {key} must be a positive "
                                  f"number, got {value!r}")
        return float(value)

    workers = number("cluster", "max_workers")
    micro = number("device", "max_micro_batch", required=False)
    for key, value in (("[cluster] max_workers", workers), ("[device] max_micro_batch", micro)):
        if value is not None and value != int(value):
            raise BatchboundError(f"cluster file {path}: {key} must be a whole number")
    return Cluster(
        bandwidth_bytes_per_s=number("network", "bandwidth_gbytes_per_s") * 1e9,  # type: ignore[operator]
        latency_s=number("network", "latency_us") / 1e6,  # type: ignore[operator]
        max_workers=int(workers),  # type: ignore[arg-type]
        examples_per_second=number("device", "examples_per_second", required=False),
        max_micro_batch=None if micro is None else int(micro),
    )


# ---------------------------------------------------------------- measured here


# The largest micro-batch timed: a step's time is linear in its examples well before this,
# and ComputeCurve extrapolates beyond it from the two largest timed (timing a LeNet step on
# 30 000 Fashion-MNIST images, 33 times on each of 2 ranks, took over 20 minutes).
TIMED_MAX = 2048


def micro_batch_sizes(largest: int) -> list[int]:
    """1, 2, 4, … and ``largest``, up to TIMED_MAX (larger ones are extrapolated)."""
    top = min(largest, TIMED_MAX)
    sizes = [1 << k for k in range(top.bit_length()) if 1 << k < top]
    return [*sizes, top]


def time_compute(config: TrainConfig, data: Dataset, sizes: Sequence[int], threads: int,
                 budget_s: float = 0.2, parts: Parts | None = None) -> ComputeCurve:
    """The trainer's step timed at each micro-batch size (medians over interleaved rounds,
    about ``budget_s`` seconds per size, non-decreasing in the size: ``time_steps``), with
    ``threads`` torch threads, on a throwaway model."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        timed = time_steps(config, data, sizes, budget_s, parts)
        return ComputeCurve(timed.sizes, tuple(timed.steps), tuple(timed.forwards),
                            timed.unsettled)
    finally:
        torch.set_num_threads(previous)


def _run_ranks(arguments: list[str], workers: int, out: Path, tmp: str) -> None:
    """``python -m batchbound.advise.step_timer ARGUMENTS`` on ``workers`` local ranks."""
    port = free_port()
    command = [sys.executable, "-m", "batchbound.advise.step_timer", *arguments]
    # stderr to files, not pipes: a rank blocked on a full pipe would hang its peers
    logs = [Path(tmp) / f"rank{r}.err" for r in range(workers)]
    ranks = []
    for r, log in enumerate(logs):
        with log.open("w") as err:  # the child keeps its own copy of the descriptor
            ranks.append(subprocess.Popen(command, stderr=err, env={
                **os.environ, "BATCHBOUND_TIMER_PARENT": str(os.getpid()),
                "BATCHBOUND_TIMER_FOLDER": tmp,  # theirs to remove if this process dies
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(workers)}))
    errors: list[str] = []
    stopped: list[str] = []  # ranks stopped by another's failure say nothing: it names it
    try:
        for rank, log in zip(ranks, logs, strict=True):
            if rank.wait():
                err = log.read_text().strip()
                line = err.splitlines()[-1] if err else f"exit {rank.returncode}"
                (stopped if rank.returncode == PEER_FAILED else errors).append(line)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    errors += stopped
    if errors or not out.exists():
        raise BatchboundError(f"timing the step on {workers} processes failed: "
                              f"{errors[0] if errors else 'no result'}")


def time_allreduce(workers: int, payload_bytes: int, threads: int, repeats: int = 30) -> float:
    """Median seconds of an all-reduce of ``payload_bytes`` among ``workers`` local gloo
    processes (for a model only this process holds)."""
    with tempfile.TemporaryDirectory(prefix="batchbound-allreduce-") as tmp:
        out = Path(tmp) / "allreduce.json"
        _run_ranks(["allreduce", str(out), str(threads), str(repeats), str(payload_bytes)],
                   workers, out, tmp)
        return float(json.loads(out.read_text())["communication"])


def time_workers(config: TrainConfig, workers: int, sizes: Sequence[int], threads: int,
                 repeats: int = 30) -> tuple[ComputeCurve, float]:
    """The trainer's real step on ``workers`` local gloo processes, in lockstep, at global
    batches P·m for each micro-batch m in ``sizes`` (``step_timer.py``): the compute curve of
    one worker, and the seconds per iteration its all-reduce takes, waiting for the slower
    peer included (per size the mean over rounds, since the run pays every wait; the median
    over sizes)."""
    timed = config.replace(workers=workers, lr=1e-9, online_diversity="off",
                           diversity_every_epochs=None, batch_policy="fixed", targets=())
    with tempfile.TemporaryDirectory(prefix="batchbound-steps-") as tmp:
        spec, out = Path(tmp) / "config.json", Path(tmp) / "steps.json"
        spec.write_text(json.dumps(timed.to_dict()))
        _run_ranks([str(spec), str(out), str(threads), str(repeats), *map(str, sizes)],
                   workers, out, tmp)
        rows = json.loads(out.read_text())
    sizes = [r["micro_batch"] for r in rows]
    steps = [r["compute"] for r in rows]
    curve = ComputeCurve(tuple(sizes), tuple(monotone(steps)),
                         tuple(monotone([r["forward"] for r in rows])), inverted(sizes, steps))
    return curve, statistics.median(r["communication"] for r in rows)


OTHER_CORES_LIMIT = 0.5  # other work using half a core on average while timing: flagged


class OtherWork:
    """The CPU other processes take while a block runs (``with others: ...``, summed over
    every block): the busy time /proc/stat counts on the CPUs this process may run on, steal
    included (a virtual machine's host taking its cores), less this process's own and its
    finished children's. The 1-minute load average cannot tell: it counts the timing's own
    threads and the minute before."""

    def __init__(self) -> None:
        self.cpu_seconds, self.wall_seconds = 0.0, 0.0
        self.known = _machine_busy_seconds() is not None
        self._start: tuple[float, float, float] | None = None

    def __enter__(self) -> OtherWork:
        self._start = _snapshot()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._start is not None
        wall, busy, own = _snapshot()
        self.wall_seconds += wall - self._start[0]
        self.cpu_seconds += max(0.0, (busy - self._start[1]) - (own - self._start[2]))

    @property
    def cores(self) -> float | None:
        """Cores other processes kept busy on average, None where the system does not say."""
        if not self.known or self.wall_seconds <= 0:
            return None
        return self.cpu_seconds / self.wall_seconds


def _machine_busy_seconds(text: str | None = None, cpus: set[int] | None = None
                          ) -> float | None:
    """CPU seconds all processes have used since boot (user, nice, system, irq, softirq,
    steal of /proc/stat) on the CPUs this process may run on (``cpus``, default its
    affinity); None without /proc/stat. Another job busy on other cores of a shared node
    takes no time from the timing's own: counted from the all-CPU line, it flagged every
    timing there."""
    try:
        text = Path("/proc/stat").read_text() if text is None else text
        rows = [line.split() for line in text.splitlines() if line.startswith("cpu")]
        if cpus is None and hasattr(os, "sched_getaffinity"):
            cpus = set(os.sched_getaffinity(0))
        per = {int(r[0][3:]): r for r in rows if r[0] != "cpu"}
        chosen = [per[c] for c in sorted(cpus or ()) if c in per] or [
            r for r in rows if r[0] == "cpu"]
        if not chosen:
            return None
        ticks = [sum(int(r[k]) for r in chosen) for k in range(1, 9)]
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _snapshot() -> tuple[float, float, float]:
    """(wall clock, the machine's busy CPU seconds, this process's and its children's)."""
    import resource

    own = sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))
    return time.monotonic(), _machine_busy_seconds() or 0.0, own


def busy_reason(other_cores: float | None, timed: float, retimed: float) -> str | None:
    """Why this machine's step timing cannot be trusted, or None: other processes keeping
    more than OTHER_CORES_LIMIT of a core busy while timing (``OtherWork``), or the same
    step timed twice (before and after the pilot) disagreeing by more than 25 %."""
    reasons = []
    if other_cores is not None and other_cores > OTHER_CORES_LIMIT:
        reasons.append(f"other processes kept {other_cores:.2g} of the {usable_cores()} "
                       "cores busy while timing")
    ratio = retimed / timed if timed > 0 else math.nan
    if not 0.8 <= ratio <= 1.25:
        reasons.append(f"the step at B0 timed {timed * 1e3:.3g} ms, then {retimed * 1e3:.3g} "
                       "ms after the pilot")
    return "; ".join(reasons) or None
