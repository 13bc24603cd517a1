"""DiversityCallback on a real Lightning Trainer (CPU): with accumulate_grad_batches=2 the
logged numbers equal the two-batch estimate computed by hand from per-micro-batch gradients
(mean and sum losses, a short last window), they converge to the exact n·Δ of ``measure``
at fixed weights, a 2-rank ddp_spawn run logs them through its CSVLogger, and a run with
neither DDP nor accumulation is refused."""

from __future__ import annotations

import csv
import importlib.util
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from batchbound.diversity import measure
from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError

if importlib.util.find_spec("lightning") is None:
    pytest.skip("lightning is not installed (pip install 'batchbound[lightning]')",
                allow_module_level=True)
# installed but broken (e.g. a mismatched torchvision): this import fails, naming the cause
from spawn_exit import fit_tolerating_exit_abort

from batchbound.integrations import lightning as integration

L = integration.L
DiversityCallback = integration.DiversityCallback
MixedPrecision = L.plugins.MixedPrecision

KEYS = ("batch_bound", "batch_bound_se", "noise_scale", "noise_scale_se", "diversity",
        "diversity_se")


class Classifier(L.LightningModule):
    def __init__(self, d: int = 6, classes: int = 3, reduction: str = "mean") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(d, 5), nn.Tanh(), nn.Linear(5, classes))
        self.reduction = reduction

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y, reduction=self.reduction)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # fixed weights: Δ(w) is fixed


class HeadOnly(Classifier):
    """The optimizer over the head only, the trunk still requiring grad: Lightning's
    zero_grad leaves the trunk's .grad to grow step after step."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.net[2].parameters(), lr=0.0)


class Memory(L.loggers.Logger):
    """Keeps what is logged."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))


def data(n: int, d: int = 6, classes: int = 3, dtype=torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=g, dtype=dtype),
                         torch.randint(0, classes, (n,), generator=g))


def trainer(**kwargs) -> L.Trainer:
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(**{**defaults, **kwargs})


