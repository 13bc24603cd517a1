"""Gradual unfreezing, as fine-tuning loops do it (ULMFiT; a LoRA base unfrozen late): which
parameters train changes between steps. ``monitored_step`` and ``watch`` must follow the
change, exact against the float64 per-example loop at every step, and leave every trainable
parameter its gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from batchbound.diversity import OnlineDiversity, monitored_step, watch


class LoRA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(6, 8).requires_grad_(False)
        self.lora_a = nn.Linear(6, 2, bias=False)
        self.lora_b = nn.Linear(2, 8, bias=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.base(x) + self.lora_b(self.lora_a(x))))


def per_example_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y, reduction="none")


def exact(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """S = Σ‖g_i‖², T = ‖Σ g_i‖² over the trainable parameters, one example at a time."""
    work = copy.deepcopy(model).double()
    params = [p for p in work.parameters() if p.requires_grad]
    S, total = 0.0, [torch.zeros_like(p) for p in params]
    for i in range(len(x)):
        grads = torch.autograd.grad(per_example_loss(work(x[i:i + 1].double()),
                                                     y[i:i + 1]).sum(), params)
        S += sum(float(g.square().sum()) for g in grads)
        for t, g in zip(total, grads, strict=True):
            t += g
    return S, sum(float(t.square().sum()) for t in total)


def unfreeze_base(model: LoRA) -> None:
    model.base.requires_grad_(True)


def freeze_head(model: LoRA) -> None:
    model.head.requires_grad_(False)


@pytest.mark.parametrize("tool", ["monitored_step", "watch"])
@pytest.mark.parametrize("change", [unfreeze_base, freeze_head])
def test_a_change_of_the_trainable_set_between_steps_is_followed(tool: str, change) -> None:
    model = LoRA()
    for step in range(3):
        if step == 1:
            change(model)
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(10, 6, generator=g), torch.randint(0, 3, (10,), generator=g)
        S, T = exact(model, x, y)
        monitor = OnlineDiversity(None, decay=0.0)
        model.zero_grad(set_to_none=True)
        if tool == "watch":
            with watch(model, monitor):
                per_example_loss(model(x), y).mean().backward()
        else:
            monitored_step(model, x, y, per_example_loss, monitor)
        b = len(x)
        assert monitor.m2 * b == pytest.approx(S, rel=1e-5)
        assert monitor.cross * b * (b - 1) + monitor.m2 * b == pytest.approx(T, rel=1e-5)
        for name, p in model.named_parameters():
            assert (p.grad is not None) == p.requires_grad, name
