"""Batch-size warmup in users' loops with the real frameworks: the Lightning callback doubles
``accumulate_grad_batches`` at group boundaries on 1 process and identically on 2 DDP ranks,
the Hugging Face callback doubles ``gradient_accumulation_steps`` at an epoch's start, and
their schedules follow the noise scale as batchbound's own trainer does on the same data."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from spawn_exit import fit_tolerating_exit_abort
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from batchbound.data import load_dataset
from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError
from batchbound.integrations.warmup import AccumulationWarmup

have = {name: importlib.util.find_spec(name) is not None for name in ("lightning",
                                                                    "transformers")}


def noisy_monitor(noise: float, steps: int = 200) -> OnlineDiversity:
    """An estimate whose B_noise is ``noise`` (exact pairs, no spread)."""
    monitor = OnlineDiversity(None, decay=None)
    for _ in range(steps):
        monitor.update(1.0 + noise, 1.0)  # M2 = 1 + B_noise, ‖G‖² = 1
    return monitor


def test_the_plain_ddp_helper_doubles_at_its_cadence_and_waits_for_a_boundary():
    warmup = AccumulationWarmup(micro_batch=8, accumulation=1, world_size=2, every=3,
                                fraction=0.5)
    monitor = noisy_monitor(100.0)  # 2·16 ≤ 50: one doubling allowed
    factors = [warmup.step(monitor, ready=False) for _ in range(3)]
    assert factors == [1.0, 1.0, 1.0] and warmup.pending and warmup.accumulation == 1
    factor = warmup.step(monitor, ready=True)
    assert warmup.accumulation == 2 and warmup.batch_size == 32 and not warmup.pending
    assert factor == pytest.approx((1 + 100 / 16) / (1 + 100 / 32))
    for _ in range(6):  # 2·32 > 50: no further doubling
        assert warmup.step(monitor) == 1.0
    assert warmup.accumulation == 2
    again = AccumulationWarmup(8, world_size=2, every=3)
    again.load_state_dict(json.loads(json.dumps(warmup.state_dict())))
    assert again.state_dict() == warmup.state_dict()
    with pytest.raises(BatchboundError, match="micro_batch"):
        AccumulationWarmup(0)


# ------------------------------------------------------------------------------ Lightning

DIGITS = load_dataset("digits")


def digits_loader(batch: int, seed: int | None = 0) -> DataLoader:
    """Shuffled digits; ``seed=None`` leaves the order to the framework (a generator does not
    survive ddp_spawn's pickling)."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(DIGITS.x_train, DIGITS.y_train), batch_size=batch,
                      shuffle=True, generator=generator)


if have["lightning"]:
    from batchbound.integrations import lightning as lightning_integration

    L = lightning_integration.L

    class DigitsNet(L.LightningModule):
        def __init__(self, directory: str = "") -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(64, 36), nn.ReLU(), nn.Linear(36, 36),
                                     nn.ReLU(), nn.Linear(36, 10))
            self.directory = directory
            self.accumulations: list[int] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.accumulations.append(self.trainer.accumulate_grad_batches)
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_end(self) -> None:
            if self.directory:
                torch.save(self.accumulations,
                           Path(self.directory) / f"rank{self.global_rank}.pt")


def lightning_trainer(**kwargs):
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(**{**defaults, **kwargs})


LIGHTNING_EPOCHS = 8


@pytest.fixture(scope="module")
def lightning_warmed():
    """One Lightning fit with the warmup callback (B0 = 16 as 8 × 2 accumulated), read by the
    two tests below: each only reads the fitted model, trainer and callback (one fit, not
    two, of ~1400 callback steps)."""
    if not have["lightning"]:
        pytest.skip("lightning is not installed")
    model = DigitsNet()
    callback = lightning_integration.BatchWarmupCallback(every=10, fraction=1.0)
    trainer = lightning_trainer(accumulate_grad_batches=2, max_epochs=LIGHTNING_EPOCHS,
                                callbacks=[callback])
    trainer.fit(model, digits_loader(8))
    return model, callback, trainer


@pytest.mark.skipif(not have["lightning"], reason="lightning is not installed")
def test_lightning_doubles_accumulation_at_group_boundaries(lightning_warmed):
    model, callback, trainer = lightning_warmed
    history = callback.warmup.history
    assert trainer.accumulate_grad_batches > 2, history  # it warmed up
    # the accumulation changed only where a group of the new size starts (batch_idx = 0 mod
    # the new accumulation) and only by doubling
    seen = model.accumulations
    changes = [i for i in range(1, len(seen)) if seen[i] != seen[i - 1]]
    assert all(seen[i] == 2 * seen[i - 1] for i in changes)
    per_epoch = len(digits_loader(8))
    assert all((i % per_epoch) % seen[i] == 0 for i in changes)


