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


def median_seconds(fn: Callable[[], Any], budget_s: float) -> float:
    """Median wall time of ``fn()`` after one warm-up call: at least 3 calls, more while
    under ``budget_s`` seconds in all (at most 200)."""
    fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < 3 or (spent < budget_s and len(times) < 200):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return statistics.median(times)
