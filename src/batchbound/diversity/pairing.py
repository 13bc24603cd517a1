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
  pointwise (a count per expert as offsets) choose rows: the row tracker's (``rows.py``);
- an operation that *mixes the rows* along the examples' own dimension and keeps its shape
  (a ``cumsum``, a sort, a softmax over the examples): each operation that reads the
  examples is run again on each example's row alone (``rowwise.py``); counted along a
  dimension that is the batch's size at every size, where seen at two of them.

A fused attention kernel pairs every two positions of its sequences without a tensor of the
pairs: one whose sequences grow with the batch attends across the examples.

``joining`` names the first of them. A chunk of such a model is then checked by value
(``prepared.PreparedStats``): its examples' losses, the model run on halves of the chunk
split by each bit of the examples' positions (any two examples fall in different halves
once), against their losses in the whole chunk. A user's loss is read the same way
(``losses.loss_joining``). Where the forward cannot be rerun so (dropout in train mode;
``watch``, which sees each step once), a model that pairs the examples, mixes their rows
or feeds back a quantity of the batch that combines their rows or is laid over them
(``Joined.reduced``: a mean of their rows, one example's row added to each; not the last
steps of packed sequences, some examples' rows put back among theirs) is refused.

Not seen: a mix through a tensor whose examples' dimension is not n (a shift by padding,
``cat([zeros, h[:-1]])``; packed tokens, n·T), or written in place into a view of the
batch: the first chunk's check holds alone there (docs/diversity.md).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from batchbound.diversity.calls import flatten
from batchbound.diversity.rowwise import Mix, is_pointwise, mixes

GIVEN = -1  # what the examples' own tensors were written by, in ``Op.reads``


@dataclass
class Op:
    func: Any
    shapes: list[tuple[int, ...]]  # its tensor outputs'
    reads: set[int] = field(default_factory=set)  # the operations that wrote its inputs
    integral: bool = False  # its outputs are integers or booleans (counts, positions)
    derived: bool = False  # it reads the examples' values, directly or through others
    # its outputs are made in the forward from the examples or from nothing, reading no
    # values the model holds (weights): ``zeros_like``, ``arange``, ``x[:, 0] > 0``
    inside: bool = False
    mixes: frozenset[Mix] = frozenset()  # where it mixes rows (``rowwise.py``)


