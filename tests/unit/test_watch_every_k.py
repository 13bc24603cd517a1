"""``watch`` on one step in k (docs/diversity.md: a host-bound GPU step's cost divided by k):
the watched steps are exact against the float64 per-example loop at their own weights, and
the training is the unwatched one's, bit for bit."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from training_models import loop_S_T

from batchbound.diversity import OnlineDiversity, watch

B, STEPS, EVERY = 6, 9, 3


def train(model: nn.Module, monitor: OnlineDiversity | None,
          expected: OnlineDiversity | None = None) -> None:
    """SGD with momentum over STEPS batches, steps 0, EVERY, 2·EVERY, … inside ``watch``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(B, 5, generator=g, dtype=torch.float64)
        y = torch.randint(3, (B,), generator=g)
        watched = monitor is not None and step % EVERY == 0
        if watched and expected is not None:  # the loop at the weights this step reads
            S, T = loop_S_T(copy.deepcopy(model), (x,), {},
                            lambda out, i, y=y: F.cross_entropy(out, y[i:i + 1]), B)
            expected.update_from_norms(S, T, B)  # each example's own loss
        optimizer.zero_grad()
        with watch(model, monitor) if watched else contextlib.nullcontext():
            F.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_one_step_in_k_is_exact_and_leaves_the_training_as_it_was() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)).double()
    plain = copy.deepcopy(model)
    monitor, expected = OnlineDiversity(100), OnlineDiversity(100)
    train(model, monitor, expected)
    train(plain, None)
    assert monitor.steps == expected.steps == len(range(0, STEPS, EVERY))
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-8)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q), name
