"""Checks of a run against its data, before any work: sizes, targets and loss that fit the
task, the model built on the meta device (no memory, no RNG drawn) for the task and the
machine's memory. ``TrainConfig.validate_against`` calls ``preflight``; the schema itself
(``config.py``) checks only what needs no data."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from batchbound.errors import BatchboundError

if TYPE_CHECKING:
    from batchbound.train.config import TrainConfig

TEXT_LOSS = "sequence_cross_entropy"


def preflight(config: TrainConfig, dataset: Any, model_given: bool = False) -> None:
    """Raise BatchboundError if ``config`` cannot run on ``dataset`` (a Dataset).
    ``model_given``: the caller trains a module of its own, not ``config.model``."""
    check_data(config, dataset)
    if model_given:
        return
    check_model(config, dataset)


def check_data(config: TrainConfig, dataset: Any) -> None:
    n = dataset.n_train
    if config.batch_size > n:
        raise BatchboundError(
            f"batch size {config.batch_size} is larger than the training set ({n} examples)"
        )
    # accuracy: of labels (classification) or of next tokens (text); regression has none
    if dataset.task not in ("classification", "text"):
        bad = [t.name for t in config.targets if t.metric.endswith("_acc")]
        if bad:
            raise BatchboundError(
                f"target {', '.join(bad)} needs accuracy, which a {dataset.task} task does "
                "not have; use train_loss or test_loss targets"
            )
    if config.loss is not None and (config.loss == TEXT_LOSS) != (dataset.task == "text"):
        raise BatchboundError(
            f"loss {config.loss!r} does not fit a {dataset.task} task; "
            + (f"text needs {TEXT_LOSS} (the default)" if dataset.task == "text"
               else f"{TEXT_LOSS} is for text data sets")
        )
    if dataset.n_test == 0 and any(t.metric.startswith("test_") for t in config.targets):
        raise BatchboundError(f"data set {dataset.name!r} has no test split for a test target")
    if config.eval_subset is not None and config.eval_subset > n:
        raise BatchboundError(f"eval_subset {config.eval_subset} exceeds the {n} train examples")
    policy = config.parsed_batch_policy()
    if policy.adaptive and policy.min > n:
        raise BatchboundError(f"adaptive batch min={policy.min} exceeds n={n}")
    if config.loss is not None:
        from batchbound.diversity.losses import resolve_loss

        resolve_loss(config.loss, dataset.task)


def check_model(config: TrainConfig, dataset: Any) -> None:
    """Token models (gpt, lstm) read text, the others float features: say so before a dtype
    error in the first layer; and refuse a model or a step that cannot fit in memory."""
    import torch

    from batchbound.models import build_model, check_fits, model_shape
    from batchbound.models.layers import check_task
    from batchbound.models.user import is_user_spec, load_factory, probe_user_model

    if is_user_spec(config.model):  # a user's factory may not build on the meta device:
        load_factory(config.model)  # it must import, build, and take one of the examples
        model = build_model(config.model, dataset.input_shape, dataset.num_outputs,
                            seed=config.seed)
        dtype = torch.float64 if config.dtype == "float64" else torch.float32
        example = dataset.x_train[:1]
        if example.is_floating_point():
            example = example.to(dtype)
        probe_user_model(config.model, model.to(dtype), example, dataset.num_outputs,
                         dataset.task)
        return
    with torch.device("meta"):
        model = build_model(config.model, dataset.input_shape, dataset.num_outputs)
    check_task(model_shape(model), dataset.task, dataset.name)
    width = 8 if config.dtype == "float64" else 4
    check_fits(config.model, model, width)
    check_activations(config, dataset, width)


def check_activations(config: TrainConfig, dataset: Any, bytes_per_value: int) -> None:
    """The largest layer output, for the most examples ever in memory at once (an
    evaluation chunk, a worker's step), is a lower bound on what the run needs: refuse a
    run that cannot fit now, not at its first evaluation."""
    from batchbound.models import describe_model
    from batchbound.models.registry import memory_bytes

    memory = memory_bytes()
    layers = describe_model(config.model, dataset.input_shape, dataset.num_outputs).layers
    largest = max((math.prod(row.output_shape) for row in layers), default=0)
    evaluated = max(dataset.n_test, config.eval_subset or dataset.n_train)
    chunk = min(config.eval_batch_size, evaluated)
    step = config.micro_batch or -(-config.batch_size // config.workers)
    need = largest * max(chunk, step) * bytes_per_value
    if memory is None or need <= memory:
        return
    what, lower = (("an evaluation chunk", "eval_batch_size") if chunk >= step
                   else ("a worker's step", "batch_size, or set micro_batch"))
    raise BatchboundError(
        f"model {config.model}: {what} of {max(chunk, step):,} examples holds a layer output "
        f"of {largest:,} values per example, {need / 1e9:,.1f} GB, more than this "
        f"machine's {memory / 1e9:.1f} GB of memory; lower {lower}"
    )
