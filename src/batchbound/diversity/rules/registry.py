"""The one table of per-layer rules: module type -> rule.

A rule has one signature, ``rule(module, inputs, grad_output) -> {param_name: (n,) tensor}``:

- ``inputs`` is the module's first positional input from the forward pass (detached);
- ``grad_output`` is ∂(Σ_i f_i)/∂output, whose row i is ∂f_i/∂output_i because the loss is
  an explicit sum of per-example losses and the layers keep examples apart;
- it returns, for each of the module's own trainable parameters (``module.weight``,
  ``module.bias``; the local name is the key), the per-example squared gradient norms ‖g_i‖².

Register a rule with ``@register_rule(nn.SomeLayer, ...)``. Lookup is by exact type, so a
subclass that changes ``forward`` is never silently given its parent's rule; it goes to the
fallback engine instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

Rule = Callable[[nn.Module, Tensor, Tensor], dict[str, Tensor]]


@dataclass(frozen=True)
class RuleEntry:
    rule: Rule
    params: tuple[str, ...]  # the local parameter names the rule covers


RULES: dict[type[nn.Module], RuleEntry] = {}


def register_rule(
    *module_types: type[nn.Module], params: tuple[str, ...] = ("weight", "bias")
) -> Callable[[Rule], Rule]:
    """Register ``rule`` for each of ``module_types``; ``params`` are the parameters it covers."""

    def decorate(rule: Rule) -> Rule:
        for module_type in module_types:
            if module_type in RULES:
                raise ValueError(f"a rule for {module_type.__name__} is registered twice")
            RULES[module_type] = RuleEntry(rule, tuple(params))
        return rule

    return decorate


def rule_for(module: nn.Module) -> RuleEntry | None:
    return RULES.get(type(module))


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
