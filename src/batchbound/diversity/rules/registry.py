"""The one table of per-layer rules: module type -> rule.

A rule has one signature, ``rule(call) -> {param_name: PerExampleGrad}``:

- ``call.inputs`` holds the module's forward arguments by name, however they were passed
  (positionally or as keywords), the forward's own tensors (not detached: the rule runs
  under no_grad, and one that enables grad detaches what it reads); ``call.input`` is the
  main one;
- ``call.grads`` holds ∂(Σ_i f_i)/∂output for each tensor output, in output order (None for
  an output the loss does not use); row i of each is ∂f_i/∂output_i because the loss is an
  explicit sum of per-example losses and the layer keeps examples apart;
- the examples lie along dimension 0 of ``call.input`` and of every gradient, except for
  rules registered with an ``example_axis`` of their own (recurrent layers, attention),
  which read their layout from the module;
- it returns, for each parameter it covers (local names, dotted for a child's parameter),
  that call's per-example gradients in one of the forms of ``forms.py``.

Register a rule with ``@register_rule(nn.SomeLayer, ...)``. Lookup is by exact type, so a
subclass that changes ``forward`` is never silently given its parent's rule; it goes to the
fallback engine instead. A third-party layer is named by its full dotted path instead
(``"transformers.pytorch_utils.Conv1D"``): batchbound never imports that library; the rule
applies once the library is imported and a module of exactly that class (the class found at
that path) appears in a model. A rule registered with ``copies=True`` also applies to
every class that runs that class's own code (``same_code``): a layer copied into many files
(Hugging Face generates each model family's file, and its copy of Llama's RMSNorm, from one
definition; nanoGPT's LayerNorm is pasted into users' own) is recognised by its code, not
by a list of names.

What the engine checks before trusting a rule, for every call: that each use of a parameter
in the autograd graph lies inside a call of a module whose rule covers it; that the examples
lie along the axis the rule reads (found once per model by running two batch sizes); and,
once per model, that the rule's norms agree with the per-example loop on a few examples.
``unsupported`` lets a rule decline a configuration it does not handle (dropout between
recurrent layers in train mode, say), which sends that call's parameters to the fallback.
"""

from __future__ import annotations
import __future__

import importlib
import inspect
import sys
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from batchbound.diversity.rules.forms import PerExampleGrad


@dataclass
class Call:
    """One call of a module, as a rule sees it (see the module docstring)."""

    module: nn.Module
    inputs: dict[str, Any]
    grads: list[Tensor | None] = field(default_factory=list)
    main: str = "input"  # the key of the main input in ``inputs``
    # The autograd nodes of the outputs, when ``input`` is the call's own tensor (not moved
    # or expanded by the engine): a rule may read what the forward saved there.
    nodes: list[Any] = field(default_factory=list)

    @property
    def input(self) -> Tensor:
        return self.inputs[self.main]

    @property
    def grad(self) -> Tensor:
        """The gradient of the first output (a zero tensor is never passed: see hooks)."""
        g = self.grads[0]
        assert g is not None
        return g


Rule = Callable[[Call], dict[str, PerExampleGrad]]
ExampleAxis = Callable[[nn.Module], int] | None


@dataclass(frozen=True)
class RuleEntry:
    rule: Rule
    params: Callable[[nn.Module], tuple[str, ...]]  # local names the rule covers
    example_axis: ExampleAxis  # None: any leading dimension of the main input (see below)
    feature_dims: Callable[[nn.Module], int]  # trailing non-example dims, for example_axis=None
    main: str | None  # the name of the main input argument (None: forward's first)
    unsupported: Callable[[Call, int], str | None] | None  # (call, n) -> reason, at forward
    # (module, main input, output shape) -> local names whose batch gradient the rule's form
    # gives from work it does anyway (materialised per-example gradients): autograd skips them.
    own_sums: Callable[[nn.Module, Tensor, torch.Size], tuple[str, ...]] | None = None
    # module -> everything the rule reads of it besides its parameters' values: calls of
    # modules with equal ones may run as one call over their examples stacked (hooks.py)
    config: Callable[[nn.Module], Hashable] | None = None
    # The rule takes a bfloat16 or float16 call's input and output gradient as the call
    # computed them, not widened to float32: its forms widen what they need (hooks.py)
    low_precision: bool = False


RULES: dict[type[nn.Module], RuleEntry] = {}
NAMED_RULES: dict[str, RuleEntry] = {}  # "package.module.Class" -> rule, for other libraries
COPIED_RULES: dict[type | str, RuleEntry] = {}  # rules that also apply to their code's copies
# class -> (its attributes when looked up, the rule found): a class changed since is looked
# up again (a forward assigned to the class after its first model was planned)
_COPIES: weakref.WeakKeyDictionary[type, tuple[tuple, RuleEntry | None]] = (
    weakref.WeakKeyDictionary())


