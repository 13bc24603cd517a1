"""Recording the calls of modules that have layer rules, during one forward pass.

A forward hook with keyword arguments sees every call, however its arguments were passed
(``self.conv(x)`` and ``self.conv(input=x)`` alike): they are bound to the names of the
module's ``forward`` signature. For each call the record keeps the tensor arguments (for
the rule, which runs under no_grad), the autograd nodes they came from (where the call's own
operations stop, see ``graph.region``), and the node and shape of each tensor output.

Calls are recorded only inside ``recording()``, the model's own forward: forward passes that
activation checkpointing reruns during the backward pass are not new calls.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, fields, is_dataclass
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from batchbound.diversity.graph import Node
from batchbound.diversity.rules import RuleEntry
from batchbound.errors import BatchboundError


@dataclass
class Output:
    node: Node | None  # the autograd node that made it (None: it does not require grad)
    index: int  # its output_nr on that node
    shape: torch.Size
    dtype: torch.dtype = torch.float32  # the precision the call computed it in
    # the tensor itself, while it lives: an in-place write after the call to an output that
    # is a view (a Linear's on 3-d input) moves its history off ``node`` (``rebased``)
    tensor: weakref.ref[Tensor] | None = None

    def rebased(self, reached: Callable[[Node], bool]) -> bool:
        """The output's gradient flows into the backward pass past ``node``, which it no
        longer reaches: the output was written in place after the call, and autograd gave
        it a new history (a view's: ``CopySlices`` on its base). Where ``node`` is still
        reached, by what read the output before the write, ``hooks._written_past`` sees it."""
        live = self.tensor() if self.tensor is not None else None
        now = live.grad_fn if live is not None else None
        return (self.node is not None and now is not None and now is not self.node
                and not reached(self.node) and reached(now))


@dataclass
class CallRecord:
    prefix: str
    module: nn.Module
    entry: RuleEntry
    index: int  # this is the module's index-th call in the forward pass
    inputs: dict[str, Any]
    input_nodes: set[Node]
    outputs: list[Output]
    grads: list[Tensor | None] = field(default_factory=list)
    main: str = ""  # the argument the rule reads the examples from
    # Saved-tensor hooks were active (non-reentrant checkpointing): what the forward saved
    # may be unpacked only once, by the backward itself, so no rule may read it.
    saved_hooks: bool = False
    # each input tensor's version counter when the call returned: a rule reads the inputs
    # after the forward, so one written in place since (``h.add_(f(h))`` after f's call)
    # would be read as it is then, not as the call saw it (``written``)
    versions: tuple[tuple[Tensor, int | None], ...] = ()

    def written(self) -> bool:
        """Whether an input was written in place after the call."""
        for t, v in self.versions:  # noqa: SIM110 -- no generator frame: every call, every step
            if v is not None and t._version != v:
                return True
        return False

    def __post_init__(self) -> None:
        self.main = self.entry.main or first_argument(self.module)
        # read a dozen times per call every step: attributes, not properties (host time)
        self.key: tuple[str, int] = (self.prefix, self.index)
        self.main_input: Any = self.inputs.get(self.main)

    @property
    def label(self) -> str:
        repeat = f", call {self.index + 1}" if self.index else ""
        return f"{self.prefix or '<root>'} ({type(self.module).__name__}{repeat})"


_SIGNATURES: dict[type, inspect.Signature] = {}
_POSITIONAL: dict[type, list[str] | None] = {}  # names, when positional calls bind by order
_FIRST: dict[type, str] = {}  # forward's first argument after self


def _signature(module: nn.Module) -> inspect.Signature:
    kind = type(module)
    signature = _SIGNATURES.get(kind)
    if signature is None:
        signature = _SIGNATURES[kind] = inspect.signature(kind.forward)
    return signature


def first_argument(module: nn.Module) -> str:
    """The name of ``forward``'s first argument after self."""
    kind = type(module)
    name = _FIRST.get(kind)
    if name is None:
        names = list(_signature(module).parameters)
        name = _FIRST[kind] = names[1] if len(names) > 1 else ""
    return name


def _positional(module: nn.Module) -> list[str] | None:
    kind = type(module)
    if kind not in _POSITIONAL:
        params = list(_signature(module).parameters.values())[1:]
        simple = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        _POSITIONAL[kind] = [p.name for p in params] if simple else None
    return _POSITIONAL[kind]


def bind(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The forward's arguments by name."""
    names = _positional(module)
    if not kwargs and names is not None and len(args) <= len(names):
        return dict(zip(names, args, strict=False))  # the common case, without inspect
    signature = _signature(module)
    try:
        bound = signature.bind(module, *args, **kwargs)
    except TypeError:  # a forward that does not match its own signature: let it raise itself
        return {}
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(signature.parameters)), None)  # self
    return arguments


