"""Closed-form bounds: hand-computed values, and the data-dependent lower bounds against
measured n·Δ."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchbound.diversity import measure, per_example_stats
from batchbound.errors import BatchboundError
from batchbound.theory import (
    batch_bound_from_noise_scale,
    conflict_graph_max_degree,
    glm_batch_bound,
    linear_network_rho_bound,
    sparse_conflict_batch_bound,
    speedup_ratio,
    two_layer_linear_bound,
)


def test_hand_computed_values() -> None:
    # 100·10·20 / (10·100 + 20·100 + 10·20) = 20000 / 3200
    assert two_layer_linear_bound(100, 10, 20) == pytest.approx(6.25)
    # L = 3, d = 11, K = (3, 5): 3 / ((2/2 + 1/4) + 6/10) = 3 / 1.85
    assert linear_network_rho_bound(11, [3, 5]) == pytest.approx(3 / 1.85)
    # X = diag(1, 2): n·min‖x‖²/σ_max² = 2·1/4
    assert glm_batch_bound([[1.0, 0.0], [0.0, 2.0]]) == pytest.approx(0.5)
    assert conflict_graph_max_degree([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 1]]) == 1
    assert conflict_graph_max_degree([[1, 1], [1, 0], [0, 1]]) == 2
    assert sparse_conflict_batch_bound(3, 1) == pytest.approx(1.5)
    assert speedup_ratio(50, 200) == pytest.approx(4.0)
    assert batch_bound_from_noise_scale(9.0) == 10.0


@pytest.mark.parametrize(("depth", "width", "d"), [(1, 10, 50), (3, 20, 100), (9, 7, 30)])
def test_equal_width_form_of_the_depth_bound(depth: int, width: int, d: int) -> None:
    layers = depth + 1  # [width]'s L counts weight matrices: fc depth + 1
    expected = 1 / ((layers - 1) / (2 * (width - 1)) + 2 / (d - 1))
    assert linear_network_rho_bound(d, [width] * depth) == pytest.approx(expected)


def test_bounds_move_the_way_the_width_paper_says() -> None:
    assert two_layer_linear_bound(10**6, 64, 100) > two_layer_linear_bound(10**6, 16, 100)
    assert two_layer_linear_bound(10**9, 50, 50) == pytest.approx(25, rel=1e-6)  # Kd/(K+d)
    assert linear_network_rho_bound(100, [32] * 2) > linear_network_rho_bound(100, [32] * 6)
    assert linear_network_rho_bound(100, [64] * 3) > linear_network_rho_bound(100, [16] * 3)


@pytest.mark.parametrize("bias", [False, True])
def test_glm_bound_is_below_measured_batch_bound_for_least_squares(bias: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(80, 5, dtype=torch.float64) + 0.5
    y = x @ torch.randn(5, 1, dtype=torch.float64) + 0.1 * torch.randn(80, 1, dtype=torch.float64)
    features = torch.cat([x, torch.ones(80, 1, dtype=torch.float64)], 1) if bias else x
    bound = glm_batch_bound(features)
    for _ in range(5):  # the bound holds at every w
        model = nn.Linear(5, 1, bias=bias).double()
        measured = measure(model, (x, y), "mse").batch_bound
        assert bound <= measured * (1 + 1e-12)
        assert 0 < bound < 80


def test_glm_bound_holds_for_multi_output_linear_classifiers() -> None:
    torch.manual_seed(1)
    x = torch.randn(50, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (50,))
    model = nn.Linear(4, 3, bias=False).double()
    assert glm_batch_bound(x) <= measure(model, (x, y), "cross_entropy").batch_bound


@settings(max_examples=50, deadline=None)
@given(n=st.integers(2, 12), d=st.integers(1, 10), density=st.floats(0.05, 0.6),
       seed=st.integers(0, 10_000))
def test_sparse_conflict_bound_holds_on_random_sparse_gradients(n, d, density, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, d, generator=gen, dtype=torch.float64)
    g = g * (torch.rand(n, d, generator=gen) < density)
    g[:, 0] += 1e-3 * (torch.arange(n) == 0)  # keep T > 0
    S, T = float(g.square().sum()), float(g.sum(0).square().sum())
    rho = conflict_graph_max_degree(g)
    assert n * S / T >= sparse_conflict_batch_bound(n, rho) * (1 - 1e-9)


def test_sparse_conflict_bound_on_a_sparse_linear_model() -> None:
    torch.manual_seed(2)
    x = torch.zeros(30, 30, dtype=torch.float64)
    for i in range(30):  # each example touches its own coordinate and its neighbour's
        x[i, i], x[i, (i + 1) % 30] = 1.0, 0.5
    y = torch.randn(30, 1, dtype=torch.float64)
    measured = measure(nn.Linear(30, 1, bias=False).double(), (x, y), "mse").batch_bound
    rho = conflict_graph_max_degree(x)
    assert rho == 2
    assert measured >= sparse_conflict_batch_bound(30, rho)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: two_layer_linear_bound(0, 3, 3), "n must be > 0"),
    (lambda: linear_network_rho_bound(1, [4]), "input_dim ≥ 2"),
    (lambda: linear_network_rho_bound(5, [4, 1]), "hidden width ≥ 2"),
    (lambda: glm_batch_bound([[0.0, 0.0]]), "all zeros"),
    (lambda: glm_batch_bound([1.0, 2.0]), r"\(n, d\) matrix"),
    (lambda: sparse_conflict_batch_bound(4, -1), "max_degree"),
    (lambda: speedup_ratio(0, 10), "iterations"),
])
def test_bad_input_is_named(call, message: str) -> None:
    with pytest.raises(BatchboundError, match=message):
        call()


def gaussian_linear_net(d: int, widths: list[int]) -> nn.Module:
    dims = [d, *widths, 1]
    layers = [nn.Linear(a, b, bias=False) for a, b in itertools.pairwise(dims)]
    model = nn.Sequential(*layers).double()
    for p in model.parameters():
        nn.init.normal_(p)
    return model


@pytest.mark.parametrize(("d", "widths"), [(10, [5]), (12, [6, 6])])
def test_depth_bound_is_below_the_monte_carlo_rho_of_gaussian_linear_networks(d, widths) -> None:
    # Theorem 3's setting: N(0,1) weights, inputs and teacher, f_i = ½(Wx_i − W*x_i)²;
    # ρ is a ratio of expectations, estimated by summing numerators and denominators.
    # Observed ρ from 5.8 to 9.3 over seeds against bounds 2.9 and 2.6: MC noise cannot flip it.
    torch.manual_seed(3)
    n, numerator, denominator = 100, 0.0, 0.0
    for _ in range(20):
        student, teacher = gaussian_linear_net(d, widths), gaussian_linear_net(d, widths)
        x = torch.randn(n, d, dtype=torch.float64)
        with torch.no_grad():
            y = teacher(x)
        stats = per_example_stats(student, x, y, lambda out, t: 0.5 * (out - t).square().sum(1))
        numerator += n * stats.S
        denominator += stats.T
    assert linear_network_rho_bound(d, widths) <= numerator / denominator
