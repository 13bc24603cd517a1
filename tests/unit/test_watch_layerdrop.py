"""A layer dropped for the whole batch with a small probability (LayerDrop: M2M100 and NLLB
fine-tune with 0.05 by default). Two forward passes usually both keep it, so the model was
taken as deterministic, and the check's examples, run alone in train mode, drew other
decisions: watch refused every seed as "the examples interact" (an outside review, 8 of 8).
A forward that draws from torch's generator is now random whatever its outputs show; each
step is exact against the loop that draws the step's decisions again."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.diversity import OnlineDiversity, watch


class LayerDrop(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if not (self.training and torch.rand([]) < self.p):  # the batch's one decision
            h = h + torch.tanh(self.b(h))
        return self.c(h)


def reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> float:
    """m2 by the loop, each example drawing the step's decision again (the same seed)."""
    copied = copy.deepcopy(model)
    params = list(copied.parameters())
    grads = []
    for i in range(len(x)):
        torch.manual_seed(seed)
        loss = F.cross_entropy(copied(x[i : i + 1]), y[i : i + 1])
        found = torch.autograd.grad(loss, params, allow_unused=True)
        grads.append(torch.cat([(torch.zeros_like(q) if g is None else g).reshape(-1)
                                for q, g in zip(params, found, strict=True)]))
    return float(torch.stack(grads).square().sum()) / len(x)


@pytest.mark.parametrize("p", [0.05, 0.5])
def test_a_layer_dropped_now_and_then_is_measured(p: float) -> None:
    torch.manual_seed(0)
    model, monitor = LayerDrop(p).double().train(), OnlineDiversity(100, decay=0.0)
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(5, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (5,), generator=g)
        seed = 10 * step + 1
        expected = reference(model, x, y, seed)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        with watch(model, monitor):
            F.cross_entropy(model(x), y).backward()
        assert monitor.last is not None
        assert monitor.last[0] == pytest.approx(expected, rel=1e-9), step


class SeedsItself(nn.Module):
    """A forward that seeds torch's generator itself before it draws (Reformer's fixed hash
    seed, after its reversible layers' ``default_generator.seed()``): it draws, but no
    seed given to it changes what it computes; deterministic, as before."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.default_generator.seed()  # from the system's entropy
        torch.manual_seed(7)
        rotation = torch.randn(8, 8, dtype=x.dtype)
        return self.c(torch.tanh(self.a(x)) @ rotation)


def test_a_forward_that_seeds_itself_is_deterministic() -> None:
    from batchbound.diversity.rule_check import deterministic

    torch.manual_seed(0)
    model = SeedsItself().double().train()
    x = torch.randn(4, 6, dtype=torch.float64)
    assert deterministic(model, x)
    assert not deterministic(LayerDrop(0.05).double().train(), x)
