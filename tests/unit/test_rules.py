"""Every layer rule against the per-example loop, in float64 (relative error <= 1e-9)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchbound.diversity import per_example_stats
from batchbound.diversity.hooks import plan_hooks
from batchbound.diversity.rules import RULES, conv
from batchbound.diversity.rules.registry import Call

RTOL = 1e-9


def feature_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A non-linear per-example loss for any output shape: Σ_j tanh(out_j)·y_j."""
    return (torch.tanh(out).reshape(out.shape[0], -1) * y).sum(dim=1)


def check_against_loop(model: nn.Module, x: torch.Tensor) -> None:
    model = model.double()
    x = x.double() if x.dtype.is_floating_point else x
    with torch.no_grad():
        width = model(x).reshape(x.shape[0], -1).shape[1]
    y = torch.randn(x.shape[0], width, dtype=torch.float64)
    assert not plan_hooks(model).uncovered, "the model must be covered by rules"
    fast = per_example_stats(model, x, y, feature_loss, engine="hooks")
    slow = per_example_stats(model, x, y, feature_loss, engine="loop")
    assert fast.sq_norms.keys() == slow.sq_norms.keys()
    for name in slow.sq_norms:
        torch.testing.assert_close(fast.sq_norms[name], slow.sq_norms[name], rtol=RTOL, atol=0)
        torch.testing.assert_close(fast.grad_sum[name], slow.grad_sum[name], rtol=RTOL, atol=1e-12)
    torch.testing.assert_close(fast.losses, slow.losses, rtol=RTOL, atol=1e-12)


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(1, 4),
    d_in=st.integers(1, 6),
    d_out=st.integers(1, 6),
    lead=st.lists(st.integers(1, 4), max_size=2),
    bias=st.booleans(),
)
def test_linear(n: int, d_in: int, d_out: int, lead: list[int], bias: bool) -> None:
    torch.manual_seed(0)
    check_against_loop(nn.Linear(d_in, d_out, bias=bias), torch.randn(n, *lead, d_in))


@pytest.mark.parametrize(
    "n,steps,d_in,d_out,branch",
    [
        (3, 2, 8, 8, "gram"),
        (2, 2, 6, 7, "gram"),
        (3, 7, 2, 9, "materialise"),
        (2, 30, 3, 4, "materialise"),
    ],
)
def test_linear_sequence_both_branches(
    n: int, steps: int, d_in: int, d_out: int, branch: str
) -> None:
    gram_cheaper = steps * steps * (d_in + d_out + 1) < steps * d_in * d_out
    assert gram_cheaper == (branch == "gram")
    torch.manual_seed(1)
    check_against_loop(nn.Linear(d_in, d_out), torch.randn(n, steps, d_in))


conv_cases = st.fixed_dictionaries(
    {
        "dims": st.sampled_from([1, 2]),
        "n": st.integers(1, 3),
        "groups": st.sampled_from([1, 2, 3]),
        "c_in_per_group": st.integers(1, 2),
        "c_out_per_group": st.integers(1, 2),
        "kernel": st.integers(1, 3),
        "stride": st.integers(1, 2),
        "dilation": st.integers(1, 2),
        "padding": st.sampled_from([0, 1, 2, "same", "valid"]),
        "padding_mode": st.sampled_from(["zeros", "reflect", "circular", "replicate"]),
        "bias": st.booleans(),
        "size": st.integers(5, 8),
        "strategy": st.sampled_from(["gram", "conv", "patches", "shifts"]),
    }
)


@settings(max_examples=40, deadline=None)
@given(case=conv_cases)
def test_conv(case: dict) -> None:
    if case["padding"] == "same":
        case["stride"] = 1  # torch allows padding='same' only with stride 1
    layer_type = nn.Conv1d if case["dims"] == 1 else nn.Conv2d
    g = case["groups"]
    torch.manual_seed(2)
    layer = layer_type(
        g * case["c_in_per_group"],
        g * case["c_out_per_group"],
        case["kernel"],
        stride=case["stride"],
        padding=case["padding"],
        dilation=case["dilation"],
        groups=g,
        bias=case["bias"],
        padding_mode=case["padding_mode"],
    )
    spatial = (case["size"],) * case["dims"]
    x = torch.randn(case["n"], g * case["c_in_per_group"], *spatial)
    with conv.force_strategy(case["strategy"]):
        check_against_loop(layer, x)


