"""bfloat16 calls of Linear and Hugging Face's Conv1D reach their rule unwidened
(``low_precision``): the weight's ``Outer`` multiplies u and v as the call computed them
(``forms.products``: on CUDA with float32 results, tests/integration/test_gpu.py) and widens
them for everything else. On CPU ``products`` widens first, so every number must be the one
the rule gave when the engine widened its inputs itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from batchbound.diversity import PreparedStats
from batchbound.diversity.rules import registry
from batchbound.diversity.rules.forms import Outer, inner, products, project


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).bfloat16()


@pytest.mark.parametrize("steps,p,q", [(6, 40, 50), (30, 3, 4)])  # the Gram form; materialised
def test_an_outer_of_bfloat16_terms_gives_what_its_widened_twin_gives(steps, p, q) -> None:
    torch.manual_seed(0)
    u, v = _bf16(5, steps, p), _bf16(5, steps, q)
    low, wide = Outer(u, v), Outer(u.float(), v.float())
    assert low.u.dtype == torch.float32 and torch.equal(low.u, wide.u)
    assert torch.equal(low.sq_norms(), wide.sq_norms())
    assert torch.equal(low.dense(), wide.dense())
    assert torch.equal(low.part(slice(1, 3)).sq_norms(), wide.part(slice(1, 3)).sq_norms())
    other = Outer(_bf16(5, 4, p), _bf16(5, 4, q))
    assert torch.equal(inner(low, other, p * q), inner(wide, Outer(other.u, other.v), p * q))
    a, b = torch.randn(p, 3), torch.randn(q, 3)
    assert torch.equal(project(low, a, b), project(wide, a, b))
    want = (u.double().transpose(1, 2) @ v.double()).square().sum(dim=(1, 2))
    torch.testing.assert_close(low.sq_norms().double(), want, rtol=1e-5, atol=0)


def test_products_of_bfloat16_on_cpu_are_the_widened_products() -> None:
    x, y = _bf16(3, 4, 8), _bf16(3, 8, 5)
    got = products(x, y)
    assert got.dtype == torch.float32 and torch.equal(got, x.float() @ y.float())


class _Blocks(nn.Module):
    """Linear layers on sequences, one shared input (q/k/v-like) and a bias-free head."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(12, 16), nn.Linear(12, 16)
        self.head = nn.Linear(16, 7, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.q(x)) * self.k(x))


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() * y).reshape(out.shape[0], -1).sum(dim=1)


def _stats(low_precision: bool, monkeypatch: pytest.MonkeyPatch):
    entry = registry.RULES[nn.Linear]
    monkeypatch.setitem(registry.RULES, nn.Linear,
                        dataclasses.replace(entry, low_precision=low_precision))
    torch.manual_seed(0)
    model = _Blocks().eval()
    x, y = torch.randn(6, 9, 12), torch.randn(6, 9, 7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return PreparedStats(model, _loss)(x, y)


def test_watch_under_autocast_gives_the_same_numbers_unwidened(monkeypatch) -> None:
    wide = _stats(False, monkeypatch)
    low = _stats(True, monkeypatch)
    assert low.sq_norms.keys() == wide.sq_norms.keys()
    for name, sq in low.sq_norms.items():
        assert sq.dtype == torch.float32
        torch.testing.assert_close(sq, wide.sq_norms[name], rtol=1e-6, atol=0)
    assert abs(low.S / wide.S - 1) < 1e-6


class _TiedFloat64(nn.Module):
    """A float64 first parameter (the working dtype) before a tied embedding and head: under
    bfloat16 autocast the head's call is bfloat16, the embedding's forms float64."""

    def __init__(self, vocab: int = 2000, dim: int = 64) -> None:
        super().__init__()
        self.temp = nn.Parameter(torch.ones((), dtype=torch.float64))
        self.wte = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.wte(idx))) * self.temp


def _token_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.double().transpose(1, 2), y,
                                       reduction="none").sum(dim=1)


def test_a_float64_working_dtype_keeps_the_forms_in_float64_under_autocast(monkeypatch) -> None:
    """Only where the working dtype is float32 do the terms go unwidened: here the bfloat16
    head meets the float64 embedding form in the tied weight's cross terms (n·numel past
    2²⁰, not summed materialised), which multiplied float32 by float64 and raised."""
    torch.manual_seed(0)
    model = _TiedFloat64().eval()
    x, y = torch.randint(0, 2000, (16, 5)), torch.randint(0, 2000, (16, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stats = PreparedStats(model, _token_loss)(x, y)
    assert {t.dtype for t in stats.sq_norms.values()} == {torch.float64}
    entry = registry.RULES[nn.Linear]
    monkeypatch.setitem(registry.RULES, nn.Linear, dataclasses.replace(entry, low_precision=False))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        wide = PreparedStats(model, _token_loss)(x, y)
    for name, sq in stats.sq_norms.items():
        assert torch.equal(sq, wide.sq_norms[name])
