"""Which example each row belongs to: rows selected or moved by the data.

A layer rule reads row r of its call (along the example axis) as example r. The probe
(``rule_check.py``) shows that the axis follows the batch size; it cannot show that the rows stay
in example order when the forward pass chooses them from the data: tokens routed to an
expert (``flat[where(route == e)]``), unpadded tokens (``fc(x[mask])``), rows put back with
``out[idx] = ...``. Such a selection may hold exactly n rows on some chunk by coincidence.

So the hooks forward runs under ``RowTracker``, a dispatch mode that sees every ATen
operation and marks the tensors whose rows may belong to other examples than their
position says. An operation *moves rows* when

- its output's shape depends on the data (``x[mask]``, ``nonzero``, ``masked_select``,
  ``unique``, ``repeat_interleave`` by a tensor): torch tags such operations
  ``dynamic_output_shape``, and its fake-tensor kernels tell, for the arguments at hand,
  whether the shape really needs the values (``x[idx]`` with integer indices does not), or
- it is not pointwise and reads an integer or boolean tensor computed from the examples'
  floating-point values or drawn at random (``argmax``, ``topk``'s indices, ``h > 0``,
  ``randperm``), or a tensor computed from such positions alone (a one-hot matrix of them
  cast to float), beside a tensor of such values: it uses data as positions into that
  tensor (``index_select``, ``gather``, ``index_put``, ``scatter``, an embedding of
  data-chosen indices, a product with that one-hot matrix), where a pointwise ``where`` or
  ``masked_fill`` only masks.

Its outputs are marked, and so is everything computed from a marked tensor afterwards. The
hooks engine refuses every call that reads a marked tensor, and every call whose output
reaches (through the autograd graph) an operation that moves rows. What is computed from the
model's integer inputs, the buffers and constants alone (``arange``) is not such data: token
ids and position ids index embeddings freely, a padding mask from the ids or a causal
``tril`` of a buffer chooses nothing. Every other floating-point tensor counts as the
examples' values, also one made outside the forward's operations (``.data``, ``detach``,
``from_numpy``). A sort of the examples themselves by value (``h.sort(dim=0)``) reorders
rows without any index; it makes an example's loss depend on the others, which the first
chunk's check against the per-example loop refuses. Nothing here is a list of models or
layers: it follows torch's own tags, dtypes and the data flow of the chunk at hand.

``RowChecks`` decides which chunks the tracker sees: the first of each kind of input, and
every one from a chunk where the data chose rows, a shape or a Python branch; a later chunk
that runs untracked is compared with its tracked like after its forward.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from batchbound.diversity.graph import Node, is_accumulator
from batchbound.diversity.precision import LOW_PRECISION, Casts, GradientPrecision, lowest

_INDEX_DTYPES = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32,
                           torch.int64})
_KINDS: dict[Any, tuple[bool, bool, bool]] = {}  # op -> (dynamic shape, pointwise, random)
# Operations whose integer operand picks an entry inside each row, never another row, so
# they count as pointwise along the examples: the negative log-likelihood's target picks
# row n's class, out[n, …] = −in[n, target[n, …], …], whatever chose the targets (a Hugging
# Face model's own loss when it is called with its labels, inside the forward).
_WITHIN_ROWS = frozenset({torch.ops.aten.nll_loss_forward.default,
                          torch.ops.aten.nll_loss2d_forward.default})


def _name(func: Any) -> str:
    return str(func.overloadpacket.__name__)


def _kind(func: Any) -> tuple[bool, bool, bool]:
    kind = _KINDS.get(func)
    if kind is None:
        tags = set(getattr(func, "tags", ()))
        kind = _KINDS[func] = (torch.Tag.dynamic_output_shape in tags,
                               torch.Tag.pointwise in tags or func in _WITHIN_ROWS,
                               torch.Tag.nondeterministic_seeded in tags)
    return kind


def _tensors(values: Any, into: list[Tensor]) -> list[Tensor]:
    for value in values.values() if isinstance(values, dict) else values:
        if isinstance(value, Tensor):
            into.append(value)
        elif isinstance(value, (tuple, list, dict)):  # a model's keyword arguments too
            _tensors(value, into)
    return into


_BELOW_FLOAT64 = frozenset({torch.float32, *LOW_PRECISION})
_SHAPES_NEED_DATA: dict[tuple, bool] = {}  # (op, input dtypes) -> its output shape needs data


def _selects(func: Any, args: tuple, kwargs: dict, inputs: list[Tensor]) -> bool:
    """Whether an operation torch tags ``dynamic_output_shape`` needs the data for its output
    shape with these arguments, as torch's own fake-tensor kernels decide (``x[mask]`` and
    ``nonzero`` do; ``x[idx]`` with integer indices does not): asked once per operation and
    input dtypes, on fake copies of the arguments."""
    key = (func, tuple(t.dtype for t in inputs))
    found = _SHAPES_NEED_DATA.get(key)
    if found is None:
        with FakeTensorMode() as mode:
            fake = tree_map(lambda v: mode.from_tensor(v) if isinstance(v, Tensor) else v,
                            (args, kwargs))
            try:
                func(*fake[0], **fake[1])
                found = False
            except (DynamicOutputShapeException, DataDependentOutputException):
                found = True
        _SHAPES_NEED_DATA[key] = found
    return found


class _HostReads:
    """While trackers are active, a tensor's values read into Python without an ATen
    operation (``tolist()``, ``numpy()``), which Python may branch on, make each active
    tracker's chunk unsteady where the tensor is not clean for it. The three methods are
    wrapped only meanwhile: a ``TorchFunctionMode`` would see them too, at a Python call for
    every function of the forward (GPT-2's structure: +50 % on a tracked chunk's host time)."""

    NAMES = ("tolist", "numpy", "__array__")
    active: ClassVar[list[RowTracker]] = []
    _saved: ClassVar[dict[str, Any]] = {}

    @classmethod
    def enter(cls, rows: RowTracker) -> None:
        if not cls.active:
            for name in cls.NAMES:
                cls._saved[name] = Tensor.__dict__.get(name)
                setattr(Tensor, name, cls._reading(name, getattr(Tensor, name)))
        cls.active.append(rows)

    @classmethod
    def exit(cls, rows: RowTracker) -> None:
        if rows in cls.active:
            cls.active.remove(rows)
        if not cls.active:
            for name, own in cls._saved.items():
                if own is None:
                    delattr(Tensor, name)  # TensorBase's, found again
                else:
                    setattr(Tensor, name, own)
            cls._saved.clear()

    @classmethod
    def _reading(cls, name: str, method: Callable) -> Callable:
        def read(self: Tensor, *args: Any, **kwargs: Any) -> Any:
            for rows in cls.active:
                if id(self) not in rows.clean and rows.unsteady is None:
                    rows.unsteady = f"a Python value read by {name}"
            return method(self, *args, **kwargs)

        return read


class RowTracker(TorchDispatchMode):
    """See the module docstring. ``inputs``: the model's arguments (the examples), ``fixed``:
    its buffers; ``moved_by``: the first row-moving operation, by name. The tensors it notes
    are held until it is dropped (one chunk): small index tensors, and the activations
    downstream of a move."""

    def __init__(self, inputs: Any = (), fixed: Iterable[Tensor] = (),
                 weights: Iterable[Tensor] = ()) -> None:
        super().__init__()
        # By id, holding the tensor (so no id is reused while noted):
        self.clean: dict[int, Tensor] = {}  # from no example's values: ids, buffers, constants
        self.positions: dict[int, Tensor] = {}  # indices computed from the examples' values
        self.marked: dict[int, Tensor] = {}  # rows may belong to other examples
        self.sources: list[Node] = []  # autograd nodes of what row-moving operations read
        self.moved_by: str | None = None
        # Of the clean, what comes from no input of the model either (buffers, ``arange``);
        # ``weights``, and what is computed from them and constants alone (autocast's casts
        # of them, not an embedding of the ids): not the examples' values, for ``unsteady``
        self.constant: dict[int, Tensor] = {}
        self.weights: dict[int, Tensor] = {id(t): t for t in weights}
        # Why a later chunk may choose rows where this one did not, unseen by any check but
        # this tracker's (``RowChecks``): a row moved by the data, a shape or a Python value
        # (``item()``, ``bool()``) from the examples' values, or integer or boolean positions
        # read beside the examples' values by an operation that is not pointwise, where
        # Python state could choose them from the data on another chunk; None: none of these.
        self.unsteady: str | None = None
        # The lowest floating precision the backward runs in below the parameters' (autocast,
        # a cast inside the forward such as LlamaRMSNorm's float32): what the stated
        # precision and the self-check's tolerance must allow.
        self._seen = GradientPrecision()
        # Any bfloat16 or float16 result, on the gradient's path or not: autocast reuses its
        # cast of a weight within one context, so the cast may run in an earlier step only.
        self._low: torch.dtype | None = None
        for t in _tensors(inputs if isinstance(inputs, (tuple, list)) else (inputs,), []):
            if not t.is_floating_point():  # token ids, masks: positions, not values
                self.clean[id(t)] = t
        for t in fixed:
            self.clean[id(t)] = self.constant[id(t)] = t

    @property
    def lowest(self) -> torch.dtype | None:
        """The lowest floating dtype the backward ran in below an input's, or any bfloat16 or
        float16 result of the forward (None: neither; read it after the backward,
        ``precision.GradientPrecision``)."""
        return self._low or self._seen.dtype

    def __enter__(self) -> RowTracker:
        _HostReads.enter(self)
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        _HostReads.exit(self)
        self._seen.arm()  # the forward's end: its lowered results have their nodes now

    def loss_casts(self) -> Casts:
        """A mode for the loss, computed after the forward and outside the tracker: its
        casts below the parameters' precision (``logits.float()`` in a float64 model) count
        as the forward's do."""
        return Casts(self._seen)

    def _valued(self, t: Tensor) -> bool:
        """Floating-point values that depend on the examples (or on the weights): everything
        but what is known computed from integer inputs, buffers and constants alone. A
        tensor made outside the forward's operations (``.data``, ``from_numpy``) counts."""
        return t.is_floating_point() and id(t) not in self.clean

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if out is not None and not isinstance(out, (Tensor, tuple, list)):
            # a number or a bool for Python to branch on (``item()``, ``bool()``): from the
            # examples' values, later chunks may take another branch
            inputs = _tensors(kwargs.values(), _tensors(args, []))
            if not all(id(t) in self.clean for t in inputs):
                self.unsteady = self.unsteady or f"a Python value read by {_name(func)}"
            return out
        if isinstance(out, Tensor):
            dtype = out.dtype
            if dtype in _BELOW_FLOAT64:
                if dtype in LOW_PRECISION:
                    self._low = dtype
                # only an input of another dtype that requires grad can be lowered from:
                # checked here, without a call, for the float32 model's every operation
                for arg in (*args, *kwargs.values()) if kwargs else args:
                    if isinstance(arg, Tensor) and arg.dtype is not dtype and arg.requires_grad:
                        self._seen.see(out, (*args, *kwargs.values()))
                        break
            kind = _KINDS.get(func) or _kind(func)
            if not (kind[0] or kind[2] or self.positions or self.marked
                    or out.dtype in _INDEX_DTYPES):
                # The common case, decided without collecting the inputs: an activation
                # from an activation (one top-level input not known clean makes the output
                # not clean either; nothing is marked, chosen or drawn).
                clean, weights = self.clean, self.weights
                index = unclean = valued = weighted = inputs_of_model = False
                for arg in args:
                    if isinstance(arg, Tensor):
                        index = index or arg.dtype in _INDEX_DTYPES
                        if id(arg) in clean:
                            inputs_of_model = inputs_of_model or id(arg) not in self.constant
                            continue
                        unclean = True
                        if id(arg) in weights:
                            weighted = True
                        elif arg.is_floating_point():
                            valued = True
                if unclean:
                    if id(out) in clean:  # written in place from the examples' values
                        del clean[id(out)]
                        self.constant.pop(id(out), None)
                    if valued and index and not kind[1]:
                        self.unsteady = self.unsteady or f"positions read by {_name(func)}"
                    elif weighted and not (valued or inputs_of_model):
                        weights[id(out)] = out
                    return out
        inputs = _tensors(kwargs.values(), _tensors(args, [])) if kwargs else _tensors(args, [])
        dynamic, pointwise, random = _KINDS.get(func) or _kind(func)
        clean = not random and all(id(t) in self.clean for t in inputs)
        if not clean and self.unsteady is None:
            self._note_unsteady(func, inputs, dynamic, pointwise)
        if (not (dynamic or random or clean or self.positions or self.marked)
                and isinstance(out, Tensor) and out.dtype not in _INDEX_DTYPES):
            return out  # the common case: an activation from activations; nothing chosen
        positions = [id(t) in self.positions for t in inputs]
        # a position cast to a float (a one-hot dispatch matrix) is still a position
        valued = [self._valued(t) and not p for t, p in zip(inputs, positions, strict=True)]
        indexes = not pointwise and any(positions) and any(valued)
        moves = indexes or (dynamic and _selects(func, args, kwargs, inputs))
        if moves:
            self.moved_by = self.moved_by or _name(func)
            self.unsteady = self.unsteady or f"rows moved by {self.moved_by}"
            self.sources.extend(t.grad_fn for t in inputs if t.grad_fn is not None)
        outputs = _tensors(out if isinstance(out, (tuple, list)) else (out,), [])
        if not isinstance(out, Tensor):  # several results (native_layer_norm, split)
            for t in outputs:
                self._seen.see(t, inputs)
        if moves or (self.marked and any(self.is_marked(t) for t in inputs)):
            for t in outputs:
                self._mark(t)
        chosen = random or any(positions) or any(valued)
        of_positions = any(positions) and not (random or any(valued))
        constant = clean and all(id(t) in self.constant for t in inputs)
        for t in outputs:
            if clean:
                self.clean[id(t)] = t
                if constant:
                    self.constant[id(t)] = t
                continue
            self.clean.pop(id(t), None)  # a clean tensor written in place (``scatter_``)
            self.constant.pop(id(t), None)
            if (chosen and t.dtype in _INDEX_DTYPES) or of_positions:
                self.positions[id(t)] = t
        return out

    def _note_unsteady(self, func: Any, inputs: list[Tensor], dynamic: bool,
                       pointwise: bool) -> None:
        """``unsteady``'s shapes and positions, for an operation on something not clean."""
        if dynamic:
            self.unsteady = f"a shape from the examples' values ({_name(func)})"
        elif not pointwise and any(t.dtype in _INDEX_DTYPES for t in inputs) and any(
                t.is_floating_point() and id(t) not in self.clean and id(t) not in self.weights
                for t in inputs):
            self.unsteady = f"positions read by {_name(func)}"

    def _mark(self, t: Tensor) -> None:
        self.marked[id(t)] = t
        if t._base is not None:  # a write through a view moves the base's rows too
            self.marked[id(t._base)] = t._base

    def is_marked(self, t: Tensor) -> bool:
        return id(t) in self.marked or (t._base is not None and id(t._base) in self.marked)

    def reads_marked(self, values: Any) -> bool:
        if not self.marked:  # the common case, read for every call: nothing moved
            return False
        return any(self.is_marked(t) for t in _tensors(values, []))

    def feeding_moves(self) -> set[Node]:
        """Every autograd node upstream of what a row-moving operation read."""
        seen: set[Node] = set()
        stack = list(self.sources)
        while stack:
            node = stack.pop()
            if node in seen or is_accumulator(node):
                continue
            seen.add(node)
            stack.extend(child for child, _ in node.next_functions if child is not None)
        return seen