def test_conv_strategy_follows_flop_estimate() -> None:
    # Few positions, many channels: Gram form; many positions: materialising.
    assert conv.choose_strategy(8, 64, 64, 1, 9, 4) == "gram"
    assert conv.choose_strategy(8, 1, 6, 1, 25, 784) == "patches"  # ≤ 4 channels per group
    assert conv.choose_strategy(8, 6, 16, 1, 25, 100) == "conv"
    assert conv.choose_strategy(8, 12, 24, 3, 9, 100) == "patches"  # 4 per group
    assert conv.choose_strategy(8, 4, 4, 4, 9, 100) == "conv"  # depthwise: oneDNN's kernel
    assert conv.choose_strategy(8, 16, 16, 1, 9, 1024) == "conv"
    # Small maps with many channels and 1×1 kernels: the grouped kernel too (it gives the
    # batch sum, so autograd skips the weight gradient), up to MATERIALISE_BUDGET numbers.
    assert conv.choose_strategy(8, 64, 64, 1, 9, 64) == "conv"
    assert conv.choose_strategy(8, 16, 32, 1, 1, 256) == "conv"
    assert conv.choose_strategy(4096, 64, 64, 1, 1, 64) == "conv"  # 4096·64·64 = 2**24
    assert conv.choose_strategy(4097, 64, 64, 1, 1, 64) == "shifts"  # per tap beyond it
    assert conv.choose_strategy(64, 512, 512, 1, 9, 3136) == "shifts"


