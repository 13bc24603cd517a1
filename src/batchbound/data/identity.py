"""What a data set was read from: the files its loader found, and their fingerprint.

Every user file reaches a loader through one of two functions of ``batchbound.data.files``
(``find_files`` for the published formats, ``resolve_user_file`` for ``npz``, ``libsvm``,
``text``), and both report it here; ``recording()`` collects them while a data set loads. The
fingerprint is a SHA-256 over each file's name, size and content hash, so a run's identity
(``TrainConfig.data_files``) changes exactly when its data does. Content hashes are cached per
process by (device, inode, size, mtime, ctime), so a data set is hashed once however often it loads.
Embedded data sets read no file and have no fingerprint: their runs keep their keys.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import numpy as np

_READ: ContextVar[list[Path] | None] = ContextVar("batchbound_files_read", default=None)
_DIGESTS: dict[tuple[int, int, int, int, int], str] = {}
_CHUNK = 1 << 20


def note_read(path: Path) -> None:
    """A loader is about to read ``path`` (a no-op when nothing is recording)."""
    read = _READ.get()
    if read is not None:
        read.append(Path(path).resolve())


@contextmanager
def recording() -> Iterator[list[Path]]:
    """The files noted while the block runs, in the order first noted."""
    read: list[Path] = []
    token = _READ.set(read)
    try:
        yield read
    finally:
        _READ.reset(token)


def content_hash(path: Path) -> str:
    """SHA-256 of the file's bytes, cached by the file's identity, size, mtime and ctime.
    The ctime too: a file rewritten in place to the same size with its mtime put back
    (``cp -p``, ``rsync -t``, ``touch -r``) keeps the other four, and no one can set a ctime."""
    info = os.stat(path)
    key = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def fingerprint(paths: Iterable[Path]) -> str | None:
    """One string naming the content of ``paths`` (None for none): the hash of every file's
    name, size and content hash, in sorted order."""
    unique = sorted(set(paths))
    if not unique:
        return None
    lines = [f"{p.name} {os.stat(p).st_size} {content_hash(p)}" for p in unique]
    return "sha256:" + hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def data_digest(dataset: Any) -> str:
    """SHA-256 of a data set's tensors as loaded (train and test, inputs and labels, with
    their dtypes and shapes): what a checkpoint records, so that a run resumed on other data
    (a file rewritten between the stop and the resume) is refused, whatever it came from."""
    digest = hashlib.sha256()
    for tensor in (dataset.x_train, dataset.y_train, dataset.x_test, dataset.y_test):
        array = np.ascontiguousarray(tensor.detach().cpu().numpy())
        digest.update(f"{array.dtype.str} {array.shape}\n".encode())
        if array.size:  # an empty split (test_fraction=0) has no bytes to view
            digest.update(memoryview(array).cast("B"))
    return "sha256:" + digest.hexdigest()[:32]