def saved_tensor_hooks_active() -> bool:
    """Whether ``torch.autograd.graph.saved_tensors_hooks`` are in force (checkpointing);
    True where this torch cannot tell."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return True if top is None else top(False) is not None


def flatten(value: Any) -> list[Any]:
    """The leaves of nested tuples, lists, dicts (a Hugging Face ``ModelOutput`` is one) and
    dataclass instances, in order."""
    if isinstance(value, Tensor):  # the common leaf, first (every call's inputs and outputs)
        return [value]
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in flatten(item)]
    if isinstance(value, dict):
        return [leaf for item in value.values() for leaf in flatten(item)]
    if is_dataclass(value) and not isinstance(value, type):
        return [leaf for f in fields(value) for leaf in flatten(getattr(value, f.name))]
    return [value]


def detached(value: Any) -> Any:
    """``value`` with every tensor in it (in tuples and lists too) detached."""
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple (PackedSequence)
        return type(value)(*(detached(item) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(detached(item) for item in value)
    return value


# The check that batchbound is running a model for (a token), or None: the passes a
# ``watch`` makes of its own (its check, its fallback's replay) are recorded by the
# recorders made for them alone, and seen by no other watcher (a watch of a submodule
# around the model's).
CHECKING: ContextVar[object | None] = ContextVar("batchbound_checking", default=None)


class CopiedInert:
    """A hook batchbound puts on a user's module for one block or pass: a copy of the module
    (``copy.deepcopy``, pickle: an EMA or a snapshot of the model made inside ``watch``)
    carries a hook that does nothing, not the pass's state (autograd nodes, which cannot be
    copied) nor its work on a model it was never asked to watch."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook

    # Run as Python, never traced: torch.compile of the watched model (``watch(m)`` around a
    # call of ``torch.compile(m)``) would otherwise trace into the hook's own bookkeeping
    # (its dispatch modes and records) and fail inside Dynamo. torch's own lazy form of
    # ``torch.compiler.disable``: Dynamo is imported at the first call, not with batchbound.
    @torch._disable_dynamo
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hook(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return _nothing

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple]:
        return _inert, ()


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _inert() -> Callable[..., None]:
    return _nothing


class CallRecorder:
    """Forward hooks on ``modules`` (prefix -> (module, rule)); ``calls`` after a forward."""

    def __init__(self, modules: dict[str, tuple[nn.Module, RuleEntry]]) -> None:
        self.modules = modules
        self.calls: list[CallRecord] = []
        self._counts: dict[str, int] = {}  # calls so far, by prefix
        self._recording = False
        self._handles: list[RemovableHandle] = []
        self._owner = CHECKING.get()  # the check it records for (None: the user's calls)

    def __enter__(self) -> CallRecorder:
        for prefix, (module, entry) in self.modules.items():
            hook = self._hook(prefix, entry)
            # First of the module's forward hooks: the record is the layer's own output,
            # before any user hook replaces it (a clamp): the rule needs the gradient with
            # respect to what the layer itself computed, which its own node receives.
            self._handles.append(module.register_forward_hook(
                CopiedInert(hook), with_kwargs=True, prepend=True))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def start(self) -> None:
        self._recording = True

    def stop(self) -> None:
        self._recording = False

    @contextmanager
    def recording(self) -> Iterator[None]:
        self.start()
        try:
            yield
        finally:
            self.stop()

    def _hook(self, prefix: str, entry: RuleEntry):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not self._recording or CHECKING.get() is not self._owner:
                return
            index = self._counts.get(prefix, 0)
            self._counts[prefix] = index + 1
            arguments = bind(module, args, kwargs)
            # The arguments themselves, not detached copies (one operation per tensor per
            # call, every step): the rules run under no_grad (hooks.HooksPass), and a rule
            # that enables grad itself detaches what it reads.
            inputs = dict(arguments)
            nodes, versions = set(), []
            for value in arguments.values():
                for leaf in flatten(value):
                    if isinstance(leaf, Tensor):
                        versions.append((leaf, None if leaf.is_inference() else leaf._version))
                        if leaf.grad_fn is not None:
                            nodes.add(leaf.grad_fn)
            outputs = [
                Output(leaf.grad_fn if leaf.requires_grad else None, leaf.output_nr, leaf.shape,
                       leaf.dtype, weakref.ref(leaf))
                for leaf in flatten(output)
                if isinstance(leaf, Tensor)
            ]
            self.calls.append(CallRecord(prefix, module, entry, index, inputs, nodes, outputs,
                                         saved_hooks=saved_tensor_hooks_active(),
                                         versions=tuple(versions)))

        return hook


