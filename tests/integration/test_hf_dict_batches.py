"""The Hugging Face DiversityCallback as an outside user runs it on dict batches: a real
``transformers.Trainer`` (CPU, gradient_accumulation_steps=2, learning rate 0 so every step
sees the same weights), tiny GPT-2 and BERT models from configs (no download), in-memory
datasets of dicts padded with ``attention_mask`` 0 and ``-100`` labels. Every step's
logged estimate is checked against McCandlish et al.'s two-batch quantities computed by
hand, in float64, from the micro-batches the model saw: each micro-batch's mean gradient
over its labelled tokens (the small batches) against the step's mean over all of them (the
big one), each token's loss written out here, not the model's."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError

if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed (pip install 'batchbound[hf]')",
                allow_module_level=True)
from batchbound.integrations import transformers as integration

transformers = integration.transformers
transformers.logging.set_verbosity_error()
PREFIX = "gradient_diversity/"
VOCAB, LENGTH = 23, 10


class Padded(Dataset):
    """Sequences padded at the end: mask 0 and label -100 on 0 to 5 padded positions; for
    the masked LM only every third real token is labelled."""

    def __init__(self, n: int, *, masked: bool = False) -> None:
        g = torch.Generator().manual_seed(3)
        self.rows = []
        for i in range(n):
            ids = torch.randint(1, VOCAB, (LENGTH,), generator=g)
            mask = (torch.arange(LENGTH) < LENGTH - i * 7 % 6).long()
            labels = ids.masked_fill(mask == 0, -100)
            if masked:
                labels = labels.masked_fill(torch.arange(LENGTH) % 3 != i % 3, -100)
            self.rows.append({"input_ids": ids * mask, "attention_mask": mask,
                              "labels": labels})

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.rows[i]


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))


def bert_mlm() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def token_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor], shifted: bool
              ) -> tuple[torch.Tensor, int]:
    """Σ cross entropy over the labelled tokens (next-token for the causal LM), and their
    number."""
    logits = model(input_ids=batch["input_ids"],
                   attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    if shifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="sum")
    return loss, int(labels.ne(-100).sum())


def reference(model: torch.nn.Module, seen: list[dict[str, torch.Tensor]], shifted: bool,
              steps: int, dtype: torch.dtype | None = None) -> OnlineDiversity:
    """The two-batch estimate of each step (two micro-batches) by hand; in float64, or
    under CPU autocast to ``dtype``."""
    model = copy.deepcopy(model).train()
    if dtype is None:
        model = model.double()
    params = [p for p in model.parameters() if p.requires_grad]
    monitor = OnlineDiversity(None, decay=None)
    for step in range(steps):
        grads, counts = [], []
        for batch in seen[2 * step: 2 * step + 2]:
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss, count = token_sum(model, batch, shifted)
            grads.append(torch.cat([g.reshape(-1).double() for g in torch.autograd.grad(
                loss, params, allow_unused=True, materialize_grads=True)]))
            counts.append(count)
        small = sum(float((g / c).square().sum()) for g, c in zip(grads, counts, strict=True)) / 2
        big = float((sum(grads) / sum(counts)).square().sum())
        harmonic = 2 / sum(1 / c for c in counts)
        monitor.update_two_batch(small, harmonic, big, sum(counts))
    return monitor


def trim(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Dynamic padding, as DataCollatorWithPadding: each batch padded to its own longest."""
    width = max(int(item["attention_mask"].sum()) for item in items)
    return {k: torch.stack([item[k][:width] for item in items]) for k in items[0]}


def run(tmp_path: Path, model: torch.nn.Module, data: Dataset, collator=None, **options
        ) -> tuple[integration.DiversityCallback, list[dict[str, torch.Tensor]], list[dict]]:
    seen: list[dict[str, torch.Tensor]] = []
    handle = model.register_forward_pre_hook(
        lambda m, a, kw: seen.append({k: kw[k].clone() for k in
                                      ("input_ids", "attention_mask", "labels")})
        if m.training and torch.is_grad_enabled() else None, with_kwargs=True)
    callback = integration.DiversityCallback(every=1, decay=None)
    args = transformers.TrainingArguments(**{**dict(
        output_dir=str(tmp_path), per_device_train_batch_size=3,
        gradient_accumulation_steps=2, learning_rate=0.0, weight_decay=0.0,
        num_train_epochs=1, logging_steps=1000, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0), **options})
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   data_collator=collator, callbacks=[callback])
    trainer.train()
    handle.remove()
    rows = [r for r in trainer.state.log_history if PREFIX + "batch_bound" in r]
    return callback, seen, rows


