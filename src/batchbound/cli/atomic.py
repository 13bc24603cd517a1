"""Files the commands write whole or not at all.

The text goes to a hidden temporary file of its own beside the target (``.NAME.PID.HEX.tmp``),
is synced, and only then takes the target's name (``os.replace``, or ``os.link`` for a name
no file may have yet). A write that fails (a full disk, a file-size limit) removes its
temporary file; a kill leaves at most that hidden file. Either way the target is the previous
file, whole, or the new one, whole: never a truncated JSON that looks like a result.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable
from pathlib import Path


def _synced_temp(folder: Path, name: str, text: str) -> Path:
    tmp = folder / f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "x", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return tmp


def write_whole(path: str | Path, text: str) -> Path:
    """Replace ``path`` (through a symlink: its target) by ``text`` atomically; raises the
    OSError of a write that failed, with ``path`` as it was."""
    real = Path(path).expanduser().resolve()
    tmp = _synced_temp(real.parent, real.name, text)
    try:
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return real


def write_new(folder: str | Path, prefix: str, suffix: str, text: str) -> Path:
    """Write ``text`` whole to a new file ``PREFIX<random>SUFFIX`` in ``folder`` (never
    replacing one) and return its path; raises the OSError of a write that failed, leaving
    nothing behind."""
    folder = Path(folder)
    tmp = _synced_temp(folder, prefix, text)
    try:
        while True:
            name = folder / f"{prefix}{secrets.token_hex(4)}{suffix}"
            try:
                os.link(tmp, name)  # fails, rather than replaces, when the name is taken
                return name
            except FileExistsError:
                continue
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_through(path: str | Path, write: Callable[[Path], object],
                  default_suffix: str = "") -> Path:
    """Have ``write(tmp)`` write a file (a figure: ``savefig`` picks the format by the
    suffix, which the temporary name keeps, ``default_suffix`` for a path without one), then
    move it onto ``path`` atomically; raises what the write raised, with ``path`` as it was
    and no temporary file left."""
    real = Path(path).expanduser().resolve()
    suffix = real.suffix or default_suffix
    tmp = real.parent / f".{real.name}.{os.getpid()}.{secrets.token_hex(4)}{suffix}"
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return real
