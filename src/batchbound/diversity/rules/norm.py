"""Affine parameters of LayerNorm, RMSNorm (torch's and Hugging Face's), GroupNorm and
BatchNorm (eval mode).

All three compute y = x̂·weight + bias with a normalised x̂, so the per-example gradients are
weight: Σ (b·x̂) and bias: Σ b, summed over the positions that share a parameter entry.
x̂ is recomputed from the saved input (cheap, and nothing private of torch is needed; two
passes, mean then centred square, are ten times faster than ``torch.var_mean`` on CPU).

BatchNorm is supported in eval mode only. In train mode x̂ uses the batch's mean and
variance, so each example's output depends on every other example: f_i is then not a
function of example i alone, per-example gradients do not exist, and S = Σ‖g_i‖² is not
defined. Gradient diversity is therefore defined, and measured, with BatchNorm in eval mode
(running statistics); ``measure`` switches the model to eval and back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchbound.diversity.graph import name_of
from batchbound.diversity.rules.forms import Dense, PerExampleGrad
from batchbound.diversity.rules.registry import Call, first_axis, register_rule, trainable
from batchbound.errors import BatchboundError


def _affine_grads(layer: nn.Module, x_hat: Tensor, b: Tensor, param_dims: int) -> dict:
    """Sum b·x̂ and b over all but the batch dimension and the trailing ``param_dims``."""
    n = b.shape[0]
    grads: dict[str, PerExampleGrad] = {}
    shape = (n, -1, *b.shape[b.dim() - param_dims :])
    # (n, positions, *param) already: no reshape to dispatch
    flat = (lambda t: t) if b.dim() == 2 + param_dims else (lambda t: t.reshape(shape))
    if trainable(layer, "weight"):
        grads["weight"] = Dense(flat(b * x_hat).sum(dim=1))
    if trainable(layer, "bias"):
        grads["bias"] = Dense(flat(b).sum(dim=1))
    return grads


def _normalized_dims(layer: nn.Module) -> int:
    return len(layer.normalized_shape)


def _config(layer: nn.Module) -> tuple:
    """All that the rules below read of the layer (its shape, its eps under either name, which
    parameters train), for stacking its calls with its like's (``RuleEntry.config``)."""
    return (tuple(getattr(layer, "normalized_shape", ())), getattr(layer, "eps", None),
            getattr(layer, "variance_epsilon", None), trainable(layer, "weight"),
            trainable(layer, "bias"))


@register_rule(nn.LayerNorm, feature_dims=_normalized_dims, config=_config)
def layer_norm_rule(call: Call) -> dict[str, PerExampleGrad]:
    return _layer_norm_grads(call, len(call.module.normalized_shape), call.module.eps)


def _layer_norm_grads(call: Call, count: int, eps: float) -> dict[str, PerExampleGrad]:
    """A layer norm over the last ``count`` dimensions, its affine parameters' gradients."""
    layer, x, b = call.module, call.input, call.grad
    saved = _saved_statistics(call, x, count)
    if saved is not None:  # the forward's own mean and 1/std: x̂ in one pass
        return _affine_grads(layer, (x - saved[0]) * saved[1], b, count)
    dims = tuple(range(x.dim() - count, x.dim()))
    centred = x - x.mean(dim=dims, keepdim=True)
    var = centred.square().mean(dim=dims, keepdim=True)
    return _affine_grads(layer, centred * torch.rsqrt(var + eps), b, count)


class NanoGPTLayerNorm(nn.Module):
    """nanoGPT's LayerNorm (a bias or none), as its model.py writes it and the many files
    that paste it do: the rule below applies to every class that runs this code
    (``copies=True``, ``registry.same_code``: the forward's bytecode, its eps 1e-5 and ``F``
    the same), whatever its name or module."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):  # nanoGPT's code as it is: its bytecode is what is compared
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


def _weight_config(layer: nn.Module) -> tuple:
    return tuple(layer.weight.shape), trainable(layer, "weight"), trainable(layer, "bias")


@register_rule(NanoGPTLayerNorm, feature_dims=1, config=_weight_config, copies=True)
def nanogpt_layer_norm_rule(call: Call) -> dict[str, PerExampleGrad]:
    return _layer_norm_grads(call, 1, 1e-5)


def _saved_statistics(call: Call, x: Tensor, count: int) -> tuple[Tensor, Tensor] | None:
    """The mean and 1/std that torch's layer_norm saved for its backward, when the call's
    output is that operation's own (its autograd node) and they fit ``x``."""
    node = call.nodes[0] if len(call.nodes) == 1 else None
    if node is None or name_of(node) != "NativeLayerNormBackward0":
        return None
    mean, rstd = node._saved_result1, node._saved_result2
    shape = (*x.shape[: x.dim() - count], *([1] * count))
    if tuple(mean.shape) != shape or tuple(rstd.shape) != shape:
        return None
    if mean.dtype == x.dtype and rstd.dtype == x.dtype:  # no casts to dispatch
        return mean, rstd
    return mean.to(x.dtype), rstd.to(x.dtype)



