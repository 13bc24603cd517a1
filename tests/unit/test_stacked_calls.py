"""Small calls of like layers run as one call over their examples stacked (stacking.py):
the norms equal the float64 per-example loop's, under ``watch`` and under the hooks engine,
with one rule call per stack; modules the rule would read differently (another eps) and
parameters that need cross terms (a tied weight) are never stacked."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.support.reference import assert_exact, feature_loss, feature_targets
from torch import Tensor, nn
from training_models import loop_S_T

from batchbound.diversity import OnlineDiversity, hooks, watch


class Blocks(nn.Module):
    """Residual blocks of one width (a LayerNorm and a Linear layer each), and a head."""

    def __init__(self, eps: tuple[float, ...] = (1e-5, 1e-5, 1e-5), tied: bool = False,
                 leak: bool = False) -> None:
        super().__init__()
        self.leak = leak  # norms.1.weight also used outside its call: the fallback's
        self.norms = nn.ModuleList(nn.LayerNorm(8, eps=e) for e in eps)
        self.fcs = nn.ModuleList(nn.Linear(8, 8) for _ in eps)
        if tied:  # one weight in every block: its norms need the cross terms
            for fc in self.fcs[1:]:
                fc.weight = self.fcs[0].weight
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        for norm, fc in zip(self.norms, self.fcs, strict=True):
            x = x + torch.tanh(fc(norm(x)))
        out = self.head(x)
        return out * self.norms[1].weight[0] if self.leak else out


@pytest.fixture
def stacks(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The modules of every stack that ran, one list per stack."""
    seen: list[list[str]] = []
    run = hooks.HooksPass._run_stack

    def recorded(self: hooks.HooksPass, calls: list) -> None:
        seen.append([call.prefix for call in calls])
        run(self, calls)

    monkeypatch.setattr(hooks.HooksPass, "_run_stack", recorded)
    return seen


def watched(model: nn.Module, x: Tensor, y: Tensor) -> tuple[OnlineDiversity, OnlineDiversity]:
    """(watch's monitor, the float64 loop's) for the summed ``feature_loss``."""
    S, T = loop_S_T(copy.deepcopy(model), (x,), {},
                    lambda out, i: feature_loss(out, y[i : i + 1]).sum(), x.shape[0])
    monitor, expected = OnlineDiversity(1000, decay=0.0), OnlineDiversity(1000, decay=0.0)
    with watch(model, monitor, reduction="sum"):
        feature_loss(model(x), y).sum().backward()
    expected.update_from_norms(S, T, x.shape[0])
    return monitor, expected


@pytest.mark.parametrize("step", [1, 2])  # the first watched step checks the model
def test_watch_stacks_like_layers_exactly(step: int, stacks: list[list[str]]) -> None:
    torch.manual_seed(0)
    model = Blocks().double()
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    y = feature_targets(model, x)
    for _ in range(step):
        stacks.clear()
        model.zero_grad()
        monitor, expected = watched(model, x, y)
        assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
        assert monitor.cross == pytest.approx(expected.cross, rel=1e-9, abs=1e-9 * expected.m2)
    # the watched pass's (after, on the first step, the check's own)
    assert sorted(map(sorted, stacks[-2:])) == [["fcs.0", "fcs.1", "fcs.2"],
                                                ["norms.0", "norms.1", "norms.2"]]


def test_the_hooks_engine_stacks_norms_exactly(stacks: list[list[str]]) -> None:
    """Under per_example_stats every parameter's own norms, each from its stack's rows; the
    Linear layers, whose batch sums the rule gives there (``own_sums``), stack too, each
    adding its own rows' sum."""
    torch.manual_seed(1)
    model = Blocks()
    x = torch.randn(4, 5, 8)
    assert_exact(model, x, feature_targets(model.double(), x.double()), feature_loss,
                 engine="hooks")
    assert stacks and all(sorted(s) in (["fcs.0", "fcs.1", "fcs.2"],
                                        ["norms.0", "norms.1", "norms.2"]) for s in stacks)
    assert ["fcs.0", "fcs.1", "fcs.2"] in map(sorted, stacks)