@pytest.mark.skipif(not have["lightning"], reason="lightning is not installed")
def test_lightning_schedule_follows_the_trainers_own_warmup(lightning_warmed):
    """Same data, model, B0 = 16, lr and rule: the Lightning callback and batchbound's
    trainer reach batches within one doubling of each other and similar losses."""
    from batchbound.train import TrainConfig, train

    epochs = LIGHTNING_EPOCHS
    model, callback, _ = lightning_warmed
    ours = train(TrainConfig(dataset="digits", model="fc(depth=2,width=36)", batch_size=16,
                             lr=0.1, max_epochs=epochs, eval_every_epochs=epochs,
                             batch_policy="warmup(every=10,fraction=1.0)"), progress=False)
    theirs = callback.warmup.batch_size
    mine = int(ours.curve("batch_size")[-1][3])
    assert mine > 16 and theirs > 16
    assert max(mine, theirs) <= 2 * min(mine, theirs), (mine, theirs)
    with torch.no_grad():
        lightning_loss = float(F.cross_entropy(model.net(DIGITS.x_train), DIGITS.y_train))
    assert lightning_loss == pytest.approx(ours.final["train_loss"], rel=0.5), (
        ours.curve("batch_size"), callback.warmup.history)


@pytest.mark.distributed
@pytest.mark.skipif(not have["lightning"], reason="lightning is not installed")
def test_lightning_ddp_ranks_change_together(tmp_path: Path):
    model = DigitsNet(str(tmp_path))
    logger = L.loggers.CSVLogger(tmp_path, name="run", version=0)
    trainer = lightning_trainer(
        strategy="ddp_spawn", devices=2, accumulate_grad_batches=1, max_epochs=6,
        logger=logger,
        callbacks=[lightning_integration.BatchWarmupCallback(every=10, fraction=1.0)])
    fit_tolerating_exit_abort(lambda: trainer.fit(model, digits_loader(8, seed=None)),
                              [tmp_path / f"rank{r}.pt" for r in range(2)])
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0] == ranks[1]  # the same accumulation at every batch on both ranks
    assert max(ranks[0]) >= 2
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("warmup/batch_size")]
    assert rows and float(rows[-1]["warmup/batch_size"]) == 8 * 2 * max(ranks[0])


# ------------------------------------------------------------------------- Hugging Face

if have["transformers"]:
    from batchbound.integrations import transformers as hf_integration

    hf = hf_integration.transformers

    class Digits(Dataset):
        def __len__(self) -> int:
            return DIGITS.n_train

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": DIGITS.x_train[i], "labels": DIGITS.y_train[i]}

    class HFNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(64, 36), nn.ReLU(), nn.Linear(36, 10))

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": F.cross_entropy(self.body(x), labels)}


