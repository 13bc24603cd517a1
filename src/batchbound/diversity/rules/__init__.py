"""Per-layer rules for per-example gradients, gathered in one table.

Each family lives in its own module and registers its rule with ``@register_rule`` into
``RULES``; the imports below are the complete list, so adding a layer means adding one
module and one line here. ``forms.py`` holds the forms a rule returns its gradients in.
"""

from batchbound.diversity.rules import attention, conv, embedding, linear, norm, recurrent
from batchbound.diversity.rules.forms import (
    DEFER_NUMEL,
    Dense,
    Lazy,
    Outer,
    PerExampleGrad,
    combined_sq_norms,
    inner,
    project,
    project_bound,
    sum_dense,
)
from batchbound.diversity.rules.registry import (
    RULES,
    Call,
    Rule,
    RuleEntry,
    register_rule,
    rule_for,
)

__all__ = [
    "DEFER_NUMEL",
    "RULES",
    "Call",
    "Dense",
    "Lazy",
    "Outer",
    "PerExampleGrad",
    "Rule",
    "RuleEntry",
    "attention",
    "combined_sq_norms",
    "conv",
    "embedding",
    "inner",
    "linear",
    "norm",
    "project",
    "project_bound",
    "recurrent",
    "register_rule",
    "rule_for",
    "sum_dense",
]