# ---------------------------------------------------------------- which chunks are tracked
# The tracker costs a Python call for every ATen operation of the forward: on a small model
# most of the hooks engine's host time (GPT-2's structure at width 32: a watched step +169 %
# over a plain one with it; benchmarks/host.py). What it decides follows from the operations
# and the data flow of the forward, so a chunk that runs the same operations on the same kind
# of inputs as a tracked chunk, with nothing in them chosen by the data, is decided alike.

KNOWN_KEYS = 64  # input keys remembered per model (each holds its programs' signatures)
PROGRAMS = 4  # programs remembered per key (a mask skipped where a chunk has no padding)


def chunk_key(given: Any, training: bool) -> Hashable:
    """What a forward's operations may depend on besides the data's values: every tensor
    argument's shape, dtype and device, the other arguments (a flag, ``use_cache=False``),
    the model's train flag and autocast's state."""
    leaves: list[Hashable] = []
    _leaves(given, leaves)
    autocast = tuple(torch.is_autocast_enabled(d) and torch.get_autocast_dtype(d)
                     for d in ("cpu", "cuda"))
    return (tuple(leaves), training, autocast)


def _leaves(value: Any, into: list[Hashable]) -> None:
    if isinstance(value, Tensor):
        into.append((value.shape, value.dtype, value.device, value.requires_grad))
    elif isinstance(value, (tuple, list)):
        for item in value:
            _leaves(item, into)
    elif isinstance(value, dict):
        for name, item in value.items():
            into.append(name)
            _leaves(item, into)
    elif value is None or isinstance(value, (bool, int, float, str)):
        into.append(value)
    else:
        into.append(type(value))


