"""Global batches of example indices, drawn by permutation with no per-example Python.

Without replacement every epoch is a fresh permutation of ``range(n)`` from one
``torch.Generator`` seeded by ``seed``. A batch that crosses an epoch boundary takes the rest
of the current permutation and continues with the next one, so batch sizes may change from
step to step and ``epoch = samples_seen / n`` stays exact. With replacement indices are
i.i.d. uniform on ``range(n)``, as in the papers' theory.

>>> s = BatchSampler(10, seed=0)
>>> s.next_indices(4).shape, s.next_indices(8).shape, s.epoch
(torch.Size([4]), torch.Size([8]), 1.2)
"""

from __future__ import annotations

from typing import Any

import torch

from batchbound.errors import BatchboundError


class BatchSampler:
    """Draws batches of indices into a data set of ``n`` examples (kept on the CPU).

    ``state_dict()``/``load_state_dict()`` restore the generator, the current permutation
    and the position in it, so a resumed sampler continues bit-identically.
    """

    def __init__(self, n: int, seed: int, replacement: bool = False) -> None:
        if int(n) < 1:
            raise BatchboundError(f"BatchSampler: n must be >= 1, got {n}")
        self.n = int(n)
        self.seed = int(seed)
        self.replacement = bool(replacement)
        self.samples_seen = 0
        self._generator = torch.Generator().manual_seed(self.seed)
        self._perm: torch.Tensor | None = None  # current epoch's permutation (no replacement)
        self._pos = 0  # next unused position in _perm

    @property
    def epoch(self) -> float:
        """Examples drawn so far, in units of the data set size."""
        return self.samples_seen / self.n

    def next_indices(self, batch_size: int) -> torch.Tensor:
        """The next ``batch_size`` indices as an int64 tensor (any size >= 1, may exceed n).
        Read-only: it may be a view of the epoch's permutation."""
        batch_size = int(batch_size)
        if batch_size < 1:
            raise BatchboundError(f"BatchSampler: batch_size must be >= 1, got {batch_size}")
        self.samples_seen += batch_size
        if self._perm is not None and self._pos + batch_size <= self.n:  # the usual step
            start, self._pos = self._pos, self._pos + batch_size
            return self._perm[start : self._pos]
        if self.replacement:
            return torch.randint(self.n, (batch_size,), generator=self._generator)
        pieces = []
        needed = batch_size
        while needed > 0:
            if self._perm is None or self._pos == self.n:
                self._perm = torch.randperm(self.n, generator=self._generator)
                self._pos = 0
            take = min(needed, self.n - self._pos)
            pieces.append(self._perm[self._pos : self._pos + take])
            self._pos += take
            needed -= take
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def state_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "seed": self.seed,
            "replacement": self.replacement,
            "samples_seen": self.samples_seen,
            "generator": self._generator.get_state().clone(),
            "perm": None if self._perm is None else self._perm.clone(),
            "pos": self._pos,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["n"]) != self.n or bool(state["replacement"]) != self.replacement:
            raise BatchboundError(
                f"BatchSampler: state is for n={state['n']}, replacement={state['replacement']}; "
                f"this sampler has n={self.n}, replacement={self.replacement}"
            )
        self.seed = int(state["seed"])
        self.samples_seen = int(state["samples_seen"])
        self._generator.set_state(state["generator"].clone())
        self._perm = None if state["perm"] is None else state["perm"].clone()
        self._pos = int(state["pos"])
