"""Per-layer rules for per-example squared gradient norms, gathered in one table.

Each family lives in its own module and registers its rule with ``@register_rule`` into
``RULES``; the imports below are the complete list, so adding a layer means adding one
module and one line here.
"""

from batchbound.diversity.rules import conv, embedding, linear, norm
from batchbound.diversity.rules.registry import RULES, Rule, RuleEntry, register_rule, rule_for

__all__ = [
    "RULES",
    "Rule",
    "RuleEntry",
    "conv",
    "embedding",
    "linear",
    "norm",
    "register_rule",
    "rule_for",
]