def register_rule(
    *module_types: type[nn.Module] | str,
    params: tuple[str, ...] | Callable[[nn.Module], tuple[str, ...]] = ("weight", "bias"),
    example_axis: ExampleAxis = None,
    feature_dims: int | Callable[[nn.Module], int] = 0,
    main: str | None = None,
    unsupported: Callable[[Call, int], str | None] | None = None,
    own_sums: Callable[[nn.Module, Tensor, torch.Size], tuple[str, ...]] | None = None,
    config: Callable[[nn.Module], Hashable] | None = None,
    low_precision: bool = False,
    copies: bool = False,
) -> Callable[[Rule], Rule]:
    """Register ``rule`` for each of ``module_types``: classes, or the full dotted paths of
    classes from libraries batchbound does not import (see the module docstring).

    ``params``: the local parameter names it covers (or a function of the module).
    ``example_axis``: None for layers that treat every leading dimension of the main input
    alike (Linear, Embedding, LayerNorm): the examples may then lie along any of them, and the
    engine moves that axis to 0 (and expands a batch-less input) before calling the rule;
    ``feature_dims`` trailing dimensions are features, never examples. Otherwise a function
    giving the fixed axis of the examples in the main input, which the rule handles itself.
    ``own_sums``: for a call about to run backward, the local names whose Σ_i g_i the rule's
    forms give at no extra cost (``total()`` of gradients they materialise anyway); the
    engine then asks autograd for the call's output gradient instead of those parameters'
    gradients, so the batch weight gradient is not computed twice.
    ``config``: for a rule whose one input and output gradient hold the examples along
    dimension 0, everything it reads of the module besides the parameters' values (a
    hashable value: eps, shapes, which parameters train). Small calls of modules of one type
    with equal configs and equal shapes are then computed as one call over their examples
    stacked: a row of the stacked input is one example of one call, so the rule gives each
    call's rows exactly as it would alone, in one launch per operation for all of them
    (a model's like layers). None (the default): every call on its own.
    ``low_precision``: the rule is given a bfloat16 or float16 call's input and output
    gradient in that dtype (else widened to float32 first) and its forms widen what they
    compute with, or multiply them as they are with float32 results (``forms.products``:
    on CUDA, tensor-core speed where the model trains in bfloat16).
    ``copies``: the rule also applies to any class that runs a registered class's code
    (``same_code``), wherever it is defined (a layer users paste into their own files).
    """

    names = params if callable(params) else (lambda module, _p=tuple(params): _p)
    features = feature_dims if callable(feature_dims) else (lambda module, _f=feature_dims: _f)

    def decorate(rule: Rule) -> Rule:
        for module_type in module_types:
            table: dict = NAMED_RULES if isinstance(module_type, str) else RULES
            if module_type in table:
                name = module_type if isinstance(module_type, str) else module_type.__name__
                raise ValueError(f"a rule for {name} is registered twice")
            table[module_type] = RuleEntry(rule, names, example_axis, features, main, unsupported,
                                           own_sums, config, low_precision)
            if copies:
                COPIED_RULES[module_type] = table[module_type]
        return rule

    return decorate


def rule_for(module: nn.Module) -> RuleEntry | None:
    kind = type(module)
    entry = RULES.get(kind)
    if entry is None and NAMED_RULES:
        entry = NAMED_RULES.get(f"{kind.__module__}.{kind.__qualname__}")
        home = sys.modules.get(kind.__module__)
        if entry is not None and getattr(home, kind.__qualname__, None) is not kind:
            return None  # a class of that name, but not the one at that path
    if entry is None and COPIED_RULES and "forward" not in vars(module):
        # a copy's __init__ is its own: one that sets a forward on the instance is not a copy
        entry = _copied_rule(kind)
    return entry


def _copied_rule(kind: type) -> RuleEntry | None:
    """The rule of a registered class whose code ``kind`` runs (once per class, while the
    class's attributes stay the same objects)."""
    now = tuple(vars(kind).values())
    cached = _COPIES.get(kind)
    if cached is not None and len(cached[0]) == len(now) and all(
            a is b for a, b in zip(cached[0], now, strict=True)):
        return cached[1]
    found, unseen = None, False
    for registered, entry in COPIED_RULES.items():
        reference = registered if isinstance(registered, type) else _imported_class(registered)
        unseen = unseen or reference is None
        if reference is not None and reference is not kind and same_code(kind, reference):
            found = entry
            break
    if found is not None or not unseen:  # asked again once the library is imported
        _COPIES[kind] = (now, found)
    return found


def _imported_class(path: str) -> type | None:
    """The class at ``path`` where its library is imported already (its module is then
    imported too: a few milliseconds), else None: batchbound never imports a library."""
    module, name = path.rsplit(".", 1)
    if module.split(".")[0] not in sys.modules:
        return None
    try:
        found = getattr(importlib.import_module(module), name, None)
    except Exception:  # any: a library's module that fails to import has no class to copy
        return None
    return found if isinstance(found, type) else None


