"""``watch`` reads each example's gradient at 1/b of its loss (a mean) and scales it by b, which
holds where the backward is linear in the loss: every operation's vector-Jacobian product is,
so only what rewrites a gradient breaks it. A clamp in a hook gave M2 25 % off the float64
loop with no warning (an outside review); it is refused now, checked on the model's first
step (``rule_check.not_linear``), while linear rewrites (a gradient reversal, a scale) stay
exact."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from training_models import loop_S_T

from batchbound.diversity import OnlineDiversity, watch
from batchbound.errors import BatchboundError

B = 6


class Reversal(torch.autograd.Function):
    """A domain-adaptation gradient reversal: identity forward, −λ·g backward."""

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:  # type: ignore[no-untyped-def, override]
        return h.view_as(h)

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:  # type: ignore[no-untyped-def, override]
        return -0.5 * g


class SignOfGradient(torch.autograd.Function):
    """A backward that keeps only each gradient's sign: not linear."""

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:  # type: ignore[no-untyped-def, override]
        return h.view_as(h)

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:  # type: ignore[no-untyped-def, override]
        return g.sign()


class Rewrite(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, h: Tensor) -> Tensor:
        if self.how == "reversal":
            return Reversal.apply(h)
        if self.how == "sign":
            return SignOfGradient.apply(h)
        if h.requires_grad:  # a hook registered in the forward, as users clip activations
            h.register_hook((lambda g: 3.0 * g) if self.how == "scale"
                            else (lambda g: g.clamp(-0.02, 0.02)))
        return h


def model_with(how: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), Rewrite(how), nn.Tanh(), nn.Linear(16, 4)).double()


def data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(B, 10, generator=g, dtype=torch.float64),
            torch.randint(0, 4, (B,), generator=g))


@pytest.mark.parametrize("how", ["clamp", "sign"])
def test_a_backward_that_rewrites_gradients_not_linearly_is_refused(how: str) -> None:
    model, (x, y) = model_with(how), data()
    with pytest.raises(BatchboundError, match="backward is not linear in the loss"), \
            watch(model, OnlineDiversity(100)):
        F.cross_entropy(model(x), y).backward()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("how", ["reversal", "scale"])
def test_a_linear_rewrite_of_the_gradients_is_exact(how: str) -> None:
    model, (x, y) = model_with(how), data()
    S, T = loop_S_T(copy.deepcopy(model), (x,), {},
                    lambda out, i: F.cross_entropy(out, y[i:i + 1]), B)
    monitor, expected = OnlineDiversity(100, decay=0.0), OnlineDiversity(100, decay=0.0)
    expected.update_from_norms(S, T, B)
    with watch(model, monitor):
        F.cross_entropy(model(x), y).backward()
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-8)
