"""Hugging Face-style dict batches, ``{"input_ids", "attention_mask", "labels"}``, in
``measure()``: the model called with ``model(**batch)``, the per-example loss from the
user's callable given the outputs and the batch (split by example: the first dimension of
every tensor in it), equal to the float64 per-example loop on a real GPT-2 from a small
config (no download)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader

from batchbound.diversity import measure
from batchbound.errors import BatchboundError

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, STEPS, N = 48, 10, 7


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB,
                                     n_positions=32, use_cache=False, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)  # the trainer trains
    return transformers.GPT2LMHeadModel(config).double().eval()


def examples() -> list[dict[str, Tensor]]:
    """Padded sequences as a tokenizer and collator leave them: the mask 0 and the label
    -100 on the padding."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(N):
        ids = torch.randint(1, VOCAB, (STEPS,), generator=g)
        mask = torch.ones(STEPS, dtype=torch.int64)
        mask[STEPS - i % 3 * 2:] = 0  # 0, 2 or 4 padded positions
        ids = ids * mask
        out.append({"input_ids": ids, "attention_mask": mask,
                    "labels": ids.masked_fill(mask == 0, -100)})
    return out


def lm_loss(outputs, batch: dict[str, Tensor]) -> Tensor:
    """Each sequence's summed next-token cross entropy over its labelled tokens."""
    logits, labels = outputs.logits[:, :-1], batch["labels"][:, 1:]
    return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100,
                           reduction="none").sum(dim=1)


def loop_reference(model: torch.nn.Module, rows: list[dict[str, Tensor]],
                   loss=None) -> tuple[float, float]:
    """S = Σ‖g_i‖² and T = ‖Σ g_i‖² of ``loss`` (default lm_loss), one example at a time,
    in float64."""
    loss = loss or lm_loss
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    S = 0.0
    for row in rows:
        batch = {k: v.unsqueeze(0) for k, v in row.items()}
        grads = torch.autograd.grad(loss(model(**batch), batch).sum(), params,
                                    allow_unused=True)
        for t, g in zip(total, grads, strict=True):
            if g is not None:
                t += g
                S += float(g.square().sum())
    return S, float(sum(t.square().sum() for t in total))


