"""Online diversity estimators: unbiasedness in Monte Carlo, convergence to the exact Δ, the
smoothing, and monitored_step's gradients."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from batchbound.diversity import OnlineDiversity, measure, monitored_step, per_example_stats, watch
from batchbound.errors import BatchboundError

N, D = 60, 5


def population(seed: int = 0) -> torch.Tensor:
    """(N, D) per-example gradients: a small shared mean under unit noise (n·Δ from about 2
    to 17 depending on the seed)."""
    gen = torch.Generator().manual_seed(seed)
    mean = 0.5 * torch.randn(D, generator=gen, dtype=torch.float64)
    return mean + torch.randn(N, D, generator=gen, dtype=torch.float64)


def batches(k: int, b: int, replacement: bool, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if replacement:
        return torch.randint(0, N, (k, b), generator=gen)
    return torch.rand(k, N, generator=gen).argsort(dim=1)[:, :b]


def within(values: torch.Tensor, truth: float, sigmas: float = 5.0) -> bool:
    """The sample mean is within ``sigmas`` standard errors of ``truth``."""
    se = float(values.std()) / math.sqrt(values.numel())
    return abs(float(values.mean()) - truth) <= sigmas * se


@pytest.mark.parametrize("replacement", [False, True])
def test_per_example_estimates_are_unbiased_and_converge(replacement: bool) -> None:
    g = population()
    S, T = float(g.square().sum()), float(g.sum(0).square().sum())
    k, b = 20000, 8
    idx = batches(k, b, replacement, seed=1)
    picked = g[idx]  # (k, b, D)
    s_b, t_b = picked.square().sum(dim=(1, 2)), picked.sum(1).square().sum(1)
    monitor = OnlineDiversity(N, decay=None,
                              sampling="with_replacement" if replacement else "without_replacement")
    for s, t in zip(s_b.tolist(), t_b.tolist(), strict=True):
        monitor.update_from_norms(s, t, b)
    m2_steps, cross_steps = s_b / b, (t_b - s_b) / (b * (b - 1))
    assert monitor.m2 == pytest.approx(float(m2_steps.mean()), rel=1e-9)
    assert within(m2_steps, S / N)
    # E[C] is ‖G‖² = T/n² with replacement, (T − S)/(n(n − 1)) without
    cross_truth = T / N**2 if replacement else (T - S) / (N * (N - 1))
    assert within(cross_steps, cross_truth)
    assert monitor.gradient_sq_norm == pytest.approx(T / N**2, rel=0.05)
    assert monitor.batch_bound == pytest.approx(N * S / T, rel=0.05)
    assert monitor.diversity == pytest.approx(S / T, rel=0.05)
    assert monitor.noise_scale == pytest.approx(N * S / T - 1, rel=0.06)
    # the naive per-batch ratio b·S_B/T_B is badly biased (it never exceeds ~b here)
    naive = b * s_b / t_b
    assert not within(naive, N * S / T, sigmas=20)


def test_two_batch_estimator_is_unbiased_with_unequal_workers() -> None:
    g = population(2)
    S, T = float(g.square().sum()), float(g.sum(0).square().sum())
    sizes = [4, 8, 12]
    idx = batches(4000, sum(sizes), replacement=False, seed=3)
    running = OnlineDiversity(N, decay=None)
    m2_steps, cross_steps = [], []
    for row in idx:
        parts = row.split(sizes)
        small = [g[p].mean(0) for p in parts]
        single = OnlineDiversity(N, decay=0.0)  # one step's estimates
        single.update_from_gradients(small, sizes)
        running.update_from_gradients(small, sizes)
        m2_steps.append(single.m2)
        cross_steps.append(single.cross)
    m2_t = torch.tensor(m2_steps, dtype=torch.float64)
    cross_t = torch.tensor(cross_steps, dtype=torch.float64)
    assert within(m2_t, S / N)
    assert within(cross_t, (T - S) / (N * (N - 1)))
    assert running.m2 == pytest.approx(float(m2_t.mean()), rel=1e-9)
    assert running.batch_bound == pytest.approx(N * S / T, rel=0.15)


def test_gradient_forms_agree() -> None:
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0])
    one, two, three = OnlineDiversity(), OnlineDiversity(), OnlineDiversity()
    one.update_from_gradients([a, b], 4)
    two.update_from_gradients([{"w": a[:1], "v": a[1:]}, [b[:1], b[1:]]], [4, 4],
                              big_grad=(a + b) / 2, big_size=8)
    three.update_two_batch(float((a.square().sum() + b.square().sum()) / 2), 4,
                           float(((a + b) / 2).square().sum()), 8)
    assert one.m2 == pytest.approx(two.m2) and one.cross == pytest.approx(two.cross)
    assert one.m2 == pytest.approx(three.m2) and one.cross == pytest.approx(three.cross)


def test_ema_is_bias_corrected_and_smooths_numerator_and_denominator_separately() -> None:
    monitor = OnlineDiversity(decay=0.5)
    monitor.update(4.0, 1.0)
    assert (monitor.m2, monitor.cross) == (4.0, 1.0)
    monitor.update(10.0, 4.0)
    assert monitor.m2 == pytest.approx((4 + 2 * 10) / 3)
    assert monitor.cross == pytest.approx((1 + 2 * 4) / 3)
    # ratio of the smoothed values, not the smoothed ratios (4 and 2.5)
    assert monitor.batch_bound == pytest.approx(24 / 9)
    restored = OnlineDiversity()
    restored.load_state_dict(monitor.state_dict())
    assert restored.to_dict() == monitor.to_dict()


def test_noise_dominated_and_empty_readings() -> None:
    monitor = OnlineDiversity(10)
    assert math.isnan(monitor.batch_bound)
    monitor.update(1.0, -0.5)
    assert monitor.batch_bound == math.inf
    no_n = OnlineDiversity()
    no_n.update(2.0, 1.0)
    assert no_n.batch_bound == 2.0 and math.isnan(no_n.diversity)


def fixed_problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x = torch.randn(96, 6, dtype=torch.float64)
    y = (x[:, 0] > 1.0).long()  # mostly class 0: a resolvable mean gradient, n·Δ ≈ 3
    return model, x, y


def test_monitored_step_leaves_ordinary_gradients() -> None:
    model, x, y = fixed_problem()
    reference = copy.deepcopy(model)
    for reduction in ("mean", "sum"):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        monitor = OnlineDiversity(96)
        value = monitored_step(model, x[:16], y[:16], "cross_entropy", monitor,
                               reduction=reduction)
        full = nn.functional.cross_entropy(reference(x[:16]), y[:16], reduction=reduction)
        full.backward()
        assert float(value) == pytest.approx(float(full.detach()), rel=1e-12)
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-14)
        assert monitor.steps == 1
    # accumulates like backward does
    monitored_step(model, x[16:32], y[16:32], "cross_entropy", OnlineDiversity(),
                   reduction="sum")
    nn.functional.cross_entropy(reference(x[16:32]), y[16:32], reduction="sum").backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-14)


def test_monitored_steps_converge_to_the_exact_measurement() -> None:
    model, x, y = fixed_problem()
    exact = measure(model, (x, y), "cross_entropy")
    monitor = OnlineDiversity(96, decay=None)
    gen = torch.Generator().manual_seed(5)
    for _ in range(100):
        idx = torch.randperm(96, generator=gen)[:32]
        monitored_step(model, x[idx], y[idx], "cross_entropy", monitor)
        model.zero_grad()
    # Over seeds 0-7 the relative error after 100 batches of 32 was ≤ 1.5 %; 5 % leaves margin.
    assert monitor.m2 == pytest.approx(exact.m2, rel=0.05)
    assert monitor.batch_bound == pytest.approx(exact.batch_bound, rel=0.05)
    assert monitor.diversity == pytest.approx(exact.diversity, rel=0.05)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: OnlineDiversity(0), "positive integer"),
    (lambda: OnlineDiversity(decay=1.0), "decay"),
    (lambda: OnlineDiversity(sampling="bootstrap"), "unknown sampling"),
    (lambda: OnlineDiversity().update_from_norms(1.0, 1.0, 1), "batch of ≥ 2"),
    (lambda: OnlineDiversity().update_two_batch(1.0, 8, 1.0, 8), "small_size < big_size"),
    (lambda: OnlineDiversity().update_from_gradients([torch.ones(2)], [1, 2]), "one size"),
    (lambda: OnlineDiversity().update_from_gradients([torch.ones(2)], 4), "at least 2 small"),
    (lambda: OnlineDiversity().update_from_gradients([torch.ones(2), torch.ones(3)], 4),
     "different lengths"),
    (lambda: OnlineDiversity().update_from_gradients(
        [[None, torch.ones(2)], [torch.ones(2), None]], 4), "None at different entries"),
    (lambda: OnlineDiversity().update_from_gradients([torch.ones(2)] * 2, 0), "positive"),
    (lambda: OnlineDiversity().update(math.nan, 1.0), "non-finite"),
])
def test_bad_input_is_named(make, message: str) -> None:
    with pytest.raises(BatchboundError, match=message):
        make()


@pytest.mark.parametrize(("decay", "steps"), [(None, 100), (0.9, 150)])
def test_standard_error_matches_the_spread_over_replications(decay, steps: int) -> None:
    g = population(1)  # n·Δ ≈ 17: the noise-dominated regime
    reps, b = 300, 16
    idx = batches(reps * steps, b, replacement=False, seed=5).reshape(reps, steps, b)
    picked = g[idx]
    s_b = picked.square().sum(dim=(2, 3))
    t_b = picked.sum(2).square().sum(-1)
    finals, ses = [], []
    for r in range(reps):
        monitor = OnlineDiversity(N, decay=decay)
        for s, t in zip(s_b[r].tolist(), t_b[r].tolist(), strict=True):
            monitor.update_from_norms(s, t, b)
        finals.append(monitor.batch_bound)
        ses.append(monitor.batch_bound_se)
    spread = float(torch.tensor(finals).std())
    typical = float(torch.tensor(ses).median())
    # the SD of an SD over 300 replications is ~4 %; the delta method adds some bias
    assert 0.75 < typical / spread < 1.33


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_watch_reads_the_users_own_backward(reduction: str) -> None:
    model, x, y = fixed_problem()
    reference = copy.deepcopy(model)
    x, y = x[:20], y[:20]
    exact = per_example_stats(reference, x, y, "cross_entropy")
    for p in model.parameters():  # a gradient left over from earlier is not counted
        p.grad = torch.ones_like(p)
    monitor = OnlineDiversity(96, decay=0.0)
    with watch(model, monitor, reduction=reduction):
        nn.functional.cross_entropy(model(x), y, reduction=reduction).backward()
    expected = OnlineDiversity(96, decay=0.0)
    expected.update_from_stats(exact)
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-10)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-8)
    scale = 1 / 20 if reduction == "mean" else 1.0
    for p, name in zip(model.parameters(), exact.grad_sum, strict=True):
        assert torch.allclose(p.grad, 1 + scale * exact.grad_sum[name], rtol=1e-12)


def test_watch_refuses_what_it_cannot_measure() -> None:
    model, x, _ = fixed_problem()
    with pytest.raises(BatchboundError, match="no backward pass"), watch(model, OnlineDiversity()):
        model(x)
    with pytest.raises(BatchboundError, match="more than once"), watch(model, OnlineDiversity()):
        (model(x).sum() + model(x).sum()).backward()
    bn = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4)).double()
    with pytest.raises(BatchboundError, match="eval"), watch(bn, OnlineDiversity()):
        bn(x)  # checked as it is called: a model.eval() inside the block is in time


def test_watch_refuses_examples_that_interact_or_are_reordered() -> None:
    """watch() has no loss to check against; a projection of the outputs stands in for it."""

    class Centres(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(5, 7), nn.Linear(7, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            return self.b(torch.tanh(h - h.mean(0, keepdim=True)))

    torch.manual_seed(0)
    model = Centres()
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    with pytest.raises(BatchboundError, match="interact"), watch(model, OnlineDiversity(n=100)):
        nn.functional.cross_entropy(model(x), y).backward()


def test_the_interval_reaches_a_rising_bound_that_the_standard_error_misses() -> None:
    """n·Δ rising 1 per step, noiselessly: the EMA trails by about decay/(1 − decay) = 19
    steps, which ± 2 SE (zero here: no sampling noise) cannot contain; the lag estimate
    does."""
    monitor = OnlineDiversity(decay=0.95)
    for t in range(400):
        monitor.update(1.0, 1.0 / (50.0 + t))  # M2 = 1, ‖G‖² = 1/(50 + t): n·Δ = 50 + t
    now = 50.0 + 399
    assert monitor.batch_bound < now - 10  # the smoothed value lags behind
    assert 0.5 * (now - monitor.batch_bound) < monitor.batch_bound_lag < 1.5 * (
        now - monitor.batch_bound)
    low, high = monitor.batch_bound_interval
    assert low <= now <= high + 2.0  # within the interval, up to the trend's curvature
    steady = OnlineDiversity(decay=0.95)
    for _ in range(400):
        steady.update(1.0, 0.01)
    assert steady.batch_bound_lag == pytest.approx(0.0, abs=1e-9)  # no trend, no lag
    assert math.isnan(OnlineDiversity(decay=None).batch_bound_lag)


def test_gradients_as_users_collect_them() -> None:
    """``[p.grad for p in model.parameters()]`` with a frozen layer (None entries; an
    AttributeError before), a numpy or tensor size (a TypeError before): the same numbers as
    the gradients without the None entries; the big side summed in float64."""
    import numpy as np

    g = torch.Generator().manual_seed(3)
    grads = [[None, torch.randn(3, generator=g), torch.randn(2, generator=g)] for _ in range(3)]
    plain = OnlineDiversity(decay=None)
    plain.update_from_gradients([torch.cat([a, b]) for _, a, b in grads], 4)
    for size in (np.int64(4), torch.tensor(4), np.array([4, 4, 4])):
        monitor = OnlineDiversity(decay=None)
        monitor.update_from_gradients(grads, size)
        assert monitor.to_dict() == plain.to_dict()
    low = [torch.randn(5, generator=g).bfloat16() for _ in range(3)]
    monitor = OnlineDiversity(decay=None)
    monitor.update_from_gradients(low, 8)
    exact = OnlineDiversity(decay=None)
    exact.update_from_gradients([t.double() for t in low], 8)
    assert monitor.m2 == pytest.approx(exact.m2, rel=1e-12)
    assert monitor.cross == pytest.approx(exact.cross, rel=1e-12)


def test_sparse_gradients_are_taken_as_dense() -> None:
    """``nn.Embedding(sparse=True)`` leaves sparse ``.grad``s (uncoalesced: a row drawn
    twice appears twice); reshape raised a RuntimeError on them."""
    torch.manual_seed(0)
    embedding = nn.Embedding(20, 4, sparse=True).double()
    grads = []
    for _ in range(3):
        embedding.zero_grad(set_to_none=True)
        embedding(torch.randint(0, 20, (6,))).square().sum(1).mean().backward()
        grads.append([p.grad.clone() for p in embedding.parameters()])
    assert grads[0][0].is_sparse
    sparse, dense = OnlineDiversity(decay=None), OnlineDiversity(decay=None)
    sparse.update_from_gradients(grads, 6)
    dense.update_from_gradients([[g.to_dense() for g in step] for step in grads], 6)
    assert sparse.to_dict() == dense.to_dict()
    single = OnlineDiversity(decay=None)
    single.update_from_gradients([step[0] for step in grads], 6)  # bare tensors too
    assert single.to_dict() == dense.to_dict()
