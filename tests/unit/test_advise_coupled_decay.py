"""Coupled L2 weight decay in advise's noise scale: SGD's and Adam's weight_decay step on
g + λθ, the same λθ for every example, so it moves the mean gradient G (|G|², GᵀPG) and not
Σ. The pilot's estimate takes the gradient the optimiser steps on."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batchbound.advise.pilot as pilot_module
from batchbound.advise.pilot import run_pilot
from batchbound.data import load_dataset
from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Parts
from batchbound.train.monitor import OnlineMonitor
from batchbound.train.optimizers import coupled_decay

F64 = torch.float64


@pytest.mark.parametrize(("make", "coupled"), [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), True),
    (lambda p: torch.optim.Adam(p, lr=1e-3), True),
    (lambda p: torch.optim.RMSprop(p, lr=1e-3), True),
    (lambda p: torch.optim.Adagrad(p, lr=1e-2), True),
    (lambda p: torch.optim.AdamW(p, lr=1e-3), False),
    (lambda p: torch.optim.Adam(p, lr=1e-3, decoupled_weight_decay=True), False),
    (lambda p: torch.optim.Rprop(p, lr=1e-2), False),  # no weight_decay setting
])
def test_coupled_decay_is_read_off_the_steps(make, coupled: bool) -> None:
    assert coupled_decay(make) is coupled


def _loop_estimator(mode: str, per_example: list[list[torch.Tensor]], shift: list[torch.Tensor],
                    weights, micro: int) -> OnlineDiversity:
    """The reference in float64: the estimator fed from the per-example gradients the
    optimiser uses, g_i + s, one example at a time."""
    used = [[g + s for g, s in zip(example, shift, strict=True)] for example in per_example]

    def sq(tensors):
        return sum(float(((w if w is not None else 1.0) * t.square()).sum())
                   for t, w in zip(tensors, weights or [None] * len(tensors), strict=True))

    def mean(rows):
        return [sum(r[k] for r in rows) / len(rows) for k in range(len(rows[0]))]

    estimator = OnlineDiversity(n=1000, sampling="without_replacement")
    batch = len(used)
    if mode == "norms":
        total = [sum(r[k] for r in used) for k in range(len(used[0]))]
        estimator.update_from_norms(sum(sq(r) for r in used), sq(total), batch)
    else:
        smalls = [used[i:i + micro] for i in range(0, batch, micro)]
        small_sq = sum(sq(mean(rows)) for rows in smalls) / len(smalls)
        estimator.update_two_batch(small_sq, micro, sq(mean(used)), batch)
    return estimator


@pytest.mark.parametrize("mode", ["two_batch", "norms"])
@pytest.mark.parametrize("convention", ["mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])  # Adam's metric: Σ w·t²
def test_the_monitor_takes_the_shift_as_a_float64_loop_does(mode, convention, weighted) -> None:
    if mode == "norms" and weighted:
        pytest.skip("only the two-batch estimate is weighted (the pilot's Adam metric)")
    g = torch.Generator().manual_seed(3)
    batch, micro, decay = 8, 4, 0.3
    shapes = [(3, 2), (5,)]
    per_example = [[torch.randn(s, generator=g, dtype=F64) for s in shapes]
                   for _ in range(batch)]
    theta = [torch.randn(s, generator=g, dtype=F64) for s in shapes]
    weights = [torch.rand(s, generator=g, dtype=F64) for s in shapes] if weighted else None
    scale = 1.0 / batch if convention == "mean" else 1.0
    shift = [decay * t / (scale * batch) for t in theta]  # as the pilot sets it

    monitor = OnlineMonitor(mode, 1000, DistContext(), micro_batch=micro)
    monitor.weights, monitor.shift = weights, list(shift)
    extras = [0.0]
    if mode == "two_batch":
        extras = [sum(monitor.small_batch_sq(
            [scale * sum(e[k] for e in per_example[i:i + micro]) for k in range(len(shapes))],
            scale, micro) for i in range(0, batch, micro))]
    else:
        extras = [sum(float(sum(t.square().sum() for t in e)) for e in per_example)]
    grads = [scale * sum(e[k] for e in per_example) for k in range(len(shapes))]
    monitor.update(grads, scale, extras, batch)
    expected = _loop_estimator(mode, per_example, shift, weights, micro)
    assert monitor.estimator.diversity == pytest.approx(expected.diversity, rel=1e-12)
    # and the shift matters: without it the estimate is another number
    plain = _loop_estimator(mode, per_example, [0 * s for s in shift], weights, micro)
    assert abs(plain.diversity / expected.diversity - 1) > 1e-3


class WithL2(nn.Module):
    """The inner model's logits, and λ/2·‖θ‖² in a last column: a loss that adds it to every
    example's cross entropy has per-example gradients g_i + λθ, what SGD's coupled decay
    steps on."""

    def __init__(self, inner: nn.Module, decay: float) -> None:
        super().__init__()
        self.inner, self.decay = inner, decay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        penalty = 0.5 * self.decay * sum(p.square().sum() for p in self.inner.parameters())
        return torch.cat([out, penalty.expand(len(out), 1)], dim=1)


def _with_penalty(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[:, :-1], y, reduction="none") + out[:, -1]


@pytest.mark.filterwarnings("ignore:batchbound. computing exact per-example")
@pytest.mark.parametrize(("optimizer", "lr", "estimator"), [
    (torch.optim.SGD, 0.1, "two_batch"), (torch.optim.SGD, 0.1, "norms"),
    (torch.optim.Adam, 3e-3, "two_batch")])  # Adam: GᵀPG in its metric, v̂ of g + λθ
def test_a_coupled_decay_gives_the_noise_scale_of_the_loss_with_its_l2_term(
        optimizer, lr: float, estimator: str) -> None:
    """An optimiser with weight_decay λ on the loss and the same without it on the loss
    plus λ/2‖θ‖² per example take the same steps; their pilots must give the same noise
    scale."""
    decay = 0.05
    data = load_dataset("digits")
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)).double()
    config = TrainConfig(dataset="digits", model="fc", batch_size=16, lr=lr, dtype="float64")
    adam = optimizer is torch.optim.Adam

    def pilot(model: nn.Module, weight_decay: float, loss=None):
        made = run_pilot(config, data, torch.device("cpu"), iterations=30, estimator=estimator,
                         precondition=adam, parts=Parts(
                             model=model, loss=loss, optimizer=lambda p: optimizer(
                                 p, lr=lr, weight_decay=weight_decay)))
        assert made.metric == ("adam" if adam else "euclidean")
        return made.segments

    decayed = pilot(copy.deepcopy(inner), decay)
    penalised = pilot(WithL2(copy.deepcopy(inner), decay), 0.0, _with_penalty)
    assert len(decayed) == len(penalised) > 0
    for a, b in zip(decayed, penalised, strict=True):
        assert a.noise == pytest.approx(b.noise, rel=1e-8)
    # the loss's gradient alone gives another noise scale
    original = pilot_module.coupled_decays
    try:
        pilot_module.coupled_decays = lambda trainer: None
        blind = pilot(copy.deepcopy(inner), decay)
    finally:
        pilot_module.coupled_decays = original
    assert abs(blind[-1].noise / decayed[-1].noise - 1) > 1e-3


def test_the_exact_estimator_refuses_a_coupled_decay() -> None:
    config = TrainConfig(dataset="digits", model="fc(depth=1,params=800)", batch_size=16,
                         lr=0.1, weight_decay=0.01)
    with pytest.raises(BatchboundError, match="coupled weight decay"):
        run_pilot(config, load_dataset("digits"), torch.device("cpu"), iterations=10,
                  estimator="exact")
    # AdamW's decoupled decay is not in the gradient: nothing to refuse
    run_pilot(config.replace(optimizer="adamw", lr=1e-3), load_dataset("digits"),
              torch.device("cpu"), iterations=10, estimator="exact", exact_every_epochs=0.1)


class MatricesL2(WithL2):
    """λ/2·‖W‖² over the matrices alone: nanoGPT's decay groups."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        penalty = 0.5 * self.decay * sum(p.square().sum() for p in self.inner.parameters()
                                         if p.dim() >= 2)
        return torch.cat([out, penalty.expand(len(out), 1)], dim=1)


