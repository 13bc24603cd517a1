"""Hugging Face-style dict batches for advise: ``{"input_ids", "attention_mask", "labels"}``
with ``model(**batch)`` and a loss ``(outputs, batch) -> (n,)``.

The trainer keeps the training set as one tensor of inputs and one of targets, which it
indexes, shards, splits into micro-batches and moves to the device. A dict's tensors, one
row per example each, are packed side by side into one tensor (n, F) that the trainer
handles as any inputs; the model it trains is ``DictModel``, which unpacks its rows into
the dict and calls ``model(**batch)``, and the loss gets the unpacked dict. Tensors of one
dtype are packed as they are and unpacked as copies (never views of the stored rows,
which a loss writing into its batch would change). Tensors of several (an image model's
float ``pixel_values`` beside int64 ``labels``) are packed in float64, which every value
must survive bit for bit (refused at packing where one does not: an integer beyond 2^53);
the trainer casts float rows to its dtype, as it does any float inputs, so the integer
keys are cast back to their own dtype on unpacking, refused there where the rows' dtype
cannot hold every one of their values exactly (beyond 2^24 in float32). So every number is
the one ``model(**batch)`` gives on those examples.
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
    """Which columns of a packed row hold which key, in what shape and dtype per example."""

    def __init__(self, shapes: dict[str, tuple[int, ...]],
                 dtypes: dict[str, torch.dtype]) -> None:
        self.shapes, self.dtypes = shapes, dtypes
        self.sizes = [math.prod(shape) for shape in shapes.values()]
        self.storage = storage_dtype(dtypes)
        # each integer key's largest |value| when the storage is float: what the rows'
        # dtype must hold exactly to give them back
        self.limits = {key: 0 for key, dtype in dtypes.items()
                       if self.storage.is_floating_point and not dtype.is_floating_point}

    def unpack(self, rows: Tensor) -> dict[str, Tensor]:
        """The dict batch of packed ``rows`` (n, F): one tensor per key, each a copy of its
        own (a key packed in another dtype: cast back). Never a view of ``rows``: a loss or
        model that writes into ``batch["labels"]`` in place must not change the stored
        examples (the rows a micro-batch is cut from may be the training set's own); the
        copy costs one pass over the batch's inputs."""
        parts = rows.split(self.sizes, dim=1)
        batch = {key: part.reshape(len(rows), *shape)
                 for (key, shape), part in zip(self.shapes.items(), parts, strict=True)}
        for key, dtype in self.dtypes.items():
            if batch[key].dtype == dtype or (dtype.is_floating_point
                                              and rows.is_floating_point()):
                # float inputs in the run's dtype, as the trainer casts any
                batch[key] = batch[key].clone(memory_format=torch.contiguous_format)
                continue
            if key in self.limits and rows.is_floating_point():
                exact = round(2 / torch.finfo(rows.dtype).eps)  # 2^(mantissa bits + 1)
                if self.limits[key] > exact:
                    raise BatchboundError(
                        f"the batch dict's {key} ({dtype}) holds {self.limits[key]}, beyond "
                        f"the {exact} that {rows.dtype} keeps exactly, and it is packed beside "
                        f"float keys, which run in {rows.dtype}: keep its values within "
                        f"±{exact} (remap the ids), or give every key an integer dtype")
            batch[key] = batch[key].to(dtype)
        return batch

    def pack(self, batch: dict[str, Tensor]) -> Tensor:
        n = len(next(iter(batch.values())))
        columns = []
        for key in self.shapes:
            values = batch[key].reshape(n, -1)
            packed = values.to(self.storage)
            back = packed.to(values.dtype)
            same = back == values
            if values.is_floating_point():
                same |= back.isnan() & values.isnan()
            if not bool(same.all()):
                raise BatchboundError(
                    f"the batch dict's {key} ({values.dtype}) does not survive packing in "
                    f"{self.storage} beside the other keys bit for bit (an integer beyond "
                    "2^53): give every key one dtype")
            if key in self.limits and values.numel():  # from the float64 copy: exact
                self.limits[key] = max(self.limits[key], int(packed.abs().max()))
            columns.append(packed)
        return torch.cat(columns, dim=1)


def storage_dtype(dtypes: dict[str, torch.dtype]) -> torch.dtype:
    """The dtype the keys are packed in: their own when they share one; float64 when
    floats are among them (it holds float16, bfloat16 and float32 values exactly, and
    integers up to 2^53); else the integer dtype that holds them all."""
    kinds = set(dtypes.values())
    if any(dtype.is_complex for dtype in kinds):
        raise BatchboundError("the batch dict holds complex tensors: advise packs real ones")
    if len(kinds) == 1:
        return kinds.pop()
    if any(dtype.is_floating_point for dtype in kinds):
        return torch.float64
    storage = torch.bool
    for dtype in kinds:
        storage = torch.promote_types(storage, dtype)
    return storage


def pack_batches(chunks: Iterable[tuple[Inputs, Any]]) -> tuple[Packing, Tensor]:
    """The examples of every dict batch (``calls.dict_batch``'s ``Inputs``) packed into one
    tensor; refused in one line where they cannot be packed exactly."""
    packing, rows = None, []
    for inputs, _ in chunks:
        batch = {k: v.detach().cpu() for k, v in inputs.kwargs.items()}
        whole = [k for k, v in batch.items() if not isinstance(v, Tensor) or v.dim() == 0]
        if whole:
            raise BatchboundError(
                f"the batch dict's {', '.join(whole)} hold one value for the whole batch, "
                "not one per example: advise keeps the examples, not the batches")
        shapes = {k: tuple(v.shape[1:]) for k, v in batch.items()}
        dtypes = {k: v.dtype for k, v in batch.items()}
        if packing is None:
            packing = Packing(shapes, dtypes)
        elif set(shapes) != set(packing.shapes):
            raise BatchboundError(
                f"the batches' keys differ ({', '.join(packing.shapes)} in one, "
                f"{', '.join(shapes)} in another): give every batch the same keys")
        elif shapes != packing.shapes:
            differ = next(k for k in shapes if shapes[k] != packing.shapes[k])
            raise BatchboundError(
                f"the batches are padded to different lengths ({differ} "
                f"{packing.shapes[differ]} per example in one, {shapes[differ]} in another): "
                "advise keeps the examples in one tensor of one width; pad every batch to "
                "one length (a tokenizer's padding='max_length' with max_length=..., or "
                "DataCollatorWithPadding(tokenizer, padding='max_length', max_length=...))")
        elif dtypes != packing.dtypes:
            differ = next(k for k in dtypes if dtypes[k] != packing.dtypes[k])
            raise BatchboundError(
                f"the batch dict's {differ} changes dtype from one batch to the next "
                f"({packing.dtypes[differ]}, then {dtypes[differ]})")
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
