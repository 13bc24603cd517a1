"""The Lightning DiversityCallback on dict batches as an outside user writes them: a
LightningModule whose ``training_step`` takes ``{"input_ids", "attention_mask", "labels"}``
(padded: mask 0, label -100), calls ``model(**batch)`` on a tiny GPT-2 and returns the mean
over the micro-batch's sequences of each one's summed next-token loss;
accumulate_grad_batches=2, learning rate 0 (fixed weights). The logged estimate equals
McCandlish et al.'s two-batch quantities by hand, in float64, from the micro-batches the
module saw (each micro-batch's mean per-sequence gradient against their mean), in float32
and under bf16 autocast (``precision="bf16-mixed"``)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from batchbound.diversity.online import OnlineDiversity

if importlib.util.find_spec("lightning") is None or importlib.util.find_spec(
        "transformers") is None:
    pytest.skip("needs lightning and transformers", allow_module_level=True)
from batchbound.integrations import lightning as integration

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
L = integration.L
VOCAB, LENGTH, N, MICRO = 23, 10, 24, 3


def rows() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(N):
        ids = torch.randint(1, VOCAB, (LENGTH,), generator=g)
        mask = (torch.arange(LENGTH) < LENGTH - i * 7 % 6).long()
        out.append({"input_ids": ids * mask, "attention_mask": mask,
                    "labels": ids.masked_fill(mask == 0, -100)})
    return out


def per_sequence(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sequence's summed next-token cross entropy over its labelled tokens."""
    logits = model(**batch).logits[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), batch["labels"][:, 1:], ignore_index=-100,
                           reduction="none").sum(dim=1)


class LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
        self.seen: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append({k: v.clone() for k, v in batch.items()})
        return per_sequence(self.model, batch).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def reference(model: torch.nn.Module, seen: list[dict[str, torch.Tensor]],
              dtype: torch.dtype | None) -> OnlineDiversity:
    model = copy.deepcopy(model).train()
    if dtype is None:
        model = model.double()
    params = [p for p in model.parameters() if p.requires_grad]
    monitor = OnlineDiversity(N, decay=None)
    for step in range(len(seen) // 2):
        grads = []
        for batch in seen[2 * step: 2 * step + 2]:
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = per_sequence(model, batch).mean()
            grads.append([g.double() for g in torch.autograd.grad(
                loss, params, allow_unused=True, materialize_grads=True)])
        monitor.update_from_gradients(grads, [len(b["input_ids"]) for b in seen[2 * step:
                                                                               2 * step + 2]])
    return monitor


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_dict_batches_equal_the_hand_two_batch(precision: str) -> None:
    module = LM()
    start = copy.deepcopy(module.model)
    callback = integration.DiversityCallback(every=1, decay=None)
    L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, max_epochs=1,
              accumulate_grad_batches=2, precision=precision, callbacks=[callback]).fit(
        module, DataLoader(rows(), batch_size=MICRO))
    assert callback.mode == "accumulation" and len(module.seen) == N // MICRO
    got = callback.monitor
    if precision == "32-true":
        want = reference(start, module.seen, None)
        assert got.steps == want.steps == 4
        assert got.m2 == pytest.approx(want.m2, rel=1e-4)
        assert got.cross == pytest.approx(want.cross, rel=1e-4, abs=1e-4 * want.m2)
        assert got.batch_bound == pytest.approx(want.batch_bound, rel=1e-3)
        assert got.diversity == pytest.approx(want.diversity, rel=1e-3)
        return
    # bf16: Lightning divides the loss by 2 before its backward, the hand does not, so the
    # autocast gradients round differently; C's error is measured against M2
    for tolerance, dtype in ((2e-3, torch.bfloat16), (2e-2, None)):
        want = reference(start, module.seen, dtype)
        assert got.m2 == pytest.approx(want.m2, rel=tolerance)
        assert got.cross == pytest.approx(want.cross, abs=tolerance * want.m2)


def fit(module: LM, loader: DataLoader) -> integration.DiversityCallback:
    callback = integration.DiversityCallback(every=1, decay=None)
    L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, max_epochs=1,
              accumulate_grad_batches=2, callbacks=[callback]).fit(module, loader)
    return callback


def test_a_value_for_the_whole_batch_is_not_taken_for_its_size() -> None:
    """A dict batch whose first entry is one number for the whole batch (a 0-dim tensor):
    Lightning's extract_batch_size answers 1 for it (with only a warning), and the callback
    weighed every micro-batch as one example (B_simple off, silently). The examples are
    counted on the tensors that have a first dimension."""
    from torch.utils.data import default_collate

    module = LM()
    start = copy.deepcopy(module.model)
    collate = lambda items: {"scale": torch.tensor(1.0), **default_collate(items)}  # noqa: E731
    original = LM.training_step

    def step(self, batch, batch_idx):
        return original(self, {k: v for k, v in batch.items() if k != "scale"}, batch_idx)

    module.training_step = step.__get__(module)
    callback = fit(module, DataLoader(rows(), batch_size=MICRO, collate_fn=collate))
    want = reference(start, [{k: v for k, v in b.items() if k != "scale"}
                             for b in module.seen], None)
    assert callback.monitor.m2 == pytest.approx(want.m2, rel=1e-4)
    assert callback.monitor.cross == pytest.approx(want.cross, rel=1e-4, abs=1e-4 * want.m2)


def test_tensors_that_disagree_on_the_examples_are_refused_in_one_line() -> None:
    from torch.utils.data import default_collate

    from batchbound.errors import BatchboundError

    collate = lambda items: {"weights": torch.ones(5), **default_collate(items)}  # noqa: E731
    module = LM()
    original = LM.training_step
    module.training_step = (lambda self, batch, i: original(
        self, {k: v for k, v in batch.items() if k != "weights"}, i)).__get__(module)
    with pytest.raises(BatchboundError) as info:
        fit(module, DataLoader(rows(), batch_size=MICRO, collate_fn=collate))
    said = str(info.value)
    assert "disagree on the number of examples" in said and "\n" not in said
