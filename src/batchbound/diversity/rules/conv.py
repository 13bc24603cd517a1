"""nn.Conv1d and nn.Conv2d, with any stride, padding (incl. 'same' and non-zero padding
modes), dilation and groups.

Per example and group, with the input seen as patches A_i (C_in/g·k × L positions) and the
output gradient B_i (C_out/g × L), the weight gradient is B_i A_iᵀ. Its squared norm is
computed in one of two forms, whichever the flop estimate says is cheaper for the layer:

- Gram form Σ_ts (a_t·a_s)(b_t·b_s): n·L²·(C_in·k + C_out + g) flops, n·g·L² memory; wins
  when there are few output positions L;
- materialising B_i A_iᵀ: n·C_out·(C_in/g)·k·L flops, by torch's weight-gradient kernel with
  the examples folded into groups, or, for layers with at most ``PATCH_CHANNELS`` input
  channels per group (first layers), by batched matrix products over patches copied from
  strided views of the input a block of examples at a time (``"patches"``; oneDNN's grouped
  kernel is 1.3–2× slower there); their gradients also give the batch sum, so autograd then
  skips the layer's weight gradient. Where all of them would hold more than
  ``MATERIALISE_BUDGET`` numbers: k batched matrix products over views of the input, one per
  kernel tap, norms only.

``force_strategy`` pins the choice (the tests check every branch against the loop).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchbound.diversity.rules.forms import (
    MATERIALISE_BUDGET,
    Dense,
    Lazy,
    PerExampleGrad,
    add_row_sum,
    ones,
)
from batchbound.diversity.rules.registry import (
    Call,
    first_axis,
    register_rule,
    row_sq_norms,
    trainable,
)

STRATEGIES = ("auto", "gram", "conv", "patches", "shifts")
MATERIALISING = ("conv", "patches")  # the methods that make the gradients (and so their sum)
# At most this many input channels per group, the materialised gradients come from copied
# patches (``patches_weight_grads``): measured faster than the grouped kernel for 1–4 channels
# per group in every shape timed, slower from 8 on (benchmarks/conv_grads.py).
PATCH_CHANNELS = 4
# Numbers in one block of copied patches (1 MiB of float32): the block's product reads it while
# it is still in cache; one example at a time where one example's patches hold more. On a GPU
# each block is ~6 kernel launches (LeNet-5's first layer at 1024 examples would take 79), so
# there a block is bounded by memory alone (128 MiB of float32: that layer in one).
PATCH_BLOCK = 2**18
PATCH_BLOCK_DEVICE = 2**25
_strategy = "auto"


@contextmanager
def force_strategy(strategy: str) -> Iterator[None]:
    """Within the block every conv layer uses ``strategy``: one of STRATEGIES."""
    global _strategy
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown conv strategy {strategy!r}; choose from {STRATEGIES}")
    previous, _strategy = _strategy, strategy
    try:
        yield
    finally:
        _strategy = previous


def _padded(layer: nn.Module, x: Tensor) -> Tensor:
    """The input padded exactly as the layer pads it (any padding mode, 'same', 'valid')."""
    if layer.padding == "valid":
        per_dim = [(0, 0)] * (x.dim() - 2)
    elif layer.padding == "same":
        per_dim = []
        for k, d in zip(layer.kernel_size, layer.dilation, strict=True):
            total = d * (k - 1)
            per_dim.append((total // 2, total - total // 2))
    else:
        per_dim = [(p, p) for p in layer.padding]
    pads = [amount for pair in reversed(per_dim) for amount in pair]
    if not any(pads):
        return x
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    return F.pad(x, pads, mode=mode)


def gram_weight_sq_norms(layer: nn.Module, x: Tensor, b: Tensor) -> Tensor:
    """Σ_ts (a_t·a_s)(b_t·b_s) per group, from unfolded patches: (n,)."""
    n, g = x.shape[0], layer.groups
    x = _padded(layer, x)
    kernel, dilation, stride = layer.kernel_size, layer.dilation, layer.stride
    if x.dim() == 3:
        x = x.unsqueeze(2)
        kernel, dilation, stride = (1, *kernel), (1, *dilation), (1, *stride)
    positions = math.prod(b.shape[2:])
    a = F.unfold(x, kernel, dilation=dilation, stride=stride).reshape(n, g, -1, positions)
    bg = b.reshape(n, g, -1, positions)
    gram_a = a.transpose(2, 3) @ a
    gram_b = bg.transpose(2, 3) @ bg
    return (gram_a * gram_b).sum(dim=(1, 2, 3))


def conv_weight_grads(layer: nn.Module, x: Tensor, b: Tensor) -> Tensor:
    """Materialised per-example weight gradients by torch's own weight-gradient kernel,
    (n, C_out, C_in/g, *kernel).

    Folding the examples into the channels, (n, C, ...) -> (1, n·C, ...), and treating each
    (example, group) pair as a convolution group turns the batch weight gradient into n·g
    independent ones: (n·C_out, C_in/g, *kernel) = the per-example gradients.
    """
    symmetric_zeros = layer.padding_mode == "zeros" and not isinstance(layer.padding, str)
    padding = layer.padding if symmetric_zeros else 0  # let the kernel pad: no input copy
    if not symmetric_zeros:
        x = _padded(layer, x)
    n, spatial = x.shape[0], x.dim() - 2
    weight_grad = torch.nn.grad.conv1d_weight if spatial == 1 else torch.nn.grad.conv2d_weight
    folded = x.reshape(1, -1, *x.shape[2:])
    if _blocked_channels_last(layer, folded):
        folded = folded.contiguous(memory_format=torch.channels_last)
    grads = weight_grad(
        folded,
        (n * layer.out_channels, layer.in_channels // layer.groups, *layer.kernel_size),
        b.reshape(1, -1, *b.shape[2:]),
        stride=layer.stride,
        padding=padding,
        dilation=layer.dilation,
        groups=n * layer.groups,
    )
    # A channels-last input gives channels-last gradients, returned as they are (a view):
    # the norms and the sum read them in memory order (``memory_rows``), where a copy to
    # the standard layout cost 0.5 ms per chunk of LeNet-5's second layer
    return grads.reshape(n, layer.out_channels, -1, *layer.kernel_size)


def memory_rows(grads: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """(n, numel) rows of per-example gradients (n, ...) in the order their entries lie in
    memory, and the order of the per-example dimensions that gives it: a view where each
    example's entries lie together, densely, in some order of its dimensions (the standard
    layout, channels-last), a copy otherwise. A row's squared norm does not depend on the
    order of its entries; ``add_memory_row_sum`` puts the rows' sum back in the standard
    order."""
    dims = tuple(sorted(range(1, grads.dim()), key=lambda d: -grads.stride(d)))
    return grads.permute(0, *dims).reshape(grads.shape[0], -1), dims


def add_memory_row_sum(out: Tensor, grads: Tensor) -> None:
    """``out += Σ_i grads[i]``, reading ``grads`` (n, *out.shape) in memory order: one
    matrix-vector product, its (small) result put back in ``out``'s order."""
    rows, dims = memory_rows(grads)
    if dims == tuple(range(1, grads.dim())):
        add_row_sum(out, rows)
        return
    total = torch.mv(rows.t(), ones(rows.shape[0], rows.dtype, rows.device))
    back = sorted(range(len(dims)), key=dims.__getitem__)  # the inverse permutation
    out.add_(total.view([grads.shape[d] for d in dims]).permute(back))


