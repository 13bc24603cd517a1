"""nn.Conv1d and nn.Conv2d, with any stride, padding (incl. 'same' and non-zero padding
modes), dilation and groups.

The input is unfolded into patches A_i (per group: C_in/g·k × L positions) and the output
gradient is B_i (C_out/g × L), so the per-example weight gradient is B_i A_iᵀ. Its squared
norm is computed either

- by materialising B_i A_iᵀ: n·C_out·(C_in/g)·k·L multiply-adds, or
- in Gram form Σ_ts (a_t·a_s)(b_t·b_s): n·L²·(C_in·k + C_out + g), with n·g·L² memory,

whichever the flop estimate says is cheaper for this layer and batch. ``force_strategy``
pins the choice (used by the tests to check both branches).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.nn.functional as F
from torch import Tensor, nn

from batchbound.diversity.rules.registry import register_rule, trainable

STRATEGIES = ("auto", "gram", "unfold")
_strategy = "auto"


@contextmanager
def force_strategy(strategy: str) -> Iterator[None]:
    """Within the block every conv layer uses ``strategy`` ('gram', 'unfold' or 'auto')."""
    global _strategy
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown conv strategy {strategy!r}; choose from {STRATEGIES}")
    previous, _strategy = _strategy, strategy
    try:
        yield
    finally:
        _strategy = previous


def _padding(layer: nn.Module, spatial: int) -> list[int]:
    """F.pad amounts (last dim first) that reproduce the layer's padding."""
    if layer.padding == "valid":
        per_dim = [(0, 0)] * spatial
    elif layer.padding == "same":
        per_dim = []
        for k, d in zip(layer.kernel_size, layer.dilation, strict=True):
            total = d * (k - 1)
            per_dim.append((total // 2, total - total // 2))
    else:
        per_dim = [(p, p) for p in layer.padding]
    return [amount for pair in reversed(per_dim) for amount in pair]


def unfold_input(layer: nn.Module, x: Tensor) -> Tensor:
    """Patches of the input as (n, C_in·k, L), the columns the convolution multiplies."""
    spatial = x.dim() - 2
    pads = _padding(layer, spatial)
    if any(pads):
        mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
        x = F.pad(x, pads, mode=mode)
    kernel, dilation, stride = layer.kernel_size, layer.dilation, layer.stride
    if spatial == 1:
        x = x.unsqueeze(2)
        kernel, dilation, stride = (1, *kernel), (1, *dilation), (1, *stride)
    return F.unfold(x, kernel, dilation=dilation, stride=stride)


def choose_strategy(n: int, c_in_k: int, c_out: int, groups: int, positions: int) -> str:
    if _strategy != "auto":
        return _strategy
    materialise = n * c_out * (c_in_k // groups) * positions
    gram = n * positions * positions * (c_in_k + c_out + groups)
    return "gram" if gram < materialise else "unfold"


@register_rule(nn.Conv1d, nn.Conv2d, params=("weight", "bias"))
def conv_rule(layer: nn.Module, x: Tensor, b: Tensor) -> dict[str, Tensor]:
    n, g = x.shape[0], layer.groups
    b = b.reshape(n, layer.out_channels, -1)  # (n, C_out, L)
    norms: dict[str, Tensor] = {}
    if trainable(layer, "weight"):
        a = unfold_input(layer, x)  # (n, C_in·k, L)
        positions = a.shape[2]
        a = a.reshape(n, g, -1, positions)
        bg = b.reshape(n, g, -1, positions)
        if choose_strategy(n, a.shape[2] * g, layer.out_channels, g, positions) == "gram":
            gram_a = a.transpose(2, 3) @ a
            gram_b = bg.transpose(2, 3) @ bg
            norms["weight"] = (gram_a * gram_b).sum(dim=(1, 2, 3))
        else:
            norms["weight"] = (bg @ a.transpose(2, 3)).square().sum(dim=(1, 2, 3))
    if trainable(layer, "bias"):
        norms["bias"] = b.sum(dim=2).square().sum(dim=1)
    return norms