@pytest.mark.skipif(not have["transformers"], reason="transformers is not installed")
def test_hugging_face_doubles_accumulation_at_an_epoch_start(tmp_path: Path):
    args = hf.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
                                gradient_accumulation_steps=2, learning_rate=0.1,
                                lr_scheduler_type="constant", optim="sgd", num_train_epochs=6,
                                logging_steps=1000, save_strategy="no", report_to=[],
                                use_cpu=True, disable_tqdm=True, seed=0)
    callback = hf_integration.BatchWarmupCallback(every=10, fraction=1.0)
    trainer = hf.Trainer(model=HFNet(), args=args, train_dataset=Digits(), callbacks=[callback])
    rates = []

    class Rates(hf.TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            rates.append((args.gradient_accumulation_steps, optimizer.param_groups[0]["lr"]))

    trainer.add_callback(Rates())
    trainer.train()
    assert args.gradient_accumulation_steps > 2, callback.warmup.history
    logged = [h for h in trainer.state.log_history if "warmup/batch_size" in h]
    assert logged and logged[-1]["warmup/accumulation"] == args.gradient_accumulation_steps
    first, last = rates[0], rates[-1]
    assert last[0] > first[0] and last[1] > first[1]  # the noise rule raised the rate too


# ----------------------------------------------------------- the branch trigger (default)

BRANCH = dict(every=20, steps=4, lr="lsr")  # digits at lr 0.1 has room for lsr (auto: srsr)


@pytest.mark.slow
@pytest.mark.skipif(not have["lightning"], reason="lightning is not installed")
def test_lightning_branch_warmup_follows_the_trainers_own():
    """Same data, model, B0 = 16, lr and rule (lsr for SGD), the branch trigger every 20
    steps: the Lightning callback and batchbound's trainer both double, at the same steps,
    end within one doubling of each other, and both count their branches. (Their losses are
    not compared: the two models differ in initialisation and data order, and over these 4
    epochs the losses do too.)"""
    from batchbound.train import TrainConfig, train

    epochs = 4
    model = DigitsNet()
    callback = lightning_integration.BranchWarmupCallback(
        **BRANCH, loss=lambda module, batch: F.cross_entropy(module.net(batch[0]), batch[1]))
    lightning_trainer(accumulate_grad_batches=2, max_epochs=epochs,
                      callbacks=[callback]).fit(model, digits_loader(8))
    ours = train(TrainConfig(dataset="digits", model="fc(depth=2,width=36)", batch_size=16,
                             lr=0.1, max_epochs=epochs, eval_every_epochs=epochs,
                             batch_policy="warmup(every=20,steps=4,lr=lsr)"), progress=False)
    theirs = callback.warmup.batch_size
    mine = int(ours.curve("batch_size")[-1][3])
    assert mine > 16 and theirs > 16, (mine, callback.warmup.history)
    assert max(mine, theirs) <= 2 * min(mine, theirs), (mine, theirs)
    # the doublings were decided at the same optimizer steps (the trainer's change takes
    # effect at once, the callback's at the next accumulation boundary)
    history = callback.warmup.history
    decided = [h[0] for h, after in zip(history, [*history[1:], (None, theirs)], strict=True)
               if after[1] > h[1]]
    assert decided == [int(i) for i, _, _, _ in ours.curve("batch_size")[1:]], (
        history, ours.curve("batch_size"))
    assert callback.warmup.branch_examples > 0 and ours.final["policy_branch_examples"] > 0


@pytest.mark.parametrize("adam", [False, True])
def test_the_plain_loop_branch_helper_restores_the_state_and_doubles_on_a_clear_case(adam):
    """A branch leaves the model, the optimiser (Adam's moments included) and the random
    state as they were; on a least-squares problem far from its solution at B = 2 with plain
    SGD and a small rate (critical batch ≫ 2B) it grows B by 2 or 4 with lsr's factor (the
    rule named: auto is srsr); it counts the branches."""
    from batchbound.integrations.warmup import BranchWarmup

    torch.manual_seed(0)
    n = 512
    x = torch.randn(n, 8)
    y = x @ torch.randn(8) * 3 + 2.0 * torch.randn(n)
    model = nn.Linear(8, 1)
    optimizer = (torch.optim.Adam(model.parameters(), lr=0.01) if adam
                 else torch.optim.SGD(model.parameters(), lr=0.005))

    def loss_of(indices: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(x[indices]).squeeze(1), y[indices])

    for _ in range(3):  # some optimiser state to copy
        optimizer.zero_grad()
        loss_of(torch.arange(2)).backward()
        optimizer.step()
    before = ({k: v.clone() for k, v in model.state_dict().items()},
              str(optimizer.state_dict()), torch.get_rng_state())
    warmup = BranchWarmup(micro_batch=2, every=1, steps=8, lr="srsr" if adam else "lsr")
    factor = warmup.step(model, optimizer, loss_of, n)
    assert all(torch.equal(v, before[0][k]) for k, v in model.state_dict().items())
    assert str(optimizer.state_dict()) == before[1]
    assert torch.equal(torch.get_rng_state(), before[2])
    # B, 2B, 4B over 8·4B = 64 examples each (no replicate: σ from B's own trend)
    assert warmup.branch_steps == 32 + 16 + 8 and warmup.branch_examples == 3 * 64
    if not adam:
        assert warmup.batch_size in (4, 8), warmup.history
        assert factor == pytest.approx(warmup.batch_size / 2), warmup.history


@pytest.mark.slow
@pytest.mark.skipif(not have["transformers"], reason="transformers is not installed")
def test_hugging_face_branch_warmup_doubles_at_an_epoch_start(tmp_path: Path):
    """The branch trigger in the HF Trainer: on digits at B0 = 16 with SGD it doubles
    ``gradient_accumulation_steps`` (at an epoch's start), raises the rate by lsr, logs the
    branches' cost, and the training the branches interrupted goes on from the same state."""
    args = hf.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8,
                                gradient_accumulation_steps=2, learning_rate=0.1,
                                lr_scheduler_type="constant", optim="sgd", num_train_epochs=4,
                                logging_steps=1000, save_strategy="no", report_to=[],
                                use_cpu=True, disable_tqdm=True, seed=0)
    callback = hf_integration.BranchWarmupCallback(**BRANCH)
    trainer = hf.Trainer(model=HFNet(), args=args, train_dataset=Digits(), callbacks=[callback])
    rates = []

    class Rates(hf.TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            rates.append((args.gradient_accumulation_steps, optimizer.param_groups[0]["lr"]))

    trainer.add_callback(Rates())
    trainer.train()
    assert args.gradient_accumulation_steps > 2, callback.warmup.history
    assert callback.warmup.branch_examples > 0
    logged = [h for h in trainer.state.log_history if "warmup/branch_examples" in h]
    assert logged and logged[-1]["warmup/accumulation"] == args.gradient_accumulation_steps
    first, last = rates[0], rates[-1]
    assert last[1] == pytest.approx(first[1] * last[0] / first[0])  # lsr: η ∝ B