@pytest.mark.parametrize("engine", ["auto", "loop", "vmap"])
def test_gpt2_on_dict_batches_equals_the_float64_loop(engine: str) -> None:
    model, rows = gpt2(), examples()
    if engine == "vmap":  # GPT-2's attention-mask code branches on the data, which
        # torch.func.vmap cannot run (refused in one line, with or without dicts)
        rows = [{k: v for k, v in row.items() if k != "attention_mask"} for row in rows]
    loop_s, loop_t = loop_reference(model, rows)
    loader = DataLoader(rows, batch_size=3)  # dict batches of 3, 3 and 1: default collate
    report = measure(model, loader, lm_loss, engine=engine, chunk_size=2)
    assert report.n == N
    got_s, got_t = report.S, report.T
    assert got_s == pytest.approx(loop_s, rel=1e-9)
    assert got_t == pytest.approx(loop_t, rel=1e-9)
    assert report.extra["fallback_parameters"] == []


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict[str, Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return self.rows[i]


def test_a_torch_dataset_of_dicts_is_the_same() -> None:
    model, rows = gpt2(), examples()
    loop_s, _ = loop_reference(model, rows)
    got_s = measure(model, Rows(rows), lm_loss).S
    assert got_s == pytest.approx(loop_s, rel=1e-9)


def test_a_batch_encoding_is_a_dict_batch() -> None:
    """Hugging Face's collators (DataCollatorWithPadding) yield BatchEncoding, a mapping that
    is not a dict."""
    model, rows = gpt2(), examples()
    loop_s, _ = loop_reference(model, rows)
    loader = DataLoader(rows, batch_size=3, collate_fn=lambda items: transformers.BatchEncoding(
        {k: torch.stack([item[k] for item in items]) for k in items[0]}))
    got_s = measure(model, loader, lm_loss).S
    assert got_s == pytest.approx(loop_s, rel=1e-9)


def test_a_named_loss_is_refused_on_dict_batches() -> None:
    with pytest.raises(BatchboundError) as info:
        measure(gpt2(), DataLoader(examples(), batch_size=4), "sequence_cross_entropy")
    said = str(info.value)
    assert "needs the loss as a callable (outputs, batch)" in said and "\n" not in said


def test_a_dict_whose_tensors_disagree_on_the_examples_is_refused() -> None:
    rows = [{"input_ids": torch.ones(4, STEPS, dtype=torch.int64),
             "labels": torch.ones(3, STEPS, dtype=torch.int64)}]
    with pytest.raises(BatchboundError, match="one row per example"):
        measure(gpt2(), DataLoader(rows, batch_size=None), lm_loss)


# ---------------------------------------------------------------- advise on dict batches


def test_the_packed_rows_give_the_numbers_of_model_on_the_dict() -> None:
    """What advise's trainer sees (DictModel on packed rows, the loss on unpacked rows) has
    the per-example gradients of model(**batch): the float64 loop's S and T."""
    from batchbound.advise.batches import DictModel, dict_loss, pack_batches
    from batchbound.diversity.measure import data_chunks

    model, rows = gpt2(), examples()
    loop_s, loop_t = loop_reference(model, rows)
    chunks, _, _ = data_chunks(DataLoader(rows, batch_size=3), 4096)
    packing, packed = pack_batches(chunks)
    assert packed.shape == (N, 3 * STEPS) and packed.dtype == torch.int64
    report = measure(DictModel(model, packing), (packed, packed), dict_loss(lm_loss, packing))
    got_s, got_t = report.S, report.T
    assert got_s == pytest.approx(loop_s, rel=1e-9)
    assert got_t == pytest.approx(loop_t, rel=1e-9)


def assert_first_step_is_sgd(model, rows: list[dict[str, Tensor]], loss) -> None:
    """One SGD step of advise's trainer on ``rows`` (as dict batches) equals
    θ − η·mean ∇ loss(model(**one), one) over the examples its sampler drew, in float64."""
    from batchbound.advise.inputs import from_objects
    from batchbound.data import BatchSampler
    from batchbound.train.distributed import DistContext
    from batchbound.train.loop import Trainer

    lr, batch = 0.05, 4
    config, dataset, parts = from_objects(
        model, DataLoader(rows, batch_size=3), loss, lambda p: torch.optim.SGD(p, lr=lr),
        batch_size=batch, lr=None, seed=0, device="cpu")
    config = config.replace(dtype="float64", max_epochs=None, max_iterations=1,
                            eval_every_iterations=1)
    trainer = Trainer(config, DistContext(device=torch.device("cpu")), dataset=dataset,
                      parts=parts)
    assert trainer.run().status == "complete"
    picked = BatchSampler(len(rows), config.seed).next_indices(batch).tolist()
    params = [p for p in model.parameters() if p.requires_grad]
    mean = [torch.zeros_like(p) for p in params]
    for i in picked:
        one = {k: v.unsqueeze(0) for k, v in rows[i].items()}
        grads = torch.autograd.grad(loss(model(**one), one).sum(), params, allow_unused=True)
        for m, g in zip(mean, grads, strict=True):
            if g is not None:
                m += g / batch
    stepped = [p for p in trainer.model.parameters() if p.requires_grad]
    for p, m, q in zip(params, mean, stepped, strict=True):
        torch.testing.assert_close(q, p - lr * m, rtol=1e-9, atol=1e-12)


def test_the_trainers_first_step_is_sgd_on_model_of_the_dict() -> None:
    assert_first_step_is_sgd(gpt2(), examples(), lm_loss)


def test_advise_answers_for_gpt2_on_dict_batches() -> None:
    from batchbound.advise import advise

    g = torch.Generator().manual_seed(2)
    rows = [{"input_ids": ids, "attention_mask": torch.ones(STEPS, dtype=torch.int64),
             "labels": ids} for ids in torch.randint(1, VOCAB, (256, STEPS), generator=g)]
    advice = advise(gpt2().float().train(), DataLoader(rows, batch_size=32), lm_loss,
                    optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3), batch_size=8,
                    planned_epochs=4, pilot_fraction=0.25, critical_batch="noise",
                    max_workers=1)
    assert advice.pilot["metric"] == "adam"
    assert advice.rows and advice.batch_bound > 1


