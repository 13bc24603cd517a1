"""A small 1-D convolutional network for MNIST-1D (Greydanus 2020's ConvBase).

``depth`` convolutions of ``width`` channels, each with stride 2 and ReLU (the first 5 wide,
padding 1; the others 3 wide, padding 1), then one Linear classifier on the flattened
features. At the defaults (width 25, depth 3) and MNIST-1D's 40 samples this is the reference
network of the mnist1d package: 40 → 19 → 10 → 5 positions, 125 features, 5,210 parameters.

Input (C, L) is used as is; a flat input (L,) is read as one channel. ``params=P`` solves the
integer width whose parameter count (biases included) is closest to P, by bisection.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from batchbound.errors import BatchboundError
from batchbound.models.layers import ModelShape, tag
from batchbound.models.options import (
    closest_integer,
    layer_count,
    meta_parameter_count,
    one_of_width_params,
    parameter_budget,
    positive_int,
)
from batchbound.models.registry import register_family
from batchbound.spec import Spec


def _length_after(length: int, depth: int) -> int:
    for i in range(depth):
        kernel = 5 if i == 0 else 3
        length = (length + 2 - kernel) // 2 + 1
    return length


def _build(channels: int, length: int, flat: bool, num_outputs: int, width: int,
           depth: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Unflatten(1, (1, length))] if flat else []
    c_in = channels
    for i in range(depth):
        layers += [nn.Conv1d(c_in, width, 5 if i == 0 else 3, stride=2, padding=1), nn.ReLU()]
        c_in = width
    features = width * _length_after(length, depth)
    layers += [nn.Flatten(), nn.Linear(features, num_outputs)]
    return nn.Sequential(*layers)


@register_family("cnn1d", sweep="solved")
def cnn1d(
    input_shape: Sequence[int],
    num_outputs: int,
    width: int | None = None,
    params: int | None = None,
    depth: int = 3,
) -> nn.Module:
    """``depth`` stride-2 Conv1d layers of ``width`` channels (default 25) and a Linear."""
    one_of_width_params("cnn1d", width, params)
    depth = layer_count("cnn1d", "depth", depth)
    shape = tuple(int(s) for s in input_shape)
    if len(shape) not in (1, 2):
        raise BatchboundError(
            f"cnn1d needs a sequence input of shape (L,) or (C, L), got {shape}"
        )
    flat = len(shape) == 1
    channels, length = (1, shape[0]) if flat else shape
    if _length_after(length, depth) < 1:
        raise BatchboundError(
            f"cnn1d: a length-{length} input is too short for {depth} stride-2 convolutions"
        )

    def build(w: int) -> nn.Sequential:
        return _build(channels, length, flat, num_outputs, w, depth)

    if params is not None:
        budget = parameter_budget("cnn1d", params)
        width = closest_integer(lambda w: meta_parameter_count(lambda: build(w)), budget)
    width = 25 if width is None else positive_int("cnn1d", "width", width)
    resolved = str(Spec("cnn1d", {"width": width, "depth": depth}))
    return tag(build(width), ModelShape("cnn1d", depth + 1, width, resolved))
