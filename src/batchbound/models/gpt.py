"""A small GPT in nanoGPT's shape (Karpathy's model.py) for character-level text.

Token and position embeddings; ``depth`` blocks, each pre-LayerNorm causal self-attention
(packed q/k/v projection, ``heads`` heads, F.scaled_dot_product_attention with
``is_causal=True``) and a pre-LayerNorm GELU MLP of 4·``width``, both residual; a final
LayerNorm; a linear head to the vocabulary (the data set's output width), tied to the token
embedding when ``tie=true`` (nanoGPT's default). No dropout. Weights are initialised as
nanoGPT does: N(0, 0.02), the residual projections N(0, 0.02/√(2·depth)), biases zero.

Input (context,) int64 token ids; output (n, context, vocabulary) logits, one next-token
prediction per position. ``context`` (the position table's length) is read from the input
shape; giving it is a check that it matches the data's. Every layer is one the diversity
engine's rules cover (Embedding, Linear, LayerNorm; attention has no parameters), so Δ is
exact without a fallback.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchbound.errors import BatchboundError
from batchbound.models.layers import ModelShape, tag
from batchbound.models.options import flag, layer_count, positive_int
from batchbound.models.registry import register_family
from batchbound.spec import Spec


def token_input(family: str, input_shape: Sequence[int], context: Any = None) -> int:
    """The context length of a (context,) token input; ``context``, if given, must match."""
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 1:
        raise BatchboundError(
            f"{family} needs token input of shape (context,), got {shape}; use a text data set "
            "such as fortunes or text(path=FILE)"
        )
    if context is not None and positive_int(family, "context", context) != shape[0]:
        raise BatchboundError(
            f"{family}: context={context} does not match the data's context {shape[0]}; give "
            f"the data set the same context, e.g. fortunes(context={context})"
        )
    return shape[0]


def check_tokens(family: str, idx: Tensor, context: int | None = None) -> None:
    """Refuse float input (a non-text data set) and sequences longer than the model's."""
    if idx.is_floating_point() or idx.dim() != 2:
        raise BatchboundError(
            f"{family} reads (n, context) integer token ids, got {idx.dtype} "
            f"{tuple(idx.shape)}; use a text data set such as fortunes or text(path=FILE)"
        )
    if context is not None and idx.shape[1] > context:
        raise BatchboundError(
            f"{family}: sequences of {idx.shape[1]} tokens exceed the context {context}"
        )


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.heads, self.width = heads, width

    def forward(self, x: Tensor) -> Tensor:
        n, steps, width = x.shape
        q, k, v = (
            t.view(n, steps, self.heads, width // self.heads).transpose(1, 2)
            for t in self.c_attn(x).split(self.width, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(n, steps, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocabulary: int, context: int, depth: int, width: int, heads: int,
                 tie: bool) -> None:
        super().__init__()
        self.context = context
        self.wte = nn.Embedding(vocabulary, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocabulary, bias=False)
        if tie:
            self.wte.weight = self.lm_head.weight
        self._init(depth)

    @torch.no_grad()
    def _init(self, depth: int) -> None:
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() > 1:
                std = 0.02 / math.sqrt(2 * depth) if name.endswith("c_proj.weight") or \
                    name.endswith("mlp.2.weight") else 0.02
                p.normal_(0.0, std)

    def forward(self, idx: Tensor) -> Tensor:
        check_tokens("gpt", idx, self.context)
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@register_family("gpt")
def gpt(
    input_shape: Sequence[int],
    num_outputs: int,
    depth: int = 2,
    width: int = 64,
    heads: int = 4,
    context: int | None = None,
    tie: bool = True,
) -> nn.Module:
    """nanoGPT-like causal transformer on token ids; context from the data, output = vocabulary."""
    depth = layer_count("gpt", "depth", depth)
    width = positive_int("gpt", "width", width)
    heads = positive_int("gpt", "heads", heads)
    tie = flag("gpt", "tie", tie)
    steps = token_input("gpt", input_shape, context)
    if width % heads:
        raise BatchboundError(f"gpt: width {width} must be a multiple of heads {heads}")
    vocabulary = positive_int("gpt", "the output width (vocabulary)", num_outputs, minimum=2)
    resolved = Spec("gpt", {"depth": depth, "width": width, "heads": heads, "context": steps,
                            "tie": tie})
    model = GPT(vocabulary, steps, depth, width, heads, tie)
    return tag(model, ModelShape("gpt", depth, width, str(resolved), tokens=True))