@pytest.mark.parametrize(("data", "loss", "words"), [
    (lambda rows: DataLoader(rows, batch_size=3), "sequence_cross_entropy",
     "dict batches need the loss as a callable"),
    (lambda rows: [({k: v for k, v in r.items() if k != "labels"}, r["labels"])
                   for r in rows], lm_loss, "give the targets inside the dict"),
    (lambda rows: DataLoader([{**r, "input_ids": r["input_ids"][:STEPS - i % 2]}
                              for i, r in enumerate(rows)], batch_size=1), lm_loss,
     "pad every batch to one length"),
    (lambda rows: DataLoader([{**r, "labels": r["labels"] + 2**53 + 1, "scale": torch.ones(1)}
                              for r in rows], batch_size=3), lm_loss,
     "does not survive packing in torch.float64"),
    (lambda rows: DataLoader([{**r, "labels": r["labels"].to(torch.int32 if i else torch.int64)}
                              for i, r in enumerate(rows)], batch_size=1), lm_loss,
     "labels changes dtype from one batch to the next"),
    (lambda rows: DataLoader([{**r, **({"extra": r["labels"]} if i else {})}
                              for i, r in enumerate(rows)], batch_size=1), lm_loss,
     "give every batch the same keys"),
])
def test_advise_refuses_what_it_cannot_pack_in_one_line(data, loss, words: str) -> None:
    from batchbound.advise import advise

    given = data(examples())
    if isinstance(given, list):  # (inputs dict, targets) pairs, as a DataLoader yields them
        given = DataLoader(given, batch_size=3)
    with pytest.raises(BatchboundError) as info:
        advise(gpt2(), given, loss, planned_epochs=2, critical_batch="noise", max_workers=1)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_watch_takes_model_of_the_dict_as_the_user_calls_it() -> None:
    """watch sees the user's own call, ``model(**batch)``: the same S and T as the loop."""
    from batchbound.diversity import OnlineDiversity, watch

    model, rows = gpt2(), examples()
    loop_s, loop_t = loop_reference(model, rows)
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    monitor = OnlineDiversity(1000, decay=0.0)
    with watch(model, monitor, reduction="sum"):
        lm_loss(model(**batch), batch).sum().backward()
    expected = OnlineDiversity(1000, decay=0.0)
    expected.update_from_norms(loop_s, loop_t, N)
    got_m2, got_cross = monitor.m2, monitor.cross
    assert got_m2 == pytest.approx(expected.m2, rel=1e-9)
    assert got_cross == pytest.approx(expected.cross, rel=1e-9, abs=1e-9 * expected.m2)


# ------------------------------------- other Hugging Face models; dicts of mixed dtypes


def cls_loss(outputs, batch: dict[str, Tensor]) -> Tensor:
    return F.cross_entropy(outputs.logits, batch["labels"], reduction="none")


