"""watch() with torch.compile, the three ways users combine them: ``watch(m)`` around calls of
``torch.compile(m)`` (Dynamo traced into watch's own forward hook and failed inside it: an
outside review), ``watch(torch.compile(m))``, and ``m.compile()``. Each step is exact against
the per-example loop."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.diversity import OnlineDiversity, watch


def model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def loop_m2(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    params = list(net.parameters())
    total = 0.0
    for i in range(len(x)):
        grads = torch.autograd.grad(F.cross_entropy(net(x[i : i + 1]), y[i : i + 1]), params)
        total += sum(float(g.square().sum()) for g in grads)
    return total / len(x)


@pytest.mark.parametrize("way", ["around", "compiled", "method"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_models_are_measured(way: str, backend: str) -> None:
    torch._dynamo.reset()
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    if way == "method":
        net.compile(backend=backend)
        watched = called = net
    else:
        compiled = torch.compile(net, backend=backend)
        watched, called = (net, compiled) if way == "around" else (compiled, compiled)
    monitor = OnlineDiversity(100, decay=0.0)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(5, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (5,), generator=g)
        plain = copy.deepcopy(getattr(net, "_orig_mod", net))
        expected = loop_m2(plain, x, y)
        optimizer.zero_grad(set_to_none=True)
        with watch(watched, monitor):
            F.cross_entropy(called(x), y).backward()
        optimizer.step()
        assert monitor.last is not None
        assert monitor.last[0] == pytest.approx(expected, rel=1e-10), (way, step)
