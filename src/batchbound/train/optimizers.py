"""The optimisers a run can train with, one registration each.

``sgd`` (the default; with ``momentum``) is what the papers' studies run; ``adamw`` and
``adam`` are what language models are trained with. Every optimiser takes the config's
``weight_decay`` (decoupled for ``adamw``, an L2 term in the gradient for ``sgd`` and
``adam``). The learning rate is set by the trainer's strategy at every step, whatever the
optimiser; ``ADAPTIVE`` lists the Adam-type ones, whose rate rule for a batch change is the
square root (Malladi et al. 2022; Merrill et al. 2025), where SGD's follows the noise scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from batchbound.errors import BatchboundError

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


def user_optimizer(factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                   params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The optimiser a user's factory ``params -> Optimizer`` makes over ``params``, or a
    BatchboundError naming what is wrong with it. It must hold exactly ``params``: the
    trainer steps a copy of the user's model, so an optimiser over the user's own module (a
    factory closing over it) would never move the copy, and a parameter left out would count
    in the noise scale without ever being stepped. Its groups must share one rate: the
    trainer sets every group's rate from η0 and the rate rule, which would silently replace
    a group's own."""
    try:
        made = factory(params)
    except BatchboundError:
        raise
    except Exception as exc:  # the user's code: its own words, on one line
        said = str(exc).strip().splitlines()
        raise BatchboundError(f"the optimizer factory raised {type(exc).__name__}"
                              + (f": {said[0]}" if said else "")
                              + " (it is called with a list of the trainable parameter "
                              "tensors)") from exc
    if not isinstance(made, torch.optim.Optimizer):
        raise BatchboundError(f"the optimizer factory returned a {type(made).__name__}, not a "
                              "torch.optim.Optimizer")
    given = {id(p) for p in params}
    held = {id(p) for group in made.param_groups for p in group["params"]}
    foreign = len(held - given)
    if foreign:
        raise BatchboundError(
            f"the optimizer factory's optimizer holds {foreign} parameter(s) not given to it: "
            "build it from the params it is passed (the trainer trains a copy of your model, "
            "so your model's own parameters would never move)")
    missing = len(given - held)
    if missing:
        raise BatchboundError(
            f"the optimizer factory leaves {missing} of the {len(given)} trainable parameters "
            "out of its optimizer: their gradients would count in the noise scale but never "
            "be stepped; set requires_grad=False on the parameters you do not train")
    rates = sorted({float(group["lr"]) for group in made.param_groups if "lr" in group})
    if len(rates) > 1:
        raise BatchboundError(
            f"the optimizer's parameter groups have different rates ({', '.join(map(str, rates))}"
            "): the trainer sets every group's rate from one η0 and the rate rule, so give "
            "every group the same lr")
    return made


def is_adaptive(name: str) -> bool:
    return name in ADAPTIVE