def bert_classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3))


@pytest.mark.parametrize(("bf16", "collator"), [(False, None), (True, None), (False, trim)],
                         ids=["float32", "bf16-autocast", "dynamic-padding"])
def test_gpt2_on_padded_dict_batches_equals_the_hand_two_batch(tmp_path: Path, bf16,
                                                                collator) -> None:
    """ForCausalLMLoss (Σ over shifted label tokens / the step's count): the callback's
    estimate in tokens equals the float64 two-batch quantities; under bf16 autocast (the
    Trainer's bf16=True on CPU) the same quantities of the hand's autocast gradients, and
    the float64 ones within bf16's precision."""
    model, data = gpt2(), Padded(24)
    start = copy.deepcopy(model)
    callback, seen, rows = run(tmp_path, model, data, collator, bf16=bf16)
    if collator is not None:  # the micro-batches really had different widths
        assert len({b["input_ids"].shape[1] for b in seen}) > 1
    assert callback.unit == "tokens" and len(seen) == 8 and len(rows) == 4
    want = reference(start, seen, True, 4, torch.bfloat16 if bf16 else None)
    got = callback.monitor
    assert got.steps == want.steps == 4
    if not bf16:
        assert got.m2 == pytest.approx(want.m2, rel=1e-4)
        assert got.cross == pytest.approx(want.cross, rel=1e-4)
        assert rows[-1][PREFIX + "batch_bound"] == pytest.approx(want.batch_bound, rel=1e-4)
        return
    # bf16: the Trainer's loss is scaled by 1/N before its backward in bf16, the hand one is
    # not, so the gradients round differently; ‖G‖²'s estimate C is a difference of
    # norms, so its error is measured against M2, the scale of the terms it cancels
    for tolerance, expected in ((2e-3, want), (2e-2, reference(start, seen, True, 4))):
        assert got.m2 == pytest.approx(expected.m2, rel=tolerance)
        assert got.cross == pytest.approx(expected.cross, abs=tolerance * expected.m2)


@pytest.mark.parametrize(("make", "words"), [
    (bert_mlm, "its loss does not divide by it"),
    (bert_classifier, "its loss does not divide by it"),  # its own CrossEntropyLoss mean
], ids=["bert-mlm", "bert-classifier"])
def test_a_loss_the_callback_cannot_weigh_is_refused_in_one_line(tmp_path: Path, make,
                                                                  words) -> None:
    """BertForMaskedLM is given num_items_in_batch but computes its micro-batch's mean
    itself (its loss_function names ForMaskedLMLoss, which its forward does not call): the
    callback took it for Σ/N and logged an n·Δ 4.8× the hand two-batch value. Now refused,
    found by running the micro-batch with the divisor N and 2N."""
    data = Padded(24, masked=True)
    if make is bert_classifier:
        for i, row in enumerate(data.rows):
            row["labels"] = torch.tensor(i % 3)
    with pytest.raises(BatchboundError) as info:
        run(tmp_path, make(), data)
    assert words in str(info.value) and "\n" not in str(info.value)


def neox() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=16, hidden_dropout=0.0,
        attention_dropout=0.0))


def test_batch_warmup_decides_on_a_token_estimate_in_sequences(tmp_path: Path) -> None:
    """A causal LM given labels makes the estimate one in tokens; the warmup's batch is in
    sequences. It compared the two as they were (B_noise of ~300 tokens against 2B = 8
    sequences), so it doubled about τ (the labelled tokens per sequence) times too early and
    set the noise rule's rate in the wrong units. It now reads B_noise per sequence:
    B_noise_tokens / τ, τ counted from the labels the model was given."""
    callback = integration.BatchWarmupCallback(every=3, decay=None)  # decides at the end
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=0.0, num_train_epochs=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    data = Padded(12)
    transformers.Trainer(model=neox(), args=args, train_dataset=data,
                         callbacks=[callback]).train()
    assert callback.unit == "tokens" and callback.monitor is not None
    per_sequence = sum(int(r["labels"][1:].ne(-100).sum()) for r in data.rows) / len(data)
    estimate = callback.estimate()
    tokens = callback.monitor
    assert estimate.noise_scale == pytest.approx(tokens.noise_scale / per_sequence, rel=1e-9)
    assert estimate.batch_bound == pytest.approx(1 + tokens.noise_scale / per_sequence,
                                                 rel=1e-9)
    assert estimate.batch_bound_se == pytest.approx(tokens.batch_bound_se / per_sequence,
                                                    rel=1e-9)
    # each decision's recorded n·Δ is the per-sequence one, as the rule read it
    assert callback.warmup is not None and callback.warmup.history
    assert callback.warmup.history[-1][3] == pytest.approx(estimate.batch_bound, rel=1e-9)


