"""The one place the study knows the trainer's contract (``batchbound.train``).

``train_fields`` turns a cell of the study grid into ``TrainConfig`` fields, ``config_key``
hashes them the way the trainer does, and ``execute`` runs one config in a worker process and
returns ``RunResult.to_dict()``. A different trainer (or a fake one in tests) plugs in by
naming a callable ``module:function`` with the signature of ``execute``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchbound.train.config import TrainConfig

if TYPE_CHECKING:
    from batchbound.study.spec import DataSpec, StudySpec

DEFAULT_TRAINER = "batchbound.study.adapter:execute"


def train_fields(spec: StudySpec, data: DataSpec, model: str, batch_size: int, lr: float,
                 strategy: str, seed: int, mechanism: str, epochs: float,
                 with_targets: bool) -> dict[str, Any]:
    """TrainConfig fields for one run: the cell's own, then what the spec gives every run
    (``TrainSpec.run_fields``; tuning runs, without targets, skip Δ measurements), then the
    spec's other TrainConfig fields, only those it sets."""
    train = spec.train
    return {
        "dataset": data.dataset,
        "transform": data.transform,
        "model": model,
        "batch_size": int(batch_size),
        "lr": float(lr),
        "strategy": strategy,
        "seed": int(seed),
        "max_epochs": float(epochs),
        "mechanism": mechanism,
        "checkpoint_every": None if train.checkpoint_every_epochs is None else max(
            1, round(train.checkpoint_every_epochs * data_n(data) / batch_size)),
        **train.run_fields(with_targets),
        **train.overrides,
    }


def data_n(data: DataSpec) -> int:
    """Training-set size (cached: planning asks once per run)."""
    if data.label not in _N_CACHE:
        _N_CACHE[data.label] = int(load_data(data).n_train)
    return _N_CACHE[data.label]


_N_CACHE: dict[str, int] = {}


def config_key(fields: dict[str, Any]) -> str:
    """The run's key in the store: the trainer's own config hash (one rule: its
    ``NOT_HASHED`` and ``HASHED_WHEN_SET``), so a study's run and the same run trained
    alone share a key, and a field added to the trainer at its default changes none."""
    return TrainConfig.from_dict(dict(fields)).config_hash()


def load_data(data: DataSpec) -> Any:
    """The data set as planning sees it: sizes after the transform. The trainer applies the
    transform itself with each run's seed; sizes do not depend on the seed."""
    from batchbound.data import apply_transform, load_dataset

    dataset = load_dataset(data.dataset)
    if data.transform:
        dataset = apply_transform(dataset, data.transform, 0)
    return dataset


_DATA_CACHE: dict[str, Any] = {}  # per worker process: a study reuses a few data sets


def execute(fields: dict[str, Any], checkpoint_dir: Path, resume: bool) -> dict[str, Any]:
    """Run one config with batchbound.train and return ``RunResult.to_dict()``."""
    from batchbound.data import load_dataset
    from batchbound.train import TrainConfig, train

    config = TrainConfig.from_dict(dict(fields))
    if config.dataset not in _DATA_CACHE:
        _DATA_CACHE[config.dataset] = load_dataset(config.dataset, config.data_dir)
    path = Path(checkpoint_dir) / "checkpoint.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    result = train(config, dataset=_DATA_CACHE[config.dataset], checkpoint_path=path,
                   resume=resume and path.exists(), progress=False)
    return result.to_dict()


def resolve_trainer(name: str) -> Callable[[dict[str, Any], Path, bool], dict[str, Any]]:
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)
