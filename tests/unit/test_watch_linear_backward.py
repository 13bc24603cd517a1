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


class FreesItsState(torch.autograd.Function):
    """x²; its backward frees what it saved, as memory-minded users write (one backward)."""

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:  # type: ignore[no-untyped-def, override]
        ctx.h = h.detach()
        return h * h

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:  # type: ignore[no-untyped-def, override]
        h = ctx.h
        del ctx.h
        return 2 * h * g


def test_a_function_that_frees_its_state_in_the_backward_is_exact() -> None:
    """The check runs two forward passes, not a second backward through one (review)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    square = model[1].register_forward_hook(lambda m, a, out: FreesItsState.apply(out))
    x, y = data()
    S, T = loop_S_T(copy.deepcopy(model), (x,), {},
                    lambda out, i: F.cross_entropy(out, y[i:i + 1]), B)
    monitor, expected = OnlineDiversity(100, decay=0.0), OnlineDiversity(100, decay=0.0)
    expected.update_from_norms(S, T, B)
    with watch(model, monitor):
        F.cross_entropy(model(x), y).backward()
    square.remove()
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)


def test_hooks_on_every_parameter_are_named_not_a_crash() -> None:
    """With every parameter hooked there was nothing to compare: torch's RuntimeError."""
    model, (x, y) = model_with("scale"), data()
    for p in model.parameters():
        p.register_hook(lambda g: 2 * g)
    with pytest.raises(BatchboundError, match=r"a hook on its gradient \(register_hook\)"), \
            watch(model, OnlineDiversity(100)):
        F.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize("scale", [1.0, 1e-6])
def test_float16_rounding_is_not_taken_for_a_rewrite(scale: float) -> None:
    """float16 underflows at half the loss, and a gradient near zero (a key bias) is all
    rounding: the difference is weighed against the whole gradient (Llama, BERT and ConvNeXt
    under float16 autocast were refused, a review)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 4))
    x, y = data()
    monitor = OnlineDiversity(100)
    with watch(model, monitor):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x.float() * scale), y)
        loss.backward()
    assert monitor.steps == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_clamp_under_autocast_is_refused(dtype: torch.dtype) -> None:
    """Its looser tolerance still sees a rewrite of a layer whose gradient is small."""
    model, (x, y) = model_with("clamp").float(), data()
    with pytest.raises(BatchboundError, match="backward is not linear in the loss"), \
            watch(model, OnlineDiversity(100)), torch.autocast("cpu", dtype=dtype):
        F.cross_entropy(model(x.float()), y).backward()
