"""Per-iteration time split into data, compute, communication and step.

Phases are timed with ``time.perf_counter``; on CUDA each boundary synchronises the device
first, otherwise asynchronous kernels would be charged to whichever phase waits for them.
Totals are kept, not per-iteration lists, so timing costs O(1) memory.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

PHASES = ("data", "compute", "communication", "step", "monitor")


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self.sync = device.type == "cuda"
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.iterations = 0
        self.samples = 0
        self.bytes_communicated = 0
        self._last = 0.0

    def start(self) -> None:
        if self.sync:
            torch.cuda.synchronize()
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap (or start) to ``phase``."""
        if self.sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.totals[phase] += now - self._last
        self._last = now

    def end_iteration(self, samples: int, communicated_bytes: int) -> None:
        self.iterations += 1
        self.samples += samples
        self.bytes_communicated += communicated_bytes

    def state_dict(self) -> dict[str, Any]:
        return {
            "totals": dict(self.totals),
            "iterations": self.iterations,
            "samples": self.samples,
            "bytes": self.bytes_communicated,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.totals = dict(state["totals"])
        self.iterations = int(state["iterations"])
        self.samples = int(state["samples"])
        self.bytes_communicated = int(state["bytes"])

    def summary(self, world_size: int) -> dict[str, Any]:
        """Totals and per-iteration means (seconds); bytes are the all-reduce payload per rank.

        A ring all-reduce moves about 2(P−1)/P times the payload through each rank's link.
        """
        its = max(self.iterations, 1)
        busy = sum(self.totals.values())
        out: dict[str, Any] = {"iterations": self.iterations, "samples": self.samples}
        for phase in PHASES:
            out[f"{phase}_seconds"] = self.totals[phase]
            out[f"{phase}_per_iteration"] = self.totals[phase] / its
        out["bytes_per_iteration"] = self.bytes_communicated / its
        out["ring_bytes_per_iteration"] = (
            2 * (world_size - 1) / world_size * self.bytes_communicated / its
        )
        out["samples_per_second"] = self.samples / busy if busy > 0 else 0.0
        return out


# Interleaved timing: each round times every action once (a cell repeats it until CELL_S, so
# a 0.1 ms step is not one clock tick), in alternating order, and the answer is each action's
# median over rounds. A machine that slows down for a second slows one round of every action
# alike instead of all the rounds of one batch size, which sequential timing turned into a
# step at B = 1 slower than at B = 16.
CELL_S = 0.002
MIN_ROUNDS, MAX_ROUNDS = 5, 61
# every median within 10 % of the median of the rounds' first half: the share advise already
# widens its seconds' interval by for the timing
STABLE = 0.10


def interleaved_medians(actions: list[Callable[[], Any]], budget_s: float
                        ) -> tuple[list[float], bool]:
    """Median seconds of each action over interleaved rounds, and whether they settled:
    rounds go on (at least MIN_ROUNDS, at most MAX_ROUNDS, while under ``budget_s`` in all
    or MIN_ROUNDS are not done) until every median is within STABLE of the median of the
    first half of the rounds."""
    repeats = []
    for action in actions:  # a warm-up call each, which also sizes its cell
        start = time.perf_counter()
        action()
        repeats.append(max(1, min(1000, int(CELL_S / max(time.perf_counter() - start,
                                                            1e-7)))))
    rounds: list[list[float]] = [[] for _ in actions]
    spent, settled = 0.0, False
    while True:
        order = range(len(actions)) if len(rounds[0]) % 2 == 0 else reversed(range(len(actions)))
        for i in order:
            start = time.perf_counter()
            for _ in range(repeats[i]):
                actions[i]()
            cell = time.perf_counter() - start
            spent += cell
            rounds[i].append(cell / repeats[i])
        done = len(rounds[0])
        if done >= MIN_ROUNDS:
            settled = all(abs(statistics.median(r) - statistics.median(r[:(done + 1) // 2]))
                          <= STABLE * statistics.median(r) for r in rounds)
            if settled or done >= MAX_ROUNDS or spent >= budget_s:
                break
    return [statistics.median(r) for r in rounds], settled


def monotone(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): a
    step's time over its micro-batch sizes in increasing order cannot fall."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, c1), (m2, c2) = blocks.pop(-2), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]


INVERSION = 1.25  # a smaller micro-batch timed this much slower than a larger one: noise


def inverted(sizes: list[int], seconds: list[float]) -> str | None:
    """Why medians over increasing sizes cannot be a step's cost, or None: a smaller size
    timed over INVERSION times slower than a larger one."""
    for i, (m, t) in enumerate(zip(sizes, seconds, strict=True)):
        for m2, t2 in zip(sizes[i + 1:], seconds[i + 1:], strict=True):
            if t > INVERSION * t2:
                return (f"the step at micro-batch {m} timed {t * 1e3:.3g} ms, slower than at "
                        f"{m2} ({t2 * 1e3:.3g} ms)")
    return None
