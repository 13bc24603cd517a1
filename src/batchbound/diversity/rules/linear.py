"""nn.Linear: per-example gradients without materialising them.

With the examples along dim 0 and positions flattened, input a_i is (T × d_in) and output
gradient b_i is (T × d_out); the weight gradient is b_iᵀ a_i = Σ_t b_t a_tᵀ (an ``Outer``
form: ‖a_i‖²·‖b_i‖² for T = 1, else the Gram form or the materialised product, whichever
costs less), and the bias gradient is Σ_t b_t.
"""

from __future__ import annotations

from torch import nn

from batchbound.diversity.rules.forms import Dense, Outer, PerExampleGrad
from batchbound.diversity.rules.registry import Call, register_rule, row_sq_norms, trainable


@register_rule(nn.Linear, feature_dims=1)
def linear_rule(call: Call) -> dict[str, PerExampleGrad]:
    layer, a, b = call.module, call.input, call.grad
    n = a.shape[0]
    grads: dict[str, PerExampleGrad] = {}
    if a.dim() == 2:  # one position: ‖g_i‖² = ‖a_i‖²‖b_i‖², the bias's is ‖b_i‖²
        b_sq = row_sq_norms(b)
        if trainable(layer, "weight"):
            grads["weight"] = Outer(b.unsqueeze(1), a.unsqueeze(1), sq_norms=row_sq_norms(a) * b_sq)
        if trainable(layer, "bias"):
            grads["bias"] = Dense(b, b_sq)
        return grads
    a = a.reshape(n, -1, a.shape[-1])
    b = b.reshape(n, -1, b.shape[-1])
    if trainable(layer, "weight"):
        grads["weight"] = Outer(b, a)
    if trainable(layer, "bias"):
        grads["bias"] = Dense(b.sum(dim=1))
    return grads