@pytest.mark.parametrize("reduction", ["mean", "sum", "amp", "head"])
def test_accumulation_matches_hand_two_batch(reduction: str) -> None:
    """``amp``: a mean loss under a GradScaler whose scale doubles every step (the model is
    float64, which CPU autocast leaves alone, so only the scaling differs). ``head``: a mean
    loss, the optimizer over the head only (the trunk's growing .grad was read as the step's:
    the bound 89 % off)."""
    n, micro, k = 60, 8, 2  # 8 micro-batches per epoch, the last of 4 examples
    dataset = data(n)
    amp, head = reduction == "amp", reduction == "head"
    reduction = "mean" if amp or head else reduction
    model = (HeadOnly if head else Classifier)(reduction=reduction)
    memory = Memory()
    callback = DiversityCallback(every=1, reduction=reduction, decay=None)
    if amp:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
        options = dict(plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
        model = model.double()
    else:
        options = dict(precision="64-true")
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        trainer(accumulate_grad_batches=k, max_epochs=2, logger=memory, callbacks=[callback],
                **options).fit(model, DataLoader(dataset, batch_size=micro))
    if amp:
        assert scaler.get_scale() == 2.0 ** (10 + 8)  # it really scaled, differently each step
    assert callback.mode == "accumulation"
    # by hand: per-micro-batch mean gradients, the two-batch estimator over each window
    net = model.net
    reference = OnlineDiversity(n, decay=None)
    starts = list(range(0, n, micro))
    expected = []
    for _epoch in range(2):
        for w in range(0, len(starts), k):
            grads, sizes = [], []
            for s in starts[w:w + k]:
                x, y = dataset.tensors[0][s:s + micro], dataset.tensors[1][s:s + micro]
                loss = F.cross_entropy(net(x), y)
                grads.append(torch.cat([g.reshape(-1) for g in
                                        torch.autograd.grad(loss, list(net.parameters()))]))
                sizes.append(len(x))
            small = sum(float(g.square().sum()) for g in grads) / len(grads)
            harmonic = len(sizes) / sum(1 / b for b in sizes)
            if reduction == "mean":  # Lightning: each micro-batch's mean loss / k
                big = sum(grads) / len(grads)
                big_size = 1 / sum(1 / (len(sizes) ** 2 * b) for b in sizes)  # Var of the mean
            else:  # sums / k: the mean over all the window's examples
                big = sum(b * g for b, g in zip(sizes, grads, strict=True)) / sum(sizes)
                big_size = sum(sizes)
            reference.update_two_batch(small, harmonic, float(big.square().sum()), big_size)
            expected.append(reference.to_dict())
    assert len(memory.rows) == len(expected) == 8
    for (_step, row), want in zip(memory.rows, expected, strict=True):
        assert row["gradient_diversity/batch_bound"] == pytest.approx(want["batch_bound"],
                                                                      rel=1e-9)
        assert row["gradient_diversity/diversity"] == pytest.approx(want["diversity"], rel=1e-9)
        assert row["gradient_diversity/noise_scale"] == pytest.approx(want["noise_scale"],
                                                                      rel=1e-9)
    last = memory.rows[-1][1]
    assert set(last) == {"gradient_diversity/" + key for key in KEYS}
    assert last["gradient_diversity/batch_bound_se"] == pytest.approx(
        expected[-1]["batch_bound_se"], rel=1e-9)
    assert last["gradient_diversity/diversity_se"] == pytest.approx(
        last["gradient_diversity/batch_bound_se"] / n)
    kept = [w for w in warned if "hold a gradient from before the step" in str(w.message)]
    assert len(kept) == head, kept  # once, naming them
    assert not head or "net.0.weight" in str(kept[0].message)


def test_accumulation_converges_to_exact_batch_bound() -> None:
    """A linear softmax model at fixed weights: the smoothed estimate over many steps lies
    within a few standard errors of measure()'s exact n·Δ."""
    n = 256
    dataset = data(n, d=10, classes=4, dtype=torch.float32, seed=3)

    class Linear(Classifier):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1)
            self.net = nn.Linear(10, 4)

    model = Linear()
    callback = DiversityCallback(every=50, decay=None)
    trainer(accumulate_grad_batches=2, max_epochs=25, callbacks=[callback]).fit(
        model, DataLoader(dataset, batch_size=32, shuffle=True))
    exact = measure(model.net, dataset.tensors, "cross_entropy", dtype=torch.float64)
    monitor = callback.monitor
    assert monitor.steps == 25 * n // 64
    # the final estimate, though the run's 100 steps end 0 steps after its last log; and a
    # run shorter than ``every`` (which logs nothing) still leaves it in ``metrics``
    assert callback.metrics["gradient_diversity/batch_bound"] == monitor.batch_bound
    assert abs(monitor.batch_bound - exact.batch_bound) < 4 * monitor.batch_bound_se
    assert monitor.batch_bound_se < 0.2 * exact.batch_bound


def test_needs_ddp_or_accumulation() -> None:
    with pytest.raises(BatchboundError, match="accumulate_grad_batches"):
        trainer(max_steps=1, callbacks=[DiversityCallback()]).fit(
            Classifier(), DataLoader(data(16, dtype=torch.float32), batch_size=4))


def test_options_are_checked() -> None:
    with pytest.raises(BatchboundError, match="every"):
        DiversityCallback(every=0)
    with pytest.raises(BatchboundError, match="reduction"):
        DiversityCallback(reduction="none")