@dataclass
class _Tracked:
    calls: Hashable  # the layers' calls and their outputs' shapes and dtypes
    graph: tuple[object, ...]  # its autograd graph's node types (``graph_structure``)
    seen: GradientPrecision  # the tracker's, filled by its backward (holds no tensors)
    low: torch.dtype | None

    @property
    def lowest(self) -> torch.dtype | None:
        return self.low or self.seen.dtype


# Under any dispatch mode torch makes a reshape of a tensor a ``view`` where it would make
# it a ``_reshape_alias`` (the same view, by sizes and strides): one node type for both.
_VIEWS = frozenset({"ViewBackward0", "ReshapeAliasBackward0"})
_CANONICAL: dict[type, object] = {}


# Per node type: a getter of the saved arguments that say which entries an operation
# combines (integers, flags and names, alone or in tuples: dims, sizes, split sizes),
# found on the first node of the type, and which of them are single numbers. A single
# number may be an integer on one node and a float on another of the same type (``x ** 2``,
# ``x ** 0.5``): a float counts by its kind only (a scale, an exponent a schedule anneals
# combine no other entries). Left out: tensors (a Python number in an operation is one) and
# strides (a layout). None: the type saves none of them.
_ARGUMENTS: dict[type, tuple[Callable[[Node], Any], tuple[int, ...], bool] | None] = {}
# Per canonical node type with saved arguments: which of them are no size (a dimension,
# ``keepdim``, a flag, a name), kept in ``operations``; a view's are all sizes.
_SIZE_FREE: dict[object, tuple[int, ...]] = {}


