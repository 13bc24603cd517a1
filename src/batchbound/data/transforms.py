"""Transforms of the training split that the studies use. Each is a deterministic function of
(dataset, seed), leaves the test split alone unless it says so, and appends its canonical spec
(seed included) to ``Dataset.transforms``, so applying a recorded spec reproduces the data.

- ``replicate(r)`` ([diversity], Sec. 6): keep a random 1/r fraction of the training set and
  repeat it r times, so n stays the same and the gradient diversity drops. Exactly so when r
  divides n; otherwise m = ⌈n/r⌉ examples are kept, their copies are concatenated and cut to
  n, and each kept example appears ⌊n/m⌋ or ⌈n/m⌉ (≤ r) times.
- ``replicate_full(r)``: every training example r times, n → r·n. The control for
  ``replicate``: S = Σ‖g_i‖² grows r-fold and ‖Σg_i‖² r²-fold, so Δ drops to Δ/r while the
  bound n·Δ is unchanged.
- ``subset(fraction)`` ([inefficiency], Sec. 4.3, the 100/50/25 % runs): a uniformly random
  round(fraction·n) training examples without replacement, kept in their original order.
- ``neighbour_pair()`` ([diversity], Sec. 6, stability): two training sets that differ in exactly
  one example. Training example i (uniform) is replaced in the second set by test example j
  (uniform), an independent draw from the same distribution that appears nowhere else in
  the training set; example j is dropped from both test sets so neither evaluates on
  training data. ``neighbour_pair(side=0)`` and ``side=1`` give the two sets one at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from batchbound.data.dataset import Dataset
from batchbound.errors import BatchboundError
from batchbound.spec import Spec, check_options, did_you_mean, parse_spec


def _record(dataset: Dataset, name: str, **options: object) -> tuple[str, ...]:
    return (*dataset.transforms, str(Spec(name, dict(options))))


def _take(dataset: Dataset, index: np.ndarray, record: tuple[str, ...]) -> Dataset:
    idx = torch.from_numpy(np.asarray(index, dtype=np.int64))
    return replace(
        dataset, x_train=dataset.x_train[idx], y_train=dataset.y_train[idx], transforms=record
    )


def replicate(dataset: Dataset, seed: int, r: int = 2) -> Dataset:
    n = dataset.n_train
    if not isinstance(r, int) or not 1 <= r <= n:
        raise BatchboundError(f"replicate: r must be an integer in [1, n={n}], got {r!r}")
    kept = np.random.default_rng(seed).choice(n, size=math.ceil(n / r), replace=False)
    return _take(dataset, np.tile(kept, r)[:n], _record(dataset, "replicate", r=r, seed=seed))


def replicate_full(dataset: Dataset, seed: int, r: int = 2) -> Dataset:
    if not isinstance(r, int) or r < 1:
        raise BatchboundError(f"replicate_full: r must be an integer >= 1, got {r!r}")
    index = np.tile(np.arange(dataset.n_train), r)
    return _take(dataset, index, _record(dataset, "replicate_full", r=r, seed=seed))


def subset(dataset: Dataset, seed: int, fraction: float = 0.5) -> Dataset:
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, (int, float))
        or not 0 < fraction <= 1
    ):
        raise BatchboundError(f"subset: fraction must be in (0, 1], got {fraction!r}")
    n = dataset.n_train
    size = max(1, round(fraction * n))
    index = np.sort(np.random.default_rng(seed).choice(n, size=size, replace=False))
    return _take(dataset, index, _record(dataset, "subset", fraction=fraction, seed=seed))


def neighbour_pair(dataset: Dataset, seed: int) -> tuple[Dataset, Dataset]:
    """The two neighbouring data sets; see the module docstring for which example changes."""
    if dataset.n_test < 2:
        raise BatchboundError(
            "neighbour_pair: needs at least 2 test examples to draw the "
            f"replacement from, {dataset.name} has {dataset.n_test}"
        )
    rng = np.random.default_rng(seed)
    i = int(rng.integers(dataset.n_train))
    j = int(rng.integers(dataset.n_test))
    keep_test = torch.from_numpy(np.delete(np.arange(dataset.n_test), j))
    base = replace(
        dataset,
        x_test=dataset.x_test[keep_test],
        y_test=dataset.y_test[keep_test],
        meta={**dataset.meta, "neighbour": {"train_index": i, "test_index": j}},
    )
    x_other, y_other = dataset.x_train.clone(), dataset.y_train.clone()
    x_other[i], y_other[i] = dataset.x_test[j], dataset.y_test[j]
    first = replace(base, transforms=_record(dataset, "neighbour_pair", side=0, seed=seed))
    second = replace(
        base,
        x_train=x_other,
        y_train=y_other,
        transforms=_record(dataset, "neighbour_pair", side=1, seed=seed),
    )
    return first, second


def _neighbour_side(dataset: Dataset, seed: int, side: int = 0) -> Dataset:
    if side not in (0, 1):
        raise BatchboundError(f"neighbour_pair: side must be 0 or 1, got {side!r}")
    return neighbour_pair(dataset, seed)[side]


TRANSFORMS: dict[str, Callable[..., Dataset]] = {
    "replicate": replicate,
    "replicate_full": replicate_full,
    "subset": subset,
    "neighbour_pair": _neighbour_side,
}

_OPTIONS = {
    "replicate": ["r"],
    "replicate_full": ["r"],
    "subset": ["fraction"],
    "neighbour_pair": ["side"],
}


def transform_names() -> list[str]:
    return sorted(TRANSFORMS)


def apply_transform(dataset: Dataset, spec: str, seed: int) -> Dataset:
    """Apply ``spec`` (e.g. ``"replicate(r=4)"``). A ``seed=`` inside the spec wins over
    ``seed``, so a spec copied from ``Dataset.transforms`` reproduces its data exactly."""
    parsed = parse_spec(spec)
    if parsed.name not in TRANSFORMS:
        known = ", ".join(f"{name}({','.join(_OPTIONS[name])})" for name in transform_names())
        raise BatchboundError(f"unknown transform {parsed.name!r}"
                              f"{did_you_mean([parsed.name], transform_names())}; known: {known}")
    options = dict(parsed.kwargs)
    seed = options.pop("seed", seed)
    check_options(f"transform {parsed.name!r}", [*options, "seed"],
                  [*_OPTIONS[parsed.name], "seed"])
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise BatchboundError(f"transform {parsed.name!r}: seed must be an integer, got {seed!r}")
    return TRANSFORMS[parsed.name](dataset, seed, **options)
