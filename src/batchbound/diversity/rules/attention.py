"""nn.MultiheadAttention: packed or separate in-projections, the out-projection, bias_k/v,
key padding and attention masks, causal attention, either batch_first.

Attention mixes positions, so no outer-product shortcut exists for the in-projection.
The rule differentiates the layer alone, one example at a time: torch.func vmap over the
examples of a vector-Jacobian product of ``functional_call(layer, ...)`` on that example's
query, key, value and masks, with the call's output gradient as the cotangent. That is
exact by construction, costs about one more forward and backward of the layer, and
materialises the layer's per-example gradients (``Dense``) a block of examples at a time.
Declined: unbatched inputs, and dropout on the attention weights in train mode (its masks
cannot be replayed).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap

from batchbound.diversity.rules.forms import Dense, PerExampleGrad
from batchbound.diversity.rules.registry import Call, register_rule

# Per-example gradient entries materialised at once.
BUDGET = 2**24
_OPTIONS = ("need_weights", "average_attn_weights", "is_causal")


def _params(module: nn.Module) -> tuple[str, ...]:
    return tuple(name for name, p in module.named_parameters() if p.requires_grad)


def _batch_axis(module: nn.Module) -> int:
    return 0 if module.batch_first else 1


def _per_example_mask(call: Call, n: int) -> Tensor | None:
    """A 3-D attn_mask is (n·heads, L, S), example-major: (n, heads, L, S)."""
    mask = call.inputs.get("attn_mask")
    if isinstance(mask, Tensor) and mask.dim() == 3:
        return mask.reshape(n, -1, *mask.shape[1:])
    return None


def _unsupported(call: Call, n: int) -> str | None:
    m, axis = call.module, _batch_axis(call.module)
    for name in ("query", "key", "value"):
        t = call.inputs.get(name)
        if not isinstance(t, Tensor) or t.dim() != 3 or t.shape[axis] != n:
            return f"its {name} does not hold the {n} examples along dimension {axis}"
    padding = call.inputs.get("key_padding_mask")
    if isinstance(padding, Tensor) and (padding.dim() != 2 or padding.shape[0] != n):
        return f"its key_padding_mask {tuple(padding.shape)} does not hold the {n} examples"
    mask = call.inputs.get("attn_mask")
    if isinstance(mask, Tensor) and mask.dim() == 3 and mask.shape[0] != n * m.num_heads:
        return f"its 3-D attn_mask {tuple(mask.shape)} is not (examples·heads, L, S)"
    if m.training and m.dropout > 0:
        return "dropout on its attention weights in train mode draws masks the rule cannot replay"
    return None


@register_rule(nn.MultiheadAttention, params=_params, example_axis=_batch_axis,
               main="query", unsupported=_unsupported)
def attention_rule(call: Call) -> dict[str, PerExampleGrad]:
    m, n, axis = call.module, call.input.shape[_batch_axis(call.module)], _batch_axis(call.module)
    names = _params(m)
    dtype = call.input.dtype  # float32 for a low-precision model: see hooks.HooksPass._run
    params = {k: v.detach().to(dtype) for k, v in m.named_parameters() if k in names}
    options = {k: call.inputs[k] for k in _OPTIONS if k in call.inputs}
    mask = call.inputs.get("attn_mask")
    shared_mask = mask if not (isinstance(mask, Tensor) and mask.dim() == 3) else None
    per_mask = _per_example_mask(call, n)
    padding = call.inputs.get("key_padding_mask")
    cotangents = [g for g in call.grads]

    def one(q: Tensor, k: Tensor, v: Tensor, pad: Tensor | None, msk: Tensor | None,
            *grads: Tensor) -> dict[str, Tensor]:
        def layer(p: dict[str, Tensor]) -> Any:
            out = functional_call(m, p, (q, k, v), {
                **options, "key_padding_mask": pad,
                "attn_mask": msk if msk is not None else shared_mask})
            return tuple(t for t in out if t is not None)

        _, pullback = vjp(layer, params)
        return pullback(tuple(grads))[0]

    dims = (axis, axis, axis, 0 if padding is not None else None,
            0 if per_mask is not None else None, axis, *([0] * (len(cotangents) - 1)))
    per_example = vmap(one, in_dims=dims)
    step = max(1, BUDGET // max(1, sum(p.numel() for p in params.values())))
    parts: dict[str, list[Tensor]] = {k: [] for k in params}
    for start in range(0, n, step):
        length = min(n, start + step) - start
        args = [call.inputs[name].detach().narrow(axis, start, length)  # vjp with grad on
                for name in ("query", "key", "value")]
        args += [padding.narrow(0, start, length) if padding is not None else None,
                 per_mask.narrow(0, start, length) if per_mask is not None else None]
        args += [g.narrow(d, start, length) for g, d in zip(cotangents, dims[5:], strict=True)]
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="There is a performance drop")
            grads = per_example(*args)
        for k, g in grads.items():
            parts[k].append(g.detach())
    return {k: Dense(torch.cat(v)) for k, v in parts.items()}
