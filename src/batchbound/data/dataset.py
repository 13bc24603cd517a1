"""The in-memory data set every room works with: train and test tensors plus metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from batchbound.errors import BatchboundError

CLASSIFICATION = "classification"
REGRESSION = "regression"
TEXT = "text"  # next-token prediction: (n, context) token ids in, (n, context) next tokens out
# dict batches handed to advise from Python (advise/batches.py): each example's tensors
# packed side by side, the targets the same rows; the caller's loss reads them, no accuracy
BATCH = "batch"
TASKS = (CLASSIFICATION, REGRESSION, TEXT, BATCH)


@dataclass(frozen=True)
class Dataset:
    """Train/test tensors, already normalised.

    Classification labels are int64 of shape (n,); regression targets are float of shape
    (n, outputs); text inputs and targets are int64 token ids of shape (n, context), the
    targets the inputs shifted by one token, and ``num_classes`` the vocabulary size.
    ``transforms`` records, in order, every transform applied (for run configs).
    """

    name: str
    task: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int | None
    source: str
    transforms: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_train(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def n_test(self) -> int:
        return int(self.x_test.shape[0])

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def num_outputs(self) -> int:
        """Width of the model's output layer: classes, vocabulary, or regression targets."""
        if self.task in (CLASSIFICATION, TEXT):
            assert self.num_classes is not None
            return self.num_classes
        return int(self.y_train.shape[1]) if self.y_train.dim() > 1 else 1

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Dataset:
        """Move tensors to ``device``; ``dtype`` applies to float inputs and regression targets
        (token ids and class labels stay integers)."""

        def move(t: torch.Tensor, is_label: bool) -> torch.Tensor:
            floating = t.is_floating_point()
            if dtype is not None and floating and (not is_label or self.task in (REGRESSION,
                                                                                 BATCH)):
                t = t.to(dtype)
            return t.to(device)

        def pair(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            moved = move(x, False)  # targets that are the inputs (dict batches) move once
            return moved, moved if y is x and self.task == BATCH else move(y, True)

        x_train, y_train = pair(self.x_train, self.y_train)
        x_test, y_test = pair(self.x_test, self.y_test)
        return replace(self, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "n_train": self.n_train,
            "n_test": self.n_test,
            "input_shape": list(self.input_shape),
            "classes": self.num_classes,
            "task": self.task,
            "source": self.source,
            "transforms": list(self.transforms),
        }


def _finite(t: torch.Tensor) -> bool:
    """No NaN or inf in ``t``. A float64 sum is finite when every value is, so the usual case
    needs no bool copy of a large set; only a non-finite sum (or an overflow) is looked into."""
    if not t.is_floating_point() or math.isfinite(float(t.sum(dtype=torch.float64))):
        return True
    return bool(torch.isfinite(t).all())


def _label_problem(y: torch.Tensor, task: str, num_classes: int | None) -> str | None:
    """What is wrong with one split's labels or targets (their count is checked already)."""
    if task == BATCH:  # the inputs' own rows (checked with them)
        return None if y.dim() == 2 else f"targets must be packed rows (n, F), got {tuple(y.shape)}"
    if task == REGRESSION:
        if not y.is_floating_point() or y.dim() != 2 or y.shape[1] == 0:
            return f"targets must be float of shape (n, outputs), got {y.dtype} {tuple(y.shape)}"
        return None if _finite(y) else "the targets have NaN or infinite values"
    dims, shape = (1, "(n,)") if task == CLASSIFICATION else (2, "(n, context)")
    if y.dtype != torch.int64 or y.dim() != dims:
        return f"labels must be int64 of shape {shape}, got {y.dtype} {tuple(y.shape)}"
    if num_classes is None or num_classes < 1:
        return f"needs num_classes >= 1, got {num_classes}"
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        return f"labels run from {int(y.min())} to {int(y.max())}, outside 0..{num_classes - 1}"
    return None


def dataset_problem(dataset: Dataset) -> str | None:
    """The first thing that keeps the rooms after ``data`` from using ``dataset``, or None."""
    if dataset.task not in TASKS:
        return f"unknown task {dataset.task!r}"
    if dataset.n_train == 0:
        return "no training examples"
    if dataset.x_test.shape[1:] != dataset.x_train.shape[1:]:
        return (
            f"test inputs have shape {tuple(dataset.x_test.shape[1:])} per example, training "
            f"inputs {tuple(dataset.x_train.shape[1:])}"
        )
    splits = (("training", dataset.x_train, dataset.y_train),
              ("test", dataset.x_test, dataset.y_test))  # fmt: skip
    for split, x, y in splits:
        if x.dim() < 2 or math.prod(x.shape[1:]) == 0:
            return f"{split} inputs have shape {tuple(x.shape)}; need (n, features...)"
        if len(x) != len(y):
            return f"the {split} split has {len(x)} inputs but {len(y)} labels"
        if not _finite(x):
            bad = int((~torch.isfinite(x)).sum())
            return f"the {split} inputs have {bad} NaN or infinite values"
        label_problem = _label_problem(y, dataset.task, dataset.num_classes)
        if label_problem:
            return f"{split} split: {label_problem}"
    return None


def check_dataset(dataset: Dataset) -> Dataset:
    """``dataset``, or a ``BatchboundError`` naming the set, where it came from and what is
    wrong. ``load_dataset`` passes every loader's output through here, so a file that parses
    but holds unusable numbers (NaN, labels out of range, splits that disagree) is refused
    whatever its format."""
    problem = dataset_problem(dataset)
    if problem is not None:
        raise BatchboundError(f"data set {dataset.name!r} ({dataset.source}): {problem}")
    return dataset
