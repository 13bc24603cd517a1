"""Hugging Face-style dict batches for advise: ``{"input_ids", "attention_mask", "labels"}``
with ``model(**batch)`` and a loss ``(outputs, batch) -> (n,)``.

The trainer keeps the training set as one tensor of inputs and one of targets, which it
indexes, shards, splits into micro-batches and moves to the device. A dict's tensors, one
row per example each and one dtype, are packed side by side into one tensor (n, F) that
the trainer handles as any inputs; the model it trains is ``DictModel``, which unpacks its
rows into the dict and calls ``model(**batch)``, and the loss gets the unpacked dict. The
unpacked tensors are views of the rows the trainer picked, with their values unchanged, so
every number is the one ``model(**batch)`` gives on those examples.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from batchbound.diversity.calls import Inputs
from batchbound.errors import BatchboundError


class Packing:
    """Which columns of a packed row hold which key, in what shape per example."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes = shapes
        self.sizes = [math.prod(shape) for shape in shapes.values()]

    def unpack(self, rows: Tensor) -> dict[str, Tensor]:
        """The dict batch of packed ``rows`` (n, F): views, one per key."""
        parts = rows.split(self.sizes, dim=1)
        return {key: part.reshape(len(rows), *shape)
                for (key, shape), part in zip(self.shapes.items(), parts, strict=True)}

    def pack(self, batch: dict[str, Tensor]) -> Tensor:
        n = len(next(iter(batch.values())))
        return torch.cat([batch[key].reshape(n, -1) for key in self.shapes], dim=1)


def pack_batches(chunks: Iterable[tuple[Inputs, Any]]) -> tuple[Packing, Tensor]:
    """The examples of every dict batch (``calls.dict_batch``'s ``Inputs``) packed into one
    tensor; refused in one line where they cannot be packed exactly."""
    packing, rows, dtype = None, [], None
    for inputs, _ in chunks:
        batch = {k: v.detach().cpu() for k, v in inputs.kwargs.items()}
        whole = [k for k, v in batch.items() if not isinstance(v, Tensor) or v.dim() == 0]
        if whole:
            raise BatchboundError(
                f"the batch dict's {', '.join(whole)} hold one value for the whole batch, "
                "not one per example: advise keeps the examples, not the batches")
        shapes = {k: tuple(v.shape[1:]) for k, v in batch.items()}
        if packing is None:
            packing = Packing(shapes)
            dtypes = {v.dtype for v in batch.values()}
            if len(dtypes) > 1:
                kinds = ", ".join(f"{k} {v.dtype}" for k, v in batch.items())
                raise BatchboundError(
                    f"the batch dict's tensors have different dtypes ({kinds}): advise keeps "
                    "the examples in one tensor; give them one dtype")
            dtype = dtypes.pop()
        elif shapes != packing.shapes:
            differ = next(k for k in {*shapes, *packing.shapes}
                          if shapes.get(k) != packing.shapes.get(k))
            raise BatchboundError(
                f"the batches' {differ} differ per example ({packing.shapes.get(differ)} and "
                f"{shapes.get(differ)}): advise keeps the examples in one tensor; pad every "
                "batch to one length (a tokenizer's padding='max_length') and give every "
                "batch the same keys")
        elif {v.dtype for v in batch.values()} != {dtype}:
            raise BatchboundError("the batches' tensors change dtype from one batch to the next")
        rows.append(packing.pack(batch))
    if packing is None:
        raise BatchboundError("the data are empty: 0 examples")
    return packing, torch.cat(rows)


class DictModel(nn.Module):
    """``model(**batch)`` on packed rows: what the trainer trains (as a copy) for a user's
    model that takes dict batches."""

    def __init__(self, model: nn.Module, packing: Packing) -> None:
        super().__init__()
        self.model, self.packing = model, packing

    def forward(self, rows: Tensor) -> Any:
        return self.model(**self.packing.unpack(rows))


def dict_loss(loss: Callable[..., Tensor], packing: Packing) -> Callable[[Any, Tensor], Tensor]:
    """The user's ``loss(outputs, batch)`` on packed target rows."""
    def per_example(outputs: Any, rows: Tensor) -> Tensor:
        return loss(outputs, packing.unpack(rows))

    per_example.__name__ = getattr(loss, "__name__", "custom")
    return per_example
