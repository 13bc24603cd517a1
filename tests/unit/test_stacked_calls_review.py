"""A review of stacking (stacking.py): calls of like modules that differ in something the
rule reads, or that share parameters, or that run on inputs of other shapes, each under
``watch`` against the float64 per-example loop. Stacked or not, the numbers must be exact."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from tests.support.reference import assert_exact, feature_loss, feature_targets
from torch import Tensor, nn
from training_models import loop_S_T

from batchbound.diversity import OnlineDiversity, hooks, watch

WIDTH = 8


class Chain(nn.Module):
    """Residual blocks x + tanh(fc(norm(x))) over ``norms`` and ``fcs``, in ``order`` (a
    block may run more than once), then a head; ``short``: the blocks of index ≥ 3 run on
    the first 3 positions only (inputs of another shape)."""

    def __init__(self, norms: list[nn.Module], fcs: list[nn.Module],
                 order: list[int] | None = None, short: bool = False) -> None:
        super().__init__()
        self.norms, self.fcs = nn.ModuleList(norms), nn.ModuleList(fcs)
        self.order = order if order is not None else list(range(len(norms)))
        self.short = short
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x: Tensor) -> Tensor:
        side = x[:, :3]
        for k in self.order:
            if self.short and k >= 3:
                side = side + torch.tanh(self.fcs[k](self.norms[k](side)))
            else:
                x = x + torch.tanh(self.fcs[k](self.norms[k](x)))
        if self.short:
            x = torch.cat([x, side], dim=1)
        return self.head(x)


def lns(count: int = 3, **kw) -> list[nn.Module]:
    return [nn.LayerNorm(WIDTH, **kw) for _ in range(count)]


def fcs(count: int = 3, **kw) -> list[nn.Module]:
    return [nn.Linear(WIDTH, WIDTH, **kw) for _ in range(count)]


def frozen() -> nn.Module:
    model = Chain(lns(), fcs())
    model.norms[1].weight.requires_grad_(False)
    model.fcs[2].bias.requires_grad_(False)
    model.fcs[1].weight.requires_grad_(False)
    return model


def no_bias() -> nn.Module:
    norms, linears = lns(), fcs()
    norms[1] = nn.LayerNorm(WIDTH, bias=False)
    linears[2] = nn.Linear(WIDTH, WIDTH, bias=False)
    return Chain(norms, linears)


def no_affine() -> nn.Module:
    norms = lns()
    norms[1] = nn.LayerNorm(WIDTH, elementwise_affine=False)
    return Chain(norms, fcs())


def shared() -> nn.Module:
    """A LayerNorm weight and a Linear bias shared by two modules (the other parameters
    their own): the shared ones need cross terms."""
    model = Chain(lns(), fcs())
    model.norms[2].weight = model.norms[0].weight
    model.fcs[1].bias = model.fcs[0].bias
    return model


def reused() -> nn.Module:
    """Blocks run several times (weights reused across steps, as a recurrent loop)."""
    return Chain(lns(), fcs(), order=[0, 1, 0, 2, 0, 1])


def rms() -> nn.Module:
    norms = [nn.RMSNorm(WIDTH), nn.RMSNorm(WIDTH), nn.RMSNorm(WIDTH, eps=1e-1),
             nn.RMSNorm(WIDTH, elementwise_affine=False)]
    return Chain(norms, fcs(4))


def lengths() -> nn.Module:
    """Like blocks on 5 positions and on 3."""
    return Chain(lns(6), fcs(6), short=True)


def normalized_shapes() -> nn.Module:
    """LayerNorms over the last dimension and over the last two, on the same input."""
    norms = lns()
    norms[1] = nn.LayerNorm((5, WIDTH))
    return Chain(norms, fcs())


def eps_forms() -> nn.Module:
    """eps 0.1 written two ways (stacked together) and 0.5 (on its own)."""
    return Chain([nn.LayerNorm(WIDTH, eps=1e-1), nn.LayerNorm(WIDTH, eps=0.1),
                  nn.LayerNorm(WIDTH, eps=0.5)], fcs())


def conv1d() -> nn.Module:
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    return Chain(lns(), [Conv1D(WIDTH, WIDTH), Conv1D(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)])


MODELS: dict[str, Callable[[], nn.Module]] = {
    "frozen": frozen, "no-bias": no_bias, "no-affine": no_affine, "shared": shared,
    "reused": reused, "rms": rms, "lengths": lengths, "normalized-shapes": normalized_shapes,
    "eps": eps_forms, "conv1d": conv1d,
}


def expected_and_watched(model: nn.Module, x: Tensor, y: Tensor, steps: int = 2
                         ) -> tuple[OnlineDiversity, OnlineDiversity]:
    S, T = loop_S_T(copy.deepcopy(model), (x,), {},
                    lambda out, i: feature_loss(out, y[i : i + 1]).sum(), x.shape[0])
    expected = OnlineDiversity(1000, decay=0.0)
    expected.update_from_norms(S, T, x.shape[0])
    for _ in range(steps):  # the first step checks the model; the second is a plain one
        model.zero_grad()
        monitor = OnlineDiversity(1000, decay=0.0)
        with watch(model, monitor, reduction="sum"):
            feature_loss(model(x), y).sum().backward()
    return monitor, expected


@pytest.mark.parametrize("name", sorted(MODELS))
def test_watch_is_exact_where_like_calls_differ(name: str) -> None:
    torch.manual_seed(0)
    model = MODELS[name]().double()
    x = torch.randn(4, 5, WIDTH, dtype=torch.float64)
    monitor, expected = expected_and_watched(model, x, feature_targets(model, x))
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-9, abs=1e-9 * expected.m2)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_hooks_engine_is_exact_where_like_calls_differ(name: str) -> None:
    torch.manual_seed(1)
    model = MODELS[name]().double()
    x = torch.randn(4, 5, WIDTH, dtype=torch.float64)
    assert_exact(model, x, feature_targets(model, x), feature_loss, engine="hooks")


@pytest.mark.parametrize("budget", [1, 4 * 5 * WIDTH, 4 * 5 * WIDTH + 1])
def test_every_budget_boundary_is_exact(budget: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """One call's gradient over the budget, exactly one call's, one number more: held calls
    run alone (their nodes' saved values freed) or in stacks of one or two."""
    monkeypatch.setattr(hooks, "DEFER_BUDGET", budget)
    torch.manual_seed(2)
    model = Chain(lns(5), fcs(5)).double()
    x = torch.randn(4, 5, WIDTH, dtype=torch.float64)
    monitor, expected = expected_and_watched(model, x, feature_targets(model, x))
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-9, abs=1e-9 * expected.m2)