def test_layers_the_rule_reads_differently_are_not_stacked(stacks: list[list[str]]) -> None:
    torch.manual_seed(2)
    model = Blocks(eps=(1e-5, 1e-1, 1e-5)).double()
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    monitor, expected = watched(model, x, feature_targets(model, x))
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
    assert ["norms.0", "norms.2"] in map(sorted, stacks)
    assert not any("norms.1" in s for s in stacks)


def test_a_tied_weight_is_not_stacked(stacks: list[list[str]]) -> None:
    torch.manual_seed(3)
    model = Blocks(tied=True).double()
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    monitor, expected = watched(model, x, feature_targets(model, x))
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-9, abs=1e-9 * expected.m2)
    assert not any(s[0].startswith("fcs") for s in stacks)


def test_held_gradients_stay_within_the_budget(stacks: list[list[str]],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``defer_budget`` numbers of held output gradients the held calls run at once:
    still exact, in smaller stacks (the backward meets a Linear and a LayerNorm by turns)."""
    monkeypatch.setattr(hooks, "DEFER_BUDGET", 4 * 4 * 5 * 8)  # four calls' gradients
    torch.manual_seed(4)
    model = Blocks(eps=(1e-5,) * 5).double()
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    monitor, expected = watched(model, x, feature_targets(model, x))
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
    assert stacks and max(map(len, stacks)) <= 2


def test_rows_nobody_asked_for_are_left_out(stacks: list[list[str]]) -> None:
    """A LayerNorm weight also used outside its call goes to the exact fallback: its rows
    in the stack are nobody's, and S counts that weight once, the fallback's."""
    torch.manual_seed(5)
    model = Blocks(leak=True).double()
    x = torch.randn(4, 5, 8, dtype=torch.float64)
    with pytest.warns(UserWarning, match="norms.1.weight"):
        monitor, expected = watched(model, x, feature_targets(model, x))
    assert monitor.m2 == pytest.approx(expected.m2, rel=1e-9)
    assert monitor.cross == pytest.approx(expected.cross, rel=1e-9, abs=1e-9 * expected.m2)
    assert ["norms.0", "norms.1", "norms.2"] in map(sorted, stacks)


def test_measure_stacks_like_linear_layers_exactly(stacks: list[list[str]]) -> None:
    """measure(): Linear layers of one shape, whose batch sums the rules add into the running
    sums themselves, run stacked, each adding its own rows' sum; the first (its input needs
    no gradient, so autograd is asked for its output's and its node never runs) is taken once.
    S, T and every parameter's S equal the float64 loop's, over several chunks."""
    from batchbound.diversity import measure

    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(20, 8, dtype=torch.float64), torch.randint(3, (20,))
    report = measure(model, (x, y), "cross_entropy", chunk_size=6)
    params = dict(model.named_parameters())
    per = dict.fromkeys(params, 0.0)
    total = {k: torch.zeros_like(p) for k, p in params.items()}
    for i in range(20):
        loss = nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        for k, g in zip(params, torch.autograd.grad(loss, list(params.values())),
                        strict=True):
            per[k] += float(g.square().sum())
            total[k] += g
    T = sum(float(t.square().sum()) for t in total.values())
    assert report.per_parameter_S == pytest.approx(per, rel=1e-10)
    assert pytest.approx((sum(per.values()), T), rel=1e-10) == (report.S, report.T)
    assert ["2", "4"] in map(sorted, stacks)


def test_calls_that_add_batch_sums_stack_only_when_small(stacks: list[list[str]],
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Past ``SUMS_STACK_NUMEL`` numbers a call whose rule adds its batch sum runs alone (the
    copies into the stack cost more there than they save, on CPU)."""
    from batchbound.diversity import measure, stacking

    monkeypatch.setattr(stacking, "SUMS_STACK_NUMEL", 6 * 8 - 1)  # below a chunk's 6 × 8
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(12, 8, dtype=torch.float64), torch.randint(3, (12,))
    measure(model, (x, y), "cross_entropy", chunk_size=6)
    assert not any("2" in s for s in stacks)
