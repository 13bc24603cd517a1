"""MicroBatchNorms's fused way (references in the hooks, one multi-tensor norm at the end of
each backward pass) against its exact per-parameter way and a float64 reference built from
each micro-batch's own gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from batchbound.integrations import common
from batchbound.integrations.common import MicroBatchNorms


class Net(nn.Module):
    """LayerNorm, linears and a branch used only by some micro-batches (``.grad`` of its
    parameters is still None when they first get a gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)
        self.late = nn.Linear(8, 3)
        self.use_late = False
        self.reentrant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.a(x)))
        h = checkpoint(self.b, h, use_reentrant=True) if self.reentrant else self.b(h)
        return h + self.late(h.new_ones(h.shape[0], 8)) if self.use_late else h


def batches(k: int, sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(k)
    return [(torch.randn(b, 6, generator=g), torch.randint(0, 3, (b,), generator=g))
            for b in sizes]


def run_step(model: Net, probe: MicroBatchNorms, data: list, late_from: int = 99) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    k = len(data)
    for j, (x, y) in enumerate(data):
        model.use_late = j >= late_from
        probe.start(float(x.shape[0]), 1.0)
        (nn.functional.cross_entropy(model(x), y) / k).backward()
        probe.stop()
    return probe.record(1.0 / k, 1.0)


def reference(model: Net, data: list, late_from: int = 99) -> list[float]:
    """Each micro-batch's mean gradient G_j on its own, in float64, and their sum."""
    model = copy.deepcopy(model).double()
    model.reentrant = False  # the same function; autograd.grad cannot run reentrant checkpoints
    grads = []
    for j, (x, y) in enumerate(data):
        model.use_late = j >= late_from
        loss = nn.functional.cross_entropy(model(x.double()), y)
        ps = list(model.parameters())
        g = torch.autograd.grad(loss, ps, allow_unused=True)
        grads.append(torch.cat([(torch.zeros_like(p) if t is None else t).reshape(-1)
                                for p, t in zip(ps, g, strict=True)]))
    k = len(data)
    sizes = [x.shape[0] for x, _ in data]
    small = sum(float(g.square().sum()) for g in grads) / k
    big = float(torch.stack(grads).mean(dim=0).square().sum())
    harmonic = k / sum(1.0 / b for b in sizes)
    effective = k**2 / sum(1.0 / b for b in sizes)
    return [small, harmonic, big, effective]


@pytest.mark.parametrize("late_from", [99, 1])
def test_fused_equals_exact_and_the_float64_reference(late_from: int) -> None:
    torch.manual_seed(0)
    model = Net().double()
    other = copy.deepcopy(model)
    data = [(x.double(), y) for x, y in batches(3, [5, 7, 4])]
    fused = run_step(model, MicroBatchNorms(model.parameters()), data, late_from)
    exact = run_step(other, MicroBatchNorms(other.parameters(), fused=False), data, late_from)
    assert torch.allclose(fused, exact, rtol=1e-12, atol=0)
    assert fused.tolist() == pytest.approx(reference(model, data, late_from), rel=1e-12)


def test_float32_model_agrees_with_the_float64_reference() -> None:
    torch.manual_seed(1)
    model = Net()
    data = batches(4, [6, 6])
    row = run_step(model, MicroBatchNorms(model.parameters()), data)
    assert row.dtype == torch.float64
    assert row.tolist() == pytest.approx(reference(model, data), rel=1e-5)


def test_early_reduction_of_held_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "STASH_BYTES", 64)  # every few held gradients reduced early
    torch.manual_seed(2)
    model = Net().double()
    data = [(x.double(), y) for x, y in batches(5, [3, 4, 5])]
    row = run_step(model, MicroBatchNorms(model.parameters()), data)
    assert row.tolist() == pytest.approx(reference(model, data), rel=1e-12)


def test_nested_backward_drops_the_step_and_goes_the_exact_way() -> None:
    torch.manual_seed(3)
    model = Net().double()
    model.reentrant = True  # the checkpointed layer's backward runs inside the outer one
    probe = MicroBatchNorms(model.parameters())
    data = [(x.double(), y) for x, y in batches(6, [4, 4])]
    assert run_step(model, probe, data) is None and not probe.fused
    row = run_step(model, probe, data)  # the next step, the exact way
    assert row.tolist() == pytest.approx(reference(model, data), rel=1e-12)


