"""Processes that end with the process that started them, however it ends (SIGKILL included,
which no handler sees). Standard library only, so the reaper starts light.

``die_with_parent()`` is for our own workers (a study's pool, a run's local ranks): a thread
notices the parent is gone (this process was re-parented) within ``poll_seconds``, sends this
process SIGTERM, so a run in progress checkpoints and stops as it does when a user stops it,
and exits for certain ``grace_seconds`` later.

``reap_when_dead()`` is for processes we do not control, such as a local Ray instance's agents,
which outlive a driver killed with SIGKILL: it starts a small watcher process that records
this process's descendants while it lives and, once it has died, sends them SIGTERM and then
SIGKILL. Linux only (it reads /proc); elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PROC = Path("/proc")


def die_with_parent(grace_seconds: float = 5.0, poll_seconds: float = 0.5, *,
                    parent: int | None = None, remove: str | Path | None = None) -> None:
    """``parent``: the pid to outlive no longer than ``poll_seconds`` (default: the current
    parent; give it when the parent may have died before this process started). ``remove``:
    a folder that only the parent reads (this process's results for it), deleted once the
    parent is gone, before the SIGTERM: no one else would ever delete it."""
    parent = os.getppid() if parent is None else parent
    _no_parent_death_signal()

    def gone() -> None:
        if remove is not None:
            shutil.rmtree(remove, ignore_errors=True)
        os.kill(os.getpid(), signal.SIGTERM)

    if os.getppid() != parent:  # gone before this process started: nothing to do for it
        gone()  # here, not in the thread, which raced the work it was to stop (on a busy host)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        gone()
        time.sleep(grace_seconds)
        os._exit(1)

    threading.Thread(target=watch, name="batchbound-die-with-parent", daemon=True).start()


def _no_parent_death_signal() -> None:
    """Clear the signal a launcher library asked the kernel to send when our parent dies
    (torch's spawn sets SIGINT): the kernel sends it each time the parent *thread* that
    started us ends, and a dying multi-threaded parent sends several, the second one a
    KeyboardInterrupt in whatever this process was doing. The watcher above says it once."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG, none


def reap_when_dead() -> subprocess.Popen[bytes] | None:
    """Start the watcher for this process (see the module's docstring); None off Linux."""
    if not (PROC / "self" / "stat").exists():
        return None
    return subprocess.Popen([sys.executable, "-m", "batchbound.lifetime", str(os.getpid())],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a live process, None when it is gone or a zombie."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else (int(fields[1]), fields[19])


def _descendants(root: int) -> dict[int, str]:
    """pid -> start time of every live process below ``root``."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
            children.setdefault(stat[0], []).append((int(entry.name), stat[1]))
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            found[pid] = start
            todo.append(pid)
    return found


def _reap(parent: int, poll_seconds: float = 0.5, grace_seconds: float = 3.0) -> None:
    started = _stat(parent)
    known: dict[int, str] = {}
    while started is not None and (now := _stat(parent)) is not None and now[1] == started[1]:
        known.update(_descendants(parent))
        time.sleep(poll_seconds)
    known.pop(os.getpid(), None)

    def same(pid: int, start: str) -> bool:  # not a new process that reused the pid
        stat = _stat(pid)
        return stat is not None and stat[1] == start

    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = {pid: start for pid, start in known.items() if same(pid, start)}
        for pid in left:
            with contextlib.suppress(OSError):  # it ended meanwhile
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_seconds
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(
                same(pid, start) for pid, start in left.items()):
            time.sleep(0.1)


if __name__ == "__main__":
    _reap(int(sys.argv[1]))
