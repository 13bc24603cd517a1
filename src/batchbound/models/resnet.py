"""CIFAR-style ResNets with basic blocks (He et al. 2016), as [width] and [inefficiency] use them.

A 3×3 stem convolution (stride 1), then four chunks of basic blocks; chunk i has ``blocks[i]``
blocks of ``width·2^i`` filters, and chunks 2–4 halve the resolution. Global average pooling
feeds a fully connected head: ``head`` lists its hidden widths (default none, one Linear).
ResNet-18 is ``blocks=[2,2,2,2]`` and ResNet-34 ``blocks=[3,4,6,3]``; at ``width=64`` with 10
classes they have 11,173,962 and 21,282,122 parameters ([width]: "11m / 21m").

``params=P`` solves for the integer ``width`` (the first chunk's filters; the others keep the
1:2:4:8 ratio) whose total trainable parameter count — convolutions, normalisation, head —
is closest to P, by bisection on that non-decreasing count. This is how [width] keeps
[s1,s2,s3,s4] variants at a fixed size. ``norm=group`` swaps BatchNorm for GroupNorm so
examples stay independent in train mode; ``norm=none`` gives the convolutions biases.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from batchbound.errors import BatchboundError
from batchbound.models.layers import (
    NORMS,
    ModelShape,
    fc_head,
    fold,
    head_widths,
    image_input,
    norm2d,
    tag,
)
from batchbound.models.options import (
    MAX_LAYERS,
    choice,
    closest_integer,
    int_list,
    meta_parameter_count,
    one_of_width_params,
    parameter_budget,
    positive_int,
)
from batchbound.models.registry import register_family
from batchbound.spec import Spec

RESNET18 = (2, 2, 2, 2)


def conv3x3(c_in: int, c_out: int, stride: int, norm: str) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=norm == "none")


class BasicBlock(nn.Module):
    """relu(norm(conv(relu(norm(conv(x))))) + shortcut(x)); the shortcut is a 1×1 projection
    when the block changes resolution or width, else the identity."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = conv3x3(c_in, c_out, stride, norm)
        self.norm1 = norm2d(norm, c_out)
        self.relu1 = nn.ReLU()
        self.conv2 = conv3x3(c_out, c_out, 1, norm)
        self.norm2 = norm2d(norm, c_out)
        self.relu2 = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=norm == "none"), norm2d(norm, c_out)
            )

    def forward(self, x):  # type: ignore[no-untyped-def]
        out = self.relu1(self.norm1(self.conv1(x)))
        return self.relu2(self.norm2(self.conv2(out)) + self.shortcut(x))


def _build(
    image: tuple[int, int, int],
    folded: bool,
    num_outputs: int,
    blocks: Sequence[int],
    width: int,
    hidden: Sequence[int],
    norm: str,
) -> nn.Sequential:
    layers: list[nn.Module] = [
        *fold(image, folded),
        conv3x3(image[0], width, 1, norm),
        norm2d(norm, width),
        nn.ReLU(),
    ]
    c_in = width
    for chunk, count in enumerate(blocks):
        c_out = width * 2**chunk
        for b in range(count):
            stride = 2 if chunk > 0 and b == 0 else 1
            layers.append(BasicBlock(c_in, c_out, stride, norm))
            c_in = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), *fc_head(c_in, hidden, num_outputs)]
    return nn.Sequential(*layers)


@register_family("resnet", sweep="head")
def resnet(
    input_shape: Sequence[int],
    num_outputs: int,
    blocks: Any = RESNET18,
    width: int | None = None,
    params: int | None = None,
    head: Any = None,
    norm: str = "batch",
    image: Any = None,
) -> nn.Module:
    """ResNet with ``blocks`` per chunk; ``width`` filters in the first chunk (default 64)."""
    one_of_width_params("resnet", width, params)
    blocks = int_list("resnet", "blocks", blocks, maximum=MAX_LAYERS)
    if not blocks:
        raise BatchboundError("resnet: blocks needs at least one chunk, e.g. [2,2,2,2]")
    norm = choice("resnet", "norm", norm, NORMS)
    hidden = head_widths("resnet", head)
    shape, folded = image_input("resnet", input_shape, image)

    def build(w: int) -> nn.Sequential:
        return _build(shape, folded, num_outputs, blocks, w, hidden, norm)

    if params is not None:
        budget = parameter_budget("resnet", params)
        width = closest_integer(lambda w: meta_parameter_count(lambda: build(w)), budget)
    width = 64 if width is None else positive_int("resnet", "width", width)
    options: dict[str, Any] = {"blocks": blocks, "width": width, "head": hidden, "norm": norm}
    if image is not None:
        options["image"] = list(shape)
    depth = 1 + 2 * sum(blocks) + len(hidden) + 1
    return tag(build(width), ModelShape("resnet", depth, width, str(Spec("resnet", options))))
