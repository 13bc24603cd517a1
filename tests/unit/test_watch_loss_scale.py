"""watch(loss_scale=scaler): a GradScaler multiplies the loss by its scale s, so M2 and C
carried s² and the running estimate weighed each step by its s²; a scale that grows
(``growth_interval``) put the smoothed bound 6.7 % to 88 % off (an outside review). The scale
is divided out now, and the running estimate is that of the unscaled steps, exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.diversity import OnlineDiversity, watch
from batchbound.errors import BatchboundError


def reference_row(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """S and T of the examples' own losses, by the per-example loop."""
    copied = copy.deepcopy(model)
    params = list(copied.parameters())
    rows = []
    for i in range(len(x)):
        grads = torch.autograd.grad(F.cross_entropy(copied(x[i : i + 1]), y[i : i + 1]), params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    g = torch.stack(rows)
    return float(g.square().sum()), float(g.sum(0).square().sum())


@pytest.mark.parametrize("update", ["after", "inside"])
def test_a_growing_loss_scale_is_divided_out(update: str) -> None:
    """``inside``: scaler.step and scaler.update in the block, after the backward; the scale
    was read as the block ended, after update() had doubled it (M2 4× too small)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
    monitor, unscaled = OnlineDiversity(1000, decay=0.9), OnlineDiversity(1000, decay=0.9)
    reference = OnlineDiversity(1000, decay=0.9)
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=g)
        S, T = reference_row(model, x, y)
        reference.update_from_norms(S, T, 8)
        scale = scaler.get_scale()
        optimizer.zero_grad(set_to_none=True)
        with watch(model, unscaled):  # the same step, the scale not given: it carries s²
            scaler.scale(F.cross_entropy(model(x), y)).backward()
        optimizer.zero_grad(set_to_none=True)
        with watch(model, monitor, loss_scale=scaler):
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            if update == "inside":
                scaler.step(optimizer)
                scaler.update()
        if update == "after":
            scaler.step(optimizer)
            scaler.update()
        assert monitor.last == pytest.approx(reference.last, rel=1e-10)
        assert unscaled.last[0] == pytest.approx(reference.last[0] * scale**2, rel=1e-10)
    assert scaler.get_scale() == 2.0 ** (4 + 6)  # it grew every step
    assert monitor.batch_bound == pytest.approx(reference.batch_bound, rel=1e-10)
    assert unscaled.batch_bound != pytest.approx(reference.batch_bound, rel=1e-3)


def test_a_loss_scale_that_is_no_scaler_is_refused() -> None:
    model = nn.Linear(3, 2)
    with pytest.raises(BatchboundError, match=r"loss_scale must be a number or a torch\.amp"), \
            watch(model, OnlineDiversity(10), loss_scale="2"):
        pass
