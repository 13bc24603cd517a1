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


# ------------------------------------------- fine-tuning that unfreezes the backbone


class Finetune(L.LightningModule):
    """A backbone and a head, as Lightning's BackboneFinetuning expects them; lr = 0 keeps
    the weights fixed, so each step can be recomputed by hand."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(6, 5), nn.Tanh())
        self.head = nn.Linear(5, 3)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
                      ) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.0)


class Memory(L.loggers.Logger):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []

    name, version = "memory", 0  # type: ignore[assignment]

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append(dict(metrics))


def test_diversity_callback_follows_the_backbone_lightning_unfreezes() -> None:
    """BackboneFinetuning freezes the backbone at fit start and unfreezes it at epoch 1: the
    callback hooked only the parameters trainable at train start, so from epoch 1 on it
    logged the head's n·Δ as the model's (1.46 against the model's 1.30 here). Each step
    must equal McCandlish et al.'s two-batch estimate over the parameters that train then."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    from batchbound.diversity.online import OnlineDiversity

    n, micro, k = 32, 8, 2
    g = torch.Generator().manual_seed(0)
    # one class for all: a mean gradient the noise does not hide, so every n·Δ is finite
    data = torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g, dtype=torch.float64),
                                          torch.zeros(n, dtype=torch.long))
    module, memory = Finetune().double(), Memory()
    callback = integration.DiversityCallback(every=1, decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        L.Trainer(max_epochs=2, accumulate_grad_batches=k, logger=memory, precision="64-true",
                  callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1), callback],
                  enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(
            module, torch.utils.data.DataLoader(data, batch_size=micro))
    head = list(module.head.parameters())
    want = []
    for params in (head, list(module.backbone.parameters()) + head):  # epoch 0, then 1
        for start in range(0, n, micro * k):
            grads = []
            for s in range(start, start + micro * k, micro):
                x, y = data.tensors[0][s:s + micro], data.tensors[1][s:s + micro]
                loss = F.cross_entropy(module.head(module.backbone(x)), y)
                grads.append(torch.cat([d.reshape(-1)
                                        for d in torch.autograd.grad(loss, params)]))
            reference = OnlineDiversity(n, decay=0.0)
            reference.update_two_batch(sum(float(d.square().sum()) for d in grads) / k, micro,
                                       float((sum(grads) / k).square().sum()), micro * k)
            want.append(reference.batch_bound)
    got = [row["gradient_diversity/batch_bound"] for row in memory.rows]
    assert got == pytest.approx(want, rel=1e-9)
    assert want[-1] != pytest.approx(want[0], rel=1e-3)  # the backbone changes the answer
