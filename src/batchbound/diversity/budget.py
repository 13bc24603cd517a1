"""How many examples a chunk of ``measure`` may hold for its work to fit a memory budget.

A chunk's work is measured, not estimated: ``measure``'s own pass (moving the chunk to the
device, the forward, the backward, the layer rules' per-example forms, the exact fallback
where one runs, and whatever the device's kernels allocate inside, such as a bfloat16
convolution's float32 copies in its backward) is run on the data's first examples, and the
bytes the device allocates above its start are read at their peak (``peak_bytes``). A pass's
peak is not a line through small chunks: kernels and the rules change method with the size
(a bfloat16 MLP's passes take 6 KB an example at 4–8 examples and 14 KB at 1 024), so the
chunk is searched for on measured peaks:

    room = TARGET · (budget − kept),    c = b + (room − peak(b)) / slope,

``kept`` being what ``measure`` holds beside the chunks for the whole run (each parameter's
running sum in its norm dtype and the float64 totals, ``kept_bytes``; a ``dtype`` copy of the
model and a loader's batch, counted by the caller) and the slope the secant through the two
measured sizes nearest the room (first 2 and 4 examples). Each candidate c is measured
itself, up to ``ROUNDS`` times, and is at most twice the largest size that fitted, so that no
pass of the search runs far past the room where bytes per example grow with the size; the
answer is the largest size whose measured peak fitted the room. So the chunk returned has
fitted the budget on the data's first examples; a later chunk that holds more (longer padded
sequences) can take more, which ``measure`` warns of.
"""

from __future__ import annotations

import numbers
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from batchbound.diversity.stats import norm_dtype
from batchbound.errors import BatchboundError

PROBE_EXAMPLES = 2  # the first line: passes on this many examples and twice as many
ROUNDS = 10  # candidate chunks measured at most (each at most twice the largest fit)
CLOSE = 0.9  # a measured peak this close to the room ends the search
# The room is this much of the budget: a pass's peak varies a little between chunks of one
# size (the order of allocations and releases, a kernel's scratch space).
TARGET = 0.95


def check_budget(budget: object) -> int:
    """``memory_budget`` as an int (a numpy integer too), refusing anything but a positive
    whole number of bytes."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget <= 0:
        raise BatchboundError(f"memory_budget must be a positive number of bytes, got {budget!r}")
    return int(budget)


def size(nbytes: float) -> str:
    """Bytes as a person reads them: 512 B, 37.5 KiB, 1.2 MiB, 3.0 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def kept_bytes(params: dict[str, nn.Parameter]) -> int:
    """What ``measure`` keeps for the whole run, outside any chunk's pass: a running sum per
    parameter in its norm dtype, and the float64 totals they are added into."""
    return sum(p.numel() * (norm_dtype(p.dtype).itemsize + 8) for p in params.values())


def peak_bytes(device: torch.device, run: Callable[[], object]) -> int:
    """The most bytes ``device`` holds allocated above its start while ``run()`` runs: CUDA's
    caching allocator's peak (its peak statistics are reset for it), on CPU the allocation
    events of ``torch.profiler``, in order."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return max(torch.cuda.max_memory_allocated(device) - start, 0)
    if device.type != "cpu":
        raise BatchboundError(
            f"memory_budget is measured on CPU and CUDA devices, not on {device.type}; "
            "give chunk_size instead")
    if torch.autograd._profiler_enabled():
        raise BatchboundError(
            "memory_budget measures measure()'s allocations with torch.profiler on CPU, and a "
            "profiler is running already; call measure outside it, or give chunk_size instead")
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _stderr_silenced():
        prof.start()
    try:
        run()
    finally:
        with _stderr_silenced():
            prof.stop()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()  # negative for a release
        peak = max(peak, live)
    return peak


@contextmanager
def _stderr_silenced() -> Iterator[None]:
    """The process's stderr (file descriptor 2) sent to /dev/null: some torch builds log a
    line there from C++ each time a profiler starts and stops, which says nothing to a user
    of ``measure``."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def chunk_for_budget(run: Callable[[int], object], examples: int, device: torch.device,
                     kept: int, budget: int, most: int) -> int:
    """The largest chunk (at most ``most`` and ``examples``) whose measured peak fitted
    ``budget`` bytes beside the ``kept`` bytes measure holds for the whole run, from
    ``run(k)``, measure's pass on the first k of ``examples`` examples (module docstring).
    Refuses a budget that ``kept`` alone exceeds, or that cannot hold one example's pass."""
    budget = check_budget(budget)
    room = TARGET * (budget - kept)
    if room <= 0:
        raise BatchboundError(
            f"memory_budget {size(budget)} cannot hold measure()'s work: {size(kept)} for "
            "the gradient sums, the float64 totals and the data or model copies it holds "
            "alone; raise the budget")
    cap = min(most, examples)
    peaks: dict[int, int] = {}

    def quiet(k: int) -> None:  # a warning of the model's shows in the real run, once
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run(k)

    def measure_at(k: int) -> None:
        peaks[k] = peak_bytes(device, lambda: quiet(k))

    k = min(PROBE_EXAMPLES, max(cap // 2, 1))
    quiet(k)  # the first pass checks the model (kept for the rest), unmeasured
    measure_at(k)
    if 2 * k <= cap:
        measure_at(2 * k)
    for _ in range(ROUNDS):
        lower = max((c for c, p in peaks.items() if p <= room), default=0)  # fits
        upper = min((c for c, p in peaks.items() if p > room), default=cap + 1)  # does not
        if lower == cap or (lower and peaks[lower] >= CLOSE * room) or upper - lower < 2:
            break
        a, b = _secant(sorted(peaks), lower, upper)
        slope = max((peaks[b] - peaks.get(a, 0)) / (b - a), 1.0)
        candidate = int(b + (room - peaks[b]) / slope)
        if lower:  # at most double the largest fit: a pass's bytes per example can grow
            candidate = min(candidate, 2 * lower)  # with its size, past what a line foresees
        measure_at(min(max(candidate, lower + 1), upper - 1))
    best = max((c for c, p in peaks.items() if p <= room), default=0)
    if best == 0:
        if 1 not in peaks:
            measure_at(1)
        if peaks[1] > room:
            raise BatchboundError(
                f"memory_budget {size(budget)} cannot hold measure()'s work: {size(kept)} "
                f"held for the whole run and {size(peaks[1])} for a chunk of one example; "
                "raise the budget")
        best = 1
    return best


def _secant(sizes: list[int], lower: int, upper: int) -> tuple[int, int]:
    """The two measured sizes the next candidate is read off (``a`` may be 0, the origin):
    the largest fit and the smallest miss where both are known, else the two largest fits
    (growing), else the two smallest misses (shrinking)."""
    if lower and upper in sizes:
        return lower, upper
    if lower:
        below = [c for c in sizes if c <= lower]
        return (below[-2] if len(below) > 1 else 0), lower
    return 0, sizes[0]  # every size measured missed: scale the smallest down
