"""nn.Embedding: rows of the per-example gradient are sums of output gradients over the
positions holding the same index, so ‖g_i‖² = Σ_v ‖Σ_{t: x_it = v} b_it‖².

Computed in O(n·T·D) by summing b over unique (example, index) pairs; no n×V×D tensor.
Positions at ``padding_idx`` get no gradient and are left out.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from batchbound.diversity.rules.registry import register_rule, trainable


@register_rule(nn.Embedding, params=("weight",))
def embedding_rule(layer: nn.Module, idx: Tensor, b: Tensor) -> dict[str, Tensor]:
    if not trainable(layer, "weight"):
        return {}
    n, dim = idx.shape[0], b.shape[-1]
    idx = idx.reshape(n, -1).long()
    b = b.reshape(n, -1, dim)
    if layer.padding_idx is not None:
        b = b * (idx != layer.padding_idx).unsqueeze(-1).to(b.dtype)
    example = torch.arange(n, device=idx.device).unsqueeze(1).expand_as(idx)
    keys = (example * layer.num_embeddings + idx).reshape(-1)
    unique, inverse = torch.unique(keys, return_inverse=True)
    rows = b.new_zeros(unique.numel(), dim).index_add_(0, inverse, b.reshape(-1, dim))
    owner = torch.div(unique, layer.num_embeddings, rounding_mode="floor")
    sq = b.new_zeros(n).index_add_(0, owner, rows.square().sum(dim=1))
    return {"weight": sq}
