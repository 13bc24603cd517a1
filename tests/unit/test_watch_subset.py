"""``watch(subset="norms")``: the LayerNorm/RMSNorm parameters' own n·Δ, exactly, against the
per-example statistics of the whole model restricted to those parameters (float64)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.diversity import OnlineDiversity, per_example_stats, watch
from batchbound.diversity.subsets import monitored_parameters, norm_layer_modules
from batchbound.errors import BatchboundError


def model_with_norms() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 8),
                         nn.RMSNorm(8), nn.Linear(8, 3)).double()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_norms_subset_is_exact_for_those_parameters(reduction: str) -> None:
    model = model_with_norms()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,),
                                                                               generator=g)
    exact = per_example_stats(copy.deepcopy(model), x, y, "cross_entropy")
    names = ["1.weight", "1.bias", "4.weight"]
    assert list(monitored_parameters(model, "norms")) == names
    S = sum(float(exact.sq_norms[k].sum()) for k in names)
    T = sum(float(exact.grad_sum[k].square().sum()) for k in names)
    expected = OnlineDiversity(100, decay=0.0)
    expected.update_from_norms(S, T, 12)
    monitor = OnlineDiversity(100, decay=0.0)
    with watch(model, monitor, reduction=reduction, subset="norms"):
        nn.functional.cross_entropy(model(x), y, reduction=reduction).backward()
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-10)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-8)
    # the whole model's gradients are the user's own, untouched
    scale = 1 / 12 if reduction == "mean" else 1.0
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, scale * exact.grad_sum[name], rtol=1e-12)


def test_a_model_without_norm_layers_is_refused() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    assert norm_layer_modules(model) == []
    with pytest.raises(BatchboundError, match="no trainable ones"):
        monitored_parameters(model, "norms")
    with pytest.raises(BatchboundError, match="unknown parameter subset"):
        monitored_parameters(model, "layers")


class LayerNorm(nn.Module):
    """ LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False """

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class ArithmeticLayerNorm(nn.Module):
    """A LayerNorm written out in its arithmetic, as some GPT-2 tutorials do."""

    def __init__(self, ndim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=-1, keepdim=True)
        var = x.var(dim=-1, keepdim=True, unbiased=False)
        return (x - mean) / torch.sqrt(var + 1e-5) * self.weight + self.bias


class CastingLayerNorm(nn.LayerNorm):
    """A library's LayerNorm subclass whose forward casts back to the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(x.dtype)


@pytest.mark.parametrize("norm", [ArithmeticLayerNorm, CastingLayerNorm])
def test_a_norm_layer_the_subset_cannot_read_is_refused_not_left_out(norm: type) -> None:
    """Beside one the subset reads, a norm no rule takes: its n·Δ left them out before
    (a library's LayerNorm subclass: 41 % low, in an outside review)."""
    model = nn.Sequential(nn.Linear(5, 8), norm(8), nn.Tanh(), nn.Linear(8, 8), nn.LayerNorm(8),
                          nn.Linear(8, 3))
    with pytest.raises(BatchboundError, match=rf"1 of Sequential's normalisation layers have "
                                              rf"none: 1 \({norm.__name__}\).*subset='all'"):
        monitored_parameters(model, "norms")
    assert list(monitored_parameters(model, "all")) == [k for k, _ in model.named_parameters()]