def bert() -> tuple[torch.nn.Module, list[dict[str, Tensor]]]:
    """BertForSequenceClassification: input_ids, attention_mask, token_type_ids, labels."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, type_vocab_size=2, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(N):
        ids = torch.randint(1, 40, (8,), generator=g)
        mask = (torch.arange(8) < 8 - i % 4).long()
        rows.append({"input_ids": ids * mask, "attention_mask": mask,
                     "token_type_ids": (torch.arange(8) >= 4).long(),
                     "labels": ids[0] % 3})
    return transformers.BertForSequenceClassification(config).double().eval(), rows


def vit(dtype: torch.dtype = torch.float64) -> tuple[torch.nn.Module, list[dict[str, Tensor]]]:
    """ViTForImageClassification: float pixel_values beside int64 labels."""
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
        num_attention_heads=2, intermediate_size=32, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    g = torch.Generator().manual_seed(2)
    rows = [{"pixel_values": torch.randn(3, 8, 8, generator=g, dtype=dtype),
             "labels": torch.tensor(i % 3)} for i in range(N)]
    return transformers.ViTForImageClassification(config).to(dtype).eval(), rows


@pytest.mark.filterwarnings("ignore:batchbound. computing exact per-example")
@pytest.mark.parametrize("make", [bert, vit])
def test_hf_classifiers_on_dict_batches_equal_the_float64_loop(make) -> None:
    model, rows = make()
    loop_s, loop_t = loop_reference(model, rows, cls_loss)
    report = measure(model, DataLoader(rows, batch_size=4), cls_loss, chunk_size=3)
    got_s, got_t = report.S, report.T
    assert got_s == pytest.approx(loop_s, rel=1e-9)
    assert got_t == pytest.approx(loop_t, rel=1e-9)


def _packed(rows: list[dict[str, Tensor]], batch_size: int = 3):
    from batchbound.advise.batches import pack_batches
    from batchbound.diversity.measure import data_chunks

    chunks, _, _ = data_chunks(DataLoader(rows, batch_size=batch_size), 4096)
    return pack_batches(chunks)


def test_mixed_dtypes_come_back_bit_for_bit_in_the_runs_dtype() -> None:
    """float32 pixels, int64 labels (-100 among them) and a bool mask packed in float64; the
    trainer casts the rows to its dtype, as any float inputs: the integer keys come back
    in their own dtype, every value as it was, the float keys in the run's dtype."""
    g = torch.Generator().manual_seed(4)
    pixels = torch.randn(N, 3, 2, 2, generator=g) * 1e3
    labels = torch.randint(-100, 2**24, (N, 5), generator=g)
    labels[0, 0], labels[1, 1] = -100, 2**24  # the largest float32 holds exactly
    mask = torch.rand(N, 5, generator=g) > 0.5
    rows = [{"pixel_values": pixels[i], "labels": labels[i], "mask": mask[i]} for i in range(N)]
    packing, packed = _packed(rows)
    assert packed.dtype == torch.float64 and packed.shape == (N, 12 + 5 + 5)
    for dtype in (torch.float32, torch.float64):
        got = packing.unpack(packed.to(dtype))
        assert got["labels"].dtype == torch.int64 and torch.equal(got["labels"], labels)
        assert got["mask"].dtype == torch.bool and torch.equal(got["mask"], mask)
        assert got["pixel_values"].dtype == dtype
        assert torch.equal(got["pixel_values"], pixels.to(dtype))
    # one dtype: packed as it is, unpacked as copies of their own (a loss may write into them)
    packing, packed = _packed([{"a": pixels[i], "b": pixels[i, 0]} for i in range(N)])
    assert packed.dtype == torch.float32
    got = packing.unpack(packed)
    assert torch.equal(got["b"], pixels[:, 0]) and got["b"].data_ptr() != packed[:, 12:].data_ptr()


def test_integers_the_rows_cannot_hold_are_refused() -> None:
    """2^24 + 1 survives float64 packing but not a float32 run's cast (it would become
    2^24): refused on unpacking there, exact in float64; 2^53 + 1 is refused at packing."""
    rows = [{"pixel_values": torch.ones(2), "labels": torch.tensor(2**24 + i)} for i in range(3)]
    packing, packed = _packed(rows)
    assert packing.unpack(packed)["labels"].tolist() == [2**24, 2**24 + 1, 2**24 + 2]
    with pytest.raises(BatchboundError) as info:
        packing.unpack(packed.float())
    said = str(info.value)
    assert "labels (torch.int64) holds 16777218, beyond the 16777216" in said
    assert "\n" not in said
    rows = [{"pixel_values": torch.ones(2), "labels": torch.tensor(2**53 + 1)}]
    with pytest.raises(BatchboundError, match=r"labels \(torch.int64\) does not survive packing"):
        _packed(rows)


@pytest.mark.filterwarnings("ignore:batchbound. computing exact per-example")
def test_a_vit_on_packed_mixed_rows_gives_the_loops_numbers() -> None:
    """What advise's trainer sees for float pixel_values beside int64 labels: the float64
    loop's S and T, and its first SGD step θ − η·mean ∇ over the examples drawn."""
    from batchbound.advise.batches import DictModel, dict_loss

    model, rows = vit()
    loop_s, loop_t = loop_reference(model, rows, cls_loss)
    packing, packed = _packed(rows)
    report = measure(DictModel(model, packing), (packed, packed), dict_loss(cls_loss, packing))
    got_s, got_t = report.S, report.T
    assert got_s == pytest.approx(loop_s, rel=1e-9)
    assert got_t == pytest.approx(loop_t, rel=1e-9)

    assert_first_step_is_sgd(model, rows, cls_loss)


