"""nn.Linear: per-example squared norms without per-example gradients.

With 2-D inputs the per-example weight gradient is the outer product b_i a_iᵀ, so
‖g_i‖² = ‖a_i‖²·‖b_i‖². With extra leading dimensions (sequences: a_i is T×d_in) the
gradient is b_iᵀ a_i and its squared norm is either the Gram form Σ_ts (a_t·a_s)(b_t·b_s),
costing T²(d_in+d_out) per example, or the materialised T·d_in·d_out product; the cheaper is
chosen per call.
"""

from __future__ import annotations

from torch import Tensor, nn

from batchbound.diversity.rules.registry import register_rule, row_sq_norms, trainable


def sequence_weight_sq_norms(a: Tensor, b: Tensor) -> Tensor:
    """‖b_iᵀ a_i‖²_F for a: (n, T, p), b: (n, T, q), by Gram form or materialising."""
    steps, p, q = a.shape[1], a.shape[2], b.shape[2]
    if steps * steps * (p + q + 1) < steps * p * q:
        gram_a = a @ a.transpose(1, 2)
        gram_b = b @ b.transpose(1, 2)
        return (gram_a * gram_b).sum(dim=(1, 2))
    return row_sq_norms(b.transpose(1, 2) @ a)


@register_rule(nn.Linear)
def linear_rule(layer: nn.Module, a: Tensor, b: Tensor) -> dict[str, Tensor]:
    n = a.shape[0]
    norms: dict[str, Tensor] = {}
    if a.dim() == 2:
        b_sq = row_sq_norms(b)
        if trainable(layer, "weight"):
            norms["weight"] = row_sq_norms(a) * b_sq
        if trainable(layer, "bias"):
            norms["bias"] = b_sq
        return norms
    a = a.reshape(n, -1, a.shape[-1])
    b = b.reshape(n, -1, b.shape[-1])
    if trainable(layer, "weight"):
        norms["weight"] = sequence_weight_sq_norms(a, b)
    if trainable(layer, "bias"):
        norms["bias"] = row_sq_norms(b.sum(dim=1))
    return norms
