"""Fully connected families at a fixed parameter budget ([width]): ``fc`` and ``linear``.

Depth L counts *hidden* layers, as in [width]'s experiments (L = 1..10): a depth-L net has
L hidden layers of width K and L + 1 weight matrices, so its weight count is
d_in·K + (L−1)·K² + K·d_out. Depth 0 is the linear model x ↦ Wx (d_in·d_out weights).
Given a budget p, the solver picks the positive integer K whose count is closest to p.
By default the budget counts weights only, as [width] does; ``count_biases=true`` makes the
solver count the L·K + d_out biases too. ([width]'s *theory* writes L for the number of weight
matrices, i.e. our depth + 1.)

``linear`` is [width]'s deep linear network: no activations and no biases. Its ``init`` option
picks the weights' distribution: ``default`` is PyTorch's (``nn.Linear``'s Kaiming-uniform,
std 1/√(3·fan_in)); ``normal`` draws every weight i.i.d. from N(0, init_std²), init_std = 1 by
default, Theorem 3's setting. Both are seeded by the model seed (``build_model(seed=...)``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from batchbound.errors import BatchboundError
from batchbound.models.layers import ModelShape, activation, tag
from batchbound.models.options import (
    choice,
    flag,
    layer_count,
    one_of_width_params,
    parameter_budget,
    positive_float,
    positive_int,
)
from batchbound.models.registry import register_family
from batchbound.spec import Spec


def weight_count(d_in: int, width: int, depth: int, d_out: int) -> int:
    """Weights (no biases) of a net with L hidden layers: d_in·K + (L−1)·K² + K·d_out."""
    if depth == 0:
        return d_in * d_out
    return d_in * width + (depth - 1) * width**2 + width * d_out


def bias_count(width: int, depth: int, d_out: int) -> int:
    """Biases of the same net: one per hidden unit and per output, L·K + d_out."""
    return depth * width + d_out


def budget_count(d_in: int, width: int, depth: int, d_out: int, count_biases: bool = False) -> int:
    """What the solver compares with the budget: weights, plus biases when asked."""
    extra = bias_count(width, depth, d_out) if count_biases else 0
    return weight_count(d_in, width, depth, d_out) + extra


def solve_width(
    params: int, d_in: int, depth: int, d_out: int, count_biases: bool = False
) -> int:
    """The integer K >= 1 whose budget count is closest to ``params`` ([width]'s solver).

    The count a·K² + b·K + c is increasing in K, so the real root of a·K² + b·K + c = p lies
    between the two best integers; ties go to the smaller K.
    """
    if depth < 1:
        raise BatchboundError("solving a width needs depth >= 1: depth 0 has no hidden layer")
    a = depth - 1
    b = d_in + d_out + (depth if count_biases else 0)
    c = d_out if count_biases else 0
    target = params - c
    root = target / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * target)) / (2 * a)
    candidates = {max(1, math.floor(root)), max(1, math.ceil(root))}
    return min(
        candidates,
        key=lambda k: (abs(budget_count(d_in, k, depth, d_out, count_biases) - params), k),
    )


def _resolve_width(
    family: str,
    d_in: int,
    d_out: int,
    depth: object,
    width: object,
    params: object,
    count_biases: bool,
) -> tuple[int, int]:
    depth = layer_count(family, "depth (hidden layers)", depth, minimum=0)
    one_of_width_params(family, width, params)
    if depth == 0:
        if width is not None:
            raise BatchboundError(f"{family}: depth=0 has no hidden layer, so no width")
        if params is not None:
            parameter_budget(family, params)
        return 0, 0
    if params is not None:
        return depth, solve_width(parameter_budget(family, params), d_in, depth, d_out,
                                  count_biases)
    if width is None:
        raise BatchboundError(f"{family}: give width=K or params=P (depth={depth} needs a width)")
    return depth, positive_int(family, "width", width)


def _stack(d_in: int, width: int, depth: int, d_out: int, act: str, bias: bool) -> list[nn.Module]:
    dims = [d_in, *[width] * depth, d_out]
    layers: list[nn.Module] = [nn.Flatten()]
    for i in range(depth + 1):
        layers.append(nn.Linear(dims[i], dims[i + 1], bias=bias))
        if i < depth and act != "linear":
            layers.append(activation("fc", act))
    return layers


@register_family("fc", sweep="layers")
def fully_connected(
    input_shape: Sequence[int],
    num_outputs: int,
    depth: int = 2,
    width: int | None = None,
    params: int | None = None,
    act: str = "relu",
    bias: bool = True,
    count_biases: bool = False,
) -> nn.Module:
    """``depth`` hidden layers of ``width`` units (or the width that meets ``params``)."""
    bias = flag("fc", "bias", bias)
    count_biases = flag("fc", "count_biases", count_biases)
    activation("fc", act)  # validate before solving
    d_in = math.prod(input_shape)
    depth, width = _resolve_width(
        "fc", d_in, num_outputs, depth, width, params, count_biases and bias
    )
    resolved = Spec("fc", {"depth": depth, "width": width, "act": act, "bias": bias})
    if depth == 0:
        resolved = Spec("fc", {"depth": 0, "act": act, "bias": bias})
    model = nn.Sequential(*_stack(d_in, width, depth, num_outputs, act, bias))
    return tag(model, ModelShape("fc", depth, width, str(resolved)))


LINEAR_INITS = ("default", "normal")


def _linear_init(init: object, init_std: object) -> tuple[str, float | None]:
    """Validate ``init`` and ``init_std``; init_std belongs to ``normal`` only (1.0 if omitted)."""
    init = choice("linear", "init", init, LINEAR_INITS)
    if init == "default":
        if init_std is not None:
            raise BatchboundError(
                "linear: init_std applies to init=normal only (init=default is PyTorch's "
                "initialisation, whose scale is set by fan-in)"
            )
        return init, None
    return init, 1.0 if init_std is None else positive_float("linear", "init_std", init_std)


@register_family("linear", sweep="layers")
def deep_linear(
    input_shape: Sequence[int],
    num_outputs: int,
    depth: int = 2,
    width: int | None = None,
    params: int | None = None,
    init: str = "default",
    init_std: float | None = None,
) -> nn.Module:
    """[width]'s deep linear network: ``depth`` hidden linear layers, no biases.

    ``init=normal`` redraws every weight i.i.d. N(0, init_std²) (init_std = 1: Theorem 3)
    after PyTorch's default initialisation, from the same generator, so a seed fixes them.
    """
    init, std = _linear_init(init, init_std)
    d_in = math.prod(input_shape)
    depth, width = _resolve_width("linear", d_in, num_outputs, depth, width, params, False)
    options: dict[str, object] = {"depth": depth, "width": width} if depth else {"depth": 0}
    if init != "default":
        options["init"] = init
        if std != 1.0:
            options["init_std"] = std
    resolved = Spec("linear", options)
    model = nn.Sequential(*_stack(d_in, width, depth, num_outputs, "linear", bias=False))
    if init == "normal":
        with torch.no_grad():
            for layer in model.modules():
                if isinstance(layer, nn.Linear):
                    layer.weight.normal_(0.0, std)
    return tag(model, ModelShape("linear", depth, width, str(resolved)))
