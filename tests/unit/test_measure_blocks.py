"""measure()'s gradient sum over blocks of chunks (each chunk adds its sum into the block,
the rules' own sums in their kernels; float64 totals from the second block on; one block is
normed as it is) against the float64 per-example loop, for every way the chunks fall into
blocks."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.diversity import measure

MEASURE = sys.modules["batchbound.diversity.measure"]


class Shared(nn.Module):
    """A bias reached twice through one broadcast: autograd hands both uses one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.shift = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) + self.shift


def loop_S_T(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    reference = model.double()
    params = [p for p in reference.parameters() if p.requires_grad]
    S, total = 0.0, [torch.zeros_like(p) for p in params]
    for i in range(x.shape[0]):
        loss = F.cross_entropy(reference(x[i : i + 1].double()), y[i : i + 1], reduction="sum")
        grads = torch.autograd.grad(loss, params)
        S += sum(float(g.square().sum()) for g in grads)
        total = [t + g for t, g in zip(total, grads, strict=True)]
    return S, sum(float(t.square().sum()) for t in total)


@pytest.mark.parametrize("block", [1, 2, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blocks_of_chunks_match_the_float64_loop(monkeypatch, block: int, dtype) -> None:
    monkeypatch.setattr(MEASURE, "BLOCK", block)
    torch.manual_seed(0)
    model = Shared().to(dtype)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(11, 5, generator=g, dtype=dtype), torch.randint(0, 3, (11,), generator=g)
    report = measure(model, (x, y), "cross_entropy", chunk_size=2)  # 6 chunks, the last of 1
    weights = [p.detach().clone() for p in model.parameters()]
    S, T = loop_S_T(copy.deepcopy(model), x, y)
    rel = 1e-5 if dtype == torch.float32 else 1e-12
    assert pytest.approx(S, rel=rel) == report.S
    assert pytest.approx(T, rel=rel) == report.T
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters(), strict=True))
    # a second call on the same model gives the same numbers (no buffer kept or reused)
    again = measure(model, (x, y), "cross_entropy", chunk_size=2)
    assert (again.S, again.T) == (report.S, report.T)


@pytest.mark.parametrize("block", [1, 2, 16])
def test_chunks_of_changing_sizes_match_the_float64_loop(monkeypatch, block: int) -> None:
    """A loader whose batches change size back and forth (3, 1, 3, 3, 2, 1): each block's
    chunks are summed by runs of one size, in the chunks' order, and their losses with them."""
    from torch.utils.data import DataLoader, TensorDataset

    monkeypatch.setattr(MEASURE, "BLOCK", block)
    torch.manual_seed(0)
    model = Shared().double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(13, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (13,), generator=g)
    sizes, start, batches = [3, 1, 3, 3, 2, 1], 0, []
    for k in sizes:
        batches.append(list(range(start, start + k)))
        start += k
    loader = DataLoader(TensorDataset(x, y), batch_sampler=batches)
    report = measure(model, loader, "cross_entropy")
    S, T = loop_S_T(copy.deepcopy(model), x, y)
    assert report.n == 13
    for name, p in model.named_parameters():  # each parameter's own, not another's
        own = 0.0
        for i in range(13):
            loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum")
            own += float(torch.autograd.grad(loss, p)[0].square().sum())
        assert pytest.approx(own, rel=1e-12) == report.per_parameter_S[name]
    assert pytest.approx(S, rel=1e-12) == report.S
    assert pytest.approx(T, rel=1e-12) == report.T
    with torch.no_grad():
        mean_loss = float(F.cross_entropy(model(x), y))
    assert pytest.approx(mean_loss, rel=1e-12) == report.loss
