"""The registry of data sets, addressed by a spec string such as ``digits`` or
``synthetic-linear(n=2000,d=50)``.

Each entry is a loader ``(data_dir, **options) -> Dataset``, a note on where its data comes
from, and static facts (sizes, shape, classes, task) so ``batchbound data list`` can describe
a set without loading it. A file-backed entry also has ``missing(data_dir)``: ``None`` when its
files are there, else the reason they are not. Register one with ``@register_dataset(...)``.
"""

from __future__ import annotations

import inspect
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchbound.config import INT64_MAX
from batchbound.data.dataset import Dataset, check_dataset
from batchbound.errors import BatchboundError
from batchbound.spec import check_options, did_you_mean, parse_spec

Loader = Callable[..., Dataset]
MissingCheck = Callable[[Path], "str | None"]

DEFAULT_DATA_DIR = Path("~/.cache/batchbound/data").expanduser()


@dataclass(frozen=True)
class DatasetEntry:
    """A registered data set. Facts describe the default options and may be ``None``
    where they depend on the user's file (``libsvm``, ``npz``)."""

    name: str
    loader: Loader
    source: str
    embedded: bool
    description: str
    task: str | None = None
    n_train: int | None = None
    n_test: int | None = None
    input_shape: tuple[int, ...] | None = None
    classes: int | None = None
    check: MissingCheck | None = None

    def missing(self, data_dir: str | Path | None = None) -> str | None:
        """Why this set cannot be loaded from ``data_dir`` now, or ``None`` if it can."""
        if self.check is None:
            return None
        return self.check(resolve_data_dir(data_dir))

    def describe(self, data_dir: str | Path | None = None) -> dict[str, Any]:
        reason = self.missing(data_dir)
        return {
            "name": self.name,
            "n_train": self.n_train,
            "n_test": self.n_test,
            "input_shape": None if self.input_shape is None else list(self.input_shape),
            "classes": self.classes,
            "task": self.task,
            "source": self.source,
            "embedded": self.embedded,
            "available": reason is None,
            "reason": reason,
            "description": self.description,
        }


_REGISTRY: dict[str, DatasetEntry] = {}


def register_dataset(
    name: str,
    *,
    source: str,
    embedded: bool,
    description: str = "",
    task: str | None = None,
    n_train: int | None = None,
    n_test: int | None = None,
    input_shape: tuple[int, ...] | None = None,
    classes: int | None = None,
    check: MissingCheck | None = None,
) -> Callable[[Loader], Loader]:
    def decorate(loader: Loader) -> Loader:
        if name in _REGISTRY:
            raise ValueError(f"data set {name!r} registered twice")
        _REGISTRY[name] = DatasetEntry(
            name, loader, source, embedded, description,
            task, n_train, n_test, input_shape, classes, check,
        )  # fmt: skip
        return loader

    return decorate


def dataset_names() -> list[str]:
    return sorted(_REGISTRY)


def get_entry(name: str) -> DatasetEntry:
    if name not in _REGISTRY:
        raise BatchboundError(f"unknown data set {name!r}{did_you_mean([name], dataset_names())}"
                              f"; available: {', '.join(dataset_names())}")
    return _REGISTRY[name]


def resolve_data_dir(data_dir: str | Path | None) -> Path:
    """``--data-dir``, else ``$BATCHBOUND_DATA``, else ``~/.cache/batchbound/data``."""
    if data_dir is not None:
        return Path(data_dir).expanduser()
    env = os.environ.get("BATCHBOUND_DATA")
    return Path(env).expanduser() if env else DEFAULT_DATA_DIR


def load_dataset(spec: str, data_dir: str | Path | None = None) -> Dataset:
    """Load a data set by spec string, e.g. ``load_dataset("synthetic-linear(n=500,d=20)")``."""
    parsed = parse_spec(spec)
    entry = get_entry(parsed.name)
    accepted = options_of(entry)
    check_options(f"data set {parsed.name!r}", parsed.kwargs, accepted)
    hints = typing.get_type_hints(entry.loader)
    for key, value in parsed.kwargs.items():
        allowed = _scalar_types(hints.get(key))
        if allowed and not _fits(value, allowed):
            names = " or ".join(t.__name__ for t in allowed)
            raise BatchboundError(
                f"data set {parsed.name!r}: option {key} must be {names}, got {value!r}"
            )
        if isinstance(value, int) and not -INT64_MAX - 1 <= value <= INT64_MAX:
            # a seed or a size torch cannot hold (its "Overflow when unpacking long long")
            raise BatchboundError(
                f"data set {parsed.name!r}: option {key}={value} does not fit in a 64-bit "
                "integer"
            )
    # every set passes one check, whatever its loader: the rooms after data can rely on it
    return check_dataset(entry.loader(resolve_data_dir(data_dir), **parsed.kwargs))


def _scalar_types(hint: object) -> tuple[type, ...]:
    """The plain types a loader's annotation allows (``int | None`` -> (int,))."""
    members = typing.get_args(hint) if typing.get_args(hint) else (hint,)
    return tuple(t for t in members if t in (int, float, bool, str))


def _fits(value: object, allowed: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int) and float in allowed:
        return True
    return isinstance(value, tuple(t for t in allowed if t is not bool))


def options_of(entry: DatasetEntry) -> list[str]:
    """The option names a data set's spec accepts, in the loader's order."""
    params = list(inspect.signature(entry.loader).parameters.values())[1:]  # skip data_dir
    return [
        p.name
        for p in params
        if p.kind is inspect.Parameter.KEYWORD_ONLY
        or p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
