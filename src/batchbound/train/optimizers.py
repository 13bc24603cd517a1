"""The optimisers a run can train with, one registration each.

``sgd`` (the default; with ``momentum``) is what the papers' studies run; ``adamw`` and
``adam`` are what language models are trained with. Every optimiser takes the config's
``weight_decay`` (decoupled for ``adamw``, an L2 term in the gradient for ``sgd`` and
``adam``). The learning rate is set by the trainer's strategy at every step, whatever the
optimiser; ``ADAPTIVE`` lists the Adam-type ones, whose rate rule for a batch change is the
square root (Malladi et al. 2022; Merrill et al. 2025), where SGD's follows the noise scale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Factory = Callable[[list[torch.Tensor], Any], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Factory] = {}
ADAPTIVE = ("adamw", "adam")  # Adam-type: per-coordinate scaling, √k rate rule


def register_optimizer(name: str) -> Callable[[Factory], Factory]:
    def decorate(factory: Factory) -> Factory:
        if name in OPTIMIZERS:
            raise ValueError(f"optimizer {name!r} registered twice")
        OPTIMIZERS[name] = factory
        return factory

    return decorate


@register_optimizer("sgd")
def _sgd(params: list[torch.Tensor], config: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum,
                           weight_decay=config.weight_decay)


# foreach=False: one kernel per tensor in a fixed order, the same on every run and rank
@register_optimizer("adamw")
def _adamw(params: list[torch.Tensor], config: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=config.lr, betas=tuple(config.betas), eps=config.eps,
                             weight_decay=config.weight_decay, foreach=False)


@register_optimizer("adam")
def _adam(params: list[torch.Tensor], config: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=config.lr, betas=tuple(config.betas), eps=config.eps,
                            weight_decay=config.weight_decay, foreach=False)


def build_optimizer(params: list[torch.Tensor], config: Any) -> torch.optim.Optimizer:
    """The config's optimiser over ``params`` (its name is checked by TrainConfig)."""
    return OPTIMIZERS[config.optimizer](params, config)


def is_adaptive(name: str) -> bool:
    return name in ADAPTIVE


def adam_preconditioner(optimizer: torch.optim.Optimizer,
                        params: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """An Adam-type optimiser's diagonal preconditioner 1/(√v̂ + ε) per parameter, v̂ its
    bias-corrected second moment: the metric its steps take. None before its first step, or
    when some parameter has no second moment (not Adam-type)."""
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    out = []
    for p in params:
        state, group = optimizer.state.get(p, {}), group_of.get(id(p))
        if "exp_avg_sq" not in state or group is None or "betas" not in group:
            return None
        steps = float(state["step"])
        if steps < 1:
            return None
        v = state["exp_avg_sq"] / (1.0 - group["betas"][1] ** steps)
        out.append(1.0 / (v.sqrt() + group["eps"]))
    return out


__all__ = ["ADAPTIVE", "OPTIMIZERS", "adam_preconditioner", "build_optimizer", "is_adaptive",
           "register_optimizer"]
