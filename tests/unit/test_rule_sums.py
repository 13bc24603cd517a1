"""Batch gradients the rules give themselves (``own_sums``): a convolution whose per-example
gradients are materialised anyway sums them, and autograd is asked for its output gradient
instead of its weight's, so the batch weight gradient is not computed twice. Everything
against the float64 per-example loop."""

from __future__ import annotations

import torch
from torch import nn

from batchbound.diversity import PreparedStats, per_example_stats
from batchbound.diversity.rules import conv

RTOL = 1e-9


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y, reduction="none")


def _lenet_like() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 2 * 2, 5),
    ).double().eval()


def _against_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    fast = PreparedStats(model, _loss, engine="hooks")(x, y)
    slow = per_example_stats(model, x, y, _loss, engine="loop")
    assert list(fast.grad_sum) == list(slow.grad_sum)  # every parameter, in order
    for name in slow.sq_norms:
        torch.testing.assert_close(fast.sq_norms[name], slow.sq_norms[name], rtol=RTOL, atol=0)
        torch.testing.assert_close(fast.grad_sum[name], slow.grad_sum[name], rtol=RTOL,
                                   atol=1e-12)


def test_conv_sums_are_the_loop_s_and_autograd_skips_the_first_layer() -> None:
    torch.manual_seed(0)
    model = _lenet_like()
    x, y = torch.randn(6, 1, 8, 8, dtype=torch.float64), torch.randint(0, 5, (6,))
    ran: list[str] = []
    first = model[0]
    with conv.force_strategy("conv"):
        _against_loop(model, x, y)
        # The first convolution's backward node needs nothing below it once its weight and
        # bias come from the rule: autograd must not run it (its output gradient is captured).
        def watch_node(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            out.grad_fn.register_prehook(lambda grads: ran.append("conv1"))

        handle = first.register_forward_hook(watch_node)
        try:
            PreparedStats(model, _loss, engine="hooks")(x, y)
        finally:
            handle.remove()
    assert ran == []


def test_other_methods_and_a_tied_conv_keep_autograd_s_sums() -> None:
    """With the Gram or per-tap method nothing is materialised (autograd sums), and a conv
    run twice contributes twice (its sum is not one call's): both still exact."""
    torch.manual_seed(1)
    model = _lenet_like()
    x, y = torch.randn(5, 1, 8, 8, dtype=torch.float64), torch.randint(0, 5, (5,))
    for method in ("gram", "shifts"):
        with conv.force_strategy(method):
            _against_loop(model, x, y)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)
            self.head = nn.Linear(2 * 4 * 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.conv(torch.tanh(self.conv(x))).flatten(1))

    twice = Twice().double().eval()
    with conv.force_strategy("conv"):
        _against_loop(twice, torch.randn(4, 2, 4, 4, dtype=torch.float64),
                      torch.randint(0, 3, (4,)))


def test_a_conv_the_loss_does_not_reach_sums_to_zero() -> None:
    """A conv branch whose output the loss ignores: its gradients are zeros, as autograd's."""

    class Branch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Conv2d(1, 2, 3)
            self.ignored = nn.Conv2d(1, 2, 3)
            self.head = nn.Linear(2 * 4 * 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.ignored(x)
            return self.head(self.used(x).flatten(1))

    torch.manual_seed(2)
    model = Branch().double().eval()
    x, y = torch.randn(4, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    with conv.force_strategy("conv"):
        stats = PreparedStats(model, _loss, engine="hooks")(x, y)
        _against_loop(model, x, y)
    assert not stats.grad_sum["ignored.weight"].any()


def test_a_conv_run_twice_with_one_call_unused() -> None:
    """One call of a conv reaches the loss, the other does not: the used call's rule gives
    the sum (the unused call contributes nothing), exactly."""

    class Spare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3)
            self.head = nn.Linear(2 * 4 * 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.conv(x.flip(-1))  # a second call whose output is dropped
            return self.head(self.conv(x).flatten(1))

    torch.manual_seed(3)
    model = Spare().double().eval()
    x, y = torch.randn(4, 1, 6, 6, dtype=torch.float64), torch.randint(0, 3, (4,))
    with conv.force_strategy("conv"):
        _against_loop(model, x, y)
