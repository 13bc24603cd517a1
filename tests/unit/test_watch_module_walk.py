"""watch's per-step walk over the modules (``steps._named_modules``) meets the modules as
``named_modules`` does: the same names, in the same order, a shared module once, where it is
first met, and no None child; the plan follows a module swapped between steps."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.diversity import OnlineDiversity, watch
from batchbound.diversity.steps import _named_modules


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        block = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.first = block
        self.inner = nn.ModuleDict({"again": block, "other": nn.Linear(4, 4)})
        self.stack = nn.ModuleList([nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 3))
                                    for _ in range(2)])
        self.register_module("missing", None)
        self.head = self.stack[0][1]  # a shared leaf, first met inside the list

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner["other"](self.first(x))
        return self.stack[1](self.stack[0][0](h)[:, :4])


def _named(model: nn.Module) -> list[tuple[str, int]]:
    return [(name, id(m)) for name, m in model.named_modules()]


def test_the_walk_meets_the_modules_as_named_modules_does() -> None:
    model = Shared()
    assert [(name, id(m)) for name, m in _named_modules(model)] == _named(model)
    deep = nn.Sequential(*[nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU()))
                           for _ in range(3)])
    assert [(name, id(m)) for name, m in _named_modules(deep)] == _named(deep)


def test_a_hugging_face_model_is_walked_as_named_modules_walks_it() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=8,
                                       vocab_size=32, use_cache=False))
    assert [(name, id(m)) for name, m in _named_modules(model)] == _named(model)


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
