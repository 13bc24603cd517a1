"""``measure(memory_budget=...)``: the chunk comes from measure's own pass measured at its
peak, the numbers do not depend on it, and a budget that cannot hold the work is refused."""

from __future__ import annotations

import warnings

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
    kept = kept_bytes({"w": nn.Parameter(torch.zeros(100))})  # 1 200 bytes
    budget = 2_000_000
    room = TARGET * (budget - kept)
    # 100 bytes an example up to 63 examples, then 1 000: a line through 2 and 4 examples
    # would allow ~19 000
    run, bytes_at, calls = allocating([(0, 100), (64, 1000)], base=5000)
    chunk = chunk_for_budget(run, 4096, CPU, kept, budget, most=4096)
    assert bytes_at(chunk) <= room
    assert bytes_at(chunk) >= 0.9 * room  # and not far below it
    assert max(calls) <= 4096 and len(calls) <= 14  # a few passes, none beyond the data
    # no pass of the search itself went beyond twice the room: it grows at most 2x a fit
    assert max(bytes_at(k) for k in calls) <= 2 * room


def test_the_chunk_is_capped_by_chunk_size_and_the_data() -> None:
    run, _, _ = allocating([(0, 10)], base=0)
    assert chunk_for_budget(run, 4096, CPU, 120, 10**9, most=64) == 64
    assert chunk_for_budget(run, 50, CPU, 120, 10**9, most=256) == 50


def test_the_search_grows_no_pass_past_twice_a_fitting_one() -> None:
    """A pass's bytes per example that grow with its size (40 then 65 kB a example in a LoRA
    model under bfloat16): the line through 2 and 4 examples asked for a pass of 116 at 1.36x
    the budget; the search now doubles from its largest fit."""
    run, bytes_at, calls = allocating([(0, 40_000), (8, 65_000)], base=1_200_000)
    budget = 6_300_000
    chunk = chunk_for_budget(run, 1024, CPU, 0, budget, most=1024)
    assert bytes_at(chunk) <= TARGET * budget
    assert max(bytes_at(k) for k in calls) <= budget  # every pass of the search within


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


def test_a_budget_too_small_is_refused_in_readable_sizes() -> None:
    model, x, y = problem()
    with pytest.raises(BatchboundError, match=r"memory_budget 1000 B cannot hold measure\(\)'s "
                       r"work: 14.0 KiB"):
        measure(model, (x, y), "cross_entropy", memory_budget=1000)
    with pytest.raises(BatchboundError, match="positive number of bytes"):
        measure(model, (x, y), "cross_entropy", memory_budget=0)
    with pytest.raises(BatchboundError, match="positive number of bytes"):
        measure(model, (x, y), "cross_entropy", memory_budget=1.5e6)


def test_a_numpy_integer_budget_is_a_budget() -> None:
    np = pytest.importorskip("numpy")
    model, x, y = problem()
    report = measure(model, (x, y), "cross_entropy", memory_budget=np.int64(100_000))
    assert 1 < report.extra["chunk_size"] < 100


def test_a_float64_copy_and_a_loaders_batch_count_against_the_budget() -> None:
    """What the run holds outside its passes: measure's float64 copy of a float32 model (its
    frozen weights too), and the whole batch a DataLoader made while its chunks run."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 3))
    frozen = nn.Linear(1000, 1000).requires_grad_(False)  # 8 MB in float64
    wide = nn.Sequential(frozen, nn.Linear(1000, 3))
    x, y = torch.randn(100, 1000), torch.randint(0, 3, (100,))
    with pytest.raises(BatchboundError, match="the data or model copies"):
        measure(wide, (x, y), "cross_entropy", dtype=torch.float64, memory_budget=6_000_000)
    assert measure(wide, (x, y), "cross_entropy", memory_budget=6_000_000).n == 100
    xs, ys = torch.randn(4096, 10), torch.randint(0, 3, (4096,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys),
                                         batch_size=4096)
    budget = 300_000  # the loader's batch alone is 200 kB
    chunk = measure(model, loader, "cross_entropy", chunk_size=256,
                    memory_budget=budget).extra["chunk_size"]
    peak = peak_bytes(CPU, lambda: measure(model, loader, "cross_entropy", chunk_size=chunk))
    assert peak <= budget


def test_a_budget_inside_a_running_profiler_is_refused() -> None:
    model, x, y = problem()
    with torch.profiler.profile(), pytest.raises(BatchboundError, match="profiler is running"):
        measure(model, (x, y), "cross_entropy", memory_budget=200_000)


def test_a_later_chunk_of_longer_examples_is_warned_of() -> None:
    """The chunk is fitted on the first chunk; a later batch padded longer can take more
    memory: said once, and not for data of one length."""
    torch.manual_seed(0)

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(50, 16), nn.Linear(16, 3)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.embed(ids).mean(dim=1))

    def padded(lengths: list[int]) -> torch.utils.data.DataLoader:
        """Batches of 16, each padded to its longest (batch_size=None: as they are)."""
        ids = [torch.randint(0, 50, (n,)) for n in lengths]
        return torch.utils.data.DataLoader(
            [(torch.nn.utils.rnn.pad_sequence(ids[i : i + 16], batch_first=True),
              torch.zeros(len(ids[i : i + 16]), dtype=torch.long))
             for i in range(0, len(ids), 16)], batch_size=None)

    model = Tokens()
    with pytest.warns(UserWarning, match="a chunk holds longer examples") as seen:
        measure(model, padded([4] * 16 + [9] * 16 + [12] * 16), "cross_entropy",
                memory_budget=10**8)
    assert sum("longer examples" in str(w.message) for w in seen) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        measure(model, padded([6] * 48), "cross_entropy", memory_budget=10**8)
