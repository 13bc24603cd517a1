"""MobileNetV2 for CIFAR-sized images (Sandler et al. 2018; [inefficiency] trains it on CIFAR-10).

Inverted residual blocks: a 1×1 expansion, a depthwise 3×3 convolution (a Conv2d with one group
per channel), a linear 1×1 projection, and a residual addition when the block keeps resolution
and width. The CIFAR variant keeps the stem at stride 1 and the second stage at stride 1, so a
32×32 image ends at 4×4. ``width`` is the usual width multiplier: channels are rounded to
multiples of 8 (at least 8), and the last 1×1 convolution keeps 1280 channels unless width > 1.
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

# (expansion t, output channels c, repeats n, stride of the first repeat s); CIFAR strides.
STAGES = [(1, 16, 1, 1), (6, 24, 2, 1), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
          (6, 160, 3, 2), (6, 320, 1, 1)]
STEM, LAST = 32, 1280


def divisible(value: float, divisor: int = 8) -> int:
    """torchvision's rounding: nearest multiple of ``divisor``, never below 90% of ``value``."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def conv_norm_act(c_in: int, c_out: int, kernel: int, stride: int, groups: int, norm: str,
                  act: bool = True) -> list[nn.Module]:
    layers: list[nn.Module] = [
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, groups=groups,
                  bias=norm == "none"),
        norm2d(norm, c_out),
    ]
    return [*layers, nn.ReLU6()] if act else layers


class InvertedResidual(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, expansion: int, norm: str) -> None:
        super().__init__()
        hidden = c_in * expansion
        layers = conv_norm_act(c_in, hidden, 1, 1, 1, norm) if expansion != 1 else []
        layers += conv_norm_act(hidden, hidden, 3, stride, hidden, norm)
        layers += conv_norm_act(hidden, c_out, 1, 1, 1, norm, act=False)
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x):  # type: ignore[no-untyped-def]
        return x + self.body(x) if self.residual else self.body(x)


@register_family("mobilenetv2")
def mobilenetv2(
    input_shape: Sequence[int],
    num_outputs: int,
    width: float = 1.0,
    norm: str = "batch",
    dropout: float = 0.0,
    image: Any = None,
) -> nn.Module:
    """MobileNetV2 with width multiplier ``width``; ``dropout`` before the classifier."""
    width = positive_float("mobilenetv2", "width", width)
    norm = choice("mobilenetv2", "norm", norm, NORMS)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise BatchboundError(f"mobilenetv2: dropout must be in [0, 1), got {dropout!r}")
    shape, folded = image_input("mobilenetv2", input_shape, image)
    channels = divisible(STEM * width)
    layers: list[nn.Module] = [*fold(shape, folded),
                               *conv_norm_act(shape[0], channels, 3, 1, 1, norm)]
    depth = 1
    for expansion, c, repeats, stride in STAGES:
        c_out = divisible(c * width)
        for i in range(repeats):
            first = stride if i == 0 else 1
            layers.append(InvertedResidual(channels, c_out, first, expansion, norm))
            channels = c_out
            depth += 3 if expansion != 1 else 2
    last = divisible(LAST * max(1.0, width))
    layers += conv_norm_act(channels, last, 1, 1, 1, norm)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout),
               nn.Linear(last, num_outputs)]
    options: dict[str, Any] = {"width": width, "norm": norm, "dropout": dropout}
    if image is not None:
        options["image"] = list(shape)
    resolved = str(Spec("mobilenetv2", options))
    return tag(nn.Sequential(*layers), ModelShape("mobilenetv2", depth + 2, width, resolved))
