"""Final probes (train/probes.py) against slow, obviously correct references, their config
validation, and the config hash that ignores new fields left at their defaults."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from batchbound.data import Dataset, load_dataset
from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig
from batchbound.train.config import HASHED_WHEN_SET
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Trainer
from batchbound.train.probes import LINEAR_ERROR_BATCHES, PROBES, probe_batches


def subset(data: Dataset, n: int) -> Dataset:
    return Dataset(name=f"{data.name}-{n}", task=data.task, x_train=data.x_train[:n],
                   y_train=data.y_train[:n], x_test=data.x_test[:50], y_test=data.y_test[:50],
                   num_classes=data.num_classes, source="test")


def trained(config: TrainConfig, data: Dataset) -> tuple[Trainer, dict]:
    trainer = Trainer(config, DistContext(), dataset=data)
    result = trainer.run()
    assert result.status == "complete", result.message
    return trainer, result


# ---------------------------------------------------------------- osg
def reference_osg(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float,
                                                                                      float]:
    """Per example, in float64: ‖∇f_i‖² by torch.autograd.grad on that example alone."""
    work = copy.deepcopy(model).double().eval()
    params = [p for p in work.parameters() if p.requires_grad]
    norms = []
    for i in range(x.shape[0]):
        loss = F.cross_entropy(work(x[i : i + 1].double()), y[i : i + 1].long())
        grads = torch.autograd.grad(loss, params)
        norms.append(sum(float(g.square().sum()) for g in grads))
    values = torch.tensor(norms, dtype=torch.float64)
    return float(values.mean()), float(values.std(correction=0))


@pytest.mark.parametrize(
    "dataset, model",
    [
        ("digits", "fc(depth=2,params=4000)"),
        ("digits(image=true)", "lenet(width_mult=0.25,padding=2)"),
    ],
)
def test_osg_matches_a_per_example_loop(dataset: str, model: str) -> None:
    data = subset(load_dataset(dataset), 300)
    config = TrainConfig(dataset=dataset, model=model, batch_size=32, lr=0.1, max_iterations=15,
                         eval_every_iterations=15, final_probes=("osg",))
    trainer, result = trained(config, data)
    mean, sd = reference_osg(trainer.model, data.x_train, data.y_train)
    assert result.final["osg_mean"] == pytest.approx(mean, rel=1e-5)
    assert result.final["osg_sd"] == pytest.approx(sd, rel=1e-5)
    assert sd > 0.05 * mean  # a deviation worth checking, not rounding noise
    assert "linear_error" not in result.final
    assert result.timings["probes"]["osg"] > 0
    assert result.timings["probe_seconds"] == result.timings["probes"]["osg"]
    assert result.final["seconds"] == result.timings["train_seconds"]  # probes are not training


# ---------------------------------------------------------------- linear_error
def regression(n: int = 40, d: int = 3) -> Dataset:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64)
    y = y + 0.3 * torch.randn(n, 1, generator=gen, dtype=torch.float64)
    return Dataset(name="quadratic", task="regression", x_train=x, y_train=y, x_test=x[:8],
                   y_test=y[:8], num_classes=None, source="test")


def closed_form(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, batches: list,
                lr: float, factor: float, weight_decay: float) -> tuple[list[float], float]:
    """For L(w) = (1/n)‖Xw − y‖² (mse, one output): ∇L = (2/n)Xᵀ(Xw − y), H = (2/n)XᵀX, and
    L(w − s) − L(w) + ⟨g_m, s⟩ = ⟨g_m − ∇L, s⟩ + ½ sᵀHs exactly (L is quadratic)."""
    n = x.shape[0]
    loss = float((x @ w - y).square().mean())
    full = 2 / n * x.T @ (x @ w - y)
    hessian = 2 / n * x.T @ x
    errors = []
    for idx in batches:
        xb, yb = x[idx], y[idx]
        g = 2 / len(idx) * xb.T @ (xb @ w - yb)
        s = lr * (factor * g + weight_decay * w)
        errors.append(abs(float((g - full).T @ s) + 0.5 * float(s.T @ hessian @ s)))
    return errors, loss


@pytest.mark.parametrize(
    "changes",
    [
        {"convention": "mean", "batch_size": 8, "strategy": "lsr(base_batch=4)"},
        {"convention": "mean", "batch_size": 40},  # B = n: g_m = ∇L, the error is ½ sᵀHs
        {"convention": "sum", "batch_size": 8, "lr": 0.01, "weight_decay": 0.05,
         "momentum": 0.9, "dtype": "float32"},
    ],
)
def test_linear_error_matches_the_quadratic_closed_form(changes: dict) -> None:
    data = regression()
    config = TrainConfig(**{
        "dataset": "quadratic", "model": "linear(depth=0)", "lr": 0.05, "max_iterations": 7,
        "eval_every_iterations": 7, "dtype": "float64", "seed": 4,
        "final_probes": ("linear_error",), **changes})
    trainer, result = trained(config, data)
    (weight,) = trainer.params  # one bias-free linear layer; float32 w* is exact in float64
    w = weight.detach().double().reshape(-1, 1)
    batch = config.batch_size
    batches = probe_batches(40, batch, config.seed)
    assert len(batches) == LINEAR_ERROR_BATCHES
    lr = config.parsed_strategy().lr(config.lr, batch, result.final["epochs"])
    factor = batch if config.convention == "sum" else 1
    run_dtype = getattr(torch, config.dtype)  # the data as the run holds them
    x, y = (t.to(run_dtype).double() for t in (data.x_train, data.y_train))
    errors, loss = closed_form(w, x, y, batches, lr, factor, config.weight_decay)
    final = result.final
    assert final["final_lr"] == pytest.approx(lr, rel=1e-15)
    assert final["final_train_loss"] == pytest.approx(loss, rel=1e-12)
    expected = torch.tensor(errors, dtype=torch.float64)
    assert final["linear_error"] == pytest.approx(float(expected.mean()), rel=1e-9)
    assert final["linear_error_sd"] == pytest.approx(float(expected.std()), rel=1e-7)
    assert final["linear_error"] > 1e-6  # a step big enough to measure
    if batch == 40:
        assert final["linear_error_sd"] == pytest.approx(0, abs=1e-12)  # one batch, 8 times


def test_probe_batches_are_reproducible_and_seeded() -> None:
    a, b = probe_batches(100, 10, seed=1), probe_batches(100, 10, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert all(len(set(x.tolist())) == 10 for x in a)  # no example twice in a batch
    assert not torch.equal(a[0], probe_batches(100, 10, seed=2)[0])


def test_probes_skip_a_diverged_run() -> None:
    config = TrainConfig(model="fc(depth=1,params=800)", batch_size=32, lr=50.0,
                         max_iterations=200, eval_every_iterations=50, final_probes=("osg",))
    result = Trainer(config, DistContext()).run()
    assert result.status == "diverged"
    assert "osg_mean" not in result.final and "probe_seconds" not in result.timings


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    "changes, words",
    [
        ({"final_probes": ("osg", "hessian")}, "unknown final probe(s) 'hessian'; choose from "
                                               "osg, linear_error"),
        ({"final_probes": ("osg", "osg")}, "given twice"),
        ({"final_probes": (3,)}, "list of probe names"),
        ({"snapshot_every_epochs": 0.0}, "snapshot_every_epochs must be > 0"),
        ({"snapshot_every_epochs": -1.0}, "snapshot_every_epochs must be > 0"),
    ],
)
def test_bad_probe_or_snapshot_config_fails(changes: dict, words: str) -> None:
    with pytest.raises(BatchboundError) as info:
        TrainConfig(**changes)
    assert words in str(info.value)


def test_probe_names_are_canonical() -> None:
    assert tuple(PROBES) == ("osg", "linear_error")
    given = TrainConfig(final_probes=["linear_error", "osg"])
    assert given.final_probes == ("osg", "linear_error")
    assert TrainConfig(final_probes="linear_error,osg") == given
    assert TrainConfig.from_dict(given.to_dict()) == given


def test_hash_ignores_new_fields_at_their_defaults() -> None:
    # the value before snapshot_every_epochs and final_probes existed: stores keep their keys
    assert TrainConfig().config_hash() == "956d8208960ae2e5"
    assert set(HASHED_WHEN_SET) == {"snapshot_every_epochs", "final_probes", "micro_batch",
                                    "eval_growth", "optimizer", "betas", "eps", "data_files",
                                    "eval_test"}
    base = TrainConfig(batch_size=32, lr=0.05, convention="sum", seed=2)
    explicit = TrainConfig.from_dict({**base.to_dict(), "final_probes": [],
                                      "snapshot_every_epochs": None})
    assert explicit.config_hash() == base.config_hash()
    probed = base.replace(final_probes=("osg",))
    snapped = base.replace(snapshot_every_epochs=1.0)
    hashes = {base.config_hash(), probed.config_hash(), snapped.config_hash(),
              base.replace(snapshot_every_epochs=2.0).config_hash(),
              base.replace(final_probes=("osg", "linear_error")).config_hash()}
    assert len(hashes) == 5