def test_auto_conv_strategy_gives_the_loop_s_norms_and_sums() -> None:
    """The choice above on a model with the layers it used to compute per tap (a 1×1
    convolution, a small map with many channels), and every layer per tap under a budget of
    one number: float64, against the per-example loop, S per parameter and the gradient
    sum."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 32, 1), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 4, 3, padding=1, stride=2), nn.Flatten(), nn.Linear(4 * 4 * 4, 3),
    ).double()
    x, y = torch.randn(6, 3, 8, 8, dtype=torch.float64), torch.randint(0, 3, (6,))
    chosen = [conv.choose_strategy(6, m.in_channels, m.out_channels, m.groups,
                                   math.prod(m.kernel_size), out)
              for m, out in zip([model[0], model[2], model[4], model[6]], (64, 64, 64, 16),
                                strict=True)]
    assert chosen == ["patches", "conv", "conv", "conv"]
    from batchbound.diversity.rules import forms

    for budget in (forms.MATERIALISE_BUDGET, 1):  # 1: every layer per tap ("shifts")
        original = conv.MATERIALISE_BUDGET
        conv.MATERIALISE_BUDGET = budget
        try:
            fast = per_example_stats(model, x, y, "cross_entropy", engine="hooks")
        finally:
            conv.MATERIALISE_BUDGET = original
        slow = per_example_stats(model, x, y, "cross_entropy", engine="loop")
        for name in slow.sq_norms:
            torch.testing.assert_close(fast.sq_norms[name], slow.sq_norms[name],
                                       rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(fast.grad_sum[name], slow.grad_sum[name],
                                       rtol=1e-10, atol=1e-12)


@settings(max_examples=10, deadline=None)
@given(
    n=st.integers(1, 4),
    steps=st.integers(1, 6),
    vocab=st.integers(2, 6),
    padding_idx=st.sampled_from([None, 0]),
    sparse=st.booleans(),
)
def test_embedding(n: int, steps: int, vocab: int, padding_idx: int | None, sparse: bool) -> None:
    torch.manual_seed(3)
    layer = nn.Embedding(vocab, 3, padding_idx=padding_idx, sparse=sparse)
    idx = torch.randint(0, vocab, (n, steps))  # small vocabularies force repeated indices
    check_against_loop(layer, idx)


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape,normalized", [((3, 5), (5,)), ((3, 4, 2, 3), (2, 3))])
def test_layer_norm(shape: tuple[int, ...], normalized: tuple[int, ...], affine: bool) -> None:
    torch.manual_seed(4)
    layer = nn.LayerNorm(normalized, elementwise_affine=affine)
    model = nn.Sequential(nn.Linear(shape[-1], shape[-1]), layer) if not affine else layer
    if affine:
        with torch.no_grad():
            layer.weight.normal_()
            layer.bias.normal_()
    check_against_loop(model, torch.randn(*shape))


@pytest.mark.parametrize("shape,normalized", [((3, 5), (5,)), ((3, 4, 2, 3), (2, 3))])
@pytest.mark.parametrize("eps", [None, 1e-3])
def test_rms_norm(shape: tuple[int, ...], normalized: tuple[int, ...], eps: float | None) -> None:
    torch.manual_seed(4)
    layer = nn.RMSNorm(normalized, eps=eps)
    with torch.no_grad():
        layer.weight.normal_()
    check_against_loop(layer, torch.randn(*shape))


@pytest.mark.parametrize("shape", [(3, 6), (3, 6, 5), (2, 6, 3, 4)])
@pytest.mark.parametrize("groups", [1, 2, 3, 6])
def test_group_norm(shape: tuple[int, ...], groups: int) -> None:
    if len(shape) == 2 and groups == 6:
        pytest.skip("torch rejects groups of one value")
    torch.manual_seed(5)
    layer = nn.GroupNorm(groups, 6)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    check_against_loop(layer, torch.randn(*shape))


@pytest.mark.parametrize(
    "layer_type,shape",
    [
        (nn.BatchNorm1d, (3, 4)),
        (nn.BatchNorm1d, (3, 4, 5)),
        (nn.BatchNorm2d, (3, 4, 3, 3)),
        (nn.BatchNorm3d, (2, 4, 2, 2, 2)),
    ],
)
def test_batch_norm_eval(layer_type: type[nn.Module], shape: tuple[int, ...]) -> None:
    torch.manual_seed(6)
    layer = layer_type(4)
    layer.train()
    with torch.no_grad():
        for _ in range(3):  # non-trivial running statistics
            layer(torch.randn(8, *shape[1:]) * 2 + 1)
        layer.weight.normal_()
        layer.bias.normal_()
    layer.eval()
    check_against_loop(layer, torch.randn(*shape))


def test_small_cnn_and_mlp_end_to_end() -> None:
    torch.manual_seed(7)
    cnn = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3, stride=2, groups=2),
        nn.GroupNorm(2, 4),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(16, 5),
        nn.LayerNorm(5),
    ).eval()
    check_against_loop(cnn, torch.randn(4, 2, 6, 6))


def test_registry_lists_every_family() -> None:
    expected = {
        nn.RMSNorm,
        nn.Linear,
        nn.Conv1d,
        nn.Conv2d,
        nn.Embedding,
        nn.LayerNorm,
        nn.GroupNorm,
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
    }
    assert expected <= set(RULES)


def test_a_new_rule_as_the_readme_writes_it() -> None:
    """The README's extension example, verbatim but for the layer, is exact under hooks."""
    from reference import assert_exact

    from batchbound.diversity.rules import Dense, Outer, register_rule

    class MyLayer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 4))
            self.bias = nn.Parameter(torch.randn(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.linear(x, self.weight, self.bias)

    @register_rule(MyLayer, params=("weight", "bias"), feature_dims=1)
    def my_layer_rule(call):  # type: ignore[no-untyped-def]
        a, b = call.input, call.grad
        n = a.shape[0]
        return {"weight": Outer(b.reshape(n, -1, b.shape[-1]), a.reshape(n, -1, a.shape[-1])),
                "bias": Dense(b.reshape(n, -1, b.shape[-1]).sum(dim=1))}

    try:
        torch.manual_seed(9)
        assert_exact(MyLayer(), torch.randn(5, 2, 4), torch.randint(0, 3, (5, 2)),
                     lambda out, y: nn.functional.cross_entropy(
                         out.transpose(1, 2), y, reduction="none").sum(1), engine="hooks")
    finally:
        del RULES[MyLayer]


PATCH_LAYERS = [
    dict(in_channels=2, out_channels=3, kernel_size=3),
    dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, dilation=2, padding=1,
         groups=2, padding_mode="reflect", bias=False),
    dict(in_channels=3, out_channels=6, kernel_size=2, padding="same", dilation=2, groups=3,
         padding_mode="circular"),
    dict(in_channels=1, out_channels=2, kernel_size=3, stride=3, padding=2),
]


@pytest.mark.parametrize("block", [1, 20, 2**18])
@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("config", range(len(PATCH_LAYERS)))
def test_conv_patches_are_each_example_s_own_gradient(
    block: int, dims: int, config: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copied patches (``"patches"``), one example per block, blocks that split the batch
    unevenly, or one block: each example's gradient computed alone (a batch of one, float64),
    and the grouped kernel's, for strides, dilations, groups, padding modes, 1-D and 2-D."""
    monkeypatch.setattr(conv, "PATCH_BLOCK", block)
    torch.manual_seed(config)
    layer_type = nn.Conv1d if dims == 1 else nn.Conv2d
    layer = layer_type(**PATCH_LAYERS[config]).double()
    x = torch.randn(5, layer.in_channels, *(9,) * dims, dtype=torch.float64)
    out = layer(x)
    b = torch.randn_like(out)
    with torch.no_grad():
        fast = conv.patches_weight_grads(layer, x, b)
        grouped = conv.conv_weight_grads(layer, x, b)
    alone = torch.stack([torch.autograd.grad(layer(x[i : i + 1]), layer.weight, b[i : i + 1])[0]
                         for i in range(x.shape[0])])
    assert fast.shape == alone.shape
    torch.testing.assert_close(fast, alone, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fast, grouped, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device,products", [("cpu", 79), ("meta", 1)])
def test_patch_blocks_are_cache_sized_on_the_cpu_only(monkeypatch, device: str,
                                                      products: int) -> None:
    """LeNet-5's first layer at 1024 examples: on the CPU blocks of 2^18 numbers (13
    examples, their patches in cache), elsewhere one product (each block costs ~6 kernel
    launches on a GPU; ``meta`` stands for a device here)."""
    layer = nn.Conv2d(1, 6, 5, padding=2).to(device)
    x = torch.randn(1024, 1, 28, 28, device=device)
    b = torch.randn(1024, 6, 28, 28, device=device)
    calls = []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda *a, **k: calls.append(1) or bmm(*a, **k))
    with torch.no_grad():
        grads = conv.patches_weight_grads(layer, x, b)
    assert grads.shape == (1024, 6, 1, 5, 5)
    assert len(calls) == products


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN only")
@pytest.mark.parametrize("groups,c_in", [(1, 6), (2, 10), (1, 3)])
def test_conv_grouped_kernel_with_channels_last_input(groups: int, c_in: int) -> None:
    """float32 layers whose input channels per group are not a multiple of 8 hand oneDNN the
    input channels-last (the tests run with oneDNN off, batchbound's portable kernels: on for
    this one): the per-example gradients (left channels-last, read in memory order) are each
    example's own, as the float64 grouped kernel gives them, to float32 rounding; and the
    rule's norms and sums read from them are the loop's."""
    with torch.backends.mkldnn.flags(enabled=True):
        _check_channels_last_input(groups, c_in)
        _check_channels_last_norms_and_sums(groups, c_in)


def _check_channels_last_input(groups: int, c_in: int) -> None:
    torch.manual_seed(groups + c_in)
    layer = nn.Conv2d(c_in, 4 * groups, 3, padding=1, groups=groups)
    x = torch.randn(5, c_in, 7, 7)
    b = torch.randn(5, 4 * groups, 7, 7)
    folded = x.reshape(1, -1, 7, 7)
    assert conv._blocked_channels_last(layer, folded) == ((c_in // groups) % 8 != 0)
    assert not conv._blocked_channels_last(layer, folded.double())
    with torch.no_grad():
        fast = conv.conv_weight_grads(layer, x, b)
        exact = conv.conv_weight_grads(layer.double(), x.double(), b.double())
    assert fast.dtype == torch.float32
    assert fast.is_contiguous() == ((c_in // groups) % 8 == 0)  # left as the kernel gave it
    torch.testing.assert_close(fast.double(), exact, rtol=1e-5, atol=1e-5)
    layer.float()
    alone = torch.stack([torch.autograd.grad(layer(x[i : i + 1]), layer.weight, b[i : i + 1])[0]
                         for i in range(5)])
    torch.testing.assert_close(fast, alone, rtol=1e-5, atol=1e-5)


def _check_channels_last_norms_and_sums(groups: int, c_in: int) -> None:
    """The grouped kernel's channels-last gradients (no copy to the standard layout): the
    squared norms, ``total()`` and ``add_total_to`` (a running sum, float32 and float64)
    equal the per-example loop's in float64."""
    torch.manual_seed(10 * groups + c_in)
    layer = nn.Conv2d(c_in, 4 * groups, 3, padding=1, groups=groups)
    x = torch.randn(6, c_in, 7, 7)
    b = torch.randn(6, 4 * groups, 7, 7)
    wide = nn.Conv2d(c_in, 4 * groups, 3, padding=1, groups=groups).double()
    wide.load_state_dict(layer.state_dict())
    alone = torch.stack([torch.autograd.grad(wide(x[i : i + 1].double()), wide.weight,
                                             b[i : i + 1].double())[0] for i in range(6)])
    with conv.force_strategy("conv"), torch.no_grad():
        grads = conv.conv_weight_grads(layer, x, b)
        rows, dims = conv.memory_rows(grads)
        assert rows.data_ptr() == grads.data_ptr() and rows.shape == (6, alone[0].numel())
        assert (dims != (1, 2, 3, 4)) == ((c_in // groups) % 8 != 0)
        forms = conv.conv_rule(Call(layer, {"input": x}, [b], "input"))
        torch.testing.assert_close(forms["weight"].sq_norms().double(),
                                   alone.flatten(1).square().sum(1), rtol=1e-5, atol=1e-5)
        for dtype in (torch.float32, torch.float64):
            running = torch.ones(layer.weight.shape, dtype=dtype)
            forms = conv.conv_rule(Call(layer, {"input": x}, [b], "input"))
            forms["weight"].sq_norms()  # materialises them, as the engine does
            forms["weight"].add_total_to(running)
            torch.testing.assert_close(running.double(), 1 + alone.sum(0), rtol=1e-5,
                                       atol=1e-5)
        forms = conv.conv_rule(Call(layer, {"input": x}, [b], "input"))
        forms["weight"].sq_norms()
        torch.testing.assert_close(forms["weight"].total().double(), alone.sum(0).flatten(),
                                   rtol=1e-5, atol=1e-5)


def test_conv_patches_read_any_input_layout() -> None:
    """The strided view follows the input's own strides: a channels-last input and a
    permuted view give each example's own gradients too (float64)."""
    torch.manual_seed(5)
    layer = nn.Conv2d(2, 3, 3, stride=2, padding=1).double()
    base = torch.randn(4, 2, 9, 9, dtype=torch.float64)
    b = torch.randn_like(layer(base))
    alone = torch.stack([torch.autograd.grad(layer(base[i : i + 1]), layer.weight,
                                             b[i : i + 1])[0] for i in range(4)])
    for x in (base.contiguous(memory_format=torch.channels_last),
              base.transpose(2, 3).contiguous().transpose(2, 3)):
        assert not x.is_contiguous()
        with torch.no_grad():
            torch.testing.assert_close(conv.patches_weight_grads(layer, x, b), alone,
                                       rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN only")
@pytest.mark.parametrize("groups", [1, 2])
def test_channels_last_gradients_end_to_end_with_onednn(groups: int) -> None:
    """``measure`` with oneDNN on (the tests otherwise run without it), float32 Conv2d and
    ConvTranspose2d layers whose channels per group are not a multiple of 8, all through the
    grouped kernel and so its channels-last gradients: S, T and every parameter's S are the
    float64 per-example loop's."""
    from batchbound.diversity import measure

    torch.manual_seed(groups)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(),
                          nn.ConvTranspose2d(6, 10, 3, stride=2, groups=groups), nn.ReLU(),
                          nn.Conv2d(10, 6, 3, groups=groups), nn.Flatten(), nn.Linear(1350, 5))
    x, y = torch.randn(24, 3, 8, 8), torch.randint(0, 5, (24,))
    with torch.backends.mkldnn.flags(enabled=True), conv.force_strategy("conv"):
        fast = measure(model, (x, y), "cross_entropy", chunk_size=8)
    exact = measure(model, (x, y), "cross_entropy", chunk_size=8, engine="loop",
                    dtype=torch.float64)
    assert pytest.approx(exact.S, rel=1e-5) == fast.S
    assert pytest.approx(exact.T, rel=1e-5) == fast.T
    for name, value in exact.per_parameter_S.items():
        assert fast.per_parameter_S[name] == pytest.approx(value, rel=1e-5), name