@pytest.mark.parametrize("bias", [True, False])
def test_nanogpts_layer_norm_pasted_into_a_users_file_is_read_exactly(bias: bool) -> None:
    """nanoGPT's LayerNorm as its model.py writes it (``LayerNorm`` above, this file's own):
    found by its code, read by the norms' rule; it was left out of the subset before (the
    subset's n·Δ 12 % low beside an nn.LayerNorm in an outside review)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), LayerNorm(8, bias), nn.Tanh(), nn.Linear(8, 8),
                          nn.LayerNorm(8), nn.Linear(8, 3)).double()
    with torch.no_grad():
        model[1].weight.normal_()
    names = ["1.weight", *(["1.bias"] if bias else []), "4.weight", "4.bias"]
    assert list(monitored_parameters(model, "norms")) == names
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (12,), generator=g)
    exact = per_example_stats(copy.deepcopy(model), x, y, "cross_entropy", engine="loop")
    expected = OnlineDiversity(100, decay=0.0)
    expected.update_from_norms(sum(float(exact.sq_norms[k].sum()) for k in names),
                               sum(float(exact.grad_sum[k].square().sum()) for k in names), 12)
    monitor = OnlineDiversity(100, decay=0.0)
    with watch(model, monitor, subset="norms"):
        F.cross_entropy(model(x), y).backward()
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-10)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-8)


def test_a_frozen_norm_layer_is_not_asked_for() -> None:
    model = nn.Sequential(nn.Linear(5, 8), ArithmeticLayerNorm(8).requires_grad_(False),
                          nn.Linear(8, 8), nn.LayerNorm(8))
    assert list(monitored_parameters(model, "norms")) == ["3.weight", "3.bias"]


def test_a_backward_that_misses_the_subset_says_so() -> None:
    """The norm's output unused by the loss: no backward reaches what the subset reads."""

    class Aside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.norm = nn.Linear(4, 3), nn.LayerNorm(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.norm(x)  # computed, never used
            return self.fc(x)

    model = Aside().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    with (pytest.raises(BatchboundError, match="no backward pass through the parameters "
                                               "subset='norms' reads"),
          watch(model, OnlineDiversity(100), subset="norms")):
        nn.functional.cross_entropy(model(x), y).backward()


def test_alternating_subsets_check_the_model_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """watch(subset="all") and watch(subset="norms") on one model keep a plan each: the probe
    (two batch sizes and the per-example loop) runs once per subset, not on every switch, and
    both monitors stay exact."""
    from batchbound.diversity import steps

    probes = []
    real = steps.probe_layout
    monkeypatch.setattr(steps, "probe_layout", lambda *a, **k: probes.append(1) or real(*a, **k))
    model = model_with_norms()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,),
                                                                              generator=g)
    exact = per_example_stats(copy.deepcopy(model), x, y, "cross_entropy")
    monitors = {"all": OnlineDiversity(decay=0.0), "norms": OnlineDiversity(decay=0.0)}
    for subset in ["all", "norms"] * 3:
        model.zero_grad(set_to_none=True)
        with watch(model, monitors[subset], reduction="sum", subset=subset):
            nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    assert len(probes) == 2
    assert monitors["all"].m2 == pytest.approx(exact.S / 6, rel=1e-10)
    names = list(monitored_parameters(model, "norms"))
    S = sum(float(exact.sq_norms[k].sum()) for k in names)
    assert monitors["norms"].m2 == pytest.approx(S / 6, rel=1e-10)


def test_rules_read_the_forwards_own_tensors_without_building_graphs() -> None:
    """The recorded call arguments are the forward's own tensors (not detached copies): the
    rules run under no_grad, so a backward with create_graph (which runs hooks with grad
    enabled) still gives exact norms, and nothing the monitor keeps carries a graph."""
    model = model_with_norms()
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(7, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (7,),
                                                                              generator=g)
    exact = per_example_stats(copy.deepcopy(model), x, y, "cross_entropy")
    monitor = OnlineDiversity(decay=0.0)
    with watch(model, monitor, reduction="sum"):
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward(create_graph=True)
    assert all(not row.requires_grad and (flag is None or not flag.requires_grad)
               for row, _, flag in monitor._deferred)
    assert monitor.m2 == pytest.approx(exact.S / 7, rel=1e-10)
    assert monitor.cross == pytest.approx((exact.T - exact.S) / (7 * 6), rel=1e-8)
    model.zero_grad(set_to_none=True)  # the create_graph .grad fields hold a graph
