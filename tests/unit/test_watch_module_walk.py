"""watch reads the model's structure on every step (``steps._walk``): a layer swapped between
steps is planned again, and its numbers are those of a model planned from scratch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.diversity import OnlineDiversity, watch


def test_a_layer_swapped_between_steps_is_planned_again() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
    x, y = torch.randn(8, 5), torch.randint(3, (8,))

    def step(net: nn.Module, monitor: OnlineDiversity) -> tuple[float, float]:
        net.zero_grad(set_to_none=True)
        with watch(net, monitor, reduction="sum"):
            F.cross_entropy(net(x), y, reduction="sum").backward()
        assert monitor.last is not None
        return monitor.last

    monitor = OnlineDiversity()
    step(model, monitor)
    model[2] = nn.Linear(6, 3)  # a new layer under the same name: the plan is made anew
    swapped = step(model, monitor)
    fresh = step(copy.deepcopy(model), OnlineDiversity())  # planned from scratch
    assert swapped == pytest.approx(fresh, rel=1e-6)
    assert swapped[0] > 0
