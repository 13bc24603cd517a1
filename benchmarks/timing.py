"""Timings taken interleaved: one call of each pass in turn, round after round, so that load
from other processes on a shared machine hits every pass alike."""

from __future__ import annotations

import time
from collections.abc import Callable


def interleaved(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each call of each run, ``repeats`` rounds of one call each in turn."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times