@pytest.mark.filterwarnings("ignore:batchbound. computing exact per-example")
def test_advise_answers_for_a_vit_on_float_pixels_and_int64_labels() -> None:
    """The image user's dicts in a float32 run, SGD with coupled weight decay."""
    from batchbound.advise import advise

    model, _ = vit(torch.float32)
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, 3, (192,), generator=g)
    pixels = torch.randn(192, 3, 8, 8, generator=g) + 2.0 * torch.eye(3)[labels][:, :, None,
                                                                                None]
    rows = [{"pixel_values": p, "labels": y} for p, y in zip(pixels, labels, strict=True)]
    advice = advise(model.train(), DataLoader(rows, batch_size=32), cls_loss,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01),
                    batch_size=8, planned_epochs=4, pilot_fraction=0.25,
                    critical_batch="noise", max_workers=1)
    assert advice.pilot["metric"] == "euclidean"
    assert advice.rows and advice.batch_bound > 1


def test_no_accuracy_is_read_off_the_packed_rows() -> None:
    """A model of dict batches that returns a tensor of logits (n, T, V), its dict one key
    of (n, T) token ids: the packed rows are those ids, and the (n, T, V)-against-(n, T)
    rule would count argmax == the current token as an accuracy. The rows are not labels:
    no accuracy is recorded."""
    from batchbound.advise.inputs import from_objects
    from batchbound.train.distributed import DistContext
    from batchbound.train.loop import Trainer

    class TinyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.out = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)

        def forward(self, input_ids: Tensor) -> Tensor:
            return self.out(self.embed(input_ids))

    def shifted(logits: Tensor, batch: dict[str, Tensor]) -> Tensor:
        return F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["input_ids"][:, 1:],
                               reduction="none").sum(dim=1)

    rows = [{"input_ids": r["input_ids"]} for r in examples()]
    torch.manual_seed(0)
    config, dataset, parts = from_objects(
        TinyLM(), DataLoader(rows, batch_size=3), shifted,
        lambda p: torch.optim.SGD(p, lr=0.1), batch_size=4, lr=None, seed=0, device="cpu")
    assert dataset.x_train.shape == (N, STEPS)  # the rows are the ids themselves
    config = config.replace(max_epochs=None, max_iterations=2, eval_every_iterations=1)
    result = Trainer(config, DistContext(device=torch.device("cpu")), dataset=dataset,
                     parts=parts).run()
    metrics = {row[3] for row in result.curves}
    assert "train_loss" in metrics and "train_acc" not in metrics
    assert "train_acc" not in result.final


@pytest.mark.parametrize(("collate", "words"), [
    (lambda items: {"input_ids": torch.stack([r["input_ids"] for r in items]),
                    "labels": np.stack([r["labels"].numpy() for r in items])}, "labels (ndarray)"),
    (lambda items: {"input_ids": torch.stack([r["input_ids"] for r in items]),
                    "labels": torch.stack([r["labels"] for r in items]),
                    "text": [f"row {i}" for i in range(len(items))]}, "text (list)"),
])
def test_a_value_that_is_not_a_tensor_is_refused_not_passed_to_every_example(
        collate, words: str) -> None:
    """A numpy array of labels (return_tensors='np') or a column of strings would reach
    each example's call whole: refused, naming the key."""
    with pytest.raises(BatchboundError) as info:
        measure(gpt2(), DataLoader(examples(), batch_size=3, collate_fn=collate), lm_loss)
    said = str(info.value)
    assert words in said and "are not torch tensors" in said and "\n" not in said


