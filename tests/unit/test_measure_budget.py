"""``measure(memory_budget=...)``: the chunk comes from measure's own pass measured at its
peak, the numbers do not depend on it, and a budget that cannot hold the work is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchbound.diversity import measure
from batchbound.diversity.budget import TARGET, chunk_for_budget, kept_bytes, peak_bytes
from batchbound.errors import BatchboundError

CPU = torch.device("cpu")


def problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 3)).double()
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(100, 10, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (100,), generator=g)


def test_peak_bytes_reads_the_most_held_at_once_not_the_total() -> None:
    def run() -> None:
        a = torch.empty(1000, dtype=torch.uint8)
        b = torch.empty(3000, dtype=torch.uint8)
        del a, b
        c = torch.empty(2000, dtype=torch.uint8)  # after both were released: not on top
        del c

    assert peak_bytes(CPU, run) == 4000


def allocating(per_example: list[tuple[int, int]], base: int):
    """A pass holding ``base`` bytes and, per example, the bytes of the first
    (examples_from, bytes) step at or below the chunk's size: a method that changes with
    the size, as kernels and the rules' forms do."""
    calls: list[int] = []

    def bytes_at(k: int) -> int:
        rate = next(b for start, b in reversed(per_example) if k >= start)
        return base + k * rate

    def run(k: int) -> None:
        calls.append(k)
        held = torch.empty(bytes_at(k), dtype=torch.uint8)
        del held

    return run, bytes_at, calls


def test_the_chunk_fits_where_small_chunks_would_mislead() -> None:
    params = {"w": nn.Parameter(torch.zeros(100))}  # 1 200 bytes kept
    budget = 2_000_000
    room = TARGET * (budget - kept_bytes(params))
    # 100 bytes an example up to 63 examples, then 1 000: a line through 4 and 8 examples
    # would allow ~19 000
    run, bytes_at, calls = allocating([(0, 100), (64, 1000)], base=5000)
    chunk = chunk_for_budget(run, 4096, CPU, params, budget, most=4096)
    assert bytes_at(chunk) <= room
    assert bytes_at(chunk) >= 0.9 * room  # and not far below it
    assert max(calls) <= 4096 and len(calls) <= 8  # a few passes, none beyond the data


def test_the_chunk_is_capped_by_chunk_size_and_the_data() -> None:
    params = {"w": nn.Parameter(torch.zeros(10))}
    run, _, _ = allocating([(0, 10)], base=0)
    assert chunk_for_budget(run, 4096, CPU, params, 10**9, most=64) == 64
    assert chunk_for_budget(run, 50, CPU, params, 10**9, most=256) == 50


def test_budget_sets_the_chunk_and_not_the_numbers() -> None:
    model, x, y = problem()
    whole = measure(model, (x, y), "cross_entropy", chunk_size=100)
    budget = 100_000  # the whole data at once takes ~170 kB
    small = measure(model, (x, y), "cross_entropy", memory_budget=budget)
    chunk = small.extra["chunk_size"]
    assert 1 < chunk < 100 and whole.extra["chunk_size"] == 100
    for ours, theirs in ((small.S, whole.S), (small.T, whole.T)):
        assert ours == pytest.approx(theirs, rel=1e-12)
    # the whole run at that chunk within the budget, measured the same way
    assert peak_bytes(CPU, lambda: measure(model, (x, y), "cross_entropy",
                                           chunk_size=chunk)) <= budget


def test_a_budget_too_small_is_refused() -> None:
    model, x, y = problem()
    with pytest.raises(BatchboundError, match="cannot hold measure"):
        measure(model, (x, y), "cross_entropy", memory_budget=1000)
    with pytest.raises(BatchboundError, match="positive number of bytes"):
        measure(model, (x, y), "cross_entropy", memory_budget=0)


def test_a_budget_inside_a_running_profiler_is_refused() -> None:
    model, x, y = problem()
    with torch.profiler.profile(), pytest.raises(BatchboundError, match="profiler is running"):
        measure(model, (x, y), "cross_entropy", memory_budget=200_000)