def graph_structure(nodes: Iterable[Node]) -> tuple[object, ...]:
    """Each node of an autograd graph in ``graph.walk``'s order: its type (the two forms of
    a reshape's view as one) and the saved arguments that say which entries it combines, so
    that ``h - h.mean(0)`` in place of ``h - h.mean(-1)`` (the batch's mean, the examples
    coupled) is another structure."""
    out: list[object] = []
    for node in nodes:
        kind = type(node)
        canonical = _CANONICAL.get(kind)
        if canonical is None:
            canonical = _CANONICAL[kind] = "view" if kind.__name__ in _VIEWS else kind
            _ARGUMENTS[kind] = _arguments_of(node)
        arguments = _ARGUMENTS[kind]
        if arguments is None:
            out.append(canonical)
            continue
        read, numbers, single = arguments
        values = read(node)
        if single:
            values = (values,)
        for k in numbers:
            if type(values[k]) is float:  # its kind only
                values = tuple(float if type(v) is float else v for v in values)
                break
        out.append((canonical, values))
    return tuple(out)


def operations(calls: Iterable[tuple[Hashable, object]], graph: tuple[object, ...]) -> Hashable:
    """A program apart from its sizes (``HooksPass.program``: the layers' calls with their
    outputs' shapes, and ``graph_structure``): the calls in order, and each node's type with
    its saved arguments that are no size (``_SIZE_FREE``), which a new batch size or
    sequence length leaves as they were and an operation added on the batch (``h -
    h.mean(0)`` switched on by a flag or a hook) changes, or the same operation over another
    dimension (``h.mean(0)`` for ``h.mean(-1)``) on the step the batch size changes too."""
    return (tuple(key for key, _ in calls),
            tuple((node[0], tuple(node[1][k] for k in _SIZE_FREE[node[0]]))
                  if isinstance(node, tuple) else node for node in graph))


