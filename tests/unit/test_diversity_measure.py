"""measure(): exact properties, engine agreement, data forms, the fallback policy, and that
the user's model comes back untouched."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from batchbound.data import load_dataset
from batchbound.diversity import (
    PreparedStats,
    measure,
    per_example_gradients,
    per_example_l1_l2,
    per_example_stats,
)
from batchbound.errors import BatchboundError
from batchbound.models import build_model


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.Conv2d(3, 4, 3, stride=2),
        nn.GroupNorm(2, 4),
        nn.Flatten(),
        nn.Linear(16, 5),
        nn.LayerNorm(5),
        nn.Linear(5, 3),
    )


def cnn_data(n: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 5, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def test_identical_gradients_give_one_over_n() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    x = torch.randn(1, 4).repeat(7, 1)
    y = torch.tensor([2]).repeat(7)
    report = measure(model, (x, y), "cross_entropy", dtype=torch.float64, chunk_size=3)
    assert report.diversity == pytest.approx(1 / 7, rel=1e-12)
    assert report.batch_bound == pytest.approx(1.0, rel=1e-12)


def test_orthogonal_gradients_give_one() -> None:
    # f_i(w) = (w·e_i − y_i)²: g_i ∝ e_i, pairwise orthogonal.
    n = 6
    model = nn.Linear(n, 1, bias=False)
    y = torch.randn(n, 1)
    report = measure(model, (torch.eye(n), y), "mse", dtype=torch.float64, chunk_size=4)
    assert report.diversity == pytest.approx(1.0, rel=1e-12)
    assert report.batch_bound == pytest.approx(n, rel=1e-12)


def test_duplicating_the_data_keeps_the_bound() -> None:
    """Duplicating every example doubles S and quadruples T, so Δ = S/T halves and the
    batch-size bound B = n·Δ is unchanged (issue 2 says "Δ unchanged"; under the seeds'
    un-normalised definition Δ_S = S/T it is B, the normalised quantity, that is invariant)."""
    torch.manual_seed(1)
    model = small_cnn()
    x, y = cnn_data()
    once = measure(model, (x, y), "cross_entropy", dtype=torch.float64)
    twice = measure(
        model, (x.repeat(2, 1, 1, 1), y.repeat(2)), "cross_entropy", dtype=torch.float64
    )
    assert twice.n == 2 * once.n
    assert pytest.approx(2 * once.S, rel=1e-12) == twice.S
    assert pytest.approx(4 * once.T, rel=1e-12) == twice.T
    assert twice.batch_bound == pytest.approx(once.batch_bound, rel=1e-10)
    assert twice.diversity == pytest.approx(once.diversity / 2, rel=1e-10)


@pytest.mark.parametrize("engine", ["hooks", "auto", "vmap"])
def test_engines_agree_with_loop(engine: str) -> None:
    torch.manual_seed(2)
    model = small_cnn()
    model[1].running_mean.normal_()  # eval-mode BatchNorm with non-trivial statistics
    x, y = cnn_data()
    ref = measure(model, (x, y), "cross_entropy", engine="loop", dtype=torch.float64)
    got = measure(model, (x, y), "cross_entropy", engine=engine, dtype=torch.float64, chunk_size=4)
    assert got.n == ref.n == 11
    assert pytest.approx(ref.S, rel=1e-9) == got.S
    assert pytest.approx(ref.T, rel=1e-9) == got.T
    assert got.loss == pytest.approx(ref.loss, rel=1e-12)
    for name, value in ref.per_parameter_S.items():
        assert got.per_parameter_S[name] == pytest.approx(value, rel=1e-9)


def test_report_fields_and_json() -> None:
    ds = load_dataset("synthetic-linear(n=40,d=5,outputs=2)")
    model = build_model("fc(depth=1,width=8)", ds.input_shape, ds.num_outputs, seed=0)
    report = measure(model, ds)  # regression: MSE chosen from the task
    data = json.loads(report.to_json())
    assert data["n"] == 40 and data["loss_name"] == "mse" and data["engine"] == "auto"
    assert data["diversity"] == pytest.approx(report.S / report.T)
    assert data["batch_bound"] == pytest.approx(40 * report.S / report.T)
    assert data["m2"] == pytest.approx(report.S / 40)
    assert sum(data["per_parameter_S"].values()) == pytest.approx(report.S)
    assert data["dtype"] == "float32" and data["seconds"] >= 0


def test_data_forms_agree() -> None:
    torch.manual_seed(3)
    model = small_cnn()
    x, y = cnn_data(10)
    ref = measure(model, (x, y), "cross_entropy", dtype=torch.float64, chunk_size=3)
    for data in (
        TensorDataset(x, y),
        DataLoader(TensorDataset(x, y), batch_size=4),
        DataLoader(TensorDataset(x, y), batch_size=10),
    ):
        got = measure(model, data, "cross_entropy", dtype=torch.float64, chunk_size=3)
        assert got.n == 10
        assert got.diversity == pytest.approx(ref.diversity, rel=1e-10)


class Scale(nn.Module):
    """A layer no rule covers."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def uncovered_model() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), Scale(5), nn.Linear(5, 3))


