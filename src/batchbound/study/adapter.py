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

from batchbound.errors import BatchboundError
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


# per worker process, with the fingerprint of its files: a study reuses a few data sets
_DATA_CACHE: dict[str, tuple[Any, str | None]] = {}


def execute(fields: dict[str, Any], checkpoint_dir: Path, resume: bool) -> dict[str, Any]:
    """Run one config with batchbound.train.run and return ``RunResult.to_dict()``."""
    from batchbound.data import load_dataset
    from batchbound.data.identity import fingerprint, recording

    # run, not train: a run whose loss is not finite at its initial weights is recorded as
    # diverged, as every diverged run (train would refuse it as bad input)
    from batchbound.train import TrainConfig, run

    config = TrainConfig.from_dict(dict(fields))
    cached = _DATA_CACHE.get(config.dataset)
    if cached is None or (config.data_files is not None and cached[1] != config.data_files):
        with recording() as read:  # loaded again when its files changed since it was cached
            dataset = load_dataset(config.dataset, config.data_dir)
        _DATA_CACHE[config.dataset] = (dataset, fingerprint(read))
    dataset, files = _DATA_CACHE[config.dataset]
    if config.data_files is not None and files != config.data_files:
        # the files changed after the study was planned: this run's key names other data
        raise BatchboundError(
            f"the files of {config.dataset} changed after the study was planned (fingerprint "
            f"{files}, planned {config.data_files}); `study run` again plans it on the new "
            "data")
    path = Path(checkpoint_dir) / "checkpoint.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    result = run(config, dataset=dataset, checkpoint_path=path,
                 resume=resume and path.exists(), progress=False)
    return result.to_dict()


def resolve_trainer(name: str) -> Callable[[dict[str, Any], Path, bool], dict[str, Any]]:
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


def check_trainer(name: str) -> None:
    """Refuse a trainer that cannot be imported or called, before the first run: a typo in
    ``--trainer`` would otherwise fail every run, each with the error in the store only."""
    module, colon, attr = name.partition(":")
    if not colon or not module or not attr:
        raise BatchboundError(f"trainer {name!r}: give it as module:function, e.g. "
                              f"{DEFAULT_TRAINER}")
    try:
        found = getattr(importlib.import_module(module), attr)
    except SystemExit as exc:  # an import that exits would end the runner silently
        raise BatchboundError(f"trainer {name!r}: importing {module} called sys.exit"
                              f"({exc.code!r})") from None
    except AttributeError:
        raise BatchboundError(f"trainer {name!r}: module {module} has no {attr!r}") from None
    except Exception as exc:  # ModuleNotFoundError, or the module's own error on import
        raise BatchboundError(f"trainer {name!r}: cannot import {module}: "
                              f"{type(exc).__name__}: {exc}") from None
    if not callable(found):
        raise BatchboundError(f"trainer {name!r}: {attr} is not callable")
