"""A residual written in place into a layer's input or output after the layer's call,
``h.add_(f(h))``, as users write it to save memory (an outside review, 2026-11-29): before,
measure() raised torch's INTERNAL ASSERT (a captured output edge whose view autograd had
rebased) or trusted the check alone to catch a rule reading the input as written later.
Now the layer is refused by engine="hooks", naming why, and computed exactly by the
fallback, against the float64 per-example loop."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.diversity import OnlineDiversity, measure, watch
from batchbound.errors import BatchboundError


class Residual(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.a, self.inner = nn.Linear(5, 8), inner
        self.c, self.b = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)  # a view: a Linear on a 3-d input
        h.add_(self.c(self.inner(h)))  # legal for autograd: inner saved no input of its own
        return self.b(h)


def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).sum(1)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(6, 4, 5, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (6, 4), generator=g))


def loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    params = [p for p in model.parameters() if p.requires_grad]
    S, total = 0.0, [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(loss(model(x[i : i + 1]), y[i : i + 1]).sum(), params)
        S += sum(float(g.square().sum()) for g in grads)
        total = [t + g for t, g in zip(total, grads, strict=True)]
    return S, sum(float(t.square().sum()) for t in total)


def llama_norm() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(8)
    with torch.no_grad():
        norm.weight.normal_()
    return norm


@pytest.mark.parametrize(("inner", "why", "rel"), [
    (nn.Tanh, r"a \(Linear\): its output was written in place after the call while read", 1e-10),
    # Llama's RMSNorm computes in float32 inside a float64 model: its rounding, 1e-9 here
    (llama_norm, r"inner \(LlamaRMSNorm\): its input was written in place after the call",
     1e-7),
])
def test_a_residual_written_in_place_is_refused_by_hooks_and_exact_by_the_fallback(
        inner, why: str, rel: float) -> None:
    torch.manual_seed(0)
    model = Residual(inner()).double()
    x, y = data()
    with pytest.raises(BatchboundError, match=why):
        measure(model, (x, y), loss, engine="hooks")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's cost
        report = measure(model, (x, y), loss, chunk_size=3)
        S, T = loop(copy.deepcopy(model), x, y)
        assert pytest.approx(S, rel=rel) == report.S
        assert pytest.approx(T, rel=rel) == report.T
        monitor = OnlineDiversity(100, decay=0.0)
        with watch(model, monitor):
            loss(model(x), y).mean().backward()
    want = OnlineDiversity(100, decay=0.0)
    want.update_from_norms(S, T, 6)
    assert monitor.m2 == pytest.approx(want.m2, rel=rel)