def test_fallback_warns_naming_module_and_is_exact() -> None:
    model = uncovered_model()
    x, y = torch.randn(9, 4), torch.randint(0, 3, (9,))
    with pytest.warns(UserWarning, match=r"no layer rule for 2 \(Scale\): 2\.gain"):
        got = measure(model, (x, y), "cross_entropy", engine="auto", dtype=torch.float64)
    ref = measure(model, (x, y), "cross_entropy", engine="loop", dtype=torch.float64)
    assert got.to_dict()["fallback_parameters"] == ["2.gain"]
    assert got.per_parameter_S["2.gain"] == pytest.approx(ref.per_parameter_S["2.gain"], rel=1e-9)
    assert got.diversity == pytest.approx(ref.diversity, rel=1e-9)


def test_hooks_engine_refuses_uncovered_module() -> None:
    model = uncovered_model()
    x, y = torch.randn(3, 4), torch.randint(0, 3, (3,))
    with pytest.raises(Exception, match=r"no layer rule for 2 \(Scale\): 2\.gain"):
        measure(model, (x, y), "cross_entropy", engine="hooks")


class Reused(nn.Module):
    """One Linear applied twice, and a weight tied between two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.emb = nn.Embedding(6, 4)
        self.out = nn.Linear(4, 6, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx).mean(dim=1)
        return self.out(torch.tanh(self.shared(torch.tanh(self.shared(h)))))


def test_reused_and_tied_modules_are_exact_under_the_rules() -> None:
    """A module run twice and a weight tied between modules need the cross terms of their
    calls' gradients: the rules give them, with no fallback and no warning."""
    torch.manual_seed(5)
    model = Reused().double()
    idx, y = torch.randint(0, 6, (8, 3)), torch.randint(0, 6, (8,))
    ref = per_example_stats(model, idx, y, "cross_entropy", engine="loop")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = per_example_stats(model, idx, y, "cross_entropy", engine="hooks")
    assert not got.fallback
    for name in ref.sq_norms:
        torch.testing.assert_close(got.sq_norms[name], ref.sq_norms[name], rtol=1e-9, atol=0)
        torch.testing.assert_close(got.grad_sum[name], ref.grad_sum[name], rtol=1e-9, atol=1e-12)


def test_users_model_is_untouched() -> None:
    torch.manual_seed(6)
    model = small_cnn().train()
    model[4].eval()  # a mixed mode that must come back as it was
    modes = [m.training for m in model.modules()]
    x, y = cnn_data()
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.25)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    measure(model, (x, y), "cross_entropy", dtype=torch.float64)
    measure(model, (x, y), "cross_entropy")
    assert [m.training for m in model.modules()] == modes
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(p.grad, torch.full_like(p, 0.25)) for p in model.parameters())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def test_a_model_in_eval_mode_is_not_switched() -> None:
    """measure() of a model in eval mode already (a loop that measures it again and again)
    leaves every module as it is: no train(False) call, no mode written back."""
    torch.manual_seed(6)
    model = small_cnn().eval()
    calls = []
    for module in model.modules():
        module.train = lambda mode=True, m=module: calls.append(m)  # type: ignore[method-assign]
    x, y = cnn_data()
    measure(model, (x, y), "cross_entropy")
    assert calls == []
    assert not any(m.training for m in model.modules())


