"""Canonical serialisation and hashing of configs.

A run is identified by the hash of its canonical config, so the same config always maps to
the same key in the results store, whatever the key order or the float spelling.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import stat
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


# A config, a study spec or a cluster file is a few kilobytes of tables a person wrote.
MAX_FILE_BYTES = 1 << 20
MAX_NESTING = 32  # tables and arrays inside each other


def load_toml(path: str | Path, what: str = "file") -> dict[str, Any]:
    """The tables of a TOML file; a missing, unreadable, malformed, oversized or too deeply
    nested file, or one that is not a regular file (a FIFO, a device), raises BatchboundError
    naming ``what`` it is and the reason, never a raw OSError, a hang or a RecursionError."""
    text = read_small_file(path, what)
    try:
        data = tomllib.loads(text.decode())
    except UnicodeDecodeError:
        raise BatchboundError(f"{what} {path} is not valid TOML: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise BatchboundError(f"{what} {path} is not valid TOML: {exc}") from None
    except RecursionError:
        data = None
    if data is None or _nesting(data) > MAX_NESTING:
        raise BatchboundError(f"{what} {path} nests tables or arrays more than {MAX_NESTING} "
                              "deep")
    return data


def read_small_file(path: str | Path, what: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes. Opened without blocking and
    checked before reading, so a FIFO cannot hang the reader and /dev/zero cannot fill its
    memory."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise BatchboundError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise BatchboundError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except ValueError:  # a path with a NUL byte
        raise BatchboundError(f"{what} path {str(path)!r} contains a NUL byte") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise BatchboundError(f"{what} {path} is a directory, not a file")
        if not stat.S_ISREG(info.st_mode):
            raise BatchboundError(f"{what} {path} is not a regular file (a "
                                  f"{_file_kind(info.st_mode)}); give a file")
        data = b""
        if info.st_size <= limit:
            with os.fdopen(os.dup(fd), "rb") as fh:
                data = fh.read(limit + 1)
        if info.st_size > limit or len(data) > limit:
            raise BatchboundError(f"{what} {path} is larger than {limit // 1024} KiB "
                                  f"({max(info.st_size, len(data)):,} bytes); a {what} is a "
                                  "few kilobytes")
        return data
    except OSError as exc:
        raise BatchboundError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
             (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))
    return next((name for test, name in kinds if test(mode)), "special file")


def _nesting(value: Any) -> int:
    """How deep tables and arrays nest in parsed TOML (iteratively: no recursion limit)."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth + 1)
            if deepest > MAX_NESTING:
                break
            todo.extend((child, depth + 1) for child in item)
    return deepest


def check_types(obj: Any, fail: Callable[[str, str], Exception]) -> None:
    """Check every field of the dataclass ``obj`` against its annotation, so a value of the
    wrong type from a file (a string for a list, 2.5 for a count, NaN for a rate) is refused
    where it enters instead of failing later in arithmetic. ``fail(field, problem)`` makes
    the exception to raise."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not _fits(value, hints[f.name]):
            if _int(value) and not _int64(value):
                raise fail(f.name, f"{value} does not fit in a 64-bit integer (at most "
                           f"{INT64_MAX}), which the store and torch's generators use")
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
        return _int(value) and _int64(value)
    if hint is float:  # ints are numbers too; inf and NaN are never a setting
        return (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value))
    return isinstance(value, hint)


INT64_MAX = 2**63 - 1  # SQLite's integers, and torch's seeds


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int64(value: int) -> bool:
    return -INT64_MAX - 1 <= value <= INT64_MAX


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
