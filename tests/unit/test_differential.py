"""Differential gradient diversity against a float64 per-example loop."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import loop_gradients
from torch import nn

from batchbound.diversity.differential import differential_diversity
from batchbound.errors import BatchboundError


def two_states(seed: int = 0):
    torch.manual_seed(seed)
    a = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    b = copy.deepcopy(a)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x, y = torch.randn(17, 5), torch.randint(0, 3, (17,))
    return a, b, x, y


@pytest.mark.parametrize("chunk_size", [1, 4, 100])
def test_matches_the_loop_reference(chunk_size: int) -> None:
    a, b, x, y = two_states()
    report = differential_diversity(a, b, (x, y), "cross_entropy", chunk_size=chunk_size,
                                    dtype=torch.float64)
    ce = nn.functional.cross_entropy
    diff = loop_gradients(a, x, y, ce) - loop_gradients(b, x, y, ce)
    s_ref, t_ref = float(diff.square().sum()), float(diff.sum(0).square().sum())
    assert report.n == 17
    assert abs(report.S - s_ref) <= 1e-10 * s_ref
    assert abs(report.T - t_ref) <= 1e-10 * t_ref
    assert abs(report.diversity - s_ref / t_ref) <= 1e-9 * s_ref / t_ref
    assert report.batch_bound == pytest.approx(17 * s_ref / t_ref, rel=1e-9)
    assert sum(report.per_parameter.values()) == pytest.approx(s_ref, rel=1e-10)
    dist = sum((p - q).detach().square().sum() for p, q in zip(a.parameters(), b.parameters(),
                                                      strict=True)) ** 0.5
    assert report.distance == pytest.approx(float(dist), rel=1e-6)


def test_state_dict_form_equals_two_models_and_leaves_model_a_alone() -> None:
    a, b, x, y = two_states(1)
    before = copy.deepcopy(a.state_dict())
    a.train()
    from_models = differential_diversity(a, b, (x, y), "cross_entropy", dtype=torch.float64)
    from_state = differential_diversity(a, b.state_dict(), (x, y), "cross_entropy",
                                        dtype=torch.float64)
    assert pytest.approx(from_models.S, rel=1e-12) == from_state.S
    assert pytest.approx(from_models.T, rel=1e-12) == from_state.T
    assert a.training  # mode restored
    for k, v in a.state_dict().items():
        assert torch.equal(v, before[k])


def test_linear_least_squares_obeys_the_glm_bound() -> None:
    # [diversity] notes Remark 1's bound also holds for B_S(w, w'): for f_i = ½(x_iᵀw − y_i)²
    # the differences are x_i x_iᵀ(w − w'), a GLM gradient in x_i.
    from batchbound.theory import glm_batch_bound

    torch.manual_seed(2)
    x = torch.randn(40, 6, dtype=torch.float64)
    y = torch.randn(40, 1, dtype=torch.float64)
    a = nn.Linear(6, 1, bias=False).double()
    b = nn.Linear(6, 1, bias=False).double()
    report = differential_diversity(a, b, (x, y), "mse")
    assert report.batch_bound >= glm_batch_bound(x) * (1 - 1e-12)


def test_mismatched_architectures_are_named() -> None:
    a = nn.Linear(3, 2)
    with pytest.raises(BatchboundError, match="shapes differ"):
        differential_diversity(a, nn.Linear(4, 2), (torch.randn(3, 3), torch.zeros(3).long()))
    with pytest.raises(BatchboundError, match="state dict does not fit"):
        differential_diversity(a, {"weight": torch.zeros(2, 3)},
                               (torch.randn(3, 3), torch.zeros(3).long()))
