"""The integrations' shared pieces without any framework: the micro-batch norms against a
brute-force accumulation loop (mean and sum losses, unequal micro-batches, a loss scale),
non-finite steps left out, the metric names, and imports that stay optional."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError
from batchbound.integrations.common import (
    MicroBatchNorms,
    MissingExtraError,
    StepRecords,
    diversity_metrics,
    require,
)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=2, max_size=4),
       reduction=st.sampled_from(["mean", "sum"]), scale=st.sampled_from([1.0, 2.0**7]),
       seed=st.integers(0, 1000))
def test_micro_batch_norms_match_brute_force_accumulation(sizes, reduction, scale, seed) -> None:
    net = model()
    params = list(net.parameters())
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(b, 4, generator=g, dtype=torch.float64),
                torch.randint(0, 2, (b,), generator=g)) for b in sizes]
    k = len(sizes)
    norms = MicroBatchNorms(params)
    # the framework's accumulation: each micro-batch's loss / k, times the AMP scale
    for x, y in batches:
        norms.start(float(len(y)), 1.0 if reduction == "mean" else float(len(y)))
        (scale * F.cross_entropy(net(x), y, reduction=reduction) / k).backward()
        norms.stop()
    row = norms.record(1.0 / k, scale).tolist()
    norms.remove()
    # brute force: every micro-batch's mean gradient, and the accumulated .grad itself
    means = [torch.cat([t.reshape(-1) for t in torch.autograd.grad(
        F.cross_entropy(net(x), y), params)]) for x, y in batches]
    accumulated = torch.cat([p.grad.reshape(-1) for p in params]) / scale
    weights = [1.0 if reduction == "mean" else float(b) for b in sizes]
    small = sum(float(m.square().sum()) for m in means) / k
    big = accumulated * k / sum(weights)  # the weighted mean of the examples' gradients
    assert row[0] == pytest.approx(small, rel=1e-10)
    assert row[1] == pytest.approx(k / sum(1 / b for b in sizes), rel=1e-12)
    assert row[2] == pytest.approx(float(big.square().sum()), rel=1e-9)
    assert row[3] == pytest.approx(sum(weights) ** 2 / sum(w * w / b for w, b in
                                                           zip(weights, sizes, strict=True)))


def test_micro_batch_norms_need_two_micro_batches_and_ignores_outside_backward() -> None:
    net = model()
    norms = MicroBatchNorms(net.parameters())
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.tensor([0, 1, 0])
    F.cross_entropy(net(x), y).backward()  # no micro-batch open: not seen
    norms.start(3.0, 1.0)
    F.cross_entropy(net(x), y).backward()
    assert norms.record(1.0, 1.0) is None  # one micro-batch: no small/big pair
    norms.remove()


def test_records_skip_non_finite_steps() -> None:
    records = StepRecords(OnlineDiversity(100, decay=None))
    records.add(torch.tensor([2.0, 4.0, 1.0, 8.0]))
    records.add(torch.tensor([math.inf, 4.0, 1.0, 8.0]))  # an AMP overflow step
    records.add(torch.tensor([3.0, 4.0, 1.5, 8.0]))
    monitor = records.fold()
    assert monitor.steps == 2 and records.skipped == 1


def test_metric_names() -> None:
    assert diversity_metrics(OnlineDiversity(10)) == {}
    monitor = OnlineDiversity(10, decay=None)
    monitor.update_two_batch(2.0, 4, 1.0, 8)
    assert set(diversity_metrics(monitor)) == {  # one step: no SE yet
        "gradient_diversity/batch_bound", "gradient_diversity/noise_scale",
        "gradient_diversity/diversity"}
    monitor.update_two_batch(2.5, 4, 1.1, 8)
    metrics = diversity_metrics(monitor)
    assert metrics["gradient_diversity/noise_scale_se"] == metrics[
        "gradient_diversity/batch_bound_se"]
    assert metrics["gradient_diversity/diversity_se"] == pytest.approx(
        metrics["gradient_diversity/batch_bound_se"] / 10)
    unknown_n = OnlineDiversity(None, decay=None)
    unknown_n.update_two_batch(2.0, 4, 1.0, 8)
    assert "gradient_diversity/diversity" not in diversity_metrics(unknown_n)


def test_importing_batchbound_does_not_import_frameworks() -> None:
    code = ("import sys, batchbound, batchbound.integrations, batchbound.integrations.ddp, "
            "batchbound.integrations.common, batchbound.diversity, batchbound.train\n"
            "loaded = {m.split('.')[0] for m in sys.modules}\n"
            "print(sorted(loaded & {'lightning', 'pytorch_lightning', 'transformers', "
            "'accelerate', 'tensorboard'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("module", "framework", "extra"), [
    ("batchbound.integrations.lightning", "lightning", "lightning"),
    ("batchbound.integrations.transformers", "transformers", "hf"),
])
def test_missing_framework_names_the_extra(monkeypatch, module, framework, extra) -> None:
    for name in list(sys.modules):
        if name == framework or name.startswith(framework + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, framework, None)  # import → ModuleNotFoundError
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=rf"pip install 'batchbound\[{extra}\]'") as info:
        __import__(module)
    assert isinstance(info.value, BatchboundError)


def test_require_reports_a_broken_dependency(tmp_path, monkeypatch) -> None:
    (tmp_path / "brokenpkg_bb.py").write_text("raise RuntimeError('operator x does not exist')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingExtraError, match="importing brokenpkg_bb failed"):
        require("brokenpkg_bb", "lightning")
