"""The in-loop tools on loops written the way outside users write them: a
Lightning module fed variable-length dict rows through its own padding collate_fn, with the
batch-size warmup's branches; each result checked against what the loop itself computes."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

if importlib.util.find_spec("lightning") is None:
    pytest.skip("needs lightning", allow_module_level=True)
from batchbound.integrations import lightning as integration

L = integration.L
VOCAB = 20


class Rows(torch.utils.data.Dataset):
    """Token rows of 4, 5 or 6 tokens: default_collate cannot stack them."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, VOCAB, (4 + i % 3,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def pad(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A collator as users write one: pads to the longest row, labels -100 on the padding."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = r["input_ids"]
        labels[i, :len(r["labels"])] = r["labels"]
    return {"input_ids": ids, "labels": labels, "padded_by": torch.tensor(1)}


class TokenModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)
        self.branch_batches: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.out(torch.tanh(self.emb(batch["input_ids"])))
        self.log("train_loss", 0.0)  # users log in training_step
        return F.cross_entropy(logits.transpose(1, 2), batch["labels"], ignore_index=-100)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer(callback: L.Callback) -> L.Trainer:
    return L.Trainer(max_epochs=1, callbacks=[callback], logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)


def test_lightning_branch_warmup_collates_with_the_loaders_own_collate_fn() -> None:
    """Was a bare RuntimeError from default_collate (it cannot stack rows of 4, 5 and 6
    tokens): the branches must see batches as the loop does, collated by its collate_fn."""
    module = TokenModel()
    seen: list[dict[str, torch.Tensor]] = []

    def loss(m: TokenModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        seen.append(batch)
        return m.training_step(batch, 0)

    callback = integration.BranchWarmupCallback(every=2, loss=loss)
    loader = torch.utils.data.DataLoader(Rows(), batch_size=4, collate_fn=pad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer(callback).fit(module, loader)
    assert callback.warmup is not None and callback.warmup.history  # the tests ran
    assert seen and all("padded_by" in b for b in seen)  # the loader's collate_fn made them
    want = pad([Rows()[i] for i in range(4)])  # one of them, as the loader collates it
    assert any(b["input_ids"].shape == want["input_ids"].shape for b in seen)
