"""A real full disk for the fault tests: a tmpfs of a few hundred KiB mounted on a fresh
folder, so that writes past it fail with ENOSPC as on a disk that filled up. Mounting needs
root (and a kernel that allows it, as containers usually do for root); elsewhere the tests
that need it are skipped, saying why."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_disk(kib: int) -> Iterator[Path]:
    """A folder on a file system of ``kib`` KiB, unmounted and removed afterwards."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a small file system needs root to mount a tmpfs")
    folder = Path(tempfile.mkdtemp(prefix="batchbound-small-disk-"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        folder.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
        folder.rmdir()


def fill(folder: Path, leave: int = 0) -> Path:
    """Take all the free space of ``folder``'s file system but ``leave`` bytes; returns the
    filler file (delete it to free the space again)."""
    filler = folder / "filler"
    for _ in range(200):  # a writer that filled it for a moment (its temporary file) lets go
        try:
            filler.touch()
            break
        except OSError:
            time.sleep(0.05)
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    with open(filler, "ab") as fh:
        try:
            fh.write(b"\0" * max(0, free - leave))
            fh.flush()
        except OSError:  # full already: nothing left to take
            pass
    return filler
