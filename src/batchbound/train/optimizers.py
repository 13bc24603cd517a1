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


__all__ = ["ADAPTIVE", "OPTIMIZERS", "build_optimizer", "is_adaptive", "register_optimizer"]
