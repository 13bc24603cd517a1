"""watch() reads T_B from the change in ``.grad`` made by the backward pass itself, at its end:
what the block does to ``.grad`` afterwards (gradient clipping, ``GradScaler.unscale_``,
``zero_grad``) belongs to the optimizer step and must not change Δ. Held-out round of issue 35:
clipping inside the block used to give a silently wrong T (the change was read at the block's
end, and a first step's change was ``.grad`` itself, scaled in place by the clip)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from training_models import loop_S_T

from batchbound.diversity import OnlineDiversity, watch


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _data() -> tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    return torch.randn(5, 6, dtype=torch.float64), torch.randint(0, 3, (5,))


def _watched(model: nn.Module, after: Callable[[nn.Module], None], *,
             grad_before: bool) -> OnlineDiversity:
    x, y = _data()
    if grad_before:  # a step that accumulates onto an older .grad
        F.cross_entropy(model(x[:2]), y[:2], reduction="sum").backward()
    monitor = OnlineDiversity(1000, decay=0.0)
    with watch(model, monitor, reduction="sum"):
        F.cross_entropy(model(x), y, reduction="sum").backward()
        after(model)
    return monitor


def _clip(model: nn.Module) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)


def _zero(model: nn.Module) -> None:
    model.zero_grad(set_to_none=True)


def _scale_down(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad.mul_(0.5)


@pytest.mark.parametrize("grad_before", [False, True])
@pytest.mark.parametrize("after", [_clip, _zero, _scale_down])
def test_changes_to_grad_after_the_backward_leave_the_estimates_exact(
        after: Callable[[nn.Module], None], grad_before: bool) -> None:
    model = _model()
    x, y = _data()
    S, T = loop_S_T(copy.deepcopy(model), (x,), {},
                    lambda out, i: F.cross_entropy(out, y[i : i + 1], reduction="sum"), 5)
    expected = OnlineDiversity(1000, decay=0.0)
    expected.update_from_norms(S, T, 5)
    monitor = _watched(model, after, grad_before=grad_before)
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-9, abs=1e-9 * expected.m2)


def test_grad_scaler_unscale_and_clip_inside_the_block() -> None:
    """The usual float16 recipe: scale, backward, unscale_, clip, all inside the block. M2
    and C carry the scale squared (docs/precision.md); their ratio, Δ, is the unscaled one's."""
    plain = _watched(_model(), lambda m: None, grad_before=False)
    scale = 256.0
    scaled_model = _model()
    optimizer = torch.optim.SGD(scaled_model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    x, y = _data()
    monitor = OnlineDiversity(1000, decay=0.0)
    with watch(scaled_model, monitor, reduction="sum"):
        scaler.scale(F.cross_entropy(scaled_model(x), y, reduction="sum")).backward()
        scaler.unscale_(optimizer)
        _clip(scaled_model)
    assert monitor.m2 == pytest.approx(scale**2 * plain.m2, rel=1e-9)
    assert monitor.cross == pytest.approx(scale**2 * plain.cross, rel=1e-9,
                                          abs=1e-9 * scale**2 * plain.m2)


def test_reentrant_checkpoint_under_watch_is_refused_in_one_line() -> None:
    """use_reentrant=True cannot be self-checked (its backward only writes .grad): a
    BatchboundError naming it, never torch's RuntimeError."""
    from torch.utils.checkpoint import checkpoint

    from batchbound.errors import BatchboundError

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x: Tensor) -> Tensor:
            h = torch.tanh(self.a(x))
            h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=True)
            return self.c(h)

    model = Checkpointed().double()
    x, y = _data()
    with pytest.raises(BatchboundError, match="use_reentrant=True"), \
            watch(model, OnlineDiversity(100), reduction="sum"):
        F.cross_entropy(model(x), y, reduction="sum").backward()


def test_a_second_backward_through_the_outputs_is_refused_in_one_line() -> None:
    """Two backward passes from one forward (retain_graph) used to end in an IndexError from
    the rules' hooks; the rules read one backward per forward: a BatchboundError says so."""
    from batchbound.errors import BatchboundError

    model = _model()
    x, y = _data()
    with pytest.raises(BatchboundError, match="second backward"), \
            watch(model, OnlineDiversity(100), reduction="sum"):
        losses = F.cross_entropy(model(x), y, reduction="none")
        losses[:2].sum().backward(retain_graph=True)
        losses[2:].sum().backward()
