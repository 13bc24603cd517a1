"""Timings taken interleaved: one call of each pass in turn, round after round, so that load
from other processes on a shared machine hits every pass alike; and a run of k steps with
one of them watched, the amortised rows of host.py and gpu.py."""

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


EVERY = 10  # the amortised rows: watch on one step in EVERY, the rest plain


def one_in(k: int, watched: Callable[[], object],
           plain: Callable[[], object]) -> Callable[[], None]:
    """k steps as one run, the first watched (docs/diversity.md's pattern for a host-bound
    step): its time over k is the cost per step."""
    def run() -> None:
        watched()
        for _ in range(k - 1):
            plain()

    return run
