"""Models written the way outside users write them, for ``watch`` inside their own training
steps (issue 35): layers with no rule of batchbound's, several inputs, dataclass outputs,
user hooks, checkpointing. And the float64 per-example loop they are checked against."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def rows(value: Any, i: int, n: int) -> Any:
    """Example i of every tensor with n rows in ``value`` (nested tuples, lists, dicts)."""
    if isinstance(value, Tensor):
        return value[i : i + 1] if value.dim() and value.shape[0] == n else value
    if isinstance(value, (tuple, list)):
        return type(value)(rows(v, i, n) for v in value)
    if isinstance(value, dict):
        return {k: rows(v, i, n) for k, v in value.items()}
    return value


def loop_S_T(model: nn.Module, args: tuple, kwargs: dict, loss: Callable[[Any, int], Tensor],
             n: int) -> tuple[float, float]:
    """S = Σ_i ‖∇f_i‖² and T = ‖Σ_i ∇f_i‖², one forward and backward per example, in float64
    sums; ``loss(outputs, i)`` is example i's loss on its own outputs."""
    params = [p for p in model.parameters() if p.requires_grad]
    S, total = 0.0, [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for i in range(n):
        out = model(*rows(args, i, n), **rows(kwargs, i, n))
        grads = torch.autograd.grad(loss(out, i), params, allow_unused=True)
        for k, g in enumerate(grads):
            if g is not None:
                g = g.to_dense() if g.is_sparse else g
                S += float(g.double().square().sum())
                total[k] += g.double()
    return S, float(sum(t.square().sum() for t in total))


class TinyViT(nn.Module):
    """Patch convolution, a class token and learned positions, one encoder block."""

    def __init__(self, image: int = 8, patch: int = 4, dim: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.block = nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), h], dim=1) + self.pos_embed
        return self.head(self.norm(self.block(h))[:, 0])


class DoRALinear(nn.Module):
    """Weight-decomposed low-rank adaptation (Liu et al. 2024) of a frozen Linear."""

    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        base.weight.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(rank))
        self.lora_B = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)
        self.magnitude = nn.Parameter(base.weight.detach().norm(dim=1, keepdim=True).clone())

    def forward(self, x: Tensor) -> Tensor:
        w = self.base.weight + self.lora_B @ self.lora_A
        w = self.magnitude * w / w.norm(dim=1, keepdim=True)
        return F.linear(x, w, self.base.bias)


class FiLM(nn.Module):
    """Feature-wise linear modulation: model(img, cond)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.film = nn.Linear(4, 16)
        self.head = nn.Linear(8, 3)

    def forward(self, img: Tensor, cond: Tensor) -> Tensor:
        gamma, beta = self.film(cond).chunk(2, dim=1)
        h = torch.relu(self.conv(img) * gamma[:, :, None, None] + beta[:, :, None, None])
        return self.head(h.mean(dim=(2, 3)))


@dataclass
class Prediction:
    logits: Tensor
    features: Tensor


class DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Prediction:
        h = torch.tanh(self.body(x))
        return Prediction(self.head(h), h)


class CheckpointedBlock(nn.Module):
    """A pre-norm MLP block under non-reentrant activation checkpointing."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm, self.fc, self.out = nn.LayerNorm(dim), nn.Linear(dim, 16), nn.Linear(16, 3)

    def inner(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))[..., : x.shape[-1]]

    def forward(self, x: Tensor) -> Tensor:
        h = checkpoint(self.inner, x, use_reentrant=False)
        return self.out(torch.cat([h, h], dim=-1))
