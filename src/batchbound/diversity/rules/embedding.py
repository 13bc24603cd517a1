"""nn.Embedding: row v of example i's gradient is the sum of its output gradients over the
positions holding index v, an ``Outer`` form with one-hot u (squared norms in O(n·T·D) by
summing over unique (example, index) pairs; no n×V×D tensor).

Positions at ``padding_idx`` get no gradient. With ``scale_grad_by_freq`` each position is
divided by how often its index occurs *in its own example* (the gradient of f_i computed on
example i alone), which differs from autograd's batch gradient, whose counts run over the
whole batch; the form then says so, the engine sums the per-example gradients for T, and
a warning states it (T is then not the step's ``.grad``: 2.5 % apart in an outside review).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from batchbound.diversity.rules.forms import Outer, PerExampleGrad, segments
from batchbound.diversity.rules.registry import Call, register_rule, trainable
from batchbound.errors import warn

BY_FREQUENCY = (
    "batchbound: nn.Embedding(scale_grad_by_freq=True): each example's gradient is divided "
    "by its indices' counts in that example (its gradient alone), while autograd's batch "
    "gradient divides by their counts over the whole batch; S, T and Δ are the examples' "
    "own gradients' (T their sum, not the step's .grad)")


@register_rule(nn.Embedding, params=("weight",))
def embedding_rule(call: Call) -> dict[str, PerExampleGrad]:
    layer, idx, b = call.module, call.input, call.grad
    if not trainable(layer, "weight"):
        return {}
    n, dim = idx.shape[0], b.shape[-1]
    idx = idx if idx.dim() == 2 else idx.reshape(n, -1)
    idx = idx if idx.dtype == torch.int64 else idx.long()
    b = b if b.dim() == 3 else b.reshape(n, -1, dim)
    if layer.padding_idx is not None:
        b = b * (idx != layer.padding_idx).unsqueeze(-1).to(b.dtype)
    if layer.scale_grad_by_freq:
        warn(BY_FREQUENCY)
        b = b / _counts_in_example(idx, layer.num_embeddings).unsqueeze(-1).to(b.dtype)
    return {"weight": Outer(idx, b, rows=layer.num_embeddings,
                            batch_sum_exact=not layer.scale_grad_by_freq)}


def _counts_in_example(idx: Tensor, rows: int) -> Tensor:
    """For each position, how often its index occurs in the same example: (n, T)."""
    n, steps = idx.shape
    keys = torch.arange(n, device=idx.device).unsqueeze(1) * rows + idx
    segment = segments(keys.reshape(-1))  # no torch.unique: it waits for the device
    counts = torch.zeros_like(segment).index_add_(0, segment, torch.ones_like(segment))
    return counts[segment].reshape(n, steps)


def _bag_unsupported(call: Call, n: int) -> str | None:
    layer = call.module
    if call.inputs.get("offsets") is not None or call.input.dim() != 2:
        return "a 1-D input with offsets (bags of different lengths)"
    if layer.mode == "max":
        return "mode='max' (each entry's gradient goes to the row that won the max)"
    if layer.padding_idx is not None or layer.max_norm is not None or layer.scale_grad_by_freq:
        return "padding_idx, max_norm or scale_grad_by_freq"
    return None


@register_rule(nn.EmbeddingBag, params=("weight",), feature_dims=1, unsupported=_bag_unsupported)
def embedding_bag_rule(call: Call) -> dict[str, PerExampleGrad]:
    """Bags of equal length, one per example ((n, T) indices): row v of example i's gradient
    is Σ_t [idx_t = v]·c_t·b_i, with c_t = 1 (sum), 1/T (mean) or the per-sample weight."""
    layer, idx, b = call.module, call.input, call.grad
    if not trainable(layer, "weight"):
        return {}
    n, steps = idx.shape
    v = b.unsqueeze(1).expand(n, steps, b.shape[-1])
    weights = call.inputs.get("per_sample_weights")
    if weights is not None:
        v = v * weights.unsqueeze(-1).to(b.dtype)
    elif layer.mode == "mean":
        v = v / steps
    return {"weight": Outer(idx.long(), v, rows=layer.num_embeddings)}
