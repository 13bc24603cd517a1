"""Pieces the families share: activations, normalisation, image input, the fully connected head,
and the shape record each built model carries.

Every module here is one the diversity engine's hook rules cover (Linear, Conv1d/2d, the norm
layers) or has no parameters (activations, pooling, reshapes), so per-example gradient norms
never need a fallback.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from batchbound.errors import BatchboundError
from batchbound.models.options import choice, int_list


class Arctan(nn.Module):
    """x ↦ arctan(x); torch has no module for it ([width] lists it among the activations)."""

    def forward(self, x):  # type: ignore[no-untyped-def]
        return x.atan()


ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "softsign": nn.Softsign,
    "arctan": Arctan,
    "linear": nn.Identity,
}

NORMS = ("batch", "group", "none")


def activation(family: str, name: Any) -> nn.Module:
    return ACTIVATIONS[choice(family, "act", name, list(ACTIVATIONS))]()


def norm2d(kind: str, channels: int) -> nn.Module:
    """BatchNorm2d, GroupNorm or nothing. GroupNorm uses gcd(channels, 8) groups, so it always
    divides; unlike BatchNorm it keeps examples independent in train mode."""
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(math.gcd(channels, 8), channels)
    return nn.Identity()


@dataclass(frozen=True)
class ModelShape:
    """What a built model is, in the terms its family uses.

    ``depth`` follows the family's convention: hidden layers for fc/linear ([width]'s L),
    weight layers on the main path for the convolutional families (ResNet-18 has 18).
    ``width`` is the family's width option after any budget was solved. ``resolved`` is a spec
    that rebuilds the same architecture without a budget, e.g. ``fc(depth=4,width=26)``.
    ``tokens``: the model reads int64 token ids (gpt, lstm), not float features.
    """

    family: str
    depth: int
    width: int | float
    resolved: str
    tokens: bool = False


def check_task(shape: ModelShape | None, task: str, data: str) -> None:
    """Refuse a token model on feature data and a feature model on text (task ``"text"``),
    in one line, before a dtype error deep in the first layer. Untagged models pass."""
    if shape is None or shape.tokens == (task == "text"):
        return
    if shape.tokens:
        raise BatchboundError(
            f"{shape.family} reads token ids, but {data} is a {task} set of features; use a "
            "text data set such as fortunes or text(path=FILE)"
        )
    raise BatchboundError(
        f"{shape.family} reads float features, but {data} is a text set of token ids; use a "
        "language model such as gpt or lstm"
    )


def tag(model: nn.Module, shape: ModelShape) -> nn.Module:
    """Attach the shape record as ``model.batchbound_shape`` (describe and sweeps read it)."""
    model.batchbound_shape = shape
    return model


def image_input(
    family: str, input_shape: Sequence[int], image: Any = None
) -> tuple[tuple[int, int, int], bool]:
    """The (C, H, W) an image family sees, and whether the input must be folded into it.

    Image input (C, H, W) is used as is. A flat input (d,) needs ``image=[C,H,W]`` with
    C·H·W = d; the model then starts with ``fold(image)``. Anything else is refused.
    """
    shape = tuple(int(s) for s in input_shape)
    if image is not None:
        target = tuple(int_list(family, "image", image))
        if len(target) != 3 or math.prod(target) != math.prod(shape):
            raise BatchboundError(
                f"{family}: image={list(target)} must be [C,H,W] with C·H·W equal to the input "
                f"size {math.prod(shape)} (input shape {shape})"
            )
        return target, True  # type: ignore[return-value]
    if len(shape) != 3:
        raise BatchboundError(
            f"{family} needs image input of shape (C, H, W), got {shape}; for flat input say "
            f"how to fold it, e.g. {family}(image=[1,8,8]) for 64 features, or use fc"
        )
    return shape, False  # type: ignore[return-value]


def fold(image: Sequence[int], needed: bool = True) -> list[nn.Module]:
    """Modules that reshape any input of C·H·W features to (C, H, W); none if not ``needed``."""
    return [nn.Flatten(), nn.Unflatten(1, tuple(image))] if needed else []


def head_widths(family: str, head: Any) -> list[int]:
    return [] if head is None else int_list(family, "head", head)


def fc_head(
    features: int, hidden: Sequence[int], num_outputs: int, act: str = "relu"
) -> list[nn.Module]:
    """Linear layers features → hidden[0] → ... → num_outputs, with an activation between."""
    dims = [features, *hidden, num_outputs]
    layers: list[nn.Module] = []
    for i in range(len(dims) - 1):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            layers.append(ACTIVATIONS[act]())
    return layers
