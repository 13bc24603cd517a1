"""Atomic checkpoints and the RNG states a bit-identical resume needs.

A checkpoint is one ``torch.save`` file written to a temporary file beside it (a name of its
own per write, so two writers never share one) and moved into place with ``os.replace``, so
a crash or a full disk mid-write leaves the previous checkpoint intact. It holds what
the trainer hands it (model, optimizer, sampler, generators, metrics so far) plus the
global RNG states of torch (CPU and CUDA), numpy and Python's ``random``.

Only tensors and plain containers (dict, list, tuple, str, numbers, None) are stored, so a
checkpoint is read back with ``torch.load(weights_only=True)``: a file handed to ``--resume``
can build tensors and nothing else, never run code. ``storable`` turns numpy arrays into
tensors and numpy scalars into Python numbers on save; the two numpy values the trainer
needs back (numpy's RNG key, the weight snapshots) are turned back on load.
"""

from __future__ import annotations

import io
import random
import re
import signal
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchbound.errors import BatchboundError, FaultError
from batchbound.files import write_whole


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
    name, key, *rest = state["numpy"]  # the key was stored as a tensor
    np.random.set_state((name, np.asarray(key, dtype=np.uint32), *rest))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def storable(value: Any) -> Any:
    """``value`` with numpy arrays as tensors and numpy scalars as Python numbers, so that
    ``torch.load(weights_only=True)`` reads it back. A container with nothing to convert is
    returned as it is (a model's state dict keeps its type and version metadata)."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        items = {key: storable(item) for key, item in value.items()}
        unchanged = all(items[key] is item for key, item in value.items())
        return value if unchanged else items
    if isinstance(value, (list, tuple)):
        converted = [storable(item) for item in value]
        if all(new is old for new, old in zip(converted, value, strict=True)):
            return value
        return tuple(converted) if isinstance(value, tuple) else converted
    return value


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write ``state`` (plus the RNG states) to ``path`` atomically. The bytes are made in
    memory, then written to a temporary file of a name no other writer uses, synced and
    moved into place; a write that fails (a full disk) removes its temporary file, keeps the
    previous checkpoint and raises a one-line FaultError."""
    path = Path(path)
    buffer = io.BytesIO()
    torch.save(storable({**state, "rng": rng_state()}), buffer)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, buffer.getbuffer())
    except OSError as exc:
        kept = "the previous one is kept" if path.exists() else "there is no earlier one"
        raise FaultError(f"cannot write the checkpoint {path}: {exc.strerror or exc} "
                         f"({len(buffer.getbuffer()):,} bytes; {kept})") from None


def _why_unreadable(exc: Exception) -> str:
    """A one-line reason for a failed ``torch.load`` (torch's own messages run to many lines
    and suggest ``weights_only=False``): the global a crafted pickle asked for, else the
    weights-only unpickler's complaint, else the first line of the error."""
    text = str(exc)
    asked = re.search(r"GLOBAL ([\w.]+)", text)
    if asked:
        return f"it refers to {asked.group(1)}; a checkpoint holds only tensors and plain data"
    detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
    if detail:
        return f"it holds more than tensors and plain data: {detail.group(1)[:200]}"
    first = re.split(r"(?<=\.)\s", text.strip())[0][:200]  # its first sentence
    reason = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return f"unreadable, truncated or not written by torch.save: {reason}"


def overwrite_refusal(path: str | Path) -> BatchboundError:
    """A run asked to keep its checkpoint (``batchbound train``) that would start afresh over
    one: rerunning a killed run's command without --resume begins at iteration 0 and writes
    over what it had saved."""
    return BatchboundError(
        f"{path} already holds a checkpoint, which this run would write over from "
        "iteration 0: add --resume to continue it (same configuration), or remove it or give "
        "another --checkpoint to start afresh")


def load_checkpoint(path: str | Path, config_hash: str | None = None) -> dict[str, Any]:
    """The checkpoint at ``path``, read with ``weights_only=True`` (nothing in it can run).
    Refused with a ``BatchboundError`` when unreadable (truncated, garbage, a pickle of
    anything but tensors and plain data) and, given ``config_hash``, when it belongs to
    another configuration: checked here, before the caller applies anything from it."""
    path = Path(path)
    if not path.exists():
        raise BatchboundError(f"no checkpoint to resume from at {path}")
    try:
        with warnings.catch_warnings():  # torch warns about odd pickles; we refuse them anyway
            warnings.simplefilter("ignore")
            saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # every way a file fails to unpickle safely, the same answer
        raise BatchboundError(
            f"{path} is not a batchbound checkpoint ({_why_unreadable(exc)})"
        ) from None
    if not isinstance(saved, dict) or not isinstance(saved.get("config_hash"), str) or (
        not isinstance(saved.get("rng"), dict)
    ):
        raise BatchboundError(
            f"{path} is not a batchbound checkpoint (no config hash and RNG states in it)"
        )
    if config_hash is not None and saved["config_hash"] != config_hash:
        raise BatchboundError(
            f"checkpoint {path} is for config {saved['config_hash']}, not {config_hash}; "
            "resume with the same configuration"
        )
    return saved


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
        previous = self._previous.get(signum)
        if callable(previous) and getattr(previous, "chained", False):
            previous(signum, frame)  # a study's pool worker tells its runner (executor.py)

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
