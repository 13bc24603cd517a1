"""Files written whole or not at all: results, checkpoints, reports, figures, exports.

The bytes go to a hidden temporary file of their own beside the target (``.NAME.PID.HEX.tmp``),
are synced, and only then take the target's name (``os.replace``, or ``os.link`` for a name
no file may have yet). A write that fails (a full disk, a file-size limit) removes its
temporary file; a kill leaves at most that hidden file, which the next write of the same
target removes once its writer is dead. Either way the target is the previous file, whole,
or the new one, whole: never a truncated JSON, checkpoint or page that looks like a result.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path

_TEMP = re.compile(r"(\d+)\.[0-9a-f]{8}(\.\w+)?")


def _temp_name(target: Path, suffix: str = ".tmp") -> Path:
    return target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}{suffix}"


def _synced_temp(folder: Path, name: str, data: str | bytes | memoryview) -> Path:
    tmp = _temp_name(folder / name)
    try:
        with open(tmp, "xb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return tmp


def write_whole(path: str | Path, data: str | bytes | memoryview) -> Path:
    """Replace ``path`` (through a symlink: its target) by ``data`` (text as UTF-8)
    atomically; raises the OSError of a write that failed, with ``path`` as it was."""
    real = Path(path).expanduser().resolve()
    return _move_into_place(_synced_temp(real.parent, real.name, data), real)


def write_new(folder: str | Path, prefix: str, suffix: str, text: str | bytes) -> Path:
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
    tmp = _temp_name(real, real.suffix or default_suffix)
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return _move_into_place(tmp, real)


def _move_into_place(tmp: Path, real: Path) -> Path:
    try:
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    remove_stale_temps(real)
    return real


def remove_stale_temps(path: Path) -> None:
    """Remove the temporary files of writers of ``path`` that died mid-write (a SIGKILL
    between the open and the replace leaves one, a checkpoint's size, at every kill); a live
    writer's, named by its pid, is left alone."""
    prefix = f".{path.name}."
    for tmp in path.parent.glob(f"{glob.escape(prefix)}*"):
        ours = _TEMP.fullmatch(tmp.name[len(prefix):])  # PID.HEX and a suffix: nobody else's
        if ours and not _alive(int(ours[1])):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
