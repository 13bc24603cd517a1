"""[width]'s width solver and the generic budget search, against brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchbound.errors import BatchboundError
from batchbound.models import (
    budget_count,
    build_model,
    count_parameters,
    solve_width,
    weight_count,
)
from batchbound.models.fc import bias_count
from batchbound.models.options import closest_integer


def brute_force_width(params: int, d_in: int, depth: int, d_out: int, biases: bool) -> int:
    """argmin over every K in 1..params+1 of |count(K) − p|, ties to the smaller K."""
    k = np.arange(1, params + 2, dtype=np.int64)
    counts = d_in * k + (depth - 1) * k * k + k * d_out
    if biases:
        counts = counts + depth * k + d_out
    return int(k[np.argmin(np.abs(counts - params))])  # argmin takes the first: smallest K


@settings(max_examples=200, deadline=None)
@given(
    d_in=st.integers(1, 3000),
    d_out=st.integers(1, 50),
    depth=st.integers(1, 12),
    params=st.integers(1, 200_000),
    biases=st.booleans(),
)
def test_solver_picks_the_closest_integer_width(d_in, d_out, depth, params, biases):
    assert solve_width(params, d_in, depth, d_out, biases) == brute_force_width(
        params, d_in, depth, d_out, biases
    )


def test_the_width_papers_example_mnist_16k_depth_10_is_width_17():
    # [width], Fig. 3(b): the MNIST FC network at 16k parameters with L = 10 has K = 17.
    assert solve_width(16_000, 784, 10, 10) == 17
    assert solve_width(16_000, 784, 1, 10) == 20
    model = build_model("fc(depth=10,params=16000)", (1, 28, 28), 10)
    assert model.batchbound_shape.width == 17
    assert count_parameters(model, include_biases=False) == 784 * 17 + 9 * 17**2 + 17 * 10


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from([(5,), (1, 4, 4), (3, 2, 2), (40,)]),
    d_out=st.integers(1, 6),
    depth=st.integers(0, 5),
    width=st.integers(1, 12),
    bias=st.booleans(),
)
def test_built_fc_counts_match_the_formula(shape, d_out, depth, width, bias):
    d_in = int(np.prod(shape))
    spec = f"fc(depth={depth},{f'width={width},' if depth else ''}bias={str(bias).lower()})"
    model = build_model(spec, shape, d_out)
    k = width if depth else 0
    assert count_parameters(model, include_biases=False) == weight_count(d_in, k, depth, d_out)
    biases = bias_count(k, depth, d_out) if bias else 0
    assert count_parameters(model) == weight_count(d_in, k, depth, d_out) + biases
    linear = build_model(f"linear(depth={depth}{f',width={width}' if depth else ''})", shape, d_out)
    assert count_parameters(linear) == weight_count(d_in, k, depth, d_out)


def test_count_biases_moves_the_budget_onto_the_total():
    weights_only = build_model("fc(depth=3,params=5000)", (64,), 10)
    with_biases = build_model("fc(depth=3,params=5000,count_biases=true)", (64,), 10)
    k0, k1 = weights_only.batchbound_shape.width, with_biases.batchbound_shape.width
    assert k1 <= k0
    assert k1 == brute_force_width(5000, 64, 3, 10, biases=True)
    assert count_parameters(with_biases) == budget_count(64, k1, 3, 10, count_biases=True)
    assert abs(count_parameters(with_biases) - 5000) <= abs(count_parameters(weights_only) - 5000)


@settings(max_examples=100, deadline=None)
@given(
    steps=st.lists(st.integers(0, 50), min_size=1, max_size=60),
    budget=st.integers(0, 3000),
)
def test_closest_integer_matches_brute_force(steps, budget):
    values = np.cumsum(steps).tolist()  # a non-decreasing count over x = 1..len(steps)
    hi = len(values)

    def count(x: int) -> int:
        return values[x - 1]

    expected = min(range(1, hi + 1), key=lambda x: (abs(values[x - 1] - budget), x))
    assert closest_integer(count, budget, lo=1, hi=hi) == expected


def test_solver_refuses_depth_zero():
    with pytest.raises(BatchboundError, match="depth >= 1"):
        solve_width(100, 10, 0, 2)
