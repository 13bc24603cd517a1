"""Fully connected families at a fixed parameter budget (seed 000).

Depth L counts *hidden* layers, as in seed 000's experiments (L = 1..10): a depth-L net has
L hidden layers of width K and L + 1 weight matrices, so its weight count is
d_in·K + (L−1)·K² + K·d_out. Depth 0 is the linear model x ↦ Wx (d_in·d_out weights).
Given a budget p, the solver picks the positive integer K whose count is closest to p.
(Seed 000's *theory* writes L for the number of weight matrices, i.e. our depth + 1.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from batchbound.errors import BatchboundError
from batchbound.models.registry import register_family

ACTIVATIONS = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "softsign": nn.Softsign,
    "arctan": None,  # built below: torch has no nn.Arctan module
    "linear": nn.Identity,
}


class Arctan(nn.Module):
    def forward(self, x):  # type: ignore[no-untyped-def]
        return x.atan()


def weight_count(d_in: int, width: int, depth: int, d_out: int) -> int:
    """Weights (no biases) of a net with L hidden layers: d_in·K + (L−1)·K² + K·d_out."""
    if depth == 0:
        return d_in * d_out
    return d_in * width + (depth - 1) * width**2 + width * d_out


def solve_width(params: int, d_in: int, depth: int, d_out: int) -> int:
    """The integer K ≥ 1 whose weight count is closest to ``params`` (seed 000's solver)."""
    if depth < 1:
        raise BatchboundError("solving a width needs depth >= 1: depth 0 has no hidden layer")
    a, b = depth - 1, d_in + d_out
    root = params / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)
    candidates = {max(1, math.floor(root)), max(1, math.ceil(root))}
    return min(candidates, key=lambda k: (abs(weight_count(d_in, k, depth, d_out) - params), k))


def fully_connected(
    input_shape: Sequence[int],
    num_outputs: int,
    depth: int = 2,
    width: int | None = None,
    params: int | None = None,
    act: str = "relu",
    bias: bool = True,
) -> nn.Sequential:
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
        raise BatchboundError(f"fc: depth (hidden layers) must be an integer >= 0, got {depth!r}")
    if act not in ACTIVATIONS:
        raise BatchboundError(f"fc: unknown act {act!r}; choose from {', '.join(ACTIVATIONS)}")
    d_in = math.prod(input_shape)
    if depth > 0:
        if (width is None) == (params is None):
            raise BatchboundError("fc: give exactly one of width=K or params=P")
        if params is not None:
            if params < 1:
                raise BatchboundError(f"fc: params must be >= 1, got {params}")
            width = solve_width(int(params), d_in, depth, num_outputs)
        if width is None or width < 1:
            raise BatchboundError(f"fc: width must be >= 1, got {width!r}")
    dims = [d_in, *[int(width or 0)] * depth, num_outputs]
    layers: list[nn.Module] = [nn.Flatten()]
    for i in range(depth + 1):
        layers.append(nn.Linear(dims[i], dims[i + 1], bias=bias))
        if i < depth:
            layers.append(Arctan() if act == "arctan" else ACTIVATIONS[act]())  # type: ignore[misc]
    return nn.Sequential(*layers)


register_family("fc")(fully_connected)
