"""Host synchronisations counted on the CPU (tests/unit/test_host_syncs.py), and the small
model those tests and tests/integration/test_gpu.py step: an embedding, two residual blocks
with LayerNorm, a head."""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

import batchbound

_OURS = os.path.dirname(os.path.abspath(batchbound.__file__)) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero")
_FUNCTIONS = ("nonzero", "unique")


def _caller_is_ours(cadence: tuple[str, ...]) -> str | None:
    """The batchbound function that called into torch (frames inside torch skipped), or None
    when the caller is someone else's (the trainer's own loss logging, the test) or the read
    happens inside one of batchbound's ``cadence`` functions (the logging reads)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(_OURS):
        return None
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"
    while frame is not None:
        if frame.f_code.co_name in cadence and frame.f_code.co_filename.startswith(_OURS):
            return None
        frame = frame.f_back
    return where


@contextmanager
def host_syncs(cadence: tuple[str, ...] = ()) -> Iterator[Counter]:
    """Counts batchbound's host reads of tensor values, by call site, while active, except
    those inside the functions named in ``cadence``."""
    found: Counter = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in _METHODS}
    saved_fn = {name: getattr(torch, name) for name in _FUNCTIONS}

    def counting(original):
        def wrapper(*args, **kwargs):
            where = _caller_is_ours(cadence)
            if where is not None:
                found[where] += 1
            return original(*args, **kwargs)
        return wrapper

    for name, original in saved.items():
        setattr(torch.Tensor, name, counting(original))
    for name, original in saved_fn.items():
        setattr(torch, name, counting(original))
    try:
        yield found
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
        for name, original in saved_fn.items():
            setattr(torch, name, original)


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(torch.tanh(self.ln(x)))


def tiny_model(vocab: int = 11) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(vocab, 16), Block(), Block(), nn.LayerNorm(16),
                         nn.Linear(16, 11))


def tokens(n: int, seed: int, vocab: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (n, 6), generator=g),
            torch.randint(0, 11, (n, 6), generator=g))