def _blocked_channels_last(layer: nn.Module, folded: Tensor) -> bool:
    """Whether to hand oneDNN the folded input channels-last: with a number of input channels
    per group that is not a multiple of 8, oneDNN's blocked grouped kernel falls back to its
    generic GEMM path, while for a channels-last input it runs its direct kernel, 1.2–2.3×
    faster in 10 of 12 shapes measured (LeNet-5's second layer 2.5–2.7 → 1.6–2.0 ms per chunk
    of 256; benchmarks/conv_grads.py). float32 on the CPU with oneDNN only (the layout copy
    buys nothing elsewhere); the choice follows the shapes and settings alone."""
    return (folded.dim() == 4 and folded.dtype == torch.float32 and folded.device.type == "cpu"
            and (layer.in_channels // layer.groups) % 8 != 0
            and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)


def conv_weight_sq_norms(layer: nn.Module, x: Tensor, b: Tensor) -> Tensor:
    return row_sq_norms(conv_weight_grads(layer, x, b).reshape(x.shape[0], -1))


def patches_weight_grads(layer: nn.Module, x: Tensor, b: Tensor) -> Tensor:
    """Materialised per-example weight gradients, (n, C_out, C_in/g, *kernel), as batched
    matrix products B_i A_iᵀ per (example, group).

    The patches A_i (C_in/g·k × L) are a strided view of the padded input: entry (c, tap,
    position) sits at channel c, offset tap·dilation + position·stride along each spatial
    dimension, so one copy of the view (no unfold) makes them, a block of examples at a time
    (at most ``PATCH_BLOCK`` numbers on the CPU, ``PATCH_BLOCK_DEVICE`` elsewhere, one example
    if that holds more), each block's product taken while its patches are in cache.
    """
    n, g = x.shape[0], layer.groups
    c_in, c_out = layer.in_channels // g, layer.out_channels // g
    kernel, out_size = tuple(layer.kernel_size), tuple(b.shape[2:])
    rows, positions = c_in * math.prod(kernel), math.prod(out_size)
    grads = b.reshape(n * g, c_out, positions)
    out = b.new_empty(n * g, c_out, rows)
    budget = PATCH_BLOCK if x.device.type == "cpu" else PATCH_BLOCK_DEVICE
    block = max(1, budget // (g * rows * positions))
    padded = _padded(layer, x)  # once: one copy per block cost 1–2 % of LeNet-5's measure()
    s = padded.stride()
    for start in range(0, n, block):
        xs = padded[start : start + block]
        m = xs.shape[0]
        view = xs.as_strided(
            (m, g, c_in, *kernel, *out_size),
            (s[0], s[1] * c_in, s[1],
             *(t * d for t, d in zip(s[2:], layer.dilation, strict=True)),
             *(t * st for t, st in zip(s[2:], layer.stride, strict=True))),
        )
        patches = view.reshape(m * g, rows, positions)  # the copy
        torch.bmm(grads[start * g : (start + m) * g], patches.transpose(1, 2),
                  out=out[start * g : (start + m) * g])
    return out.reshape(n, layer.out_channels, c_in, *kernel)


def shifts_weight_sq_norms(layer: nn.Module, x: Tensor, b: Tensor) -> Tensor:
    """Materialised per-example weight gradients one kernel tap at a time, reduced to (n,).

    For tap u, g_i[:, :, u] = B_i X_iuᵀ where X_iu is the part of the padded input that tap u
    multiplies: one batched matrix product (n·g matrices) per tap. With stride 1, X_iu is a
    contiguous slice of the flattened input if B is widened to the input's row length with
    zero columns (the extra columns then contribute nothing), so no patch is ever copied.
    """
    x = _padded(layer, x)
    n, g = x.shape[0], layer.groups
    size, out_size = x.shape[2:], b.shape[2:]
    taps = list(itertools.product(*(range(k) for k in layer.kernel_size)))
    total = x.new_zeros(n)
    if all(s == 1 for s in layer.stride):
        row = [math.prod(size[d + 1 :]) for d in range(len(size))]  # flat stride per dim
        widen = [
            amount for d in reversed(range(1, len(size))) for amount in (0, size[d] - out_size[d])
        ]
        wide = F.pad(b, widen) if any(widen) else b
        positions = out_size[0] * row[0]
        wide = wide.reshape(n * g, layer.out_channels // g, positions)
        spill = sum(
            (k - 1) * d * r
            for k, d, r in zip(layer.kernel_size[1:], layer.dilation[1:], row[1:], strict=True)
        )
        flat = x.reshape(n, x.shape[1], -1)
        flat = (F.pad(flat, (0, spill)) if spill else flat).reshape(n * g, x.shape[1] // g, -1)
        for tap in taps:
            start = sum(u * d * r for u, d, r in zip(tap, layer.dilation, row, strict=True))
            grads = torch.bmm(wide, flat[:, :, start : start + positions].transpose(1, 2))
            total += torch.linalg.vector_norm(grads.reshape(n, -1), dim=1).square()
        return total
    positions = math.prod(out_size)
    bg = b.reshape(n * g, layer.out_channels // g, positions)
    for tap in taps:
        window = tuple(
            slice(u * d, u * d + s * (m - 1) + 1, s)
            for u, d, s, m in zip(tap, layer.dilation, layer.stride, out_size, strict=True)
        )
        xs = x[(slice(None), slice(None), *window)].reshape(n * g, -1, positions)
        grads = torch.bmm(bg, xs.transpose(1, 2))  # (n·g, C_out/g, C_in/g)
        total += torch.linalg.vector_norm(grads.reshape(n, -1), dim=1).square()
    return total


def patches_weight_sq_norms(layer: nn.Module, x: Tensor, b: Tensor) -> Tensor:
    return row_sq_norms(patches_weight_grads(layer, x, b).reshape(x.shape[0], -1))


_METHODS = {
    "gram": gram_weight_sq_norms,
    "conv": conv_weight_sq_norms,
    "patches": patches_weight_sq_norms,
    "shifts": shifts_weight_sq_norms,
}
_MATERIALISE = {"conv": conv_weight_grads, "patches": patches_weight_grads}


def choose_strategy(n: int, c_in: int, c_out: int, groups: int, kernel: int, positions: int) -> str:
    """Gram form when its flop count is lower than materialising's. Otherwise materialise,
    whose gradients also give the batch sum, so that autograd skips the layer's weight
    gradient (``_own_sums``): from copied patches with at most ``PATCH_CHANNELS`` input
    channels per group and more than one output channel per group (a depthwise layer keeps
    oneDNN's depthwise kernel), else with the grouped weight-gradient kernel; per kernel tap
    (``"shifts"``: norms only, autograd's weight gradient on top) where all taps at once
    would hold more than ``MATERIALISE_BUDGET`` numbers (one tap holds 1/kernel of them).
    Timings on LeNet-5's and ResNet-8's layers: benchmarks/conv_grads.py. The choice
    depends on the shapes alone: the same command gives the same numbers."""
    if _strategy != "auto":
        return _strategy
    materialise = n * c_out * (c_in // groups) * kernel * positions
    gram = n * positions * positions * (c_in * kernel + c_out + groups)
    if gram < materialise:
        return "gram"
    if n * c_out * (c_in // groups) * kernel > MATERIALISE_BUDGET:
        return "shifts"
    if c_in // groups <= PATCH_CHANNELS and c_out // groups > 1:
        return "patches"
    return "conv"


def _unbatched(call: Call, n: int) -> str | None:
    layer = call.module
    if call.input.dim() != len(layer.kernel_size) + 2:
        return f"its input {tuple(call.input.shape)} has no batch dimension"
    return None


def _method_for(layer: nn.Module, x: Tensor, out_shape: torch.Size) -> str:
    return choose_strategy(x.shape[0], layer.in_channels, layer.out_channels, layer.groups,
                           math.prod(layer.kernel_size), math.prod(out_shape[2:]))


def _weight(layer: nn.Module, x: Tensor, b: Tensor) -> Lazy:
    held: list[Tensor] = []  # materialised gradients, until their sum is taken

    def materialised() -> Tensor:
        if not held:
            method = _method_for(layer, x, b.shape)
            make = _MATERIALISE.get(method, conv_weight_grads)
            held.append(make(layer, x, b))
        return held[0]

    def sq_norms() -> Tensor:
        method = _method_for(layer, x, b.shape)
        if method in MATERIALISING:
            return row_sq_norms(memory_rows(materialised())[0])
        return _METHODS[method](layer, x, b)

    def total() -> Tensor:
        if held:  # Σ_i of the gradients already made: no second weight-gradient kernel
            return held.pop().sum(dim=0)
        return _weight_sum(layer, x, b)

    def add_total_to(out: Tensor) -> None:
        if held:  # into the running sum in one matrix-vector product
            add_memory_row_sum(out, held.pop())
        else:
            out.add_(_weight_sum(layer, x, b))

    return Lazy(x.shape[0], sq_norms, materialised,
                lambda rows: _weight(layer, x[rows], b[rows]), total, add_total_to)


def _own_sums(layer: nn.Module, x: Tensor, out_shape: torch.Size) -> tuple[str, ...]:
    """Weight and bias, when the weight's norms materialise its per-example gradients: their
    sum then costs one reduction, and autograd's weight gradient would be a second kernel."""
    if (x.dim() != len(layer.kernel_size) + 2
            or _method_for(layer, x, out_shape) not in MATERIALISING):
        return ()
    return tuple(k for k in ("weight", "bias") if trainable(layer, k))


def _weight_sum(layer: nn.Module, x: Tensor, b: Tensor) -> Tensor:
    """Σ_i of the per-example weight gradients: torch's weight-gradient kernel on the batch."""
    symmetric_zeros = layer.padding_mode == "zeros" and not isinstance(layer.padding, str)
    padding = layer.padding if symmetric_zeros else 0
    if not symmetric_zeros:
        x = _padded(layer, x)
    weight_grad = torch.nn.grad.conv1d_weight if x.dim() == 3 else torch.nn.grad.conv2d_weight
    return weight_grad(x, layer.weight.shape, b, stride=layer.stride, padding=padding,
                       dilation=layer.dilation, groups=layer.groups)


@register_rule(nn.Conv1d, nn.Conv2d, example_axis=first_axis, unsupported=_unbatched,
               own_sums=_own_sums)
def conv_rule(call: Call) -> dict[str, PerExampleGrad]:
    layer, x, b = call.module, call.input, call.grad
    grads: dict[str, PerExampleGrad] = {}
    if trainable(layer, "weight"):
        grads["weight"] = _weight(layer, x, b)
    if trainable(layer, "bias"):
        grads["bias"] = Dense(b.reshape(x.shape[0], layer.out_channels, -1).sum(dim=2))
    return grads


class _Adjoint:
    """The Conv layer whose input gradient a ConvTranspose layer computes: same weight,
    stride, padding, dilation and groups, channels swapped. ⟨b, convT_W(x)⟩ = ⟨conv_W(b), x⟩,
    so the transposed layer's weight gradient is this layer's with input b (the output
    gradient) and output gradient x (the input): the same rule, roles exchanged."""

    padding_mode = "zeros"

    def __init__(self, layer: nn.Module) -> None:
        self.weight = layer.weight
        self.in_channels, self.out_channels = layer.out_channels, layer.in_channels
        self.kernel_size, self.stride = layer.kernel_size, layer.stride
        self.padding, self.dilation, self.groups = layer.padding, layer.dilation, layer.groups


@register_rule(nn.ConvTranspose1d, nn.ConvTranspose2d, example_axis=first_axis,
               unsupported=_unbatched)
def conv_transpose_rule(call: Call) -> dict[str, PerExampleGrad]:
    layer, x, b = call.module, call.input, call.grad
    grads: dict[str, PerExampleGrad] = {}
    if trainable(layer, "weight"):
        grads["weight"] = _weight(_Adjoint(layer), b, x)  # type: ignore[arg-type]
    if trainable(layer, "bias"):
        grads["bias"] = Dense(b.reshape(x.shape[0], layer.out_channels, -1).sum(dim=2))
    return grads