def test_no_warning_for_covered_models_even_under_no_grad() -> None:
    model = small_cnn()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        assert measure(model, cnn_data(), "cross_entropy").T > 0


def test_per_example_gradients_and_l1() -> None:
    torch.manual_seed(7)
    model = small_cnn().eval().double()
    x, y = cnn_data(5)
    x = x.double()
    grads = per_example_gradients(model, x, y, "cross_entropy")
    stats = per_example_stats(model, x, y, "cross_entropy", engine="loop")
    for name, g in grads.items():
        assert g.shape == (5, *dict(model.named_parameters())[name].shape)
        torch.testing.assert_close(g.reshape(5, -1).square().sum(1), stats.sq_norms[name])
        torch.testing.assert_close(g.sum(0), stats.grad_sum[name])
    l1, l2 = per_example_l1_l2(model, x, y, "cross_entropy")
    flat = torch.cat([g.reshape(5, -1) for g in grads.values()], dim=1)
    torch.testing.assert_close(l1, flat.abs().sum(1))
    torch.testing.assert_close(l2, stats.total_sq_norms.sqrt())


def test_zero_gradient_gives_non_finite_diversity_as_none() -> None:
    model = nn.Linear(3, 1, bias=False)
    nn.init.zeros_(model.weight)
    report = measure(model, (torch.randn(4, 3), torch.zeros(4, 1)), "mse")
    assert report.T == 0 and math.isnan(report.diversity)
    assert json.loads(report.to_json())["diversity"] is None


def test_sparse_embedding_under_every_engine() -> None:
    torch.manual_seed(8)
    model = nn.Sequential(nn.Embedding(5, 3, sparse=True), nn.Flatten(), nn.Linear(6, 2)).double()
    idx, y = torch.randint(0, 5, (6, 2)), torch.randint(0, 2, (6,))
    ref = per_example_stats(model, idx, y, "cross_entropy", engine="loop")
    for engine in ("hooks", "vmap"):
        got = per_example_stats(model, idx, y, "cross_entropy", engine=engine)
        for name in ref.sq_norms:
            torch.testing.assert_close(got.sq_norms[name], ref.sq_norms[name])
            torch.testing.assert_close(got.grad_sum[name], ref.grad_sum[name])
    assert model[0].sparse


def test_prepared_stats_match_the_per_example_loop_across_calls():
    """The plan made once stays right as the weights change and BatchNorm's mode flips."""
    torch.manual_seed(0)
    model = small_cnn().double().eval()
    x, y = cnn_data()
    x = x.double()
    prepared = PreparedStats(model, "cross_entropy", engine="hooks")
    for _ in range(3):
        fast = prepared(x, y)
        slow = per_example_stats(model, x, y, "cross_entropy", engine="loop")
        assert torch.allclose(fast.total_sq_norms, slow.total_sq_norms, rtol=1e-10)
        for name in slow.grad_sum:
            assert torch.allclose(fast.grad_sum[name], slow.grad_sum[name], rtol=1e-10)
        with torch.no_grad():  # a training step's worth of change
            for p in model.parameters():
                p.add_(0.1 * torch.randn_like(p))
    model.train()  # BatchNorm now uses batch statistics: refused on the next call
    with pytest.raises(BatchboundError, match="batch statistics"):
        prepared(x, y)


def test_a_model_is_checked_once_across_measure_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe and the loop check run on the first call only, also with a callable loss
    (resolve_loss wraps it anew every call), and again once the structure changes."""
    import batchbound.diversity.prepared as prepared

    checks = []
    real = prepared.check_rows
    monkeypatch.setattr(prepared, "check_rows", lambda *a, **k: checks.append(1) or real(*a, **k))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, target, reduction="none")

    first = measure(model, (x, y), loss, chunk_size=4)
    second = measure(model, (x, y), loss, chunk_size=4)
    assert len(checks) == 1 and second.S == first.S
    model[2] = nn.Linear(4, 3)
    measure(model, (x, y), loss, chunk_size=4)
    assert len(checks) == 2
