"""nn.Linear and Hugging Face's ``Conv1D`` (GPT-2's linear layer, its weight transposed):
per-example gradients without materialising them.

With the examples along dim 0 and positions flattened, input a_i is (T × d_in) and output
gradient b_i is (T × d_out); the weight gradient is b_iᵀ a_i = Σ_t b_t a_tᵀ (an ``Outer``
form: ‖a_i‖²·‖b_i‖² for T = 1, else the Gram form or the materialised product, whichever
costs less), and the bias gradient is Σ_t b_t. ``Conv1D`` stores the weight as (d_in × d_out),
so its gradient is the transpose, Σ_t a_t b_tᵀ: the same form with u and v swapped.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from batchbound.diversity.rules.forms import Dense, Outer, PerExampleGrad
from batchbound.diversity.rules.registry import Call, register_rule, row_sq_norms, trainable
from batchbound.diversity.stats import norm_dtype


def _affine(layer: nn.Module, a: Tensor, b: Tensor, transposed: bool) -> dict[str, PerExampleGrad]:
    """``a`` and ``b`` may be bfloat16 or float16 as the call computed (``low_precision``):
    the weight's ``Outer`` multiplies them so; everything else here is computed widened."""
    n = a.shape[0]
    grads: dict[str, PerExampleGrad] = {}
    if a.dim() == 2:  # one position: ‖g_i‖² = ‖a_i‖²‖b_i‖², the bias's is ‖b_i‖²
        a, b = _in_norm_dtype(a), _in_norm_dtype(b)
        b_sq = row_sq_norms(b)
        if trainable(layer, "weight"):
            u, v = (a, b) if transposed else (b, a)
            grads["weight"] = Outer(u, v, sq_norms=row_sq_norms(a) * b_sq)
        if trainable(layer, "bias"):
            grads["bias"] = Dense(b, b_sq)
        return grads
    if a.dim() != 3:  # (n, T, d) already: no reshape to dispatch (one per call adds up)
        a = a.reshape(n, -1, a.shape[-1])
        b = b.reshape(n, -1, b.shape[-1])
    if trainable(layer, "weight"):
        grads["weight"] = Outer(a, b) if transposed else Outer(b, a)
    if trainable(layer, "bias"):
        grads["bias"] = Dense(b.sum(dim=1, dtype=norm_dtype(b.dtype)))
    return grads


def _in_norm_dtype(t: Tensor) -> Tensor:
    dtype = norm_dtype(t.dtype)
    return t if t.dtype == dtype else t.to(dtype)  # no call where it is already (host time)


def _own_sums(layer: nn.Module, x: Tensor, out_shape: torch.Size) -> tuple[str, ...]:
    """Weight and bias: the forms' batch sum is the one product autograd would compute
    (bᵀa over all rows), and ``add_total_to`` adds it into a running sum in the same kernel.
    Not under autocast or for a low-precision input, where autograd's own sum is rounded
    (the rules widen it)."""
    weight = layer._parameters.get("weight")
    if (weight is None or x.dtype != weight.dtype or x.dtype not in _EXACT
            or torch.is_autocast_enabled(x.device.type)):
        return ()
    return _TRAINABLE[trainable(layer, "weight"), trainable(layer, "bias")]


# which of (weight, bias) train -> their names, looked up (per call, every step: host time)
_TRAINABLE = {(True, True): ("weight", "bias"), (True, False): ("weight",),
              (False, True): ("bias",), (False, False): ()}
_EXACT = (torch.float32, torch.float64)


def _config(layer: nn.Module) -> tuple[bool, bool]:
    """All that ``_affine`` reads of the layer: which of its parameters train."""
    return trainable(layer, "weight"), trainable(layer, "bias")


@register_rule(nn.Linear, feature_dims=1, own_sums=_own_sums, config=_config, low_precision=True)
def linear_rule(call: Call) -> dict[str, PerExampleGrad]:
    return _affine(call.module, call.input, call.grad, transposed=False)


@register_rule("transformers.pytorch_utils.Conv1D", feature_dims=1, own_sums=_own_sums,
               config=_config, low_precision=True)
def conv1d_transformers_rule(call: Call) -> dict[str, PerExampleGrad]:
    return _affine(call.module, call.input, call.grad, transposed=True)