def split_failure(x: Inputs, exc: Exception) -> str:
    """Why the model failed on a few examples split from a call of several arguments: every
    tensor whose first dimension is the batch's n is split, so a tensor the whole batch
    shares (position ids of length n) is split too."""
    split = [name for name, value in [*((f"argument {i}", a) for i, a in enumerate(x.args)),
                                      *x.kwargs.items()]
             if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == x.n]
    said = " ".join(str(exc).split())
    return (f"the model raised on a few examples split from this call ({type(exc).__name__}: "
            f"{said}); batchbound splits by example every tensor whose first dimension is the "
            f"batch's {x.n}, here {', '.join(split)}: a tensor the whole batch shares must "
            f"not have {x.n} rows (give it a leading dimension of 1), and the examples must "
            "lie along that dimension, not inside one flat tensor (EmbeddingBag's offsets, "
            "indices into the flattened batch such as sampled negatives)")


class Inputs:
    """A model called with several arguments, ``model(*args, **kwargs)`` (a FiLM
    ``model(img, cond)``, a Hugging Face ``model(input_ids, attention_mask=..., labels=...)``),
    split by example the way a tensor of examples is: every tensor among the arguments (in
    tuples, lists and dicts too) whose first dimension holds the ``n`` examples is indexed by
    example; any other argument (a mask shared by the batch, a flag) is passed whole.

    It answers ``shape[0]``, ``[index]`` and ``device`` as a tensor of examples does, so the
    engines, the probe and the self-check take either; ``call_model`` runs the model on it.
    """

    def __init__(self, args: tuple, kwargs: dict[str, Any], n: int) -> None:
        self.args, self.kwargs, self.n = tuple(args), dict(kwargs), n

    @staticmethod
    def of(args: tuple, kwargs: dict[str, Any]) -> Tensor | Inputs | None:
        """The examples of a call: its one tensor argument itself, or an ``Inputs``; None
        when no argument is a tensor with a first dimension."""
        first = next((t for t in flatten([args, kwargs]) if isinstance(t, Tensor)
                      and t.dim() > 0), None)
        if first is None:
            return None
        if len(args) == 1 and not kwargs and args[0] is first:
            return first
        return Inputs(args, kwargs, int(first.shape[0]))

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.n])

    @property
    def device(self) -> torch.device:
        first = next(t for t in flatten([self.args, self.kwargs]) if isinstance(t, Tensor))
        return first.device

    def __getitem__(self, index: Any) -> Inputs:
        picked = _take((self.args, self.kwargs), index, self.n)
        count = len(range(self.n)[index]) if isinstance(index, slice) else int(
            torch.as_tensor(index).numel())
        return Inputs(picked[0], picked[1], count)

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> Inputs:
        """On ``device``, floating tensors in ``dtype`` when given (as ``Tensor.to``)."""
        def move(t: Tensor) -> Tensor:
            return t.to(device=device, dtype=dtype if t.is_floating_point() else None)

        return Inputs(*_each((self.args, self.kwargs), move), self.n)

    def batched(self) -> tuple[Any, Any]:
        """(args and kwargs, the same structure with 0 at example-split tensors and None
        elsewhere): the ``in_dims`` torch.func.vmap needs."""
        tree = (self.args, self.kwargs)
        return tree, _dims(tree, self.n)


