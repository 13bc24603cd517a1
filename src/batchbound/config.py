"""Canonical serialisation and hashing of configs.

A run is identified by the hash of its canonical config, so the same config always maps to
the same key in the results store, whatever the key order or the float spelling.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchbound.errors import BatchboundError

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


def load_toml(path: str | Path, what: str = "file") -> dict[str, Any]:
    """The tables of a TOML file; a missing, unreadable or malformed file raises
    BatchboundError naming ``what`` it is and the reason, never a raw OSError."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except IsADirectoryError:
        raise BatchboundError(f"{what} {path} is a directory, not a file") from None
    except FileNotFoundError:
        raise BatchboundError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise BatchboundError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise BatchboundError(f"{what} {path} is not valid TOML: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise BatchboundError(f"{what} {path} is not valid TOML: {exc}") from None
    except ValueError:  # open() refuses a path with a NUL byte
        raise BatchboundError(f"{what} path {str(path)!r} contains a NUL byte") from None


def dump_toml(data: dict[str, Any], path: str | Path) -> None:
    import tomli_w

    Path(path).write_text(tomli_w.dumps(to_plain(data)))


def check_types(obj: Any, fail: Callable[[str, str], Exception]) -> None:
    """Check every field of the dataclass ``obj`` against its annotation, so a value of the
    wrong type from a file (a string for a list, 2.5 for a count, NaN for a rate) is refused
    where it enters instead of failing later in arithmetic. ``fail(field, problem)`` makes
    the exception to raise."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not _fits(value, hints[f.name]):
            raise fail(f.name, f"expected {_expected(hints[f.name])}, got {value!r}")


def _fits(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) for v in value)
        return len(value) == len(args) and all(
            _fits(v, a) for v, a in zip(value, args, strict=True))
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:  # True is an int to Python, never a count to a user
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # ints are numbers too; inf and NaN are never a setting
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    return isinstance(value, hint)


_NAMES = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}


def _expected(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        text = " or ".join(_expected(a) for a in kept)
        return text + (" (or unset)" if len(kept) < len(args) else "")
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_plural(args[0])}"
        return f"a list of {len(args)}: " + ", ".join(_expected(a) for a in args)
    if origin is dict or hint is dict:
        return "a table"
    return _NAMES.get(hint, f"a {getattr(hint, '__name__', hint)}")


def _plural(hint: Any) -> str:
    plural = {bool: "booleans", int: "integers", float: "finite numbers", str: "strings"}
    return plural.get(hint, f"({_expected(hint)})")