@register_rule(nn.RMSNorm, params=("weight",), feature_dims=_normalized_dims, config=_config)
def rms_norm_rule(call: Call) -> dict[str, PerExampleGrad]:
    layer, x, b = call.module, call.input, call.grad
    dims = tuple(range(x.dim() - len(layer.normalized_shape), x.dim()))
    eps = torch.finfo(x.dtype).eps if layer.eps is None else layer.eps
    x_hat = x * torch.rsqrt(x.square().mean(dim=dims, keepdim=True) + eps)
    return _affine_grads(layer, x_hat, b, len(layer.normalized_shape))


# Hugging Face's RMSNorm of Llama (x̂ computed in float32 and cast back to the input's dtype,
# eps in ``variance_epsilon``), and every class that runs its code: each model family's file
# carries a copy under its own name (141 of transformers 5.24's 197 other RMSNorm classes), found
# by their code (``registry.same_code``), not by a list of names.
LLAMA_RMS_NORM = "transformers.models.llama.modeling_llama.LlamaRMSNorm"


@register_rule(LLAMA_RMS_NORM, params=("weight",), feature_dims=1, config=_config, copies=True)
def llama_rms_norm_rule(call: Call) -> dict[str, PerExampleGrad]:
    layer, x, b = call.module, call.input, call.grad
    wide = x.to(torch.float32)
    x_hat = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + layer.variance_epsilon)
    return _affine_grads(layer, x_hat.to(x.dtype), b, 1)


def _channel_sums(layer: nn.Module, x: Tensor, b: Tensor, mean: Tensor, inv_std: Tensor) -> dict:
    """Norms for per-channel affine parameters from Σ_p b and Σ_p b·x over positions p:
    Σ_p b·x̂ = inv_std·(Σ_p b·x − mean·Σ_p b), so x̂ is never materialised.
    ``mean`` and ``inv_std`` broadcast against (n, C)."""
    n, channels = b.shape[0], b.shape[1]
    b = b.reshape(n, channels, -1)
    sum_b = b.sum(dim=2)
    grads: dict[str, PerExampleGrad] = {}
    if trainable(layer, "weight"):
        sum_bx = (b * x.reshape(n, channels, -1)).sum(dim=2)
        grads["weight"] = Dense(inv_std * (sum_bx - mean * sum_b))
    if trainable(layer, "bias"):
        grads["bias"] = Dense(sum_b)
    return grads


@register_rule(nn.GroupNorm, example_axis=first_axis)
def group_norm_rule(call: Call) -> dict[str, PerExampleGrad]:
    layer, x, b = call.module, call.input, call.grad
    n, channels, groups = x.shape[0], x.shape[1], layer.num_groups
    grouped = x.reshape(n, groups, -1)
    mean = grouped.mean(dim=2)
    var = (grouped - mean.unsqueeze(2)).square().mean(dim=2)
    inv_std = torch.rsqrt(var + layer.eps)
    per_channel = channels // groups  # (n, G) -> (n, C): channel c belongs to group c // (C/G)
    return _channel_sums(
        layer,
        x,
        b,
        mean.repeat_interleave(per_channel, dim=1),
        inv_std.repeat_interleave(per_channel, dim=1),
    )


@register_rule(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, example_axis=first_axis)
def batch_norm_rule(call: Call) -> dict[str, PerExampleGrad]:
    layer, x, b = call.module, call.input, call.grad
    if layer.training or layer.running_mean is None:
        raise BatchboundError(
            f"{type(layer).__name__} normalises with batch statistics (train mode or "
            "track_running_stats=False), so examples are not independent and per-example "
            "gradients do not exist; measure with the model in eval mode"
        )
    inv_std = torch.rsqrt(layer.running_var + layer.eps)
    return _channel_sums(layer, x, b, layer.running_mean, inv_std)
