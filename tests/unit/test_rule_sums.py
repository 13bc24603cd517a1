"""Batch gradients the rules give themselves (``own_sums``): a convolution whose per-example
gradients are materialised anyway sums them, and autograd is asked for its output gradient
instead of its weight's, so the batch weight gradient is not computed twice. Everything
against the float64 per-example loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchbound.diversity import PreparedStats, per_example_stats
from batchbound.diversity.rules import conv
from batchbound.diversity.rules.forms import Dense, Outer

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


@pytest.mark.parametrize("method", ["conv", "patches"])
def test_conv_sums_are_the_loop_s_and_autograd_skips_the_first_layer(method: str) -> None:
    torch.manual_seed(0)
    model = _lenet_like()
    x, y = torch.randn(6, 1, 8, 8, dtype=torch.float64), torch.randint(0, 5, (6,))
    ran: list[str] = []
    first = model[0]
    with conv.force_strategy(method):
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


# ------------------------------------------------- Linear sums added into a running sum


def _loop_grad_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    return per_example_stats(model, x, y, _loss, engine="loop").grad_sum


def _zeros_like_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(p) for k, p in model.named_parameters() if p.requires_grad}


def test_outer_add_total_to_equals_its_total() -> None:
    """``add_total_to`` (addmm_ / index_add_ into the running sum) adds exactly ``total()``:
    dense and indexed u, and a running sum of another dtype (the plain addition then)."""
    g = torch.Generator().manual_seed(4)
    u, v = torch.randn(3, 5, 4, generator=g, dtype=torch.float64), torch.randn(
        3, 5, 6, generator=g, dtype=torch.float64)
    rows = torch.randint(0, 7, (3, 5), generator=g)
    for form, shape in ((Outer(u, v), (4, 6)), (Outer(rows, v, rows=7), (7, 6))):
        start = torch.randn(shape, generator=g, dtype=torch.float64)
        running = start.clone()
        form.add_total_to(running)
        torch.testing.assert_close(running, start + form.total().reshape(shape), rtol=1e-12,
                                   atol=1e-12)
        wider = start.float()
        Outer(form.u.float() if not form.indexed else form.u, form.v.float(),
              form.rows).add_total_to(wider)
        torch.testing.assert_close(wider, (start + form.total().reshape(shape)).float())


def test_linear_sums_go_into_the_running_sums_and_autograd_skips_the_first_layer() -> None:
    """An MLP and a Linear on sequences: with ``into``, every parameter's chunk sum lands in
    the running sums (started non-zero: they are added, not written), equal to the loop's;
    the first Linear's backward node is not run (its output gradient is captured)."""
    torch.manual_seed(5)
    mlp = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).double().eval()
    x, y = torch.randn(7, 6, dtype=torch.float64), torch.randint(0, 3, (7,))

    class Seq(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 5)
            self.head = nn.Linear(5, 3, bias=False)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.fc(t)).mean(dim=1))

    seq = Seq().double().eval()
    xs = torch.randn(6, 3, 4, dtype=torch.float64)
    ys = torch.randint(0, 3, (6,))
    for model, inputs, targets in ((mlp, x, y), (seq, xs, ys)):
        prepared = PreparedStats(model, _loss, engine="hooks")
        prepared(inputs, targets)  # the first chunk: checked, never added in place
        start = {k: torch.full_like(t, 0.5) for k, t in _zeros_like_params(model).items()}
        running = {k: t.clone() for k, t in start.items()}
        ran: list[str] = []

        def watch_node(module: nn.Module, args: tuple, out: torch.Tensor,
                       ran: list[str] = ran) -> None:
            out.grad_fn.register_prehook(lambda grads: ran.append("first"))

        first = next(m for m in model.modules() if isinstance(m, nn.Linear))
        handle = first.register_forward_hook(watch_node)
        try:
            stats = prepared(inputs, targets, into=running)
        finally:
            handle.remove()
        assert stats.grad_sum == {} and ran == []
        slow = _loop_grad_sum(model, inputs, targets)
        for name, total in slow.items():
            torch.testing.assert_close(running[name] - start[name], total, rtol=RTOL,
                                       atol=1e-12)
        _against_loop(model, inputs, targets)


