"""Data sets that need no files: bundled with a package, or generated."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from batchbound.data.dataset import CLASSIFICATION, REGRESSION, Dataset
from batchbound.data.registry import register_dataset
from batchbound.errors import BatchboundError


def split_indices(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A deterministic shuffled train/test split."""
    order = np.random.default_rng(seed).permutation(n)
    n_test = int(round(n * test_fraction))
    return order[n_test:], order[:n_test]


@register_dataset(
    "digits",
    source="scikit-learn bundled 8x8 handwritten digits (sklearn.datasets.load_digits)",
    embedded=True,
    description="1797 real 8x8 grey images, 10 classes; 80/20 deterministic split",
)
def load_digits(data_dir: Path, test_fraction: float = 0.2, split_seed: int = 0) -> Dataset:
    from sklearn.datasets import load_digits as sk_load

    bunch = sk_load()
    x = torch.tensor(bunch.data, dtype=torch.float32) / 16.0
    x = (x - x.mean()) / x.std()
    y = torch.tensor(bunch.target, dtype=torch.int64)
    train, test = split_indices(len(y), test_fraction, split_seed)
    return Dataset(
        name="digits",
        task=CLASSIFICATION,
        x_train=x[train],
        y_train=y[train],
        x_test=x[test],
        y_test=y[test],
        num_classes=10,
        source="sklearn.datasets.load_digits",
    )


@register_dataset(
    "synthetic-linear",
    source="generated: Gaussian inputs, labels from a random deep linear teacher (seed 000)",
    embedded=True,
    description="regression; options n, d, outputs, depth, width, noise, seed",
)
def load_synthetic_linear(
    data_dir: Path,
    n: int = 2000,
    d: int = 50,
    outputs: int = 10,
    depth: int = 3,
    width: int = 50,
    noise: float = 0.0,
    n_test: int | None = None,
    seed: int = 0,
) -> Dataset:
    """x ~ N(0, I_d); y = W_L ... W_1 x (+ noise) with teacher weights N(0, 1).

    Targets are divided by their overall standard deviation so the loss scale does not grow
    with the teacher's depth and width.
    """
    for key, value in {"n": n, "d": d, "outputs": outputs, "depth": depth, "width": width}.items():
        if int(value) < 1:
            raise BatchboundError(f"synthetic-linear: {key} must be >= 1, got {value}")
    n_test = n // 4 if n_test is None else n_test
    gen = torch.Generator().manual_seed(seed)
    dims = [d] + [width] * (depth - 1) + [outputs]
    teacher = [torch.randn(dims[i + 1], dims[i], generator=gen) for i in range(depth)]
    x = torch.randn(n + n_test, d, generator=gen)
    y = x
    for weight in teacher:
        y = y @ weight.T
    y = y / y.std()
    if noise > 0:
        y = y + noise * torch.randn(y.shape, generator=gen)
    return Dataset(
        name="synthetic-linear",
        task=REGRESSION,
        x_train=x[:n],
        y_train=y[:n],
        x_test=x[n:],
        y_test=y[n:],
        num_classes=None,
        source="generated (seed 000 deep linear teacher)",
        meta={"n": n, "d": d, "outputs": outputs, "depth": depth, "width": width,
              "noise": noise, "seed": seed},
    )
