"""The registry of data sets, addressed by a spec string such as ``digits`` or
``synthetic-linear(n=2000,d=50)``.

Each entry is a loader ``(data_dir, **options) -> Dataset`` and a note on where its data
comes from. Register one with ``@register_dataset(...)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from batchbound.data.dataset import Dataset
from batchbound.errors import BatchboundError
from batchbound.spec import parse_spec

Loader = Callable[..., Dataset]

DEFAULT_DATA_DIR = Path("~/.cache/batchbound/data").expanduser()


@dataclass(frozen=True)
class DatasetEntry:
    name: str
    loader: Loader
    source: str
    embedded: bool
    description: str


_REGISTRY: dict[str, DatasetEntry] = {}


def register_dataset(
    name: str, *, source: str, embedded: bool, description: str = ""
) -> Callable[[Loader], Loader]:
    def decorate(loader: Loader) -> Loader:
        if name in _REGISTRY:
            raise ValueError(f"data set {name!r} registered twice")
        _REGISTRY[name] = DatasetEntry(name, loader, source, embedded, description)
        return loader

    return decorate


def dataset_names() -> list[str]:
    return sorted(_REGISTRY)


def get_entry(name: str) -> DatasetEntry:
    if name not in _REGISTRY:
        raise BatchboundError(
            f"unknown data set {name!r}; available: {', '.join(dataset_names())}"
        )
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
    try:
        return entry.loader(resolve_data_dir(data_dir), **parsed.kwargs)
    except TypeError as exc:
        if "unexpected keyword argument" in str(exc):
            raise BatchboundError(f"data set {parsed.name!r}: {exc}") from None
        raise
