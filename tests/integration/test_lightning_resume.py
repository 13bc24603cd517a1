"""The Lightning DiversityCallback's estimate is saved with the checkpoint and continued on
``fit(ckpt_path=...)``: a run resumed from the checkpoint at the end of its first epoch
(step 6: Lightning restarts a checkpoint's unfinished epoch from its first batch) ends with
the estimate of the run that was never stopped, the steps not folded yet at the save
included, and logs at the same steps. The warmups go on at the accumulation they had grown
to."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

if importlib.util.find_spec("lightning") is None:
    pytest.skip("lightning is not installed (pip install 'batchbound[lightning]')",
                allow_module_level=True)
from test_integrations_lightning import Classifier, Memory, data, trainer
from torch.utils.data import DataLoader, TensorDataset

from batchbound.data import load_dataset
from batchbound.integrations import lightning as integration

L = integration.L


class Learning(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.double()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(folder: Path, ckpt_path: str | None = None
         ) -> tuple[integration.DiversityCallback, list[int | None]]:
    callback = integration.DiversityCallback(every=4)  # step 6 is between two folds
    memory = Memory()
    saving = L.callbacks.ModelCheckpoint(dirpath=folder, every_n_train_steps=6,
                                                 save_top_k=-1)
    run = trainer(max_epochs=2, accumulate_grad_batches=2, callbacks=[callback, saving],
                  enable_checkpointing=True, default_root_dir=folder, logger=memory)
    loader = DataLoader(data(48), batch_size=4)
    run.fit(Learning(), loader, ckpt_path=ckpt_path)
    return callback, [step for step, row in memory.rows if "gradient_diversity/batch_bound" in row]


def test_a_resumed_run_continues_the_estimate(tmp_path: Path) -> None:
    unbroken, logged = _fit(tmp_path / "a")
    (checkpoint,) = (tmp_path / "a").glob("*step=6.ckpt")
    resumed, resumed_logged = _fit(tmp_path / "b", str(checkpoint))
    assert logged == [3, 7, 11] and resumed_logged == [s for s in logged if s > 6]
    assert unbroken.monitor.steps == 12  # 6 optimizer steps of 2 micro-batches an epoch
    _same_estimate(resumed.monitor, unbroken.monitor)


def _same_estimate(resumed, unbroken) -> None:
    a, b = resumed.state_dict(), unbroken.state_dict()
    assert a["steps"] == b["steps"]
    for part in ("sums", "fast"):
        for key, value in b[part].items():
            assert a[part][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (part, key)


class Digits(L.LightningModule):
    """Digits at B0 = 8 × 2; ``seen``: (epoch, batch, accumulation) of every training batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 36), nn.ReLU(), nn.Linear(36, 10))
        self.seen: list[tuple[int, int, int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, batch_idx, self.trainer.accumulate_grad_batches))
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("make", [
    lambda: integration.BatchWarmupCallback(every=10, fraction=1.0),
    lambda: integration.BranchWarmupCallback(every=20, steps=4, lr="lsr"),
], ids=["batch", "branch"])
def test_a_resumed_warmup_goes_on_at_the_grown_accumulation(tmp_path: Path, make) -> None:
    """From the checkpoint at the first epoch's end, after the warmup grew the accumulation:
    every batch after it at the accumulation of the run never stopped, the same decisions.
    The first step used to be formed at the Trainer's given accumulation (the warmup was
    rebuilt only at the first optimizer step): 4.5 % off the estimate, one step more."""
    digits = load_dataset("digits")

    def fit(folder: Path, ckpt_path: str | None = None):
        callback, model = make(), Digits()
        saving = L.callbacks.ModelCheckpoint(dirpath=folder, every_n_epochs=1, save_top_k=-1)
        trainer(accumulate_grad_batches=2, max_epochs=3, callbacks=[callback, saving],
                enable_checkpointing=True, default_root_dir=folder).fit(
            model, DataLoader(TensorDataset(digits.x_train, digits.y_train), batch_size=8),
            ckpt_path=ckpt_path)
        return callback, model

    unbroken, model = fit(tmp_path / "a")
    (checkpoint,) = (tmp_path / "a").glob("epoch=0*.ckpt")
    resumed, resumed_model = fit(tmp_path / "b", str(checkpoint))
    grown = [k for epoch, _, k in model.seen if epoch == 1]
    assert grown[0] > 2, unbroken.warmup.history  # grown in the first epoch
    assert resumed_model.seen == [s for s in model.seen if s[0] >= 1]
    assert resumed.warmup.history == unbroken.warmup.history
    if isinstance(unbroken, integration.DiversityCallback):
        _same_estimate(resumed.monitor, unbroken.monitor)
