"""VGG-11/16 for CIFAR-sized images ([inefficiency] trains VGG16 on CIFAR-10).

3×3 convolutions (padding 1) each followed by normalisation and ReLU, 2×2 max pooling after
every stage, then global average pooling and one Linear layer: the common CIFAR variant, with
14,724,042 parameters for VGG16 on 3×32×32 with 10 classes (the convolutions have no bias
under normalisation). ``width`` multiplies every channel count (round, at least 1). A
pooling is skipped once the image is down to 1×1, so small inputs (8×8 digits, 28×28 MNIST)
work too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from batchbound.errors import BatchboundError
from batchbound.models.layers import NORMS, ModelShape, fold, image_input, norm2d, tag
from batchbound.models.options import choice, positive_float
from batchbound.models.registry import register_family
from batchbound.spec import Spec

POOL = "M"
CONFIGS: dict[int, list[int | str]] = {
    11: [64, POOL, 128, POOL, 256, 256, POOL, 512, 512, POOL, 512, 512, POOL],
    16: [64, 64, POOL, 128, 128, POOL, 256, 256, 256, POOL, 512, 512, 512, POOL,
         512, 512, 512, POOL],
}


@register_family("vgg")
def vgg(
    input_shape: Sequence[int],
    num_outputs: int,
    cfg: int = 16,
    width: float = 1.0,
    norm: str = "batch",
    image: Any = None,
) -> nn.Module:
    """VGG-``cfg`` with channel counts scaled by ``width``."""
    if cfg not in CONFIGS:
        choices = ", ".join(map(str, CONFIGS))
        raise BatchboundError(f"vgg: unknown cfg {cfg!r}; choose from {choices}")
    width = positive_float("vgg", "width", width)
    norm = choice("vgg", "norm", norm, NORMS)
    shape, folded = image_input("vgg", input_shape, image)
    layers: list[nn.Module] = fold(shape, folded)
    channels, side = shape[0], min(shape[1], shape[2])
    for item in CONFIGS[cfg]:
        if item == POOL:
            if side >= 2:
                layers.append(nn.MaxPool2d(2))
                side //= 2
            continue
        c_out = max(1, round(int(item) * width))
        layers += [
            nn.Conv2d(channels, c_out, 3, padding=1, bias=norm == "none"),
            norm2d(norm, c_out),
            nn.ReLU(),
        ]
        channels = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_outputs)]
    options: dict[str, Any] = {"cfg": cfg, "width": width, "norm": norm}
    if image is not None:
        options["image"] = list(shape)
    return tag(nn.Sequential(*layers), ModelShape("vgg", cfg, width, str(Spec("vgg", options))))