def test_freezing_between_steps_is_followed() -> None:
    """A LayerNorm weight frozen after a watched step: its stack's config changes with it."""
    torch.manual_seed(3)
    model = Chain(lns(), fcs()).double()
    x = torch.randn(4, 5, WIDTH, dtype=torch.float64)
    y = feature_targets(model, x)
    expected_and_watched(model, x, y)
    model.norms[1].weight.requires_grad_(False)
    model.fcs[0].weight.requires_grad_(False)
    monitor, expected = expected_and_watched(model, x, y)
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-9, abs=1e-9 * expected.m2)


@pytest.mark.parametrize("offset", [0.0, 30.0, 3000.0])
def test_float32_layer_norm_recomputed_agrees_with_the_saved_statistics(offset: float) -> None:
    """A stacked (or held) LayerNorm recomputes mean and 1/std instead of reading the
    forward's: on inputs whose mean is large against their spread, the two roundings differ;
    the float32 model's S must still agree with the loop on the same float32 model to
    float32's stated 1e-3."""
    torch.manual_seed(4)
    model = Chain(lns(), fcs())
    x = offset + torch.randn(4, 5, WIDTH)
    y = feature_targets(model, x).float()
    S, T = loop_S_T(copy.deepcopy(model), (x,), {},
                    lambda out, i: feature_loss(out, y[i : i + 1]).sum(), x.shape[0])
    monitor = OnlineDiversity(1000, decay=0.0)
    for _ in range(2):
        model.zero_grad()
        monitor = OnlineDiversity(1000, decay=0.0)
        with watch(model, monitor, reduction="sum"):
            feature_loss(model(x), y).sum().backward()
    expected = OnlineDiversity(1000, decay=0.0)
    expected.update_from_norms(S, T, x.shape[0])
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-3)