def test_a_collators_dynamic_padding_is_measured_and_refused_by_advise_in_one_line() -> None:
    """DataCollatorForLanguageModeling(mlm=False) pads each batch to its own longest, the
    padding -100 in the labels: measure() takes the batches as they come (the float64
    loop's S and T on the unpadded sequences); advise, which keeps one width, refuses in
    one line naming the lengths and the padding to give."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from batchbound.advise import advise

    words = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "far", "away", "big", "small"]
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend,
                                                     pad_token="[PAD]", unk_token="[UNK]")
    texts = ["the cat sat", "a dog ran far away", "the big cat sat on the mat", "a small dog",
             "the dog ran", "a cat sat on a mat far away", "big dog"]
    encoded = [dict(tokenizer(t)) for t in texts]
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    loader = DataLoader(encoded, batch_size=3, collate_fn=collator)
    assert len({next(iter(b.values())).shape[1] for b in loader}) > 1  # lengths differ
    model = gpt2()
    rows = [{"input_ids": torch.tensor(e["input_ids"]), "labels": torch.tensor(e["input_ids"]),
             "attention_mask": torch.tensor(e["attention_mask"])} for e in encoded]
    loop_s, loop_t = loop_reference(model, rows)
    report = measure(model, loader, lm_loss)
    got_s, got_t = report.S, report.T
    assert got_s == pytest.approx(loop_s, rel=1e-9)
    assert got_t == pytest.approx(loop_t, rel=1e-9)
    with pytest.raises(BatchboundError) as info:
        advise(gpt2(), loader, lm_loss, planned_epochs=2, critical_batch="noise", max_workers=1)
    said = str(info.value)
    assert "padded to different lengths (input_ids (7,) per example in one" in said
    assert "padding='max_length'" in said and "\n" not in said


@pytest.mark.filterwarnings("ignore:batchbound. computing exact per-example")
@pytest.mark.parametrize("make", [bert, vit])
def test_the_pilots_exact_estimate_equals_the_float64_loop(make) -> None:
    """advise's pilot (estimator 'exact') on BERT's four int64 keys, and on a ViT's float
    pixel_values beside int64 labels: its n·Δ at the initial weights is the float64
    per-example loop's n·S/T."""
    from batchbound.advise.inputs import from_objects
    from batchbound.advise.pilot import run_pilot

    model, rows = make()
    loop_s, loop_t = loop_reference(model, rows, cls_loss)
    config, dataset, parts = from_objects(
        model, DataLoader(rows, batch_size=3), cls_loss, lambda p: torch.optim.SGD(p, lr=0.05),
        batch_size=4, lr=None, seed=0, device="cpu")
    run = run_pilot(config.replace(dtype="float64"), dataset, torch.device("cpu"),
                    iterations=2, estimator="exact", exact_every_epochs=0.5, parts=parts)
    first = run.result.curve("batch_bound")[0]
    assert first[0] == 0
    assert first[3] == pytest.approx(N * loop_s / loop_t, rel=1e-9)


def test_a_key_order_that_changes_between_batches_packs_the_same_rows() -> None:
    """Each key goes to the columns the first batch gave it, whatever order a later batch
    lists its keys in."""
    rows = examples()
    calls = iter(range(100))

    def collate(items):
        keys = list(items[0]) if next(calls) % 2 == 0 else list(reversed(items[0]))
        return {k: torch.stack([item[k] for item in items]) for k in keys}

    from batchbound.advise.batches import pack_batches
    from batchbound.diversity.measure import data_chunks

    packing, packed = _packed(rows)
    chunks, _, _ = data_chunks(DataLoader(rows, batch_size=2, collate_fn=collate), 4096)
    _, shuffled = pack_batches(chunks)
    assert torch.equal(packed, shuffled)
    unpacked = packing.unpack(shuffled)
    for key in rows[0]:
        assert torch.equal(unpacked[key], torch.stack([r[key] for r in rows]))


def test_a_loss_that_returns_the_batchs_mean_is_refused_by_advise() -> None:
    """``lambda outputs, batch: outputs.loss`` (Hugging Face's mean over the batch) was summed
    by the trainer as if one example's: its steps n times too small, silently. Refused in
    one line, on dict batches and on (x, y) tensors alike."""
    from batchbound.advise import advise

    model, rows = vit(torch.float32)
    with pytest.raises(BatchboundError) as info:
        advise(model.train(), DataLoader(rows, batch_size=3), lambda out, batch: out.loss,
               batch_size=4, planned_iterations=400, critical_batch="noise", max_workers=1)
    said = str(info.value)
    assert "the loss must return one value per example, shape (" in said
    assert "got ()" in said
    assert "outputs.loss is the batch's mean" in said and "\n" not in said
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    with pytest.raises(BatchboundError, match=r"one value per example, shape \(\d+,\), got \(\)"):
        advise(torch.nn.Linear(4, 3), (x, y), lambda out, y: F.cross_entropy(out, y),
               batch_size=4, planned_iterations=400, critical_batch="noise", max_workers=1)


@pytest.mark.filterwarnings("ignore:batchbound. computing exact per-example")
@pytest.mark.parametrize("make", [bert, vit])
def test_a_memory_budget_takes_dict_batches(make) -> None:
    """memory_budget sizes the chunk from a forward on the first examples: on a dict batch
    that is model(**batch) (it called model(Inputs) and raised AttributeError)."""
    model, rows = make()
    loop_s, loop_t = loop_reference(model, rows, cls_loss)
    report = measure(model, DataLoader(rows, batch_size=4), cls_loss, memory_budget=2**20)
    got_s, got_t = report.S, report.T
    assert got_s == pytest.approx(loop_s, rel=1e-9)
    assert got_t == pytest.approx(loop_t, rel=1e-9)


