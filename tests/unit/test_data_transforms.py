"""Transforms: n kept where documented, deterministic, recorded, reproducible from the record."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchbound.data import CLASSIFICATION, Dataset, apply_transform, neighbour_pair
from batchbound.errors import BatchboundError


def make(n: int = 23, n_test: int = 7) -> Dataset:
    """Row i of x_train is (i, i, i), so every training row says which example it is."""
    x = torch.arange(n + n_test, dtype=torch.float32)[:, None].repeat(1, 3)
    y = torch.arange(n + n_test) % 4
    return Dataset("toy", CLASSIFICATION, x[:n], y[:n], x[n:], y[n:], 4, "test")


def ids(ds: Dataset) -> list[int]:
    return ds.x_train[:, 0].long().tolist()


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 60), r=st.integers(1, 8), seed=st.integers(0, 99))
def test_replicate_keeps_n_and_repeats_a_random_1_over_r(n: int, r: int, seed: int) -> None:
    r = min(r, n)
    base = make(n)
    out = apply_transform(base, f"replicate(r={r})", seed)
    assert out.n_train == n and torch.equal(out.x_test, base.x_test)
    counts = Counter(ids(out))
    m = -(-n // r)  # ceil(n / r) distinct examples
    assert len(counts) == m
    assert set(counts.values()) <= {n // m, -(-n // m)} and sum(counts.values()) == n
    if n % r == 0:
        assert set(counts.values()) == {r}
    for i in counts:  # labels travel with their inputs
        assert out.y_train[ids(out).index(i)] == base.y_train[i]
    assert out.transforms == (f"replicate(r={r},seed={seed})",)
    assert torch.equal(apply_transform(base, f"replicate(r={r})", seed).x_train, out.x_train)


def test_replicate_depends_on_seed() -> None:
    base = make(100)
    a, b = (set(ids(apply_transform(base, "replicate(r=4)", s))) for s in (0, 1))
    assert a != b


def test_replicate_full_repeats_everything() -> None:
    base = make(10)
    out = apply_transform(base, "replicate_full(r=3)", 0)
    assert out.n_train == 30 and Counter(ids(out)) == {i: 3 for i in range(10)}
    assert out.transforms == ("replicate_full(r=3,seed=0)",)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 80), fraction=st.floats(0.01, 1.0), seed=st.integers(0, 99))
def test_subset_takes_a_random_fraction_without_replacement(n, fraction, seed) -> None:
    base = make(n)
    out = apply_transform(base, f"subset(fraction={fraction})", seed)
    assert out.n_train == max(1, round(fraction * n))
    chosen = ids(out)
    assert chosen == sorted(set(chosen))  # distinct, original order
    assert torch.equal(apply_transform(base, f"subset(fraction={fraction})", seed).x_train,
                       out.x_train)  # fmt: skip


def test_neighbour_pair_differs_in_exactly_one_example() -> None:
    base = make(50, 10)
    first, second = neighbour_pair(base, seed=3)
    assert first.n_train == second.n_train == 50
    differs = (first.x_train != second.x_train).any(dim=1)
    assert int(differs.sum()) == 1
    i = int(differs.nonzero())
    j = first.meta["neighbour"]["test_index"]
    assert first.meta["neighbour"]["train_index"] == i
    assert torch.equal(first.x_train, base.x_train)
    assert torch.equal(second.x_train[i], base.x_test[j]) and second.y_train[i] == base.y_test[j]
    # the replacement is held out of both test sets, which stay identical
    assert first.n_test == second.n_test == 9 and torch.equal(first.x_test, second.x_test)
    assert int(base.x_test[j, 0]) not in first.x_test[:, 0].long().tolist()
    # deterministic, and each side is reproducible from its recorded spec
    again = neighbour_pair(base, seed=3)
    assert torch.equal(again[1].x_train, second.x_train)
    assert second.transforms == ("neighbour_pair(side=1,seed=3)",)
    rebuilt = apply_transform(base, second.transforms[0], seed=999)
    assert torch.equal(rebuilt.x_train, second.x_train)


def test_transforms_chain_and_record_in_order() -> None:
    out = apply_transform(apply_transform(make(40), "subset(fraction=0.5)", 1), "replicate(r=2)", 2)
    assert out.transforms == ("subset(fraction=0.5,seed=1)", "replicate(r=2,seed=2)")
    assert out.n_train == 20


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("shuffle(p=1)", r"unknown transform 'shuffle'; known: neighbour_pair\(side\), "
         r"replicate\(r\), replicate_full\(r\), subset\(fraction\)"),
        ("replicate(k=2)", r"no option 'k'; options: r, seed"),
        ("replicate(r=0)", r"r must be an integer in \[1, n=23\]"),
        ("replicate(r=2.5)", r"r must be an integer"),
        ("subset(fraction=0)", r"fraction must be in \(0, 1\]"),
        ("subset(fraction=1.5)", r"fraction must be in \(0, 1\]"),
        ("neighbour_pair(side=2)", r"side must be 0 or 1"),
    ],
)  # fmt: skip
def test_bad_transform_specs(spec: str, match: str) -> None:
    with pytest.raises(BatchboundError, match=match):
        apply_transform(make(), spec, 0)
