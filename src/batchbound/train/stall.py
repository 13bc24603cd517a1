"""Stalls: a rank that stops answering ends the run with one line that names it.

Every collective of a run waits at most the stall timeout (the process group's timeout:
``--stall-timeout``, default ``DEFAULT_STALL_TIMEOUT``). A rank that is stopped (SIGSTOP, a
debugger), swapped out, hung or gone makes its peers' collective time out, or fail at once
when its connection closes. Each live rank then answers a roll call in the group's
rendezvous store, which the launcher or torchrun's agent hosts, not a rank: it writes its
name and waits a few seconds for the others. The ranks that never answer are named in a
FaultError, with the checkpoint to resume from; the launcher or the agent ends the rest.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from batchbound.errors import FaultError

DEFAULT_STALL_TIMEOUT = 180.0  # seconds: longer than any step, eval or checkpoint here

# What gloo (and the TCP transports) say when a peer does not answer or has gone.
_SYMPTOMS = ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer",
             "Broken pipe", "pair closure", "Socket closed")


class _RollCall:
    """The store a roll call is taken in; set by ``init_group``, cleared by ``teardown``."""

    store: dist.Store | None = None
    timeout = DEFAULT_STALL_TIMEOUT


def keep_store(store: dist.Store, timeout: float) -> None:
    """Remember this process group's rendezvous store (keys of this attempt only: torchrun's
    agent keeps its store across restarts)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    _RollCall.store = dist.PrefixStore(f"batchbound/roll-call/{attempt}", store)
    _RollCall.timeout = timeout


def forget_store() -> None:
    _RollCall.store = None


def resume_hint(checkpoint: str | Path | None) -> str:
    """What a run that ended by a fault can resume from."""
    if checkpoint is None:
        return "no --checkpoint was given, so a rerun starts over"
    if not Path(checkpoint).exists():
        return f"no checkpoint was written to {checkpoint} yet, so a rerun starts over"
    return f"the checkpoint {checkpoint} is intact: rerun with --resume to continue from it"


def collective_fault(exc: BaseException, rank: int, world_size: int, iteration: int,
                     checkpoint: str | Path | None) -> FaultError | None:
    """A one-line FaultError naming the silent ranks when ``exc`` is a collective that timed
    out or lost a peer; None for any other error."""
    text = str(exc)
    if not isinstance(exc, RuntimeError) or not any(s in text for s in _SYMPTOMS):
        return None
    timeout = _RollCall.timeout
    try:
        silent = _roll_call(rank, world_size, iteration)
    except Exception:  # the store's host is the silent one (a whole node)
        return FaultError(f"a collective at iteration {iteration + 1} got no answer for "
                          f"{timeout:g} s and the rendezvous store is unreachable: the node "
                          f"that hosts it is stopped or gone; {resume_hint(checkpoint)}")
    if not silent:
        return FaultError(f"every rank answered, but a collective at iteration "
                          f"{iteration + 1} waited more than --stall-timeout {timeout:g} s: a "
                          f"step is slower than that, so raise it; {resume_hint(checkpoint)}")
    names = ", ".join(str(r) for r in silent)
    return FaultError(
        f"rank{'s' if len(silent) > 1 else ''} {names} of {world_size} stopped answering at "
        f"iteration {iteration + 1} (no reply within --stall-timeout {timeout:g} s, or its "
        f"connection closed: stopped, swapped out, hung or gone); {resume_hint(checkpoint)}")


def _roll_call(rank: int, world_size: int, iteration: int) -> list[int]:
    """The ranks that do not write their name within a few seconds of this one."""
    store = _RollCall.store
    if store is None:
        raise RuntimeError("no rendezvous store")
    grace = max(2.0, min(10.0, _RollCall.timeout / 10))
    store.set_timeout(timedelta(seconds=grace))
    store.set(f"alive/{rank}", str(iteration))
    missing = [r for r in range(world_size) if r != rank]
    deadline = time.monotonic() + grace
    while missing and time.monotonic() < deadline:
        time.sleep(0.1)
        missing = [r for r in missing if not store.check([f"alive/{r}"])]
    return missing
