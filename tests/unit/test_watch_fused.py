"""The fused bookkeeping of ``watch`` (multi-tensor norms, one concatenation, no host sync in
the step) against the obvious float64 loop, and the monitor's deferred updates against its
immediate ones."""

from __future__ import annotations

import math

import pytest
import torch

from batchbound.diversity.online import MAX_DEFERRED, OnlineDiversity
from batchbound.diversity.steps import _grad_changes, _grad_copies, batch_sums
from batchbound.errors import BatchboundError


def test_batch_sums_match_a_float64_loop() -> None:
    g = torch.Generator().manual_seed(0)
    sq = {f"p{k}": torch.rand(7, generator=g) for k in range(5)}
    sums = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g),
            torch.randn(2, 2, 2, generator=g)]
    S_B, T_B = batch_sums(sq, sums)
    assert S_B.dtype == T_B.dtype == torch.float64
    S_ref = sum(float(v.double().sum()) for v in sq.values())
    T_ref = sum(float(t.double().square().sum()) for t in sums)
    assert float(S_B) == pytest.approx(S_ref, rel=1e-14)
    assert float(T_B) == pytest.approx(T_ref, rel=1e-14)


def test_batch_sums_count_held_gradients_whole() -> None:
    """Per-example gradients held un-normed (``HooksPass.sq_parts``) count every entry's
    square in S_B, beside the per-example squared norms, or alone."""
    g = torch.Generator().manual_seed(3)
    sq = {"p": torch.rand(4, generator=g)}
    held = [torch.randn(4, 3, generator=g), torch.randn(8, 2, 5, generator=g, dtype=torch.float64)]
    sums = [torch.randn(3, generator=g)]
    whole = sum(float(t.double().square().sum()) for t in held)
    S_B, T_B = batch_sums(sq, sums, held)
    assert float(S_B) == pytest.approx(float(sq["p"].double().sum()) + whole, rel=1e-14)
    assert float(T_B) == pytest.approx(float(sums[0].double().square().sum()), rel=1e-14)
    S_B, _ = batch_sums({}, sums, held)
    assert float(S_B) == pytest.approx(whole, rel=1e-14)


def test_batch_sums_mixed_dtypes() -> None:
    sq = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0], dtype=torch.float64)}
    S_B, _ = batch_sums(sq, [torch.ones(2)])
    assert float(S_B) == 6.0


def test_grad_copies_and_changes_are_exact() -> None:
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    a.grad = torch.tensor([1.0, 2.0, 3.0])
    params = {"a": a, "b": b}
    before = _grad_copies(params)
    assert before["b"] is None and before["a"] is not a.grad
    a.grad.add_(torch.tensor([0.5, 0.25, 0.125]))  # in place, as autograd accumulates
    delta = _grad_changes(params, before)
    assert torch.equal(delta["a"], torch.tensor([0.5, 0.25, 0.125]))
    assert torch.equal(delta["b"], torch.zeros(2))  # no gradient: no change


def test_deferred_updates_equal_immediate_ones() -> None:
    g = torch.Generator().manual_seed(1)
    now, later = OnlineDiversity(500, decay=0.9), OnlineDiversity(500, decay=0.9)
    for _ in range(MAX_DEFERRED + 5):  # past the bound: folded once on the way
        S_B, T_B = torch.rand((), generator=g, dtype=torch.float64) + 1, torch.rand(
            (), generator=g, dtype=torch.float64) * 40
        now.update_from_norms(float(S_B), float(T_B), 16)
        later.defer_from_norms(S_B, T_B, 16)
    assert len(later._deferred) == 5  # kept on the device until read
    assert later.to_dict() == now.to_dict()
    assert later.steps == now.steps == MAX_DEFERRED + 5 and later.last == now.last


def test_a_deferred_non_finite_step_is_refused_when_read() -> None:
    monitor = OnlineDiversity()
    monitor.defer_from_norms(torch.tensor(math.nan), torch.tensor(1.0), 4)
    with pytest.raises(BatchboundError, match="non-finite"):
        _ = monitor.batch_bound


def test_state_round_trip_folds_deferred_steps() -> None:
    monitor = OnlineDiversity(100)
    monitor.defer_from_norms(torch.tensor(4.0), torch.tensor(9.0), 4)
    copy = OnlineDiversity(100)
    copy.load_state_dict(monitor.state_dict())
    assert copy.steps == 1 and copy.m2 == monitor.m2 == 1.0


def test_grouped_row_norms_equal_the_per_tensor_ones() -> None:
    from batchbound.diversity.hooks import grouped_row_sq_norms
    from batchbound.diversity.rules import Dense

    g = torch.Generator().manual_seed(2)
    dense = [("a", torch.randn(6, 4, generator=g)), ("b", torch.randn(6, 4, generator=g)),
             ("c", torch.randn(6, 2, 3, generator=g)), ("d", torch.randn(6, generator=g)),
             ("e", torch.randn(6, 4, generator=g, dtype=torch.float64))]
    stack = torch.randn(18, 4, generator=g)  # three calls' rows stacked (stacking.py)
    got = grouped_row_sq_norms([([name], t) for name, t in dense]
                               + [(["s0", None, "s2"], stack)])
    assert set(got) == {"a", "b", "c", "d", "e", "s0", "s2"}  # None: rows nobody asked for
    dense += [("s0", stack[:6]), ("s2", stack[12:])]
    for name, t in dense:
        ref = t.double().reshape(6, -1).square().sum(dim=1)
        assert got[name].dtype == t.dtype
        assert torch.allclose(got[name].double(), ref, rtol=1e-6)
        # the same reduction, stacked: equal up to the order of the additions
        assert torch.allclose(got[name], Dense(t).sq_norms(), rtol=4 * torch.finfo(t.dtype).eps)


def test_a_deferred_non_finite_step_loses_none_of_the_others() -> None:
    """The steps deferred beside a non-finite one are folded in, as they were when each
    step was refused in itself: only the bad step is missing."""
    monitor, reference = OnlineDiversity(100, decay=0.9), OnlineDiversity(100, decay=0.9)
    for S_B, T_B in ((4.0, 9.0), (math.inf, 1.0), (5.0, 12.0)):
        monitor.defer_from_norms(torch.tensor(S_B), torch.tensor(T_B), 4)
        if math.isfinite(S_B):
            reference.update_from_norms(S_B, T_B, 4)
    with pytest.raises(BatchboundError, match=r"1 of the 3 steps.*non-finite"):
        _ = monitor.batch_bound
    assert monitor.steps == 2 and monitor.to_dict() == reference.to_dict()
