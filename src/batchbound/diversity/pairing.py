"""Examples joined inside the forward pass, where the data decides whether they interact.

The first chunk's check against the per-example loop (``rule_check.self_check``) sees
examples that interact on that chunk. It cannot see a forward whose interaction the data
switches on later: attention among the examples of one group, ``(q @ k.T).masked_fill(
group[:, None] != group[None, :], -inf)``, has every example alone on a chunk whose groups
all differ, and joins them on the next; so does ``h + flag[:, None] * h.mean(0)`` for a
flag in the data. Such a forward leaves one of two marks in its operations' shapes, read at
2 and at 3 examples (``OpShapes``, over the two small forward passes that
``rule_check.output_kinds`` runs anyway):

- a tensor that *pairs* the examples: two or more of its dimensions change with the batch
  size (an n × n score, an n × (n + 1) one with a null key, the (n·T) × (n·T) mask of
  packed documents, a 2n × 2n one of two views), or
- a *quantity of the batch* flowing back into the examples: an operation whose output does
  not change with the batch size although what it reads does (a mean over the examples, one
  example's row, a sum into groups) feeds, directly or through others like it, an operation
  whose output does change.

``joining`` names the first of either. A chunk of such a model is then checked by value
(``prepared.PreparedStats``): its examples' losses, the model run on halves of the chunk
split by each bit of the examples' positions (any two examples fall in different halves
once), against their losses in the whole chunk. A user's loss is read the same way
(``losses.loss_joining``).

Not seen: an operation that mixes the examples along the one axis they lie on, keeping its
shape (a ``cumsum`` or sort along the examples, attention over a batch laid out as one
sequence with no mask tensor): the first chunk's check holds alone there (docs/diversity.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any, NamedTuple

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from batchbound.diversity.calls import flatten

GIVEN = -1  # what the examples' own tensors were written by, in ``Op.reads``


@dataclass
class Op:
    func: Any
    shapes: list[tuple[int, ...]]  # its tensor outputs'
    reads: set[int] = field(default_factory=set)  # the operations that wrote its inputs


def storage(t: Tensor) -> int:
    """A tensor's storage, by address: what views and in-place writes share."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse: no storage, known by the tensor
        return id(t)


class OpShapes(TorchDispatchMode):
    """Records each ATen operation of a forward pass: its tensor outputs' shapes and which
    recorded operations (or ``GIVEN``, the ``given`` tensors) wrote the tensors it reads."""

    def __init__(self, given: Iterable[Tensor] = ()) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self._writer = {storage(t): GIVEN for t in given}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in flatten((args, kwargs)) if isinstance(t, Tensor)]
        written = [t for t in flatten(out) if isinstance(t, Tensor)]
        # a new_* factory reads its argument's dtype and device, never its values
        reads = set() if func.overloadpacket.__name__.startswith("new_") else {
            self._writer[s] for s in map(storage, inputs) if s in self._writer}
        self.ops.append(Op(func, [tuple(t.shape) for t in written], reads))
        if func._schema.is_mutable:  # in place, also into an argument it does not return
            written += inputs
        for t in written:
            if t.numel():  # every empty tensor's storage is at address 0
                self._writer[storage(t)] = len(self.ops) - 1
        return out


class Joined(NamedTuple):
    why: str = ""  # "" where nothing joins the examples
    paired: bool = False  # by a tensor that pairs them (not a quantity of the batch)


def joining(small: list[Op], large: list[Op], sizes: tuple[int, int],
            what: str = "its forward pass") -> Joined:
    """Why the forward may join its examples (the module docstring).
    The two runs' operations are matched in order (``_matched``: where the path differs
    with the batch size, experts that get no token, the longest common run of them); an
    operation with no counterpart changes with the batch where what it reads does."""
    lo, hi = sizes
    matched = _matched(small, large)
    changes: list[bool] = []
    batch: list[bool] = []  # a quantity of the whole batch
    for i, op in enumerate(small):
        read_changing = any(j == GIVEN or changes[j] for j in op.reads)
        other = matched.get(i)
        if other is None:
            changes.append(read_changing)
            batch.append(False)
            continue
        name = op.func.overloadpacket.__name__
        for s, t in zip(op.shapes, other.shapes, strict=False):
            grows = len(s) == len(t) and sum(
                _follows(a, b, lo, hi) for a, b in zip(s, t, strict=True)) >= 2
            if grows:
                return Joined(f"{what} pairs the examples ({name} makes a tensor of shape "
                              f"{t} at {hi} examples, {s} at {lo}: two of its dimensions "
                              "grow with the batch)", paired=True)
        changed = op.shapes != other.shapes
        fed = [j for j in op.reads if j != GIVEN and batch[j]]
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


def _matched(small: list[Op], large: list[Op]) -> dict[int, Op]:
    """Each operation of the small run (by index) with its counterpart in the large one:
    position by position where both ran the same operations, else the blocks of the
    longest common subsequence of operations (``difflib``)."""
    a, b = [op.func for op in small], [op.func for op in large]
    if a == b:
        return dict(enumerate(large))
    blocks = SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks()
    return {block.a + k: large[block.b + k] for block in blocks for k in range(block.size)}


def _follows(s: int, t: int, lo: int, hi: int) -> bool:
    """A size that grows with the batch, a·n + c with a ≥ 1 and c ≥ 0 (n, n + 1 with a
    null key, 2n for two views, n·T for a packed sequence)."""
    a = (t - s) // (hi - lo)
    return t - s == a * (hi - lo) and a >= 1 and s - a * lo >= 0
