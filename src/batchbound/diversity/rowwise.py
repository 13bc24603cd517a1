"""Whether one operation keeps the examples' rows apart: run again on each row alone.

A forward that mixes the examples along the one dimension they lie on keeps every shape (a
``cumsum``, a sort, a ``flip``, a softmax over the examples, a sum into pairs by
``index_add``), so ``pairing.py``'s shapes cannot see it. ``mixes`` runs an operation
recorded there once on the whole batch and once on each example's row alone, and compares
that row: the same to rounding where the rows stay apart, different by the other rows'
values where they mix. The numbers the operation read from the examples are replaced by
random ones (a fixed seed) on both sides: the question is how the operation is built, not
what the probe's data does with it (a flag that zeroes the rows of the first examples
before their ``cumsum`` would hide it).

What a row alone takes, along a dimension of the batch's size that an output shares with
what was read from the examples: the rows of every tensor made inside the forward from the
examples or from nothing (``inside``: ``zeros_like(h)``, ``torch.zeros(len(h), 8)``,
``arange(n) // 2``), and of fixed integers laid along them where the operation is not
pointwise (positions); the model's own tensors (weights) whole. A pointwise operation's
arguments line up from the right, as they broadcast. An operation that is not pointwise
and reads integers computed from the examples (indices: ``h[perm]``, tokens sorted by
expert, sequences packed by length) moves rows by the data, which the row tracker follows
(``rows.py``): not run again here.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_unflatten

from batchbound.diversity.calls import flatten

# Rounding between a batch's kernels and a row's (TF32 on a GPU rounds to 1e-3), far below
# what another row's random values change
LEAST_TOLERANCE = 1e-2
_SKIPPED = (torch.Tag.nondeterministic_seeded,  # draws other random numbers when run again
            torch.Tag.dynamic_output_shape)  # nonzero, unique: no row of the examples


class Mix(NamedTuple):
    output: int  # which of the operation's tensor outputs (a floating one)
    dim: int  # along which it mixes rows


def mixes(func: Any, leaves: list[Any], spec: Any, from_examples: list[bool],
          inside: list[bool], count: int) -> frozenset[Mix]:
    """Where ``func`` mixes the rows of ``count`` examples. ``leaves`` and ``spec``: its
    arguments flattened (``tree_flatten``), as they were before it ran; ``from_examples``:
    which were computed from the examples' values; ``inside``: which were made inside the
    forward from them or from nothing. Run below every dispatch mode, with warnings
    silenced (an ``out=`` argument resized): the user sees the forward's own operations."""
    if any(tag in getattr(func, "tags", ()) for tag in _SKIPPED):
        return frozenset()
    with _disable_current_modes(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return frozenset(_mixes(func, leaves, spec, from_examples, inside, count))


def _mixes(func: Any, leaves: list[Any], spec: Any, from_examples: list[bool],
           inside: list[bool], count: int) -> set[Mix]:
    try:
        standing = _stand_ins(leaves, from_examples)
        whole = _run(func, standing, spec)
    except Exception:  # any: a dtype with no random numbers, an operation not on these
        return set()
    pointwise = is_pointwise(func)
    shapes = [tuple(t.shape) if _strided(t) else () for t in standing]
    rank = len(whole[0].shape) if whole else 0
    if not pointwise and any(mine and not _values(t) for t, mine in zip(
            standing, from_examples, strict=True)):
        return set()  # positions computed from the examples choose rows: the row tracker's
    found: set[Mix] = set()
    for d in sorted({d for t in whole for d, size in enumerate(t.shape) if size == count}):
        lined = [_lined(shape, d, rank, count, pointwise) for shape in shapes]
        if not any(e is not None and mine for e, mine in zip(lined, from_examples,
                                                               strict=True)):
            continue
        cut = [e if e is not None and (pointwise or mine or made or not _values(t)) else None
               for t, e, mine, made in zip(standing, lined, from_examples, inside, strict=True)]
        if not pointwise and any(isinstance(t, Tensor) and t.is_cuda and not _values(t)
                                 for t in standing):
            continue  # a row alone may index past its end: a device-side assert on CUDA
        found |= _mixed_along(func, standing, spec, cut, whole, count, d)
    return found


def is_pointwise(func: Any) -> bool:
    """Whether an operation is pointwise: it reads an integer as a value, not a position,
    and its arguments broadcast."""
    return torch.Tag.pointwise in getattr(func, "tags", ())


def _stand_ins(leaves: list[Any], from_examples: list[bool]) -> list[Any]:
    """The arguments, with random numbers in place of the examples' floating values."""
    return [_random(t.numel()).view(t.shape).to(t.device, t.dtype, copy=True)
            if mine and _strided(t) and _values(t) else t
            for t, mine in zip(leaves, from_examples, strict=True)]


POOL = 65_521  # a prime: rows of any common length start at other places in it


@functools.cache
def _pool() -> Tensor:
    return torch.randn(POOL, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def _random(numel: int) -> Tensor:
    """``numel`` standard normal numbers, the same on every call: drawn once (a draw per
    operation cost 33 ms in a process that had run many others), repeated past ``POOL``."""
    pool = _pool()
    return pool.repeat(-(-numel // POOL))[:numel] if numel > POOL else pool[:numel]


def _lined(shape: tuple[int, ...], d: int, rank: int, count: int, pointwise: bool
           ) -> int | None:
    """The argument's dimension that output dimension ``d`` reads, where it has ``count``
    rows: a pointwise operation's arguments line up from the right; another's at ``d``, or
    at its one dimension of ``count`` (an LSTM's input is (T, n, D), its state (n, H))."""
    if pointwise:
        e = d - (rank - len(shape))
        return e if 0 <= e < len(shape) and shape[e] == count else None
    if d < len(shape) and shape[d] == count:
        return d
    own = [e for e, size in enumerate(shape) if size == count]
    return own[0] if len(own) == 1 else None


def _mixed_along(func: Any, leaves: list[Any], spec: Any, cut: list[int | None],
                 whole: list[Tensor], count: int, d: int) -> set[Mix]:
    """The floating outputs whose row ``i`` along ``d``, with every ``cut`` argument's row
    ``i`` alone, differs from row ``i`` of the ``whole`` run. Integers mixed so are positions
    (lengths sorted to pack sequences, tokens sorted by expert), whose moves of rows the row
    tracker follows (``rows.py``). A row that cannot run alone (a size given in full:
    ``view``) says nothing."""
    found: set[Mix] = set()
    for i in range(count):
        alone = [t.narrow(e, i, 1).contiguous() if e is not None else t
                 for t, e in zip(leaves, cut, strict=True)]
        try:
            got = _run(func, alone, spec)
            if len(got) != len(whole):
                continue
            for m, (full, part) in enumerate(zip(whole, got, strict=True)):
                if _values(full) and full.dim() > d and full.shape[d] == count and _differ(
                        full.narrow(d, i, 1), part):
                    found.add(Mix(m, d))
        except Exception:  # any: a row that cannot run alone says nothing
            continue
    return found


def _run(func: Any, leaves: list[Any], spec: Any) -> list[Tensor]:
    """``func``'s strided outputs; on copies of its arguments where it writes into them."""
    if func._schema.is_mutable:
        leaves = [t.clone() if isinstance(t, Tensor) else t for t in leaves]
    args, kwargs = tree_unflatten(leaves, spec)
    return [t for t in flatten(func(*args, **kwargs)) if _strided(t)]


def _differ(whole: Tensor, alone: Tensor) -> bool:
    """Whether a row computed alone is not its row in the batch beyond rounding: element by
    element, by more than the tolerance of the larger of the two, or of the row's median
    magnitude (a sum that cancels to near 0; a mask's -1e9 beside them sets no scale).
    Another shape or dtype: False."""
    if whole.shape != alone.shape or whole.dtype != alone.dtype:
        return False
    if torch.equal(whole, alone):
        return False
    a = whole.to(torch.complex128 if whole.is_complex() else torch.float64)
    b = alone.to(a.dtype)
    finite = torch.isfinite(a)
    if not bool(finite.all()):
        if not torch.equal(finite, torch.isfinite(b)) or not torch.equal(
                a.masked_fill(finite, 0).nan_to_num(), b.masked_fill(finite, 0).nan_to_num()):
            return True  # another infinity, or +inf where -inf
        a, b = a.masked_fill(~finite, 0), b.masked_fill(~finite, 0)
    elif not bool(torch.isfinite(b).all()):
        return True
    tolerance = max(torch.finfo(whole.dtype).eps ** 0.5, LEAST_TOLERANCE)
    gap, larger = (a - b).abs(), torch.maximum(a.abs(), b.abs())
    if not bool((gap > tolerance * larger).any()):
        return False
    return bool((gap > tolerance * larger.clamp(min=float(a.abs().median()))).any())


def _values(t: Any) -> bool:
    return isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())


def _strided(t: Any) -> bool:
    return isinstance(t, Tensor) and t.layout == torch.strided and not t.is_nested