def same_code(kind: type, reference: type) -> bool:
    """Whether ``kind`` computes what ``reference`` computes: the same base classes and
    metaclass, a ``forward`` with the same bytecode, constants (docstrings aside), names,
    argument defaults, captured values and global objects; and whatever else either class
    defines that the forward can reach (an attribute it names, the dunders a call goes
    through) the same too. Its ``__init__``, ``extra_repr`` and the like may differ: the
    forward, and the rule, read the instance's attributes as they are. The bytecode is
    CPython's: a name bound by assignment, not an import (``F = torch.nn.functional``),
    compiles a call through it otherwise, and such a copy is not recognised."""
    if kind.__bases__ != reference.__bases__ or type(kind) is not type(reference):
        return False
    own, expected = _own_attributes(kind), _own_attributes(reference)
    if "forward" not in expected or "forward" not in own:
        return False
    reached = _global_names(expected["forward"].__code__) | _CALL_PATH
    return all(name in own and name in expected and _same_value(own[name], expected[name])
               for name in (own.keys() | expected.keys()) & reached)


# what calling a module goes through besides forward
_CALL_PATH = frozenset({"forward", "__call__", "_call_impl", "_wrapped_call_impl", "__getattr__",
                        "__getattribute__", "__setattr__", "__init_subclass__"})


def _own_attributes(kind: type) -> dict[str, Any]:
    """What a class defines itself, apart from Python's records of where and how."""
    return {name: value for name, value in vars(kind).items() if name not in _RECORDS}


_RECORDS = frozenset({"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__",
                      "__annotations__", "__firstlineno__", "__static_attributes__",
                      "__orig_bases__", "__parameters__", "__type_params__"})


def _same_value(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if inspect.isfunction(a):
        return _same_function(a, b)
    if isinstance(a, property):
        return all(x is y if x is None or y is None else _same_value(x, y)
                   for x, y in ((a.fget, b.fget), (a.fset, b.fset), (a.fdel, b.fdel)))
    if isinstance(a, (staticmethod, classmethod)):
        return _same_value(a.__func__, b.__func__)
    try:
        return bool(a == b)
    except Exception:  # any: a value that cannot be compared is not known to be the same
        return False


def _same_function(a: Any, b: Any) -> bool:
    if a.__defaults__ != b.__defaults__ or a.__kwdefaults__ != b.__kwdefaults__:
        return False
    if not _same_code_object(a.__code__, b.__code__, a.__doc__, b.__doc__):
        return False
    # captured values: the same objects, but ``__class__`` (``super()``'s), each its own class
    cells = zip(a.__code__.co_freevars, a.__closure__ or (), b.__closure__ or (), strict=True)
    if not all(name == "__class__" or x.cell_contents is y.cell_contents for name, x, y in cells):
        return False
    missing = object()
    return all(a.__globals__.get(name, missing) is b.__globals__.get(name, missing)
               for name in _global_names(b.__code__))


def _same_code_object(a: Any, b: Any, doc_a: str | None = None, doc_b: str | None = None
                      ) -> bool:
    """Bytecode, names and constants (nested code compared the same way); the
    docstrings, line numbers and qualified names may differ."""
    if (a.co_code != b.co_code or a.co_names != b.co_names or a.co_varnames != b.co_varnames
            or a.co_freevars != b.co_freevars or a.co_cellvars != b.co_cellvars
            or a.co_argcount != b.co_argcount or a.co_kwonlyargcount != b.co_kwonlyargcount
            or a.co_flags & ~_LAZY_ANNOTATIONS != b.co_flags & ~_LAZY_ANNOTATIONS
            or getattr(a, "co_exceptiontable", None) != getattr(b, "co_exceptiontable", None)):
        return False
    consts_a = [c for c in a.co_consts if doc_a is None or c is not doc_a]
    consts_b = [c for c in b.co_consts if doc_b is None or c is not doc_b]
    if len(consts_a) != len(consts_b):
        return False
    for x, y in zip(consts_a, consts_b, strict=True):
        if inspect.iscode(x) and inspect.iscode(y):
            if not _same_code_object(x, y):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


# ``from __future__ import annotations`` in the file: annotations only, not what code does
_LAZY_ANNOTATIONS = __future__.annotations.compiler_flag


def _global_names(code: Any) -> set[str]:
    """The names a function's code may read from its module (with its nested code's)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _global_names(const)
    return names


def first_axis(module: nn.Module) -> int:
    return 0


def row_sq_norms(t: Tensor) -> Tensor:
    """Σ of squares over all but the first dimension, shape (n,); one fused reduction
    (``vector_norm`` is several times faster than ``square().sum()`` on CPU)."""
    if t.dim() == 1:
        return t.square()
    return torch.linalg.vector_norm(t, dim=tuple(range(1, t.dim()))).square()


def trainable(module: nn.Module, name: str) -> bool:
    """Whether ``module`` has its own trainable parameter ``name`` (e.g. ``bias=False``: no)."""
    param = module._parameters.get(name)
    return param is not None and param.requires_grad
