"""The gradient-sum checks' rounding floor (rtol × the step's whole gradient, steps.py) is for
parameters whose gradient is itself at that floor (an attention key's bias, exactly 0 up to
rounding). A regulariser on a layer with a small but real gradient, started by
``torch.autograd.backward`` (where only the fingerprints of the sums can see it), must still
be refused, or n·Δ agree with the float64 per-example loop to float32's stated 1e-3: the
fingerprint is a projection, ~1/√numel of the mismatch's norm, so a floor on it does not
bound the regulariser's size."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from training_models import loop_S_T

from batchbound.diversity import OnlineDiversity, watch
from batchbound.errors import BatchboundError

N = 16


class SmallBranch(nn.Module):
    """A main layer and a 64 × 64 branch whose gradient is about a hundredth of the step's."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        return self.head(h + 0.01 * torch.tanh(self.b(h)))


def losses(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("size", [0.01, 0.03, 0.1])  # ‖λ·W_b‖ / ‖the step's gradient‖
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_penalty_on_a_small_layer_is_refused_or_exact(size: float, seed: int) -> None:
    refused_or_exact("b", size, seed)


@pytest.mark.xfail(strict=True, reason="known, not fixed: the fingerprint's tolerance is on "
                   "the norm scale, its mismatch a projection (~1/√numel of a regulariser's "
                   "norm), so a penalty on the main layer passes, n·Δ 17 % off")
def test_a_penalty_on_the_main_layer_is_refused_or_exact() -> None:
    refused_or_exact("a", 0.1, 2)


def refused_or_exact(layer: str, size: float, seed: int) -> None:
    torch.manual_seed(seed)
    model = SmallBranch()
    x, y = torch.randn(N, 16), torch.randint(0, 4, (N,))
    S, T = loop_S_T(copy.deepcopy(model), (x,), {}, lambda out, i: losses(out, y[i : i + 1]).sum(),
                    N)
    grads = torch.autograd.grad(losses(model(x), y).sum(), list(model.parameters()))
    weight = getattr(model, layer).weight
    lam = size * float(torch.sqrt(sum(g.double().square().sum() for g in grads))) / float(
        weight.detach().norm())
    expected = OnlineDiversity(10, decay=0.0)
    expected.update_from_norms(S, T, N)
    try:
        for _ in range(2):  # the first step checks the model
            model.zero_grad()
            monitor = OnlineDiversity(10, decay=0.0)
            with watch(model, monitor, reduction="sum"):
                total = losses(model(x), y).sum() + 0.5 * lam * weight.square().sum()
                torch.autograd.backward(total)
    except BatchboundError as exc:
        assert f"{layer}.weight" in str(exc)
        return
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-3)
