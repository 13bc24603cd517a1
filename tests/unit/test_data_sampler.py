"""BatchSampler: exact epochs, boundary crossing, uniform replacement, bit-identical resume."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchbound.data.sampler import BatchSampler
from batchbound.errors import BatchboundError


def reference_stream(n: int, seed: int, total: int) -> torch.Tensor:
    """The obviously correct stream: concatenated permutations, one per epoch."""
    gen = torch.Generator().manual_seed(seed)
    epochs = -(-total // n)
    return torch.cat([torch.randperm(n, generator=gen) for _ in range(epochs)])[:total]


def test_each_epoch_covers_every_index_once() -> None:
    n = 37
    sampler = BatchSampler(n, seed=3)
    drawn = torch.cat([sampler.next_indices(5) for _ in range(3 * n // 5 + 1)])
    for epoch in range(3):
        chunk = drawn[epoch * n : (epoch + 1) * n]
        assert torch.equal(torch.sort(chunk).values, torch.arange(n))
    assert sampler.epoch == pytest.approx(len(drawn) / n)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 50),
    seed=st.integers(0, 1000),
    sizes=st.lists(st.integers(1, 120), min_size=1, max_size=12),
)
def test_variable_batches_match_concatenated_permutations(n: int, seed: int, sizes) -> None:
    sampler = BatchSampler(n, seed=seed)
    batches = [sampler.next_indices(b) for b in sizes]
    assert [len(b) for b in batches] == sizes
    assert torch.equal(torch.cat(batches), reference_stream(n, seed, sum(sizes)))
    assert sampler.samples_seen == sum(sizes)
    assert sampler.epoch == sum(sizes) / n


def test_batch_crossing_the_boundary_finishes_the_epoch_first() -> None:
    n = 10
    sampler = BatchSampler(n, seed=0)
    first = sampler.next_indices(7)
    crossing = sampler.next_indices(6)
    epoch0 = torch.cat([first, crossing[:3]])
    assert torch.equal(torch.sort(epoch0).values, torch.arange(n))
    assert len(set(crossing[3:].tolist())) == 3


def test_deterministic_given_seed_and_seeds_differ() -> None:
    a = [BatchSampler(100, seed=1).next_indices(30) for _ in range(2)]
    assert torch.equal(a[0], a[1])
    assert not torch.equal(a[0], BatchSampler(100, seed=2).next_indices(30))


def test_replacement_is_uniform() -> None:
    n, draws = 20, 200_000
    sampler = BatchSampler(n, seed=0, replacement=True)
    counts = torch.bincount(
        torch.cat([sampler.next_indices(1000) for _ in range(draws // 1000)]), minlength=n
    ).double()
    expected = draws / n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 50.0  # chi-square with 19 dof: P(> 50) ~ 1e-4
    # i.i.d. draws repeat within a batch, which a permutation never does
    assert len(set(BatchSampler(n, 0, replacement=True).next_indices(n).tolist())) < n


@pytest.mark.parametrize("replacement", [False, True])
def test_state_dict_resume_is_bit_identical(replacement: bool) -> None:
    sizes = [7, 13, 3, 30, 1, 22, 9]
    straight = BatchSampler(23, seed=5, replacement=replacement)
    expected = [straight.next_indices(b) for b in sizes]

    first = BatchSampler(23, seed=5, replacement=replacement)
    got = [first.next_indices(b) for b in sizes[:3]]
    state = first.state_dict()
    first.next_indices(11)  # advancing the original must not disturb the saved state
    resumed = BatchSampler(23, seed=999, replacement=replacement)
    resumed.load_state_dict(state)
    got += [resumed.next_indices(b) for b in sizes[3:]]
    for want, have in zip(expected, got, strict=True):
        assert torch.equal(want, have)
    assert resumed.samples_seen == straight.samples_seen


def test_bad_arguments() -> None:
    with pytest.raises(BatchboundError, match="n must be"):
        BatchSampler(0, seed=0)
    with pytest.raises(BatchboundError, match="batch_size"):
        BatchSampler(5, seed=0).next_indices(0)
    with pytest.raises(BatchboundError, match="state is for n=5"):
        BatchSampler(6, seed=0).load_state_dict(BatchSampler(5, seed=0).state_dict())
