"""measure() on what an outside review (2026-11-29, 85 models against a float64 per-example
loop) found it returned silently wrong: a ``dtype`` copy whose loss or hook reaches the
user's own parameters (S 13 % and 0.9 % off), and gradients made infinite or nan by the
backward from finite losses (S = T = nan). Each is refused now, naming the cause (and the chunk)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.diversity import measure
from batchbound.errors import BatchboundError


def reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss) -> tuple[float, float]:
    """S and T of a float64 copy, one example at a time, ``loss(model, out, y)`` reading
    the copy's own parameters."""
    model = copy.deepcopy(model).double()
    params = [p for p in model.parameters() if p.requires_grad]
    S, total = 0.0, None
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(loss(model, model(x[i:i + 1].double()), y[i:i + 1]).sum(),
                                    params)
        S += sum(float(g.square().sum()) for g in grads)
        total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
    return S, float(sum(g.square().sum() for g in total))


def data(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(n, 8), torch.randint(0, 3, (n,))


def test_a_closure_loss_over_the_model_is_refused_for_a_dtype_copy_and_exact_without():
    x, y = data()
    model = nn.Linear(8, 3)

    def penalised(m, out, t):
        return F.cross_entropy(out, t, reduction="none") + 0.5 * m.weight.square().sum()

    def loss(out, t):  # what users write: a closure over their model
        return penalised(model, out, t)

    S, T = reference(model, x, y, penalised)
    report = measure(model, (x, y), loss, chunk_size=4)
    assert math.isclose(report.S, S, rel_tol=1e-5) and math.isclose(report.T, T, rel_tol=1e-5)
    with pytest.raises(BatchboundError, match=r"reaches the model's own parameters outside "
                                              r"the copy \(weight"):
        measure(model, (x, y), loss, chunk_size=4, dtype=torch.float64)


class Gained(nn.Module):
    """A trainable gain applied by a forward hook that closes over the module holding it."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 3)
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.base.register_forward_hook(lambda m, i, o: o * self.gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x)


def test_a_hook_closing_over_the_original_module_is_refused_for_a_dtype_copy():
    x, y = data()
    model = Gained()
    report = measure(model, (x, y), "cross_entropy", chunk_size=4)
    assert report.per_parameter_S["gain"] > 0
    with pytest.raises(BatchboundError, match=r"outside the copy \(gain"):
        measure(model, (x, y), "cross_entropy", chunk_size=4, dtype=torch.float64)


def test_a_copy_that_reaches_only_itself_is_measured_exactly():
    x, y = data()
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3))

    def ce(m, out, t):
        return F.cross_entropy(out, t, reduction="none")

    S, T = reference(model, x, y, ce)
    report = measure(model, (x, y), "cross_entropy", chunk_size=4, dtype=torch.float64)
    assert math.isclose(report.S, S, rel_tol=1e-12) and math.isclose(report.T, T, rel_tol=1e-12)


class RootOfRelu(nn.Module):
    """sqrt(relu(h)): finite outputs and losses, and an infinite derivative at 0 times a zero
    one, a nan in the backward, for every example with a unit at or below 0."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(torch.sqrt(h * (h > 0)))


@pytest.mark.parametrize("engine", ["auto", "hooks", "vmap", "loop"])
def test_gradients_not_finite_from_finite_losses_are_refused_naming_the_example(engine):
    x, y = data()
    model = RootOfRelu().eval()
    assert torch.isfinite(F.cross_entropy(model(x), y, reduction="none")).all()
    with pytest.raises(BatchboundError, match=r"chunk from example 0, the gradient of an "
                                              r"example is not finite.*\(in a\.weight, a\.bias\)"):
        measure(model, (x, y), "cross_entropy", chunk_size=4, engine=engine)


class Marked(nn.Module):
    """A Linear whose output gets 0·sqrt(gate·out²): finite outputs, and a nan in the
    backward (sqrt's infinite slope at 0 times 0) for the examples whose last input is 99."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.a(x)
        gate = (x[:, 7:] != 99).to(out.dtype)
        return out + 0 * torch.sqrt(gate * out.square())


def test_a_later_block_with_a_gradient_not_finite_names_its_own_chunk():
    """40 examples in chunks of 2, so blocks of 16 chunks: example 37 lies in the second."""
    torch.manual_seed(0)
    x, y = torch.randn(40, 8), torch.randint(0, 3, (40,))
    x[37, 7] = 99
    model = Marked()
    assert torch.isfinite(F.cross_entropy(model(x), y, reduction="none")).all()
    with pytest.raises(BatchboundError, match=r"chunk from example 36, the gradient of an "
                                              r"example is not finite.*\(in a\.weight, a\.bias\)"):
        measure(model, (x, y), "cross_entropy", chunk_size=2)


def test_differential_and_materialised_passes_refuse_gradients_not_finite():
    from batchbound.diversity import differential_diversity, mechanism_diversity

    x, y = data()
    torch.manual_seed(1)
    model, other = RootOfRelu().eval(), RootOfRelu().eval()
    with pytest.raises(BatchboundError, match="are not finite though the losses are"):
        differential_diversity(model, other, (x, y), "cross_entropy")
    with pytest.raises(BatchboundError, match="are not finite though the losses are"):
        mechanism_diversity(model, (x, y), "cross_entropy", "quantization")
