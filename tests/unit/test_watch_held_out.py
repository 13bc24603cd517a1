"""The held-out round of issue 35: models written the way outside users write them, none of
which the rules were built against, under watch() in float64 against the per-example loop
(each a class: weight tying with flash attention, hand-written LoRA, GroupNorm/InstanceNorm
with in-place ReLU, a module called twice, attention masks as keyword arguments, frozen and
no_grad parts, .detach(), full backward hooks; torch.compile: test_watch_compiled.py)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from training_models import loop_S_T

from batchbound.diversity import OnlineDiversity, watch


class NanoGPT(nn.Module):
    """One block, tied embedding and head, F.scaled_dot_product_attention (causal)."""

    def __init__(self, vocab: int = 40, dim: int = 16, context: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        self.ln1, self.ln2, self.lnf = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: Tensor) -> Tensor:
        B, L = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(L))
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=2)
        q, k, v = (t.view(B, L, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, -1))
        return self.head(self.lnf(x + self.fc2(F.gelu(self.fc(self.ln2(x))))))


class LoRA(nn.Module):
    def __init__(self, base: nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.B = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + (x @ self.A.t()) @ self.B.t() * 0.5


class NormCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.gn = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.c2, self.inorm = nn.Conv2d(8, 8, 3), nn.InstanceNorm2d(8, affine=True)
        self.act, self.fc = nn.ReLU(inplace=True), nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.inorm(self.c2(self.act(self.gn(self.c1(x))))))
        return self.fc(h.mean((2, 3)))


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer, self.out = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.layer(torch.tanh(self.layer(x)))))


class MaskedAttention(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.emb, self.out = nn.Linear(6, dim), nn.Linear(dim, 3)
        self.mha = nn.MultiheadAttention(dim, 2, batch_first=True)

    def forward(self, x: Tensor, key_padding_mask: Tensor) -> Tensor:
        h, L = self.emb(x), x.shape[1]
        causal = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
        a, _ = self.mha(h, h, h, key_padding_mask=key_padding_mask, attn_mask=causal)
        return self.out(a[:, 0])


class FrozenDetached(nn.Module):
    """A frozen layer, a branch under no_grad, a .detach(), a full backward hook."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3),
                                          nn.Linear(6, 8))
        self.a.requires_grad_(False)
        self.c.register_full_backward_hook(
            lambda m, gi, go: (None if gi[0] is None else gi[0] * 2,))

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            z = self.d(x)
        h = torch.tanh(self.b(torch.tanh(self.a(x))) + z)
        return self.c(h) + 0.5 * self.c(h.detach())


def _sum_ce(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")


def _case(name: str) -> tuple[nn.Module, tuple, dict, Tensor]:
    torch.manual_seed(0)
    n = 4
    x6, y3 = torch.randn(n, 6), torch.randint(0, 3, (n,))
    if name == "nanogpt":
        return NanoGPT(), (torch.randint(0, 40, (n, 8)),), {}, torch.randint(0, 40, (n, 8))
    if name == "lora":
        return nn.Sequential(LoRA(nn.Linear(6, 8)), nn.Tanh(), nn.Linear(8, 3)), (x6,), {}, y3
    if name == "norm_cnn":
        return NormCNN(), (torch.randn(n, 3, 6, 6),), {}, y3
    if name == "shared":
        return Shared(), (x6,), {}, y3
    if name == "masked_attention":
        mask = torch.zeros(n, 5, dtype=torch.bool)
        mask[1, 3:] = True
        return MaskedAttention(), (torch.randn(n, 5, 6),), {"key_padding_mask": mask}, y3
    return FrozenDetached(), (x6,), {}, y3


def _floats(values: tuple | dict, fn: Callable[[Tensor], Tensor]) -> tuple | dict:
    if isinstance(values, dict):
        return {k: fn(v) if v.is_floating_point() else v for k, v in values.items()}
    return tuple(fn(v) if v.is_floating_point() else v for v in values)


@pytest.mark.parametrize("name", ["nanogpt", "lora", "norm_cnn", "shared", "masked_attention",
                                  "frozen_detached"])
def test_outside_model_under_watch_is_exact(name: str) -> None:
    model, args, kwargs, y = _case(name)
    model = model.double()
    args, kwargs = _floats(args, Tensor.double), _floats(kwargs, Tensor.double)
    n = y.shape[0]
    S, T = loop_S_T(copy.deepcopy(model), args, kwargs,
                    lambda out, i: _sum_ce(out, y[i : i + 1]), n)
    expected = OnlineDiversity(1000, decay=0.0)
    expected.update_from_norms(S, T, n)
    monitor = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's cost, where it runs
        with watch(model, monitor, reduction="sum"):
            _sum_ce(model(*args, **kwargs), y).backward()
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-9, abs=1e-9 * expected.m2)

