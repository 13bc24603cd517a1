"""AlexNet for CIFAR-sized images ([inefficiency] trains it on CIFAR-10).

The common CIFAR variant: five convolutions (11×11 stride 4, 5×5, then three 3×3) with 64,
192, 384, 256 and 256 channels, ReLU, three 2×2 max poolings, and one Linear classifier on the
pooled features: 2,472,266 parameters on 3×32×32 with 10 classes. ``width`` multiplies every
channel count (round, at least 1). A pooling is skipped once the image is down to 1×1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from batchbound.models.layers import ModelShape, fold, image_input, tag
from batchbound.models.options import positive_float
from batchbound.models.registry import register_family
from batchbound.spec import Spec

POOL = "M"
# (channels, kernel, stride, padding) per convolution; POOL marks a 2×2 max pooling.
LAYERS: list[tuple[int, int, int, int] | str] = [
    (64, 11, 4, 5), POOL, (192, 5, 1, 2), POOL, (384, 3, 1, 1), (256, 3, 1, 1), (256, 3, 1, 1),
    POOL,
]


@register_family("alexnet")
def alexnet(
    input_shape: Sequence[int],
    num_outputs: int,
    width: float = 1.0,
    image: Any = None,
) -> nn.Module:
    """AlexNet with channel counts scaled by ``width``."""
    width = positive_float("alexnet", "width", width)
    shape, folded = image_input("alexnet", input_shape, image)
    layers: list[nn.Module] = fold(shape, folded)
    channels, side = shape[0], min(shape[1], shape[2])
    for item in LAYERS:
        if item == POOL:
            if side >= 2:
                layers.append(nn.MaxPool2d(2))
                side //= 2
            continue
        c, kernel, stride, padding = item  # type: ignore[misc]
        c_out = max(1, round(c * width))
        layers += [nn.Conv2d(channels, c_out, kernel, stride, padding), nn.ReLU()]
        channels, side = c_out, (side + 2 * padding - kernel) // stride + 1
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_outputs)]
    options: dict[str, Any] = {"width": width}
    if image is not None:
        options["image"] = list(shape)
    resolved = str(Spec("alexnet", options))
    return tag(nn.Sequential(*layers), ModelShape("alexnet", 6, width, resolved))