def _arguments_of(node: Node) -> tuple[Callable[[Node], Any], tuple[int, ...], bool] | None:
    names, numbers, size_free = [], [], []
    for name in dir(node):
        if not name.startswith("_saved_") or name.endswith("_strides"):
            continue
        try:
            value = getattr(node, name)
        except RuntimeError:  # a saved tensor already freed
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers.append(len(names))
        elif not (isinstance(value, (bool, str)) or (
                isinstance(value, (tuple, list)) and value
                and all(isinstance(v, (int, str)) for v in value))):
            continue
        # sizes are integers; dimensions, flags and names are not sizes
        if "dim" in name or isinstance(value, (bool, str)):
            size_free.append(len(names))
        names.append(name)
    if not names:
        return None
    _SIZE_FREE[_CANONICAL[type(node)]] = () if type(node).__name__ in _VIEWS else tuple(
        size_free)
    return attrgetter(*names), tuple(numbers), len(names) == 1


class RowChecks:
    """Which chunks of one model the row tracker watches, and what an untracked one is owed.

    A chunk is tracked when no chunk with its ``chunk_key`` was, and every chunk is from the
    first tracked one that was ``unsteady`` (``RowTracker``): a row moved by the data, a
    shape or a Python value from the examples' values, or positions (integer or boolean
    tensors, from the data or not) read beside the examples' values by an operation that is
    not pointwise, where state the tracker does not see (a counter, Python's ``random``)
    could choose them from the data on another chunk without changing the graph. Otherwise
    a later chunk runs untracked, and after its forward ``same`` compares it with the
    programs its key's tracked chunks ran: the layers' calls with their outputs' shapes and
    dtypes, and every node of the autograd graph in order (``graph_structure``). A chunk
    that ran none of them (such state adding a sort of the rows; a library skipping an
    attention mask without padding) leaves its parameters to the exact fallback, and the
    key's chunks are tracked until one runs a program not yet known: that program, if
    steady, is one more of the key's (up to ``PROGRAMS``; past them every chunk is
    tracked). So an untracked chunk ran, on the gradient's path, the operations of a
    tracked chunk, none of which reads positions beside the examples' values. Not seen:
    such state starting, on a later chunk, to move the rows of a tensor that needs no
    gradient (``x[perm]`` of the raw inputs, with ``perm`` from ``tolist()`` of the data)."""

    def __init__(self) -> None:
        self.always = False
        self._known: dict[Hashable, list[_Tracked]] = {}
        self._again: set[Hashable] = set()  # keys tracked until a new program runs

    def tracker(self, key: Hashable, given: Any, fixed: Callable[[], Iterable[Tensor]],
                weights: Callable[[], Iterable[Tensor]]) -> RowTracker | None:
        """A tracker for a chunk with this key (``fixed``: the model's buffers, ``weights``:
        its parameters), or None: it runs untracked (``same`` after its forward)."""
        if self.always or key not in self._known or key in self._again:
            return RowTracker(given, fixed(), weights())
        return None

    def tracked(self, key: Hashable, calls: Hashable, graph: tuple[object, ...],
                rows: RowTracker) -> None:
        """After a tracked chunk's forward: a program its untracked like are compared with."""
        if rows.unsteady is not None:
            self._differ()
            return
        programs = self._known.get(key, [])
        if any(p.calls == calls and p.graph == graph for p in programs):
            return  # a known one: still waiting for the new one, if any
        if len(programs) >= PROGRAMS:
            self._differ()
            return
        if key not in self._known and len(self._known) >= KNOWN_KEYS:
            self._known.clear()
        self._known.setdefault(key, []).append(_Tracked(calls, graph, rows._seen, rows._low))
        self._again.discard(key)

    def same(self, key: Hashable, calls: Hashable, graph: tuple[object, ...]) -> bool:
        """Whether an untracked chunk ran one of its key's tracked programs; if not, the key's
        chunks are tracked until one runs a new program."""
        if any(p.calls == calls and p.graph == graph for p in self._known.get(key, ())):
            return True
        self._again.add(key)
        return False

    def lowest(self, key: Hashable) -> torch.dtype | None:
        """The lowest precision the tracked chunks of this key observed
        (``RowTracker.lowest``)."""
        seen = [p.lowest for p in self._known.get(key, ()) if p.lowest is not None]
        return lowest(*seen) if seen else None

    def _differ(self) -> None:
        self.always = True
        self._known.clear()
        self._again.clear()


UNTRACKED_CHANGE = ("the model ran operations other than on the chunks whose rows were checked "
                    "(control flow on state no operation shows: a counter, Python's random, "
                    "a library's own branch, as transformers skipping an attention mask "
                    "without padding), so which example each row holds is unchecked here; "
                    "the next chunk of this shape that runs them is checked, and they are "
                    "remembered")