def test_into_adds_each_chunk_once_with_a_fallback_and_on_the_first_chunk() -> None:
    """A parameter no rule covers (its fallback's sum is added too) and the first chunk,
    which the check may run twice: each chunk's sum is added exactly once."""

    class Shifted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)
            self.shift = nn.Parameter(torch.randn(3))

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.fc(t)) + self.shift

    torch.manual_seed(6)
    model = Shifted().double().eval()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    prepared = PreparedStats(model, _loss)  # auto: vmap for ``shift``
    running = _zeros_like_params(model)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for rows in (slice(0, 5), slice(5, 8)):
            prepared(x[rows], y[rows], into=running)
    slow = _loop_grad_sum(model, x, y)
    for name, total in slow.items():
        torch.testing.assert_close(running[name], total, rtol=RTOL, atol=1e-12)


def test_no_linear_sums_under_autocast_or_for_a_low_precision_input() -> None:
    """Autograd's batch gradient is rounded there (the rules widen): it stays autograd's."""
    from batchbound.diversity.rules.linear import _own_sums

    layer = nn.Linear(3, 2)
    assert _own_sums(layer, torch.randn(4, 3), torch.Size([4, 2])) == ("weight", "bias")
    assert _own_sums(layer, torch.randn(4, 3).bfloat16(), torch.Size([4, 2])) == ()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _own_sums(layer, torch.randn(4, 3), torch.Size([4, 2])) == ()
    layer.bias.requires_grad_(False)
    assert _own_sums(layer, torch.randn(4, 3), torch.Size([4, 2])) == ("weight",)


def test_a_first_chunk_run_again_after_the_check_adds_its_sum_once() -> None:
    """A rule whose norms the first chunk's check refuses: that chunk runs again with the
    fallback for them, and its sum must still reach the running sums once (a rule adding
    its own sums there during the first run would count it twice)."""
    import warnings

    from batchbound.diversity.rules import RULES, register_rule

    class Wrong(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 4))
            self.bias = nn.Parameter(torch.randn(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x, self.weight, self.bias)

    @register_rule(Wrong, feature_dims=1, own_sums=lambda m, x, shape: ("weight", "bias"))
    def wrong_rule(call):  # type: ignore[no-untyped-def]
        a, b = call.input, call.grad
        ones = torch.ones(a.shape[0], dtype=a.dtype)  # wrong norms, right sums
        return {"weight": Outer(b.unsqueeze(1), a.unsqueeze(1), sq_norms=ones),
                "bias": Dense(b, ones)}

    try:
        torch.manual_seed(7)
        model = Wrong().double().eval()
        x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
        running = _zeros_like_params(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stats = PreparedStats(model, _loss)(x, y, into=running)
        assert stats.fallback  # the check refused the rule's norms
        for name, total in _loop_grad_sum(model, x, y).items():
            torch.testing.assert_close(running[name], total, rtol=RTOL, atol=1e-12)
    finally:
        del RULES[Wrong]


def test_conv_and_bias_sums_go_into_the_running_sums() -> None:
    """The conv rule's materialised gradients and every bias, summed into the running sums
    by one matrix-vector product each (``add_row_sum``), equal the loop's sums; for each
    conv method (with "gram" and "shifts" autograd sums the conv weight)."""
    torch.manual_seed(8)
    model = _lenet_like()
    x, y = torch.randn(6, 1, 8, 8, dtype=torch.float64), torch.randint(0, 5, (6,))
    slow = _loop_grad_sum(model, x, y)
    for method in ("conv", "patches", "gram", "shifts"):
        with conv.force_strategy(method):
            prepared = PreparedStats(model, _loss, engine="hooks")
            prepared(x, y)  # the first chunk: checked
            start = {k: torch.full_like(t, -0.25) for k, t in _zeros_like_params(model).items()}
            running = {k: t.clone() for k, t in start.items()}
            assert prepared(x, y, into=running).grad_sum == {}
        for name, total in slow.items():
            torch.testing.assert_close(running[name] - start[name], total, rtol=RTOL,
                                       atol=1e-12)


def test_add_row_sum_adds_the_rows_sum_in_place() -> None:
    """One addmv_ where shapes and dtype allow, the plain sum and addition otherwise."""
    from batchbound.diversity.rules.forms import add_row_sum

    g = torch.Generator().manual_seed(9)
    rows = torch.randn(5, 3, 4, generator=g, dtype=torch.float64)
    for out in (torch.randn(3, 4, generator=g, dtype=torch.float64),
                torch.randn(4, 3, generator=g, dtype=torch.float64).t(),  # not contiguous
                torch.randn(3, 4, generator=g)):  # another dtype
        expected = (out.double() + rows.sum(dim=0)).to(out.dtype)
        add_row_sum(out, rows)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