def test_decay_groups_take_each_parameters_own_decay() -> None:
    decay, lr = 0.05, 0.1
    data = load_dataset("digits")
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)).double()
    config = TrainConfig(dataset="digits", model="fc", batch_size=16, lr=lr, dtype="float64")

    def groups(params):
        return torch.optim.SGD([{"params": [p for p in params if p.dim() >= 2],
                                 "weight_decay": decay},
                                {"params": [p for p in params if p.dim() < 2],
                                 "weight_decay": 0.0}], lr=lr)

    decayed = run_pilot(config, data, torch.device("cpu"), iterations=30,
                        parts=Parts(model=copy.deepcopy(inner), optimizer=groups)).segments
    penalised = run_pilot(config, data, torch.device("cpu"), iterations=30, parts=Parts(
        model=MatricesL2(copy.deepcopy(inner), decay), loss=_with_penalty,
        optimizer=lambda p: torch.optim.SGD(p, lr=lr))).segments
    assert len(decayed) == len(penalised) > 0
    for a, b in zip(decayed, penalised, strict=True):
        assert a.noise == pytest.approx(b.noise, rel=1e-8)


class SummedL2(WithL2):
    """λ/(2B)·‖θ‖² per example: under the ``sum`` convention the batch's loss sums B of
    them, λ/2‖θ‖², whose gradient λθ is what SGD's coupled decay adds to Σ∇ℓ_i."""

    def __init__(self, inner: nn.Module, decay: float, batch: int) -> None:
        super().__init__(inner, decay / batch)


@pytest.mark.filterwarnings("ignore:batchbound. computing exact per-example")
@pytest.mark.parametrize("estimator", ["two_batch", "norms"])
def test_under_the_sum_convention_the_decay_is_spread_over_the_batch(estimator: str) -> None:
    """convention='sum' steps on Σg_i + λθ: per example g_i + λθ/B, the noise scale of the
    summed loss plus λ/2‖θ‖² (the shift λθ/B, not λθ)."""
    decay, lr, batch = 0.05, 0.005, 16
    data = load_dataset("digits")
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(64, 16), nn.Tanh(), nn.Linear(16, 10)).double()
    config = TrainConfig(dataset="digits", model="fc", batch_size=batch, lr=lr,
                         dtype="float64", convention="sum")

    def pilot(model: nn.Module, weight_decay: float, loss=None):
        return run_pilot(config, data, torch.device("cpu"), iterations=30, estimator=estimator,
                         parts=Parts(model=model, loss=loss, optimizer=lambda p: torch.optim.SGD(
                             p, lr=lr, weight_decay=weight_decay))).segments

    decayed = pilot(copy.deepcopy(inner), decay)
    penalised = pilot(SummedL2(copy.deepcopy(inner), decay, batch), 0.0, _with_penalty)
    assert len(decayed) == len(penalised) > 0
    for a, b in zip(decayed, penalised, strict=True):
        assert a.noise == pytest.approx(b.noise, rel=1e-8)
