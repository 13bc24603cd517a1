"""Files written whole or not at all: results, checkpoints, reports, figures, exports.

The bytes go to a hidden temporary file of their own beside the target
(``.NAME.HOST.PID.HEX.tmp``; a name near the 255-byte limit is cut and hashed), are synced,
and only then take the target's name (``os.replace``, or ``os.link`` for a name no file may
have yet). A write that fails (a full disk, a file-size limit) removes its temporary file; a
kill leaves at most that hidden file, which the next write of the same target on the same
host removes once its writer is dead. A pid means nothing on another host, so on a folder
several hosts share (NFS, a cluster's home) another host's temporary file, maybe a live
writer's, is never removed here. Either way the target is the previous file, whole, or the
new one, whole: never a truncated JSON, checkpoint or page that looks like a result.

A target that is no file to replace, a device (``/dev/null``), a FIFO, or a name of an open
descriptor (``/dev/stdout``, ``/dev/fd/N``), is written in place, as ``open`` would: replacing
it would make a device a regular file (as root), or put the result where a log was.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import re
import secrets
import socket
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

_TEMP = re.compile(r"(\d+)\.[0-9a-f]{8}(\.\w+)?")
# names of a process's open descriptors: whatever is behind them is the process's stream
_DESCRIPTOR = re.compile(r"/dev/(stdout|stderr|fd/\d+)|/proc/(self|thread-self|\d+)/fd/\d+")
_OWN = {"/dev/stdout": 1, "/dev/stderr": 2}
_PID_LIMIT = 2**22  # Linux's largest pid_max: a larger number names no writer of ours


def _stream(path: str | Path) -> Path | None:
    """``path`` (user-expanded) when it names no file to replace whole: an existing device,
    FIFO or socket, or an open descriptor's name; else None."""
    given = Path(path).expanduser()
    if _DESCRIPTOR.fullmatch(os.path.abspath(given)):
        return given
    try:
        mode = os.stat(given).st_mode
    except OSError:  # not there (yet): a file, made whole
        return None
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else given


def names_a_stream(path: str | Path) -> bool:
    """Whether ``path`` is written in place: a device, FIFO, socket or descriptor's name."""
    return _stream(path) is not None


def _write_in_place(stream: Path, data: str | bytes | memoryview) -> Path:
    """Write ``data`` to a device or FIFO, or through this process's own descriptor where
    the name is one of them (``/dev/stdout > run.log``: at the log's own offset, after what
    the process wrote there, truncating nothing)."""
    data = memoryview(data.encode("utf-8") if isinstance(data, str) else data).cast("B")
    name = os.path.abspath(stream)
    fd = _OWN.get(name)
    own = re.fullmatch(rf"/dev/fd/(\d+)|/proc/(?:self|thread-self|{os.getpid()})/fd/(\d+)",
                       name)
    if own:
        fd = int(own[1] or own[2])
    if fd is None:
        with open(stream, "wb") as fh:
            fh.write(data)
        return stream
    for pending in (sys.stdout, sys.stderr):  # what this process printed comes first
        with contextlib.suppress(Exception):
            pending.flush()
    while data:
        data = data[os.write(fd, data):]
    return stream


def _keep_mode(real: Path, tmp: Path) -> None:
    """The replaced file's permission bits on its replacement (a private 0600 file stays
    private, as a write in place kept it); a new name keeps the umask's."""
    with contextlib.suppress(FileNotFoundError):
        os.chmod(tmp, stat.S_IMODE(os.stat(real).st_mode))


def host_tag(host: str | None = None) -> str:
    """This host's part of a temporary file's name (``host``'s, given one): its name made fit
    for a file name, without dots, and 6 hex digits of a hash of the whole name, so that two
    names made alike (``a.b``, ``a_b``) stay apart."""
    host = socket.gethostname() if host is None else host
    safe = re.sub(r"[^A-Za-z0-9-]", "-", host)[:24] or "host"
    return f"{safe}-{hashlib.sha256(host.encode()).hexdigest()[:6]}"


_NAME_MAX = 255  # bytes in a file name (Linux, macOS)
_ROOM = 40  # for PID.HEX and a suffix of up to 16 bytes after a temporary file's stem


def _temp_stem(target: Path) -> str:
    """``.NAME.HOST.``, the start of ``target``'s temporary files' names. A name too long to
    carry the rest within a file name's 255 bytes (the host's part made it 32 bytes longer:
    a 225-byte name failed with "File name too long") is cut, and a hash of it added."""
    stem = f".{target.name}.{host_tag()}."
    if len(os.fsencode(stem)) <= _NAME_MAX - _ROOM:
        return stem
    name = os.fsencode(target.name)
    cut = name[:150].decode(errors="ignore")  # whole characters only
    return f".{cut}~{hashlib.sha256(name).hexdigest()[:8]}.{host_tag()}."


def _temp_name(target: Path, suffix: str = ".tmp") -> Path:
    suffix = suffix if len(os.fsencode(suffix)) <= 16 else ".tmp"  # a figure keeps its type
    return target.parent / f"{_temp_stem(target)}{os.getpid()}.{secrets.token_hex(4)}{suffix}"


def _synced_temp(folder: Path, name: str, data: str | bytes | memoryview) -> Path:
    tmp = _temp_name(folder / name)
    try:
        with open(tmp, "xb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        _keep_mode(folder / name, tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return tmp


def write_whole(path: str | Path, data: str | bytes | memoryview) -> Path:
    """Replace ``path`` (through a symlink: its target) by ``data`` (text as UTF-8)
    atomically; raises the OSError of a write that failed, with ``path`` as it was. A device,
    FIFO or descriptor's name is written in place (the module's docstring)."""
    stream = _stream(path)
    if stream is not None:
        return _write_in_place(stream, data)
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
    and no temporary file left. A device, FIFO or descriptor's name gets the written bytes in
    place (the module's docstring)."""
    stream = _stream(path)
    if stream is not None:  # drawn into a file of its own, then its bytes written there
        with tempfile.TemporaryDirectory(prefix="batchbound-") as folder:
            drawn = Path(folder) / f"drawn{stream.suffix or default_suffix}"
            write(drawn)
            return _write_in_place(stream, drawn.read_bytes())
    real = Path(path).expanduser().resolve()
    tmp = _temp_name(real, real.suffix or default_suffix)
    try:
        write(tmp)
        _keep_mode(real, tmp)
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
    """Remove the temporary files of writers of ``path`` on this host that died mid-write (a
    SIGKILL between the open and the replace leaves one, a checkpoint's size, at every kill);
    a live writer's, named by its pid, is left alone, and so is every other host's (its pid
    names no process here) and a name without a host (written before names carried one)."""
    prefix = _temp_stem(path)
    for tmp in path.parent.glob(f"{glob.escape(prefix)}*"):
        ours = _TEMP.fullmatch(tmp.name[len(prefix):])  # PID.HEX and a suffix: nobody else's
        if ours and int(ours[1]) < _PID_LIMIT and not _alive(int(ours[1])):
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
