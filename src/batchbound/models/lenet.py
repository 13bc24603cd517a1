"""LeNet for 1- and 3-channel images: two 5×5 convolutions with 2×2 max pooling, then a fully
connected head.

At ``width_mult=1`` the convolutions have 20 and 50 channels and the head one hidden layer of
500 units: Caffe's LeNet, 431,080 parameters on 28×28 MNIST, [width]'s "LeNet, 431k".
``width_mult`` scales the two convolutions (round(20·m), round(50·m) channels); ``head`` lists
the hidden widths of the fully connected part and is taken as given ([width] varies the
convolutional part and the fully connected part separately).

``params=P`` searches the convolution widths: over integers c2 = 1, 2, ... for the second
convolution's channels (m = c2/50, c1 = round(0.4·c2)), the parameter count (all trainable
parameters, biases included) is non-decreasing, and a bisection picks the c2 whose count is
closest to P. The head is held fixed during the search.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from batchbound.errors import BatchboundError
from batchbound.models.layers import (
    ModelShape,
    activation,
    fc_head,
    fold,
    head_widths,
    image_input,
    tag,
)
from batchbound.models.options import (
    choice,
    closest_integer,
    meta_parameter_count,
    one_of_width_params,
    parameter_budget,
    positive_float,
    positive_int,
)
from batchbound.models.registry import register_family
from batchbound.spec import Spec

BASE_CHANNELS = (20, 50)
DEFAULT_HEAD = (500,)


def _channels(width_mult: float) -> tuple[int, int]:
    return tuple(max(1, round(c * width_mult)) for c in BASE_CHANNELS)  # type: ignore[return-value]


def _feature_side(side: int, padding: int) -> int:
    """Spatial size after conv5 → pool2 → conv5 → pool2 (floor at each pooling)."""
    side = (side + 2 * padding - 4) // 2
    return (side + 2 * padding - 4) // 2


def _build(
    image: tuple[int, int, int],
    folded: bool,
    num_outputs: int,
    width_mult: float,
    hidden: list[int],
    act: str,
    padding: int,
) -> nn.Sequential:
    channels, height, width = image
    c1, c2 = _channels(width_mult)
    features = c2 * _feature_side(height, padding) * _feature_side(width, padding)
    return nn.Sequential(
        *fold(image, folded),
        nn.Conv2d(channels, c1, 5, padding=padding),
        activation("lenet", act),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5, padding=padding),
        activation("lenet", act),
        nn.MaxPool2d(2),
        nn.Flatten(),
        *fc_head(features, hidden, num_outputs, act),
    )


@register_family("lenet", sweep="head")
def lenet(
    input_shape: Sequence[int],
    num_outputs: int,
    width_mult: float | None = None,
    params: int | None = None,
    head: Any = None,
    act: str = "relu",
    padding: int = 0,
    image: Any = None,
) -> nn.Module:
    """LeNet; ``padding=2`` keeps 5×5 convolutions from shrinking small images (e.g. 8×8)."""
    one_of_width_params("lenet", width_mult, params)
    choice("lenet", "act", act, ["relu", "tanh"])
    padding = positive_int("lenet", "padding", padding, minimum=0)
    hidden = list(DEFAULT_HEAD) if head is None else head_widths("lenet", head)
    shape, folded = image_input("lenet", input_shape, image)
    if min(_feature_side(shape[1], padding), _feature_side(shape[2], padding)) < 1:
        raise BatchboundError(
            f"lenet: a {shape[1]}×{shape[2]} image is too small for two 5×5 convolutions and "
            f"two 2×2 poolings with padding={padding}; use padding=2"
        )

    def build(m: float) -> nn.Sequential:
        return _build(shape, folded, num_outputs, m, hidden, act, padding)

    if params is not None:
        budget = parameter_budget("lenet", params)
        c2 = closest_integer(lambda n: meta_parameter_count(lambda: build(n / 50)), budget)
        width_mult = c2 / BASE_CHANNELS[1]
    m = 1.0 if width_mult is None else positive_float("lenet", "width_mult", width_mult)
    options: dict[str, Any] = {"width_mult": m, "head": hidden, "act": act, "padding": padding}
    if image is not None:
        options["image"] = list(shape)
    depth = 2 + len(hidden) + 1
    return tag(build(m), ModelShape("lenet", depth, m, str(Spec("lenet", options))))
