"""Examples joined inside the forward pass, where the data decides whether they interact.

The first chunk's check against the per-example loop (``rule_check.self_check``) sees
examples that interact on that chunk. It cannot see a forward whose interaction the data
switches on later: attention among the examples of one group, ``(q @ k.T).masked_fill(
group[:, None] != group[None, :], -inf)``, has every example alone on a chunk whose groups
all differ, and joins them on the next; so does ``h + flag[:, None] * h.mean(0)`` for a
flag in the data. Such a forward leaves one of two marks in its operations' shapes, read at
2 and at 3 examples (``OpShapes``, over the small forward passes that
``rule_check.output_kinds`` runs anyway, and one more at 4):

- a tensor that *pairs* the examples: two of its dimensions grow with the batch alike (an
  n × n score, an n × (n + 1) one with a null key, the (n·T) × (n·T) mask of packed
  documents, a 2n × 2n one of two views), and again by as much at 4 examples (not a length
  the data sets, padding trimmed to the longest sequence), or
- a *quantity of the batch* flowing back into the examples: an operation whose output does
  not change with the batch size although what it reads does (a mean over the examples, one
  example's row, a sum into groups) feeds, directly or through others like it, an operation
  whose output does change. Integers of the batch read by an operation that is not
  pointwise (a count per expert as offsets) choose rows: the row tracker's (``rows.py``).

A fused attention kernel pairs every two positions of its sequences without a tensor of the
pairs: one whose sequences grow with the batch attends across the examples.

``joining`` names the first of either. A chunk of such a model is then checked by value
(``prepared.PreparedStats``): its examples' losses, the model run on halves of the chunk
split by each bit of the examples' positions (any two examples fall in different halves
once), against their losses in the whole chunk. A user's loss is read the same way
(``losses.loss_joining``).

Not seen: an operation that mixes the examples along the one axis they lie on, keeping its
shape (a ``cumsum`` or sort along the examples): the first chunk's check holds alone there
(docs/diversity.md).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from batchbound.diversity.calls import flatten

GIVEN = -1  # what the examples' own tensors were written by, in ``Op.reads``


@dataclass
class Op:
    func: Any
    shapes: list[tuple[int, ...]]  # its tensor outputs'
    reads: set[int] = field(default_factory=set)  # the operations that wrote its inputs
    integral: bool = False  # its outputs are integers or booleans (counts, positions)


def storage(t: Tensor) -> int:
    """A tensor's storage, by address: what views and in-place writes share."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested: no storage, by the tensor
        return id(t)


def _key(t: Tensor) -> Hashable:
    """A tensor by the memory it reads: its storage, offset, shape and strides (a view of
    one example's row, ``x[0]``, is not ``x``)."""
    try:
        return storage(t), t.storage_offset(), tuple(t.shape), t.stride()
    except (RuntimeError, NotImplementedError):  # nested or sparse: by the tensor itself
        return id(t)


UNKNOWN = (-1,)  # the shape of a nested tensor, whose rows differ in size


def _shape(t: Tensor) -> tuple[int, ...]:
    try:
        return tuple(t.shape)
    except (RuntimeError, NotImplementedError):
        return UNKNOWN


def _filled(t: Tensor) -> bool:
    try:
        return t.numel() > 0
    except (RuntimeError, NotImplementedError):
        return False


# Factories that read an argument's dtype, device or shape, never its values
_METADATA = ("new_", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
             "randn_like", "randint_like")


class OpShapes(TorchDispatchMode):
    """Records each ATen operation of a forward pass: its tensor outputs' shapes and which
    recorded operations (or ``GIVEN``, the ``given`` tensors) wrote the tensors it reads."""

    def __init__(self, given: Any = (), count: int = 0) -> None:
        """``given``: what the forward is called with; its tensors with ``count`` rows are
        the examples'."""
        super().__init__()
        self.ops: list[Op] = []
        self._writer: dict[Hashable, int] = {
            _key(t): GIVEN for t in tree_flatten(given)[0]
            if isinstance(t, Tensor) and t.dim() and t.shape[0] == count}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in flatten((args, kwargs)) if isinstance(t, Tensor)]
        written = [t for t in flatten(out) if isinstance(t, Tensor)]
        name = func.overloadpacket.__name__
        reads = set() if name.startswith(_METADATA) else {
            self._writer[k] for k in map(_key, inputs) if k in self._writer}
        integral = bool(written) and not any(
            t.is_floating_point() or t.is_complex() for t in written)
        self.ops.append(Op(func, [_shape(t) for t in written], reads, integral))
        if func._schema.is_mutable:  # in place, also into an argument it does not return
            written += inputs
        for t in written:
            if _filled(t):  # every empty tensor's storage is at address 0
                self._writer[_key(t)] = len(self.ops) - 1
        return out


class Joined(NamedTuple):
    why: str = ""  # "" where nothing joins the examples
    paired: bool = False  # by a tensor that pairs them (not a quantity of the batch)


