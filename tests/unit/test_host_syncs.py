"""No host synchronisation on the per-step path of ``watch`` and of the callbacks' shared
bookkeeping (``MicroBatchNorms`` + ``StepRecords``), and on the Hugging Face and Lightning
``DiversityCallback``s' steps: on a GPU each one makes the step wait for the device. The CPU
proxy: every Tensor method that copies a value to the host (``item``, ``tolist``, ``bool``,
``float``, ``int``) and ``torch.nonzero``/``torch.unique`` are counted while N steps run, when
the Python code that called into torch is batchbound's; the reads happen only on the logging
cadence (``fold``, ``monitor.batch_bound``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from host_syncs import host_syncs, tiny_model, tokens
from torch import nn

from batchbound.diversity import OnlineDiversity, watch
from batchbound.integrations.common import MicroBatchNorms, StepRecords


@contextmanager
def counted_folds() -> Iterator[Counter]:
    """How often the callbacks' StepRecords are folded (the logging cadence's one read)."""
    folds: Counter = Counter()
    fold = StepRecords.fold

    def counted(self: StepRecords) -> OnlineDiversity:
        folds["fold"] += 1
        return fold(self)

    StepRecords.fold = counted  # type: ignore[method-assign]
    try:
        yield folds
    finally:
        StepRecords.fold = fold  # type: ignore[method-assign]


def test_the_counter_sees_a_sync_in_batchbound_code() -> None:
    """The proxy can fail: a float() of a tensor in batchbound's code is counted, the same
    call from the test is not."""
    monitor = OnlineDiversity(100)
    monitor.defer_from_norms(torch.tensor(4.0), torch.tensor(9.0), 4)
    with host_syncs() as syncs:
        float(torch.ones(()))  # the test's own: not counted
        _ = monitor.batch_bound  # the read folds the deferred steps: counted
    assert sum(syncs.values()) > 0, syncs


@pytest.mark.parametrize("subset", ["all", "norms"])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("vocab", [11, 20_000])  # 20 000: an embedding too large to materialise
def test_watch_steps_do_not_sync(subset: str, autocast: bool, vocab: int) -> None:
    model = tiny_model(vocab)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = OnlineDiversity(1000)

    def step(seed: int) -> None:
        x, y = tokens(8, seed, vocab)
        opt.zero_grad()
        with watch(model, monitor, subset=subset), torch.autocast(
                "cpu", dtype=torch.bfloat16, enabled=autocast):
            F.cross_entropy(model(x).transpose(1, 2).float(), y).backward()
        opt.step()

    # the first step checks the model (the probe, the loop), the 2nd and 4th the loss's
    # coupling again (then the 8th, 16th, …): one read each
    for seed in range(4):
        step(seed)
    with host_syncs() as syncs:
        for seed in range(4, 7):
            step(seed)
    assert not syncs, syncs
    with host_syncs() as syncs:
        value = monitor.batch_bound  # the logging cadence: the deferred steps are read here
    assert syncs and value == value
    assert monitor.steps == 7


def test_measure_reads_the_device_once_a_block_of_chunks_not_once_a_chunk() -> None:
    # on a GPU a read per chunk makes the host wait for each chunk's work before issuing
    # the next one; the losses' finiteness is read at the end of each block of chunks
    from batchbound.diversity import measure
    from batchbound.diversity.measure import BLOCK

    model = tiny_model()
    x, y = tokens(4 * BLOCK * 2, 0, 11)

    def reads(n: int) -> int:
        with host_syncs() as syncs:
            measure(model, (x[:n], y[:n]), _token_loss, chunk_size=2)
        return sum(syncs.values())

    reads(4)  # the model's checks, once
    assert reads(2 * BLOCK * 2) - reads(2) <= 2  # 2·BLOCK more chunks: two blocks' reads


def _token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)


@pytest.mark.parametrize("fused", [True, False])
def test_callback_bookkeeping_does_not_sync(fused: bool) -> None:
    """What both DiversityCallbacks run per micro-batch and per optimizer step."""
    model = tiny_model()
    norms = MicroBatchNorms(model.parameters(), fused=fused)
    records = StepRecords(OnlineDiversity(1000))

    def step(seed: int) -> None:
        model.zero_grad()
        for j in range(3):  # three micro-batches of one optimizer step
            x, y = tokens(4, 10 * seed + j)
            norms.start(4, 1.0)
            F.cross_entropy(model(x).transpose(1, 2), y).backward()
        row = norms.record(1.0 / 3, 1.0)
        assert row is not None
        records.add(row)

    with host_syncs() as syncs:
        for seed in range(5):
            step(seed)
    assert not syncs, syncs
    with host_syncs() as syncs:
        monitor = records.fold()  # the logging cadence
    assert syncs and monitor.steps == 5
    norms.remove()


def test_hf_callback_syncs_only_on_the_logging_cadence(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    from torch.utils.data import Dataset

    from batchbound.integrations.transformers import DiversityCallback

    class Pairs(Dataset):
        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(0)
            self.x, self.y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)

        def __len__(self) -> int:
            return len(self.y)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": self.x[i], "labels": self.y[i]}

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": F.cross_entropy(self.body(x), labels)}

    every = 4
    callback = DiversityCallback(every=every, decay=None)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=0.01, num_train_epochs=1, logging_steps=1000, save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=Net(), args=args, train_dataset=Pairs(64),
                                   callbacks=[callback])
    with counted_folds() as folds, host_syncs(cadence=("fold",)) as syncs:
        trainer.train()
    steps = 64 // 8
    assert callback.monitor.steps == steps
    assert not syncs, syncs  # nothing read outside the folds
    assert folds["fold"] == steps // every + 1  # every ``every`` steps, and at the end


@pytest.mark.parametrize("size", [0, 1, 7, 500])
def test_segments_equal_uniques_inverse(size: int) -> None:
    """The sort-based stand-in for ``torch.unique(return_inverse=True)`` (rules/forms.py),
    which the embedding rules use so that the backward does not wait for the device."""
    from batchbound.diversity.rules.forms import segments

    g = torch.Generator().manual_seed(size)
    keys = torch.randint(0, 40, (size,), generator=g) * 1000 + torch.randint(0, 3, (size,),
                                                                             generator=g)
    _, inverse = torch.unique(keys, return_inverse=True)
    assert torch.equal(segments(keys), inverse)


def test_lightning_callback_syncs_only_on_the_logging_cadence() -> None:
    L = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    from batchbound.integrations.lightning import DiversityCallback

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g))
    every = 4
    callback = DiversityCallback(every=every, decay=None)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, max_epochs=1,
                        accumulate_grad_batches=2, callbacks=[callback])
    with counted_folds() as folds, host_syncs(cadence=("fold",)) as syncs:
        trainer.fit(Classifier(), DataLoader(data, batch_size=4))
    steps = 64 // 8
    assert callback.monitor.steps == steps
    assert not syncs, syncs  # nothing read outside the folds
    assert folds["fold"] == steps // every + 1  # every ``every`` steps, and at the end