class Images(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"pixel_values": torch.randn(3, 8, 8, generator=g), "labels": torch.tensor(i % 3)}


class MultiLabelImages(Images):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(i), "labels": torch.tensor([1.0, 0.0, float(i % 2)])}


class Sentences(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(1, VOCAB, (6,), generator=g),
                "labels": torch.tensor(i % 3)}


def vit(problem_type: str | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, num_labels=3, problem_type=problem_type))


def llama_classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForSequenceClassification(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=16, num_labels=3,
        pad_token_id=0))


def test_a_vit_classifier_in_a_trainer_equals_the_two_batch_estimate_by_hand(
        tmp_path: Path) -> None:
    """ViT's classifier takes num_items_in_batch (its loss, ForSequenceClassificationLoss,
    is Σ cross entropy / N with N the labelled examples): it was refused as 'not a token
    loss'. Each example's weight is its label's."""
    model, data = vit(), Images
    start = copy.deepcopy(model).double().train()
    seen: list[dict[str, torch.Tensor]] = []
    handle = model.register_forward_pre_hook(
        lambda m, a, kw: seen.append({k: v.clone() for k, v in kw.items()
                                      if torch.is_tensor(v) and k != "num_items_in_batch"})
        if m.training and torch.is_grad_enabled() else None, with_kwargs=True)
    callback = integration.DiversityCallback(every=1, decay=None)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=3,
        gradient_accumulation_steps=2, learning_rate=0.0, num_train_epochs=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data(),
                                   callbacks=[callback])
    trainer.train()
    handle.remove()
    params = [p for p in start.parameters() if p.requires_grad]
    want = OnlineDiversity(12, decay=None)
    for step in range(len(seen) // 2):
        grads, sizes = [], []
        for batch in seen[2 * step: 2 * step + 2]:
            inputs = {k: v.double() if v.is_floating_point() else v
                      for k, v in batch.items() if k != "labels"}
            loss = F.cross_entropy(start(**inputs).logits, batch["labels"])
            grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(
                loss, params, materialize_grads=True)]))
            sizes.append(len(batch["labels"]))
        small = sum(float(g.square().sum()) for g in grads) / 2
        big = (grads[0] * sizes[0] + grads[1] * sizes[1]) / sum(sizes)
        want.update_two_batch(small, 2 / sum(1 / s for s in sizes), float(big.square().sum()),
                              sum(sizes))
    assert callback.monitor is not None and callback.monitor.steps == want.steps == 2
    assert callback.monitor.m2 == pytest.approx(want.m2, rel=1e-5)
    assert callback.monitor.cross == pytest.approx(want.cross, rel=1e-4, abs=1e-5 * want.m2)
    rows = [r for r in trainer.state.log_history if PREFIX + "diversity" in r]
    assert rows  # the items are examples: Δ = n·Δ / n is logged


@pytest.mark.parametrize("make, data", [(lambda: vit("multi_label_classification"),
                                         MultiLabelImages), (llama_classifier, Sentences)],
                         ids=["vit-multi-label", "llama-classifier"])
def test_a_classifier_whose_loss_ignores_the_divisor_is_refused(tmp_path: Path, make,
                                                                 data) -> None:
    """A multi-label ViT's BCEWithLogitsLoss is the micro-batch's mean whatever
    num_items_in_batch says, and Llama's classifier does not pass it to its loss."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=3,
        gradient_accumulation_steps=2, learning_rate=0.0, num_train_epochs=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(
        model=make(), args=args, train_dataset=data(),
        callbacks=[integration.DiversityCallback(every=1)])
    with pytest.raises(BatchboundError, match="does not divide by it") as info:
        trainer.train()
    assert "\n" not in str(info.value)