@pytest.mark.filterwarnings("ignore:batchbound. computing exact per-example")
def test_one_dict_of_batched_tensors_is_the_whole_data() -> None:
    """A dict of batched tensors is all the data, as an (x, y) pair of tensors is: measure()
    gives the loop's S and T on it, advise packs it; a list of dicts is refused in one
    line naming the DataLoader to give."""
    from batchbound.advise.inputs import as_dataset

    model, rows = bert()
    loop_s, loop_t = loop_reference(model, rows, cls_loss)
    whole = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    report = measure(model, whole, cls_loss, chunk_size=3)
    assert report.n == N
    got_s, got_t = report.S, report.T
    assert got_s == pytest.approx(loop_s, rel=1e-9)
    assert got_t == pytest.approx(loop_t, rel=1e-9)
    dataset, packing = as_dataset(whole)
    assert packing is not None and dataset.n_train == N
    with pytest.raises(BatchboundError) as info:
        measure(model, rows, cls_loss)
    said = str(info.value)
    assert "give DataLoader(data, batch_size=...)" in said and "\n" not in said


# ------------------------------------------- a loss that writes into its batch in place


def masking_loss(outputs, batch: dict[str, Tensor]) -> Tensor:
    """lm_loss after masking each sequence's first label in place, as a user's loss may."""
    batch["labels"][:, :2] = -100
    return lm_loss(outputs, batch)


class DropScale(torch.nn.Module):
    """model(**batch) without the float key the mixed rows carry beside the text."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, scale: Tensor | None = None, **batch: Tensor):
        return self.inner(**batch)


@pytest.mark.parametrize("mixed", [False, True])
def test_unpacked_tensors_are_copies_not_views_of_the_rows(mixed: bool) -> None:
    """Writing into every tensor of an unpacked dict batch leaves the packed rows as they
    were (one dtype: the rows are int64 as the keys; mixed: float64 beside a float key)."""
    rows = examples()
    if mixed:
        rows = [{**r, "scale": torch.ones(1, dtype=torch.float64)} for r in rows]
    packing, packed = _packed(rows)
    before = packed.clone()
    for value in packing.unpack(packed).values():
        value.fill_(7)
    assert torch.equal(packed, before)


@pytest.mark.parametrize("mixed", [False, True])
def test_a_loss_writing_into_its_batch_leaves_the_numbers_as_they_were(mixed: bool) -> None:
    """advise's stored examples are packed rows; a loss that edits batch["labels"] in place
    gets tensors of its own, so the rows, and the next measurement's numbers, stay those of
    the data given: S twice over equals the float64 loop of the same loss on fresh copies."""
    from batchbound.advise.batches import DictModel, dict_loss

    model, rows = gpt2(), examples()
    params = [p for p in model.parameters() if p.requires_grad]
    loop_s = 0.0
    for row in rows:
        one = {k: v.unsqueeze(0).clone() for k, v in row.items()}
        loss = masking_loss(model(**one), one).sum()
        loop_s += sum(float(g.square().sum()) for g in torch.autograd.grad(
            loss, params, allow_unused=True) if g is not None)
    if mixed:
        rows = [{**r, "scale": torch.ones(1, dtype=torch.float64)} for r in rows]
    packing, packed = _packed(rows)
    before = packed.clone()
    wrapped = DictModel(DropScale(model), packing)
    for _ in range(2):
        got = measure(wrapped, (packed, packed), dict_loss(masking_loss, packing)).S
        assert got == pytest.approx(loop_s, rel=1e-9)
    assert torch.equal(packed, before)


def test_the_packed_rows_move_once_as_inputs_and_targets() -> None:
    """advise's dict-batch data set holds the rows as inputs and targets both: moved to the
    run's dtype (and device) they stay one tensor, not two copies of the training set."""
    from batchbound.advise.inputs import as_dataset

    _, rows = vit()
    dataset, packing = as_dataset(DataLoader(rows, batch_size=3))
    assert packing is not None and dataset.y_train is dataset.x_train
    moved = dataset.to("cpu", torch.float32)
    assert moved.x_train.dtype == torch.float32
    assert moved.y_train is moved.x_train
    assert torch.equal(moved.x_train, dataset.x_train.to(torch.float32))
