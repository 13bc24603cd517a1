"""``per_example_gradients`` reads the loss's own uses of parameters (which torch.func cannot
see) off the graph of the vmap call itself, on every call: no forward pass of its own (a
per-example DropConnect step calls it every step), and a use that only some data make is
still caught on the call that makes it. Against the float64 per-example loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchbound.diversity import per_example_gradients
from batchbound.diversity.engines import loop_gradients
from batchbound.diversity.losses import resolve_loss


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _assert_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: object) -> None:
    fast = per_example_gradients(model, x, y, loss)
    slow = loop_gradients(model, x, y, resolve_loss(loss), list(fast))
    for name, g in slow.items():
        torch.testing.assert_close(fast[name], g, rtol=1e-10, atol=1e-12)


def test_one_forward_per_call_for_a_plain_loss() -> None:
    model = _model()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    loss = "cross_entropy"
    per_example_gradients(model, x, y, loss)  # the first call also checks a row by the loop
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, args: calls.append(1))
    try:
        per_example_gradients(model, x, y, loss)
    finally:
        handle.remove()
    assert len(calls) == 1  # the vmap's own forward only
    _assert_loop(model, x, y, loss)


def test_a_use_on_some_calls_only_is_caught_on_that_call() -> None:
    """A loss whose regulariser is switched on between calls (the same model, the same loss
    object): a check kept from the first call would miss it."""
    model = _model()
    head = model[2]
    regularise = {"on": False}

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ce = nn.functional.cross_entropy(out, y, reduction="none")
        if regularise["on"]:
            return ce + head.weight.square().sum() + 0.5 * model[0].bias.sum()
        return ce

    x, y = torch.randn(5, 4, dtype=torch.float64), torch.tensor([0, 2, 1, 1, 0])
    _assert_loop(model, x, y, loss)  # no use: vmap
    regularise["on"] = True
    with pytest.warns(UserWarning, match=r"outside their modules' attributes.*0\.bias, 2\.weight"):
        _assert_loop(model, x, y, loss)  # uses: caught on this call, the loop, said
