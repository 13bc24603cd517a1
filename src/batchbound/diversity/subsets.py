"""Which parameters an online monitor reads: all of them, or only the normalisation layers'.

``"norms"`` keeps the affine parameters of LayerNorm and RMSNorm layers (torch's and Hugging
Face's): Gray et al. (2024, nanoGNS) found that the noise scale of these parameters alone,
whose per-example gradients cost almost nothing to read off the backward pass, tracks the
whole model's. It is an estimate of the *subset's* n·Δ, not of the model's: how well it
agrees with the full value on a given model is measured in docs/benchmarks.md
(benchmarks/subsets.py), and a user should check it on theirs before relying on it.
"""

from __future__ import annotations

from torch import nn

from batchbound.diversity.rules import rule_for
from batchbound.diversity.rules.norm import layer_norm_rule, llama_rms_norm_rule, rms_norm_rule
from batchbound.diversity.stats import trainable_parameters
from batchbound.errors import BatchboundError

SUBSETS = ("all", "norms")
_NORM_RULES = (layer_norm_rule, rms_norm_rule, llama_rms_norm_rule)


def norm_layer_modules(model: nn.Module) -> list[str]:
    """The names of the model's LayerNorm and RMSNorm modules (those with a norm rule)."""
    out = []
    for name, module in model.named_modules():
        entry = rule_for(module)
        if entry is not None and entry.rule in _NORM_RULES:
            out.append(name)
    return out


def monitored_parameters(model: nn.Module, subset: str = "all") -> dict[str, nn.Parameter]:
    """The trainable parameters ``subset`` selects, in ``named_parameters`` order."""
    if subset not in SUBSETS:
        raise BatchboundError(f"unknown parameter subset {subset!r}; choose from "
                              f"{', '.join(SUBSETS)}")
    params = trainable_parameters(model)
    if subset == "all":
        return params
    chosen = {id(p) for name in norm_layer_modules(model)
              for p in model.get_submodule(name).parameters(recurse=False)}
    picked = {name: p for name, p in params.items() if id(p) in chosen}
    if not picked:
        raise BatchboundError(
            f"subset='norms' reads LayerNorm and RMSNorm parameters, and "
            f"{type(model).__name__} has no trainable ones; use subset='all'")
    return picked