def joining(small: list[Op], large: list[Op], sizes: tuple[int, int],
            what: str = "its forward pass", third: list[Op] | None = None) -> Joined:
    """Why the forward may join its examples (the module docstring). The two runs'
    operations are matched in order (``_matched``); an operation with no counterpart
    changes with the batch where what it reads does. Integers of the batch (a count per
    expert, offsets) read by an operation that is not pointwise choose rows, which the row
    tracker follows (``rows.py``): not counted here."""
    lo, hi = sizes
    matched = _matched(small, large)
    further = _matched(large, third) if third is not None else {}
    changes: list[bool] = []
    batch: list[bool] = []  # a quantity of the whole batch
    for i, op in enumerate(small):
        read_changing = any(j == GIVEN or changes[j] for j in op.reads)
        k = matched.get(i)
        if k is None:
            changes.append(read_changing)
            batch.append(False)
            continue
        other = large[k]
        name = op.func.overloadpacket.__name__
        beyond = third[further[k]].shapes if third is not None and k in further else None
        for m, (s, t) in enumerate(zip(op.shapes, other.shapes, strict=False)):
            # at a third size, one more example: the same growth again (a length the data
            # sets, the longest of the examples', seldom grows so)
            again = beyond is None or (m < len(beyond) and len(beyond[m]) == len(t) and all(
                u - v == v - w for u, v, w in zip(beyond[m], t, s, strict=True)))
            if _pairs(s, t, lo, hi) and again:
                return Joined(f"{what} pairs the examples ({name} makes a tensor of shape "
                              f"{t} at {hi} examples, {s} at {lo}: two of its dimensions "
                              "grow with the batch alike)", paired=True)
            # a fused attention pairs every two positions of its sequences, dimension -2,
            # with no tensor of the pairs to see: over the examples where that grows
            if ("scaled_dot_product" in name and m == 0 and len(s) == len(t) >= 2
                    and _grown(s[-2], t[-2], lo, hi) is not None and again):
                return Joined(f"{what} attends across the examples ({name} over sequences "
                              f"of {t[-2]} positions at {hi} examples, {s[-2]} at {lo})",
                              paired=True)
        changed = op.shapes != other.shapes or UNKNOWN in op.shapes
        pointwise = _pointwise(op.func)
        fed = [j for j in op.reads if j != GIVEN and batch[j]
               and not (small[j].integral and not pointwise)]
        if changed and fed:
            source = small[fed[0]]
            return Joined(f"{what} feeds a quantity of the whole batch back into the "
                          f"examples ({source.func.overloadpacket.__name__}'s output, of shape "
                          f"{source.shapes[0] if source.shapes else ()} whatever the batch "
                          f"size, read by {name})")
        changes.append(changed)
        # an empty output (an expert no token reached, at both sizes) holds nothing
        batch.append(not changed and any(map(all, op.shapes)) and (read_changing or any(
            j != GIVEN and batch[j] for j in op.reads)))
    return Joined()


def _pointwise(func: Any) -> bool:
    """Whether an operation is pointwise: it reads an integer as a value, not a position."""
    return torch.Tag.pointwise in getattr(func, "tags", ())


def _matched(small: list[Op], large: list[Op], window: int = 64) -> dict[int, int]:
    """Each operation of the small run with its counterpart in the large one (by index):
    in order, and where the paths part (an expert that gets no token at one size), from the
    nearest place where three operations in a row agree again, within ``window`` of each
    (linear in the number of operations)."""
    a, b = [op.func for op in small], [op.func for op in large]
    matched: dict[int, int] = {}
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] is b[j]:
            matched[i] = j
            i, j = i + 1, j + 1
            continue
        found = next(((p, d - p) for d in range(1, 2 * window - 1)
                      for p in range(max(0, d - window + 1), min(d, window - 1) + 1)
                      if a[i + p: i + p + 3] == b[j + d - p: j + d - p + 3] != []), None)
        if found is None:
            break  # the rest unmatched: each changes where what it reads does
        i, j = i + found[0], j + found[1]
    return matched


def _grown(s: int, t: int, lo: int, hi: int) -> tuple[int, int] | None:
    """(a, c) for a size that grows with the batch as a·n + c, a ≥ 1 and c ≥ 0, else None."""
    a = (t - s) // (hi - lo)
    if t - s != a * (hi - lo) or a < 1 or s - a * lo < 0:
        return None
    return a, s - a * lo


def _pairs(s: tuple[int, ...], t: tuple[int, ...], lo: int, hi: int) -> bool:
    """Two dimensions that grow with the batch alike, as a·n + c with one slope a ≥ 1 and
    intercepts within a of each other: n × n, n × (n + 1) with a null key, 2n × 2n for two
    views, (n·T) × (n·T) for a packed sequence; not (n, L) for L the longest of the
    examples' own lengths, which grows with the data."""
    if len(s) != len(t):
        return False
    growth = [g for g in (_grown(a, b, lo, hi) for a, b in zip(s, t, strict=True)) if g]
    return any(a1 == a2 and abs(c1 - c2) <= a1 for k, (a1, c1) in enumerate(growth)
               for a2, c2 in growth[k + 1:])
