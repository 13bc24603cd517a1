"""What ``advise`` is handed from Python, turned into what the trainer takes.

``advise(config)`` takes a TrainConfig (model and data by name). ``advise(model, data, ...)``
takes a user's objects: a module or a zero-argument factory, data in every form ``measure``
accepts (a batchbound Dataset, an (x, y) pair of tensors, a torch Dataset, a DataLoader;
dict batches for ``model(**batch)`` with a loss ``(outputs, batch)``, packed by
``batches.py``), a loss name or per-example callable ``(outputs, targets) -> (n,)``, and an
optimizer factory ``params -> Optimizer``. Data are read into memory once (the pilot draws
random batches).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from batchbound.advise.batches import DictModel, Packing, dict_loss, pack_batches
from batchbound.data import Dataset
from batchbound.data.dataset import BATCH, CLASSIFICATION, REGRESSION, TEXT, check_dataset
from batchbound.diversity.calls import Inputs
from batchbound.diversity.measure import data_chunks
from batchbound.diversity.stats import trainable_parameters
from batchbound.errors import BatchboundError
from batchbound.train.config import Target, TrainConfig
from batchbound.train.loop import Parts
from batchbound.train.optimizers import user_optimizer


def as_module(model: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    """A module, or what a zero-argument factory returns."""
    if isinstance(model, nn.Module):
        return model
    if callable(model):
        built = model()
        if isinstance(built, nn.Module):
            return built
        raise BatchboundError(f"the model factory returned a {type(built).__name__}, not a "
                              "torch.nn.Module")
    raise BatchboundError(f"model must be a TrainConfig, an nn.Module or a factory, got "
                          f"{type(model).__name__}")


def as_dataset(data: Any) -> tuple[Dataset, Packing | None]:
    """The training examples as a batchbound Dataset (no test split unless given one), and
    for dict batches (``model(**batch)``) how their tensors are packed into its rows."""
    if isinstance(data, Dataset):
        return data, None
    if data is None:
        raise BatchboundError("advise(model, data): give the training data")
    chunks, _, _ = data_chunks(data, 4096)
    first = next(chunks)
    if isinstance(first[0], Inputs):
        if first[0].args or not isinstance(first[1], Inputs):
            raise BatchboundError(
                "advise takes inputs of several tensors as dict batches, {'input_ids': ..., "
                "'labels': ...} for model(**batch) and loss(outputs, batch); give the "
                "targets inside the dict")
        packing, rows = pack_batches(itertools.chain([first], chunks))
        return check_dataset(Dataset("your data", BATCH, rows, rows, rows[:0], rows[:0], None,
                                     "dict batches handed to advise from Python")), packing
    xs, ys = zip(*[(x.detach().cpu(), y.detach().cpu())
                   for x, y in itertools.chain([first], chunks)], strict=True)
    x, y = torch.cat(xs), torch.cat(ys)
    if y.dtype == torch.int64 and y.dim() == 1:
        task, classes = CLASSIFICATION, int(y.max()) + 1
    elif y.dtype == torch.int64 and y.dim() == 2 and x.dtype == torch.int64:
        task, classes = TEXT, int(max(x.max(), y.max())) + 1
    elif y.is_floating_point():
        task, classes = REGRESSION, None
        y = y.reshape(len(y), -1)
    else:
        raise BatchboundError(f"targets of dtype {y.dtype} and shape {tuple(y.shape)}: need "
                              "int64 class labels (n,), int64 next tokens (n, context) or "
                              "float regression targets")
    empty_x, empty_y = x[:0], y[:0]
    return check_dataset(Dataset("your data", task, x, y, empty_x, empty_y, classes,
                                 "handed to advise from Python")), None


def from_objects(model: nn.Module | Callable[[], nn.Module], data: Any,
                 loss: str | Callable[..., torch.Tensor] | None,
                 optimizer: Callable[..., torch.optim.Optimizer] | None, *, batch_size: int,
                 lr: float | None, seed: int, device: str, targets: tuple[Target, ...] = (),
                 max_epochs: float | None = 100.0) -> tuple[TrainConfig, Dataset, Parts]:
    """(config, data, parts) for the trainer from a user's objects."""
    module = as_module(model)
    trainable_parameters(module)  # raises for a model with nothing to train
    dataset, packing = as_dataset(data)
    if packing is not None:  # dict batches: model(**batch), loss(outputs, batch)
        if not callable(loss):
            raise BatchboundError(
                "dict batches need the loss as a callable (outputs, batch) -> one loss per "
                "example, e.g. from outputs.logits and batch['labels']")
        module, loss = DictModel(module, packing), dict_loss(loss, packing)
    named = type(module.model if isinstance(module, DictModel) else module).__name__
    config = TrainConfig(dataset=dataset.name, model=f"{named} (your module)",
                         loss=loss if isinstance(loss, str) else None, batch_size=batch_size,
                         lr=pilot_lr(lr, optimizer), seed=seed, device=device, targets=targets,
                         max_epochs=max_epochs)
    parts = Parts(model=module, loss=loss if callable(loss) else None, optimizer=optimizer)
    return config, dataset, parts


DEFAULT_LR = 0.1


def pilot_lr(lr: float | None, optimizer: Callable[..., torch.optim.Optimizer] | None) -> float:
    """The pilot's η0, said once: ``lr`` when given, else the rate the optimizer factory sets
    (the trainer sets every group's rate from η0 and the strategy), else DEFAULT_LR; both
    given and different is refused rather than one silently winning."""
    if optimizer is None:
        return DEFAULT_LR if lr is None else lr
    # a throwaway parameter, to read its rate (and refuse a bad factory before any work)
    made = user_optimizer(optimizer, [nn.Parameter(torch.zeros(1))])
    own = made.param_groups[0].get("lr") if made.param_groups else None
    own = float(own) if isinstance(own, (int, float)) else None
    if lr is None:
        return DEFAULT_LR if own is None else own
    if own is not None and own != lr:
        raise BatchboundError(f"the optimizer sets lr {own:g} and lr={lr:g} was given: give "
                              "the rate once (lr=, or in the optimizer)")
    return lr
