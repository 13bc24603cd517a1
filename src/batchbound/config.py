"""Canonical serialisation and hashing of configs.

A run is identified by the hash of its canonical config, so the same config always maps to
the same key in the results store, whatever the key order or the float spelling.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def to_plain(obj: Any) -> Any:
    """Turn dataclasses, tuples and paths into JSON-compatible dicts, lists and strings."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def canonical_json(obj: Any) -> str:
    """Key-sorted, whitespace-free JSON: equal configs give equal strings."""
    return json.dumps(to_plain(obj), sort_keys=True, separators=(",", ":"), allow_nan=False)


def config_hash(obj: Any, length: int = 16) -> str:
    """Hex SHA-256 prefix of the canonical JSON of ``obj``."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()[:length]


def load_toml(path: str | Path) -> dict[str, Any]:
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def dump_toml(data: dict[str, Any], path: str | Path) -> None:
    import tomli_w

    Path(path).write_text(tomli_w.dumps(to_plain(data)))
