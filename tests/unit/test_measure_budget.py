"""``measure(memory_budget=...)``: the chunk comes from what the forward saves per example,
the numbers do not depend on it, and a budget that cannot hold the work is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchbound.diversity import measure, resolve_loss
from batchbound.diversity.budget import chunk_for_budget, saved_bytes
from batchbound.errors import BatchboundError


def problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 3)).double()
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(100, 10, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (100,), generator=g)


def test_saved_bytes_grow_linearly_with_the_examples() -> None:
    model, x, y = problem()
    loss = resolve_loss("cross_entropy")
    one, two, four = (saved_bytes(model, x[:k], y[:k], loss) for k in (4, 8, 16))
    assert two - one > 0 and four - two == 2 * (two - one)
    # at least the hidden activations: 64 float64 numbers per example
    assert (two - one) / 4 >= 64 * 8


def test_budget_sets_the_chunk_and_not_the_numbers() -> None:
    model, x, y = problem()
    loss = resolve_loss("cross_entropy")
    params = sum(p.numel() * 8 for p in model.parameters())
    per_example = (saved_bytes(model, x[:4], y[:4], loss) - saved_bytes(model, x[:2], y[:2],
                                                                       loss)) / 2
    budget = int(5 * params + 3 * per_example * 17.5)
    assert chunk_for_budget(model, x, y, loss, budget, most=256) == 17
    assert chunk_for_budget(model, x, y, loss, budget, most=8) == 8  # chunk_size caps it
    whole = measure(model, (x, y), "cross_entropy", chunk_size=100)
    small = measure(model, (x, y), "cross_entropy", memory_budget=budget)
    assert small.extra["chunk_size"] == 17 and whole.extra["chunk_size"] == 100
    for ours, theirs in ((small.S, whole.S), (small.T, whole.T)):
        assert ours == pytest.approx(theirs, rel=1e-12)


def test_a_budget_too_small_is_refused() -> None:
    model, x, y = problem()
    with pytest.raises(BatchboundError, match="cannot hold measure"):
        measure(model, (x, y), "cross_entropy", memory_budget=1000)
    with pytest.raises(BatchboundError, match="positive number of bytes"):
        measure(model, (x, y), "cross_entropy", memory_budget=0)