def adam_preconditioner(optimizer: torch.optim.Optimizer,
                        params: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """An Adam-type optimiser's diagonal preconditioner 1/(√v̂ + ε) per parameter, v̂ its
    bias-corrected second moment (with amsgrad, of its running maximum): the metric its
    steps take. None before its first step, or
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
        # amsgrad divides by the running maximum of v, the metric its steps take
        second = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
        v = second / (1.0 - group["betas"][1] ** steps)
        out.append(1.0 / (v.sqrt() + group["eps"]))
    return out


def scales_per_coordinate(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
                          ) -> bool:
    """Whether the optimiser divides each coordinate's step by that coordinate's own scale
    (Adam, RMSprop, Adagrad, ...), read off what it does, not what it is called: a few steps
    on two float64 coordinates whose constant gradients differ 100× (weight decay off). SGD,
    with or without momentum, moves them 100× apart; a per-coordinate optimiser nearly
    alike."""
    param = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    optimizer = make([param])
    for group in optimizer.param_groups:
        group["weight_decay"] = 0.0
    with torch.no_grad():
        for _ in range(3):
            param.grad = torch.tensor([1.0, 100.0], dtype=torch.float64)
            optimizer.step()
    small, large = (-param).tolist()
    if not (math.isfinite(small) and math.isfinite(large) and small > 0):
        return False  # it does not move down a constant gradient: nothing to tell
    return not math.isclose(large / small, 100.0, rel_tol=1e-6)


def unscaled_start(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
                   horizon: int = 1000) -> int:
    """How many of the optimiser's first steps are unscaled, as SGD's, before one scales
    each coordinate by its own: steps on two float64 coordinates whose constant gradients
    differ 100×, each step's two moves compared (weight decay off). RAdam's first steps,
    before its rectification (ρ_t > 5), move them 100× apart, its later ones alike. 0 when
    the first step scales them, ``horizon`` when none of the first ``horizon`` does (its
    steps are SGD's: RAdam whose β2 never lets ρ_t pass 5, Adam with a huge ε)."""
    param = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    optimizer = make([param])
    for group in optimizer.param_groups:
        group["weight_decay"] = 0.0
    with torch.no_grad():
        for step in range(horizon):
            before = param.detach().clone()
            param.grad = torch.tensor([1.0, 100.0], dtype=torch.float64)
            optimizer.step()
            small, large = (before - param).tolist()
            if not (math.isfinite(small) and math.isfinite(large) and small > 0):
                return 0  # it does not move down a constant gradient: nothing to tell
            if not math.isclose(large / small, 100.0, rel_tol=1e-6):
                return step
    return horizon


def coupled_decay(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> bool:
    """Whether the optimiser's weight decay λ enters the gradient it steps on, g + λθ (L2:
    SGD's, Adam's, RMSprop's, Adagrad's), read off what it does: three steps with decay λ
    against three without it on the gradient plus λθ, on two float64 coordinates, must
    land on the same point. Decoupled decay (AdamW's θ ← θ − ηλθ beside the step) does
    not, nor does an optimiser without a weight_decay setting."""
    def run(decay: float, added: float) -> list[float]:
        param = torch.tensor([0.5, -1.5], dtype=torch.float64, requires_grad=True)
        optimizer = make([param])
        for group in optimizer.param_groups:
            group["weight_decay"] = decay
        with torch.no_grad():
            for _ in range(3):
                param.grad = torch.tensor([1.0, 0.01], dtype=torch.float64) + added * param
                optimizer.step()
        return param.tolist()

    probe = make([torch.zeros(1, dtype=torch.float64, requires_grad=True)])
    if not all("weight_decay" in group for group in probe.param_groups):
        return False
    decayed, added, plain = run(0.25, 0.0), run(0.0, 0.25), run(0.0, 0.0)
    same = all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)
               for a, b in zip(decayed, added, strict=True))
    return same and decayed != plain  # a decay that moves nothing is no decay


def step_lag(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
             tolerance: float = 1e-9, max_steps: int = 100_000) -> float:
    """How many steps the optimiser's summed step trails its steady step from the start,
    under a constant gradient and a constant rate: Σ_s (1 − step_s/step_∞). Measured by
    stepping the optimiser ``make`` builds on one float64 scalar (weight decay off), so it
    holds for any optimiser: μ/(1 − μ) for SGD's heavy ball (PyTorch starts its buffer at
    the first gradient, so the step grows from η to η/(1 − μ)), 0 for plain SGD and for
    Adam (its bias-corrected moments give the steady step from the first).

    A step that has only shrunk since the first, to half of it or less, is taken to lead
    its steady step rather than trail it: lag 0, and the stepping stops there. That is a
    rule read off the steps, not a proof: a step that shrank so far and later grew back
    above its start would trail after all (NAdam's dips to 0.7 of its first and climbs
    back, above the half). Adagrad's step η/√t never settles: it took all ``max_steps``
    steps (seconds, on every advise call) to end at 0 all the same; RMSprop's falls from
    η/√(1 − α) to η, lag 0 either way."""
    param = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    optimizer = make([param])
    for group in optimizer.param_groups:
        group["weight_decay"] = 0.0
    steps: list[float] = []
    shrinking = True  # no step so far larger than the one before
    with torch.no_grad():
        for _ in range(max_steps):
            before = float(param)
            param.grad = torch.ones_like(param)
            optimizer.step()
            steps.append(before - float(param))
            if len(steps) > 1:
                shrinking = shrinking and steps[-1] <= steps[-2]
                if shrinking and 0 < steps[-1] <= steps[0] / 2:
                    return 0.0  # each term 1 − step_s/step_∞ < 0 while it keeps shrinking
                if abs(steps[-1] - steps[-2]) <= tolerance * abs(steps[-1]):
                    break
    steady = steps[-1]
    if not (math.isfinite(steady) and steady > 0):
        return 0.0  # it does not move down a constant gradient: no lag to speak of
    lag = sum(1.0 - step / steady for step in steps)
    return lag if lag > 1e-6 else 0.0  # below that: float rounding of a steady step


__all__ = ["ADAPTIVE", "OPTIMIZERS", "adam_preconditioner", "build_optimizer", "coupled_decay",
           "is_adaptive", "register_optimizer", "scales_per_coordinate", "step_lag",
           "unscaled_start", "user_optimizer"]
