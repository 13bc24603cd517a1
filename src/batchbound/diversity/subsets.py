"""Which parameters an online monitor reads: all of them, or only the normalisation layers'.

``"norms"`` keeps the affine parameters of LayerNorm and RMSNorm layers (torch's, nanoGPT's
LayerNorm, and Hugging Face's Llama RMSNorm, each with every copy of its code): Gray et al.
(2024, nanoGNS) found that the noise scale of these parameters alone, whose per-example
gradients cost almost nothing to read off the backward pass, tracks the whole model's. It
is an estimate of the *subset's* n·Δ, not of the model's: how well it agrees with the full
value on a given model is measured in docs/benchmarks.md (benchmarks/subsets.py), and a
user should check it on theirs before relying on it. A model with a LayerNorm or RMSNorm
layer no rule reads (one written with its own arithmetic, a subclass with a forward of its
own, Gemma's ``1 + weight``) is refused, not measured without it.
"""

from __future__ import annotations

import re

from torch import nn

from batchbound.diversity.rules import rule_for
from batchbound.diversity.rules.norm import (
    layer_norm_rule,
    llama_rms_norm_rule,
    nanogpt_layer_norm_rule,
    rms_norm_rule,
)
from batchbound.diversity.stats import trainable_parameters
from batchbound.errors import BatchboundError

SUBSETS = ("all", "norms")
_NORM_RULES = (layer_norm_rule, rms_norm_rule, llama_rms_norm_rule, nanogpt_layer_norm_rule)
_NORM_NAME = re.compile(r"(layer|rms)_?norm(\d+d)?$", re.IGNORECASE)  # the name's end


def norm_layer_modules(model: nn.Module) -> list[str]:
    """The names of the model's LayerNorm and RMSNorm modules (those with a norm rule)."""
    out = []
    for name, module in model.named_modules():
        entry = rule_for(module)
        if entry is not None and entry.rule in _NORM_RULES:
            out.append(name)
    return out


def _looks_like_a_norm(module: nn.Module) -> bool:
    """A LayerNorm or RMSNorm layer, by its class (torch's, or one of theirs subclassed) or
    its class's name (nanoGPT's ``LayerNorm``, a library's ``…RMSNorm``): what a user asking
    for the norms' subset expects to be read. It guards against leaving one out silently;
    a class named otherwise is not seen."""
    kind = type(module)
    return issubclass(kind, (nn.LayerNorm, nn.RMSNorm)) or bool(_NORM_NAME.search(kind.__name__))


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
    unread = [(name, type(module).__name__) for name, module in model.named_modules()
              if _looks_like_a_norm(module)
              and any(id(p) not in chosen for p in module.parameters(recurse=False)
                      if p.requires_grad)]
    if unread:
        shown = ", ".join(f"{name or '(the model)'} ({kind})" for name, kind in unread[:4])
        more = f" and {len(unread) - 4} more" if len(unread) > 4 else ""
        raise BatchboundError(
            f"subset='norms' reads LayerNorm and RMSNorm layers by their rules, and "
            f"{len(unread)} of {type(model).__name__}'s normalisation layers have none: "
            f"{shown}{more}; the subset's n·Δ would leave them out. Use subset='all' "
            "(the exact fallback measures them)")
    picked = {name: p for name, p in params.items() if id(p) in chosen}
    if not picked:
        raise BatchboundError(
            f"subset='norms' reads LayerNorm and RMSNorm parameters, and "
            f"{type(model).__name__} has no trainable ones; use subset='all'")
    return picked
