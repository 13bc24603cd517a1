"""The Lightning DiversityCallback's estimate is saved with the checkpoint and continued on
``fit(ckpt_path=...)``: a run resumed from the checkpoint at the end of its first epoch
(step 6: Lightning restarts a checkpoint's unfinished epoch from its first batch) ends with
the estimate of the run that was never stopped, the steps not folded yet at the save
included, and logs at the same steps."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("lightning") is None:
    pytest.skip("lightning is not installed (pip install 'batchbound[lightning]')",
                allow_module_level=True)
from test_integrations_lightning import Classifier, Memory, data, trainer
from torch.utils.data import DataLoader

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
    a, b = resumed.monitor.state_dict(), unbroken.monitor.state_dict()
    assert a["steps"] == b["steps"] == 12  # 6 optimizer steps of 2 micro-batches an epoch
    for part in ("sums", "fast"):
        for key, value in b[part].items():
            assert a[part][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (part, key)