class Recording(Classifier):
    """Saves the micro-batches each rank trained on, for the hand computation."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((batch[0].clone(), batch[1].clone()))
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        torch.save(self.seen, Path(self.directory) / f"rank{self.global_rank}.pt")


@pytest.mark.distributed
def test_ddp_spawn_matches_hand_two_batch(tmp_path: Path) -> None:
    """Two gloo ranks, each accumulating 2 micro-batches: the comm hook path (each rank's
    local gradient against DDP's average), logged by rank 0's CSVLogger, equals the
    two-batch estimate computed by hand from the micro-batches each rank saw, and lies near
    the exact n·Δ at fixed weights."""
    n, micro, k, epochs = 256, 8, 2, 4
    dataset = data(n, dtype=torch.float32, seed=5)
    model = Recording(str(tmp_path))
    logger = L.loggers.CSVLogger(tmp_path, name="run", version=0)
    spawned = trainer(strategy="ddp_spawn", devices=2, accumulate_grad_batches=k,
                      max_epochs=epochs, logger=logger,
                      callbacks=[DiversityCallback(every=8, decay=None)])
    fit_tolerating_exit_abort(
        lambda: spawned.fit(model, DataLoader(dataset, batch_size=micro, shuffle=True)),
        [tmp_path / f"rank{r}.pt" for r in range(2)])
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("gradient_diversity/batch_bound")]
    steps = epochs * n // (2 * micro * k)
    assert len(rows) == steps // 8
    last = {k: float(v) for k, v in rows[-1].items() if k.startswith("gradient_diversity/")}
    assert set(last) == {"gradient_diversity/" + key for key in KEYS}
    assert all(math.isfinite(v) for v in last.values())
    # by hand: rank r's local gradient is the mean of its two micro-batch means
    seen = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    net, reference = model.net, OnlineDiversity(n, decay=None)
    for step in range(steps):
        local = []
        for r in range(2):
            grads = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(
                F.cross_entropy(net(x), y), list(net.parameters()))])
                for x, y in seen[r][k * step:k * step + k]]
            local.append(sum(grads) / k)
        small = sum(float(g.double().square().sum()) for g in local) / 2
        big = float((sum(local) / 2).double().square().sum())
        reference.update_two_batch(small, micro * k, big, 2 * micro * k)
    bound, se = last["gradient_diversity/batch_bound"], last["gradient_diversity/batch_bound_se"]
    assert bound == pytest.approx(reference.batch_bound, rel=1e-4)
    assert se == pytest.approx(reference.batch_bound_se, rel=1e-3)
    exact = measure(net, dataset.tensors, "cross_entropy", dtype=torch.float64)
    assert abs(bound - exact.batch_bound) < 4 * se
    assert last["gradient_diversity/diversity"] == pytest.approx(bound / n, rel=1e-6)


def test_a_run_shorter_than_every_leaves_its_estimate_in_metrics() -> None:
    """An outside review: ten steps under the default every=50 logged nothing, and
    ``metrics`` stayed empty while the monitor held ten steps."""
    callback = DiversityCallback(decay=None)
    trainer(accumulate_grad_batches=2, max_steps=10, precision="64-true", callbacks=[callback]).fit(
        Classifier(), DataLoader(data(80), batch_size=4))
    assert callback.monitor.steps == 10
    assert callback.metrics["gradient_diversity/batch_bound"] == callback.monitor.batch_bound


def test_an_accumulation_scheduler_is_followed() -> None:
    """GradientAccumulationScheduler sets accumulate_grad_batches at each epoch's start,
    after on_train_start: the callback read 1 there and refused a k of 2 from the first
    step (an outside review). Epoch 0 adds 2 micro-batches, epoch 1 adds 3, exactly."""
    n, micro = 48, 8  # 6 micro-batches an epoch: 3 steps, then 2
    dataset, model = data(n), Classifier()
    memory = Memory()
    callback = DiversityCallback(every=1, decay=None)
    scheduler = L.callbacks.GradientAccumulationScheduler({0: 2, 1: 3})
    trainer(max_epochs=2, logger=memory, callbacks=[scheduler, callback],
            precision="64-true").fit(model, DataLoader(dataset, batch_size=micro))
    reference = OnlineDiversity(n, decay=None)
    for k in (2, 3):
        for w in range(0, n, k * micro):
            grads = []
            for s in range(w, w + k * micro, micro):
                x, y = dataset.tensors[0][s:s + micro], dataset.tensors[1][s:s + micro]
                loss = F.cross_entropy(model.net(x), y)
                grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(
                    loss, list(model.net.parameters()))]))
            small = sum(float(g.square().sum()) for g in grads) / k
            big = float((sum(grads) / k).square().sum())
            reference.update_two_batch(small, micro, big, k * micro)
    assert callback.monitor.steps == reference.steps == 5
    assert callback.monitor.batch_bound == pytest.approx(reference.batch_bound, rel=1e-9)
    assert callback.monitor.m2 == pytest.approx(reference.m2, rel=1e-9)
