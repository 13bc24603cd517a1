"""Atomic checkpoints and the RNG states a bit-identical resume needs.

A checkpoint is one ``torch.save`` file written to ``<path>.tmp`` and moved into place with
``os.replace``, so a crash mid-write leaves the previous checkpoint intact. It holds what
the trainer hands it (model, optimizer, sampler, generators, metrics so far) plus the
global RNG states of torch (CPU and CUDA), numpy and Python's ``random``.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchbound.errors import BatchboundError


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({**state, "rng": rng_state()}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise BatchboundError(f"no checkpoint to resume from at {path}")
    # weights_only=False: the file holds numpy/python RNG states; it is our own file.
    return torch.load(path, map_location="cpu", weights_only=False)


class StopFlag:
    """Set by SIGTERM/SIGINT; the loop checkpoints and ends with status ``stopped``.

    Handlers are installed only in the main thread and restored by ``close()``.
    """

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self._previous: dict[int, Any] = {}

    def install(self) -> StopFlag:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
