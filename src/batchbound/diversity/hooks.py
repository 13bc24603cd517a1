"""The hooks engine: per-example squared norms from one forward and one backward pass.

``NormHooks`` is a context manager that puts a forward hook on every module with a layer
rule. The forward hook saves the module's input and registers a hook on its output tensor;
when the backward pass reaches that output, the rule turns (input, output gradient) into
per-example squared norms right away, so activations are released as early as autograd's own.
The handles are always removed on exit.

The loss is reduced by an explicit sum, Σ_i f_i; its gradient is Σ_i g_i, from which T comes,
taken with ``torch.autograd.grad`` so a user's ``.grad`` fields are never touched.

Policy for a trainable parameter that no rule covers (its module has no rule, it is tied to
another module, its module runs more than once per forward, or it is used outside its
module's forward): ``strict=True`` (engine="hooks") raises BatchboundError naming the modules;
otherwise (engine="auto") the torch.func vmap engine computes those parameters' norms, with
a warning naming the modules.
"""

from __future__ import annotations

import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from types import TracebackType

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from batchbound.diversity.engines import vmap_sq_norms
from batchbound.diversity.losses import PerExampleLoss, check_finite
from batchbound.diversity.rules import RuleEntry, rule_for
from batchbound.diversity.stats import PerExampleStats, trainable_parameters
from batchbound.errors import BatchboundError


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass
class HookPlan:
    """Which module computes which parameter's norms, decided before the forward pass."""

    covered: dict[str, tuple[nn.Module, RuleEntry]] = field(default_factory=dict)
    covered_params: dict[str, str] = field(default_factory=dict)  # param name -> module name
    uncovered: dict[str, list[str]] = field(default_factory=dict)  # module name -> params


def plan_hooks(model: nn.Module, params: dict[str, nn.Parameter] | None = None) -> HookPlan:
    params = trainable_parameters(model) if params is None else params
    name_of = {id(p): name for name, p in params.items()}
    owners: defaultdict[int, list[str]] = defaultdict(list)
    for prefix, module in model.named_modules(remove_duplicate=False):
        for local, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                owners[id(p)].append(_join(prefix, local))
    plan, listed = HookPlan(), set()
    for prefix, module in model.named_modules():
        entry = rule_for(module)
        for local, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            full = name_of[id(p)]
            if entry is not None and local in entry.params and len(owners[id(p)]) == 1:
                plan.covered[prefix] = (module, entry)
                plan.covered_params[full] = prefix
            elif full not in listed:  # no rule, or tied to several modules
                listed.add(full)
                why = ", tied to another module" if len(owners[id(p)]) > 1 else ""
                label = f"{prefix or '<root>'} ({type(module).__name__}{why})"
                plan.uncovered.setdefault(label, []).append(full)
    return plan


class NormHooks:
    """Hooks that fill ``sq_norms`` (parameter name -> (n,)) during one forward+backward."""

    def __init__(self, modules: dict[str, tuple[nn.Module, RuleEntry]]) -> None:
        self.modules = modules
        self.sq_norms: dict[str, Tensor] = {}
        self.calls: Counter[str] = Counter()
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> NormHooks:
        for prefix, (module, entry) in self.modules.items():
            self._handles.append(module.register_forward_hook(self._forward_hook(prefix, entry)))
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

    def _forward_hook(self, prefix: str, entry: RuleEntry):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, inputs: tuple, output: object) -> None:
            self.calls[prefix] += 1
            if not inputs or not isinstance(output, Tensor) or not output.requires_grad:
                return
            saved = inputs[0].detach()  # shares the version counter with the input
            version = saved._version

            def on_output_grad(grad_output: Tensor) -> None:
                if saved._version != version:
                    raise BatchboundError(
                        f"the input of module {prefix!r} was modified in place after its "
                        "forward pass; its per-example norms cannot be computed"
                    )
                for local, sq in entry.rule(module, saved, grad_output).items():
                    self.sq_norms[_join(prefix, local)] = sq

            self._handles.append(output.register_hook(on_output_grad))

        return hook


def _describe(uncovered: dict[str, list[str]]) -> str:
    return "; ".join(f"{label}: {', '.join(names)}" for label, names in uncovered.items())


def hooks_stats(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss_fn: PerExampleLoss,
    plan: HookPlan,
    params: dict[str, nn.Parameter],
    *,
    strict: bool,
    offset: int = 0,
) -> PerExampleStats:
    """One chunk through the hooks engine; ``plan`` and ``params`` come from ``plan_hooks``
    and ``trainable_parameters`` of this model (``PreparedStats`` makes them once)."""
    if plan.uncovered and strict:
        raise BatchboundError(
            "engine='hooks' has no layer rule for these modules' parameters (or they are tied): "
            f"{_describe(plan.uncovered)}; use engine='auto' (vmap fallback for them) or 'vmap'"
        )
    with NormHooks(plan.covered) as hooks:
        losses = loss_fn(model(x), y)
        check_finite(losses, offset)
        grads = torch.autograd.grad(losses.sum(), list(params.values()), allow_unused=True)
    grad_sum = {  # dense always (an Embedding(sparse=True) gives a sparse gradient)
        name: torch.zeros_like(p) if g is None else g.to_dense() if g.is_sparse else g
        for (name, p), g in zip(params.items(), grads, strict=True)
    }
    n = x.shape[0]
    uncovered = dict(plan.uncovered)
    for name, prefix in plan.covered_params.items():
        calls = hooks.calls[prefix]
        reason = None
        if calls > 1:
            reason = f"runs {calls} times per forward pass"
        elif calls == 0 and grads[list(params).index(name)] is not None:
            reason = "its parameter is used outside its forward"
        if reason:
            module = plan.covered[prefix][0]
            label = f"{prefix or '<root>'} ({type(module).__name__}, {reason})"
            uncovered.setdefault(label, []).append(name)
    if uncovered and strict:
        raise BatchboundError(
            f"engine='hooks' cannot cover these modules' parameters: {_describe(uncovered)}; "
            "use engine='auto' (vmap fallback for them) or 'vmap'"
        )
    fallback = [name for names in uncovered.values() for name in names]
    sq_norms: dict[str, Tensor] = {}
    if fallback:
        warnings.warn(
            "no layer rule covers the parameters of these modules, so torch.func vmap "
            f"computes their per-example norms (slower): {_describe(uncovered)}",
            stacklevel=3,
        )
        sq_norms.update(vmap_sq_norms(model, x, y, loss_fn, fallback)[0])
    for name, p in params.items():
        if name not in sq_norms:  # a parameter with no gradient in this pass has norms 0
            found = hooks.sq_norms.get(name)
            sq_norms[name] = p.new_zeros(n) if found is None else found
    sq_norms = {name: sq_norms[name] for name in params}
    return PerExampleStats(losses.detach(), sq_norms, grad_sum, tuple(fallback))
