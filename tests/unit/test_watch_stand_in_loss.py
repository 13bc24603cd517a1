"""watch()'s check runs the model with a stand-in loss, ⟨out, r⟩ + ‖out‖²/2 per example. It
overflowed on logits masked with ``finfo.min`` or ``-inf`` (a span-selection head, HF
Splinter) and, formed in float16 under autocast, on outputs of a few hundred; watch then
refused the model, saying the user's loss was not finite when it was (an outside review).
Masked entries are now left out of the stand-in and it is computed in float32 at least."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.diversity import OnlineDiversity, watch


class SpanScores(nn.Module):
    """A score per position, the padded positions masked out."""

    def __init__(self, fill: float) -> None:
        super().__init__()
        self.score, self.fill = nn.Linear(4, 1), fill

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.score(x).squeeze(-1).masked_fill(~mask, self.fill)


def loop_m2(model: nn.Module, inputs: list[tuple], loss) -> float:  # type: ignore[no-untyped-def]
    """Σ_i ‖g_i‖² / n, each example alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = 0.0
    for args in inputs:
        grads = torch.autograd.grad(loss(*args), params)
        total += sum(float(g.double().square().sum()) for g in grads)
    return total / len(inputs)


@pytest.mark.parametrize("fill", [torch.finfo(torch.float64).min, float("-inf"), -1e9])
def test_masked_logits_are_measured(fill: float) -> None:
    torch.manual_seed(0)
    model = SpanScores(fill).double()
    x = torch.randn(6, 5, 4, dtype=torch.float64)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[2, 3:] = False
    mask[4, 1:] = False
    y = torch.tensor([0, 1, 2, 1, 0, 3])
    reference = copy.deepcopy(model)
    expected = loop_m2(reference, [(x[i : i + 1], mask[i : i + 1], y[i : i + 1])
                                   for i in range(6)],
                       lambda xi, mi, yi: F.cross_entropy(reference(xi, mi), yi))
    monitor = OnlineDiversity(100, decay=0.0)
    with watch(model, monitor, reduction="sum"):
        F.cross_entropy(model(x, mask), y, reduction="sum").backward()
    assert monitor.last is not None
    assert monitor.last[0] == pytest.approx(expected, rel=1e-10)


def test_float16_outputs_of_a_few_hundred() -> None:
    """A regression head on targets near 300, under float16 autocast: ‖out‖²/2 in float16
    was inf; the user's loss is small and finite."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    with torch.no_grad():
        model[2].bias.fill_(300.0)
    x = torch.randn(6, 8)
    y = 300.0 + torch.randn(6, 4)

    def loss(xi: torch.Tensor, yi: torch.Tensor, net: nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out = net(xi)
        return F.mse_loss(out.float(), yi, reduction="none").mean(1).sum()

    reference = copy.deepcopy(model)
    expected = loop_m2(reference, [(x[i : i + 1], y[i : i + 1]) for i in range(6)],
                       lambda xi, yi: loss(xi, yi, reference))
    monitor = OnlineDiversity(100, decay=0.0)
    with pytest.warns(UserWarning, match="float16 gradients"), \
            watch(model, monitor, reduction="sum"):
        loss(x, y, model).backward()
    assert monitor.last is not None
    assert "float16" in str(monitor.precision)
    assert monitor.last[0] == pytest.approx(expected, rel=2e-2)  # float16's rounding