def test_a_backward_outside_the_step_is_ignored() -> None:
    model = Net().double()
    probe = MicroBatchNorms(model.parameters())
    model(torch.randn(2, 6, dtype=torch.float64)).sum().backward()  # no micro-batch open
    data = [(x.double(), y) for x, y in batches(7, [3, 5])]
    row = run_step(model, probe, data)
    assert row.tolist() == pytest.approx(reference(model, data), rel=1e-12)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("zeros", [False, True])
def test_gradients_kept_from_before_the_step_are_not_the_steps(fused: bool, zeros: bool) -> None:
    """The optimizer over the head only, its zero_grad leaving the trunk's .grad to grow
    (Lightning's "train the head" with the trunk still requiring grad): the trunk's A was read
    off .grad, 89 % off the bound through the Lightning callback. With zero_grad(set_to_none=
    False) the kept zeros change nothing. Each step equals the float64 reference, with one
    warning that names the kept parameters."""
    torch.manual_seed(4)
    model = Net().double()
    names = {id(p): name for name, p in model.named_parameters()}
    probe = MicroBatchNorms(model.parameters(), fused=fused, names=names)
    head = torch.optim.SGD(model.b.parameters(), lr=0.1)
    everything = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = everything if zeros else head
    with pytest.warns(UserWarning, match=r"a\.weight.*hold a gradient from before the step"):
        for step in range(3):
            optimizer.zero_grad(set_to_none=not zeros)
            data = [(x.double(), y) for x, y in batches(10 + step, [4, 6, 5])]
            expected = reference(model, data)
            k = len(data)
            for x, y in data:
                probe.start(float(x.shape[0]), 1.0)
                (nn.functional.cross_entropy(model(x), y) / k).backward()
                probe.stop()
            assert probe.record(1.0 / k, 1.0).tolist() == pytest.approx(expected, rel=1e-12)
            optimizer.step()


@pytest.mark.parametrize("kind", ["equal", "unequal", "tensors", "scaled"])
def test_step_row_matches_the_window_formulas(kind: str) -> None:
    from batchbound.integrations.common import Window, step_row

    micro = [torch.tensor(v, dtype=torch.float64) for v in (2.0, 3.0, 5.0)]
    sizes, weights = [4.0, 6.0, 5.0], [1.0, 1.0, 1.0]
    if kind in ("unequal", "tensors"):
        weights = list(sizes)
    constant, scale = (1 / 3, 1.0) if kind != "scaled" else (0.25, torch.tensor(1024.0))
    window = Window()
    for b, w in zip(sizes, weights, strict=True):
        window.add(torch.tensor(b, dtype=torch.float64) if kind == "tensors" else b,
                   torch.tensor(w, dtype=torch.float64) if kind == "tensors" else w)
    total = torch.tensor(17.0, dtype=torch.float64)
    row = step_row(micro, total, window, constant, scale).tolist()
    s_c = float(scale) * constant
    small = sum(float(m) / w**2 for m, w in zip(micro, weights, strict=True)) / (3 * s_c**2)
    big = 17.0 / (sum(weights) * s_c) ** 2
    harmonic = 3 / sum(1 / b for b in sizes)
    effective = sum(weights) ** 2 / sum(w * w / b for w, b in zip(weights, sizes, strict=True))
    assert row == pytest.approx([small, harmonic, big, effective], rel=1e-14)


def _extra_ops(layers: int, fused: bool) -> int:
    """Outermost aten ops the probe adds to a step of 2 micro-batches on ``layers`` Linears."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    data = batches(8, [3, 3])

    def step(probe: MicroBatchNorms | None) -> None:
        model.zero_grad(set_to_none=True)
        for x, _ in data:
            x = x[:, :4]
            if probe is not None:
                probe.start(3.0, 1.0)
            (model(x).square().mean() / 2).backward()
            if probe is not None:
                probe.stop()
        if probe is not None:
            probe.record(0.5, 1.0)

    def count(probe: MicroBatchNorms | None) -> int:
        step(probe)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(probe)
        n = 0
        for e in prof.events():
            parent = e.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            n += e.name.startswith("aten::") and parent is None
        return n

    probe = MicroBatchNorms(model.parameters(), fused=fused)
    with_probe = count(probe)
    probe.remove()
    return with_probe - count(None)


def test_the_fused_probe_costs_the_same_ops_whatever_the_parameter_count() -> None:
    few, many = _extra_ops(4, fused=True), _extra_ops(16, fused=True)
    assert few == many  # one multi-tensor norm per micro-batch, not one per parameter
    assert _extra_ops(16, fused=False) - _extra_ops(4, fused=False) >= 2 * 2 * 12  # the slow way