def storage(t: Tensor) -> int:
    """A tensor's storage, by address: what views and in-place writes share."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested: no storage, by the tensor
        return id(t)


def written_in_place(func: Any, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors an operation writes into, beside what it returns: the arguments its
    schema marks written (``mul_``'s ``self``, ``out=``, batch norm's running statistics),
    not those it only reads (``h *= mask`` leaves the mask as it was)."""
    out: list[Tensor] = []
    for k, argument in enumerate(func._schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[k] if k < len(args) else kwargs.get(argument.name)
            out += [t for t in flatten(value) if isinstance(t, Tensor)]
    return out


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

    def __init__(self, given: Any = (), count: int = 0, replay_rows: bool = False) -> None:
        """``given``: what the forward is called with; its tensors with ``count`` rows are
        the examples'. ``replay_rows``: each operation reading them is also run on each
        example's row alone (``rowwise.mixes``)."""
        super().__init__()
        self.ops: list[Op] = []
        self.count, self.replay_rows = count, replay_rows
        # every tensor it wrote, kept: memory freed in the forward and handed to a tensor
        # made where no operation shows (a constant from the host) is not the old tensor
        self._alive: list[Tensor] = []
        self._writer: dict[Hashable, int] = {
            _key(t): GIVEN for t in tree_flatten(given)[0]
            if isinstance(t, Tensor) and t.dim() and t.shape[0] == count}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves, spec = tree_flatten((args, kwargs))
        name = func.overloadpacket.__name__
        factory = name.startswith(_METADATA)  # reads no values
        inside = [isinstance(t, Tensor) and self._inside(t) for t in leaves]
        from_examples = [isinstance(t, Tensor) and not factory and self._derived(t)
                         for t in leaves]
        replay = self.replay_rows and any(from_examples)
        before = ([t.clone() if isinstance(t, Tensor) else t for t in leaves]
                  if replay and func._schema.is_mutable else leaves)  # to run it again
        out = func(*args, **kwargs)
        inputs = [t for t in flatten((args, kwargs)) if isinstance(t, Tensor)]
        written = [t for t in flatten(out) if isinstance(t, Tensor)]
        reads = set() if factory else {
            self._writer[k] for k in map(_key, inputs) if k in self._writer}
        integral = bool(written) and not any(
            t.is_floating_point() or t.is_complex() for t in written)
        mixed = (mixes(func, before, spec, from_examples, inside, self.count) if replay
                 else frozenset())
        made_inside = factory or all(m for t, m in zip(leaves, inside, strict=True)
                                     if isinstance(t, Tensor))
        self.ops.append(Op(func, [_shape(t) for t in written], reads, integral,
                           any(from_examples), made_inside, mixed))
        written += written_in_place(func, args, kwargs)
        for t in written:
            if _filled(t):  # every empty tensor's storage is at address 0
                self._writer[_key(t)] = len(self.ops) - 1
                self._alive.append(t)
        return out

    def _derived(self, t: Tensor) -> bool:
        k = self._writer.get(_key(t))
        return k is not None and (k == GIVEN or self.ops[k].derived)

    def _inside(self, t: Tensor) -> bool:
        k = self._writer.get(_key(t))
        return k is not None and (k == GIVEN or self.ops[k].inside)


class Joined(NamedTuple):
    why: str = ""  # "" where nothing joins the examples
    paired: bool = False  # by a tensor that pairs them (not a quantity of the batch)
    # by a quantity of the batch that combines the examples' rows (a mean of them) or is
    # broadcast over them (one example's row added to each): not one of some examples'
    # rows put back among theirs (the last steps of packed sequences, a ``cat``)
    reduced: bool = False


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
    over: list[bool] = []  # of those, one taken over the examples' own dimension
    back = {k: i for i, k in matched.items()}
    for i, op in enumerate(small):
        k = matched.get(i)
        # what it read at either size: one size's views can share their memory (at 2
        # examples ``h[:1]`` is ``h[:-1]``), and a tensor is known by its memory
        reads = op.reads if k is None else op.reads | {
            back.get(j, j) for j in large[k].reads if j == GIVEN or back.get(j, i) < i}
        read_changing = any(j == GIVEN or changes[j] for j in reads)
        if k is None:
            changes.append(read_changing)
            batch.append(False)
            over.append(False)
            continue
        other = large[k]
        name = op.func.overloadpacket.__name__
        last = third[further[k]] if third is not None and k in further else None
        beyond = last.shapes if last is not None else None
        # where it mixes rows at two of the sizes: a dimension of another length equals
        # the batch's at one size alone (a sequence of 3 steps at 3 examples)
        runs = [run.mixes for run in (op, other, last) if run is not None]
        mixing = {mix for mix in set().union(*runs) if sum(mix in r for r in runs) >= 2}
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
            # the examples' own dimension, n at every size, along which it mixes rows
            mixed = sorted(mix.dim for mix in mixing if mix.output == m and again
                           and len(s) == len(t) > mix.dim and (s[mix.dim], t[mix.dim]) == (lo, hi))
            if mixed:
                return Joined(f"{what} mixes the examples' rows ({name}, along dimension "
                              f"{mixed[0]} of a tensor of shape {t} at {hi} examples: an "
                              "example's row run alone differs from its row in the batch)",
                              paired=True)
        changed = op.shapes != other.shapes or UNKNOWN in op.shapes
        pointwise = is_pointwise(op.func)
        fed = [j for j in sorted(reads) if j != GIVEN and batch[j]
               and not (small[j].integral and not pointwise)]
        if changed and fed:
            source = small[fed[0]]
            return Joined(f"{what} feeds a quantity of the whole batch back into the "
                          f"examples ({source.func.overloadpacket.__name__}'s output, of shape "
                          f"{source.shapes[0] if source.shapes else ()} whatever the batch "
                          f"size, read by {name})",
                          reduced=pointwise or name in _BROADCASTS or any(over[j] for j in fed))
        changes.append(changed)
        # an empty output (an expert no token reached, at both sizes) holds nothing
        batch.append(not changed and any(map(all, op.shapes)) and (read_changing or any(
            j != GIVEN and batch[j] for j in reads)))
        # the examples' rows it reads itself at both sizes: a packed RNN's step reads the
        # whole last state at 2 examples, and at 3 the rows of it still running, taken by
        # a narrow first (some examples' rows, as a view takes them: not combined)
        both = {j for j in reads if j == GIVEN or matched.get(j) in other.reads}
        over.append(batch[-1] and (
            any(j != GIVEN and batch[j] and over[j] for j in reads)
            or (not _selects(op.func) and any(
                j == GIVEN or _examples_rows(small[j], large, matched.get(j), lo, hi)
                for j in both))))
    return Joined()


# Operations other than pointwise ones that lay one tensor over the examples as it is
_BROADCASTS = ("expand", "repeat")


def _selects(func: Any) -> bool:
    """Whether an operation only picks entries (a view, an index): rows it takes from the
    examples stay one example's each (packed sequences' last steps). Any other operation
    counts as combining them, the side that refuses."""
    returns = func._schema.returns
    return (bool(returns) and returns[0].alias_info is not None) or (
        func.overloadpacket.__name__ in ("index", "index_select", "gather"))


def _examples_rows(op: Op, large: list[Op], k: int | None, lo: int, hi: int) -> bool:
    """Whether an output of ``op`` holds the examples along a dimension of its own: lo long
    at the small size, hi at the large one (``k``: its counterpart there)."""
    if k is None:
        return False
    return any(len(s) == len(t) and any((a, b) == (lo, hi) for a, b in zip(s, t, strict=True))
               for s, t in zip(op.shapes, large[k].shapes, strict=False))


def _matched(small: list[Op], large: list[Op], window: int = 64) -> dict[int, int]:
    """Each operation of the small run with its counterpart in the large one (by index):
    in order, and where the paths part (an expert that gets no token at one size, a padding
    mask made at one size alone), from the nearest place where three operations in a row
    agree again, within ``window`` of each (linear in the number of operations). The large
    run's examples hold the small one's, so no size shrinks from one to its counterpart:
    the same operation with a smaller output (``arange(3)`` for a mask beside ``arange(8)``
    for MPNet's position bias) is a parting, matched so only where no agreement follows."""
    a, b = [op.func for op in small], [op.func for op in large]
    matched: dict[int, int] = {}
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] is b[j] and _fits(small[i], large[j]):
            matched[i] = j
            i, j = i + 1, j + 1
            continue
        found = next(((p, d - p) for d in range(1, 2 * window - 1)
                      for p in range(max(0, d - window + 1), min(d, window - 1) + 1)
                      if a[i + p: i + p + 3] == b[j + d - p: j + d - p + 3] != []
                      and all(map(_fits, small[i + p: i + p + 3],
                                  large[j + d - p: j + d - p + 3]))), None)
        if found is None and a[i] is b[j]:  # no agreement ahead: by the operation alone
            matched[i] = j
            i, j = i + 1, j + 1
            continue
        if found is None:
            break  # the rest unmatched: each changes where what it reads does
        i, j = i + found[0], j + found[1]
    return matched


def _fits(small: Op, large: Op) -> bool:
    """Whether ``large``'s outputs can be ``small``'s at more examples: the same ranks, no
    size smaller."""
    return len(small.shapes) == len(large.shapes) and all(
        len(s) == len(t) and all(u <= v for u, v in zip(s, t, strict=True))
        for s, t in zip(small.shapes, large.shapes, strict=True))


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
