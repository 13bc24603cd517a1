"""One run per output path: ``train`` holds every path it will write (its checkpoint,
``--output``, ``--tensorboard``) for as long as it runs, so that a second run given the same
path is refused at the start instead of replacing the first one's work.

The hold is an advisory ``flock`` on a hidden file beside the output in its real folder
(``.NAME.lock``; symlinks resolved, so two spellings of one path are one path), which the
kernel drops when the holder dies, however it dies. The file stays: removing it would let a
second run lock a new file while the first still holds the old one. A stream (``/dev/stdout``,
``/dev/null``, a FIFO) is not held: it is written in place (batchbound/files.py), no file a
second run could replace, and a lock beside it would be a file under /dev or /proc.
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from batchbound.errors import BatchboundError
from batchbound.files import names_a_stream


@contextmanager
def claim_outputs(paths: Iterable[str | Path | None]) -> Iterator[None]:
    """Hold every given path (None: skipped) until the block ends; refuse with a one-line
    BatchboundError when another live process holds one of them."""
    with ExitStack() as stack:
        for path in paths:
            if path is not None and not names_a_stream(path):
                stack.enter_context(_claim(Path(path)))
        yield


@contextmanager
def _claim(path: Path) -> Iterator[None]:
    real = path.expanduser().resolve()
    lock = real.parent / f".{real.name}.lock"
    try:
        real.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise BatchboundError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            raise BatchboundError(
                f"{path} is an output of another run that is still going ({holder}); give "
                "this run its own path, or wait for that one to end") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        os.close(fd)