def dict_batch(batch: Mapping[str, Any]) -> Inputs:
    """A batch as a Hugging Face DataLoader yields it, ``{"input_ids": ..., "attention_mask":
    ..., "labels": ...}``, for ``model(**batch)``: every tensor with a dimension holds one
    row per example along its first (the examples are those rows); a 0-dim tensor, a
    Python number, str or None is passed whole, any other value refused. The same
    ``Inputs`` are the loss's targets: a per-example loss callable gets the batch as the
    dict it came as (``batch_of``)."""
    leading = {k: int(v.shape[0]) for k, v in batch.items()
               if isinstance(v, Tensor) and v.dim() > 0}
    if not leading:
        raise BatchboundError(f"the batch dict holds no tensor of examples (keys: "
                              f"{', '.join(map(str, batch)) or 'none'})")
    if len(set(leading.values())) > 1:
        sizes = ", ".join(f"{k} {n}" for k, n in leading.items())
        raise BatchboundError(f"the batch dict's tensors must all hold one row per example "
                              f"along their first dimension, got {sizes}")
    # whole: a flag or number for the call; anything else (a list of strings, a numpy
    # array of labels) would reach every example's call whole, so it is refused
    other = {k: type(v).__name__ for k, v in batch.items()
             if not isinstance(v, (Tensor, bool, int, float, str, type(None)))}
    if other:
        raise BatchboundError(
            f"the batch dict's values {', '.join(f'{k} ({t})' for k, t in other.items())} "
            "are not torch tensors: give one tensor of examples per key (a collator's "
            "return_tensors='pt', a datasets Dataset's set_format('torch')) and drop the "
            "columns the model does not take")
    return Inputs((), dict(batch), next(iter(leading.values())))


def batch_of(targets: Any) -> Any:
    """The dict batch behind ``targets`` when they are ``dict_batch``'s keyword-only
    ``Inputs`` (whole or split by example), else ``targets`` as they are."""
    if isinstance(targets, Inputs) and not targets.args:
        return targets.kwargs
    return targets


def vmap_parts(x: Tensor | Inputs) -> tuple[Any, Any]:
    """(what to hand torch.func.vmap, its in_dims) for a tensor of examples or ``Inputs``."""
    return x.batched() if isinstance(x, Inputs) else (x, 0)


def one_example(x: Any, dims: Any) -> Any:
    """Inside vmap: the per-example slice ``x`` (from ``vmap_parts``) as a batch of one, of
    the type it came as (a tensor, or ``Inputs``)."""
    if dims == 0:
        return x.unsqueeze(0)
    args, kwargs = _lift(x, dims)
    return Inputs(args, kwargs, 1)


def _lift(value: Any, dims: Any) -> Any:
    if isinstance(value, Tensor):
        return value.unsqueeze(0) if dims == 0 else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_lift(v, d) for v, d in zip(value, dims, strict=True)))
    if isinstance(value, (tuple, list)):
        return type(value)(_lift(v, d) for v, d in zip(value, dims, strict=True))
    if isinstance(value, dict):
        return {k: _lift(v, dims[k]) for k, v in value.items()}
    return value


def inputs(*args: Any, **kwargs: Any) -> Inputs:
    """The examples of a model called as ``model(*args, **kwargs)``, for ``monitored_step``
    and ``per_example_stats`` (``watch`` reads them off the call itself): n is the first
    dimension of the first tensor among them."""
    found = Inputs.of(args, kwargs)
    if found is None:
        raise BatchboundError("inputs(...) needs a tensor of examples among its arguments")
    return found if isinstance(found, Inputs) else Inputs(args, kwargs, int(found.shape[0]))


def _each(value: Any, fn: Any) -> Any:
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_each(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_each(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _each(v, fn) for k, v in value.items()}
    return value


def _take(value: Any, index: Any, n: int) -> Any:
    if isinstance(value, Tensor):
        return value[index] if value.dim() > 0 and value.shape[0] == n else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_take(v, index, n) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_take(v, index, n) for v in value)
    if isinstance(value, dict):
        return {k: _take(v, index, n) for k, v in value.items()}
    return value


def _dims(value: Any, n: int) -> Any:
    if isinstance(value, Tensor):
        return 0 if value.dim() > 0 and value.shape[0] == n else None
    if isinstance(value, (tuple, list)):
        return type(value)(_dims(v, n) for v in value) if not hasattr(value, "_fields") else (
            type(value)(*(_dims(v, n) for v in value)))
    if isinstance(value, dict):
        return {k: _dims(v, n) for k, v in value.items()}
    return None


def call_model(model: nn.Module, x: Tensor | Inputs) -> Any:
    """``model(x)``, or ``model(*args, **kwargs)`` for ``Inputs``."""
    if isinstance(x, Inputs):
        return model(*x.args, **x.kwargs)
    return model(x)
