"""The in-memory data set every room works with: train and test tensors plus metadata."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

CLASSIFICATION = "classification"
REGRESSION = "regression"
TEXT = "text"  # next-token prediction: (n, context) token ids in, (n, context) next tokens out
TASKS = (CLASSIFICATION, REGRESSION, TEXT)


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
            if dtype is not None and floating and (not is_label or self.task == REGRESSION):
                t = t.to(dtype)
            return t.to(device)

        return replace(
            self,
            x_train=move(self.x_train, False),
            y_train=move(self.y_train, True),
            x_test=move(self.x_test, False),
            y_test=move(self.y_test, True),
        )

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
