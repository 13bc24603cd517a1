"""The Hugging Face DiversityCallback under Trainer options and models earlier passes had not
tried, on a real ``transformers.Trainer`` (CPU, gradient_accumulation_steps=2,
learning rate 0, tiny models from configs):

- ``label_smoothing_factor``: the Trainer pops the labels and computes the loss outside the
  model, so the forward gets ``num_items_in_batch`` and no labels; the callback's probe read
  the model's loss and stopped training with a bare ``KeyError: 'loss'``. Now one line.
- Mixtral (top-2 routing) with ``output_router_logits=True``: its loss adds the
  load-balancing loss of the micro-batch, which is not a sum over tokens divided by
  ``num_items_in_batch``: refused (it was, blaming "a micro-batch's mean"; the message now
  names the auxiliary loss). Without it, the estimate in tokens equals McCandlish et al.'s
  two-batch quantities by hand in float64.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError

if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed (pip install 'batchbound[hf]')",
                allow_module_level=True)
from batchbound.integrations import transformers as integration

transformers = integration.transformers
transformers.logging.set_verbosity_error()
VOCAB, LENGTH, ROWS = 23, 10, 12


def rows() -> list[dict[str, torch.Tensor]]:
    """Sequences padded at the end (mask 0, label -100) on 0 to 5 positions."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(ROWS):
        ids = torch.randint(1, VOCAB, (LENGTH,), generator=g)
        mask = (torch.arange(LENGTH) < LENGTH - i * 7 % 6).long()
        out.append({"input_ids": ids * mask, "attention_mask": mask,
                    "labels": ids.masked_fill(mask == 0, -100)})
    return out


def mixtral(aux: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_hidden_layers=1, hidden_size=16, intermediate_size=12, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=16, use_cache=False,
        num_local_experts=4, num_experts_per_tok=2, output_router_logits=aux,
        router_aux_loss_coef=0.1))


def gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0))


def run(tmp_path: Path, model: torch.nn.Module, seen: list | None = None, **options
        ) -> integration.DiversityCallback:
    if seen is not None:
        model.register_forward_pre_hook(
            lambda m, a, kw: seen.append({k: kw[k].clone() for k in
                                          ("input_ids", "attention_mask", "labels")})
            if m.training and torch.is_grad_enabled() else None, with_kwargs=True)
    callback = integration.DiversityCallback(every=1, decay=None)
    args = transformers.TrainingArguments(**{**dict(
        output_dir=str(tmp_path), per_device_train_batch_size=3,
        gradient_accumulation_steps=2, learning_rate=0.0, weight_decay=0.0,
        num_train_epochs=1, logging_steps=1000, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0), **options})
    transformers.Trainer(model=model, args=args, train_dataset=rows(),
                         callbacks=[callback]).train()
    return callback


def test_label_smoothing_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(BatchboundError) as info:
        run(tmp_path, gpt2(), label_smoothing_factor=0.1)
    said = str(info.value)
    assert "got no labels" in said and "label_smoothing_factor" in said and "\n" not in said


def test_mixtral_with_its_load_balancing_loss_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(BatchboundError) as info:
        run(tmp_path, mixtral(aux=True))
    said = str(info.value)
    assert "load-balancing loss" in said and "\n" not in said


def test_mixtral_without_it_equals_the_hand_two_batch_in_tokens(tmp_path: Path) -> None:
    model, seen = mixtral(aux=False), []
    start = copy.deepcopy(model).double()
    start.config._experts_implementation = "eager"  # grouped_mm computes no float64
    got = run(tmp_path, model, seen).monitor
    params = [p for p in start.parameters() if p.requires_grad]
    want = OnlineDiversity(None, decay=None)
    for step in range(len(seen) // 2):
        grads, counts = [], []
        for batch in seen[2 * step: 2 * step + 2]:
            logits = start(input_ids=batch["input_ids"],
                           attention_mask=batch["attention_mask"]).logits[:, :-1]
            labels = batch["labels"][:, 1:]
            loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100,
                                   reduction="sum")
            grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(
                loss, params, allow_unused=True, materialize_grads=True)]))
            counts.append(int(labels.ne(-100).sum()))
        small = sum(float((g / c).square().sum()) for g, c in zip(grads, counts, strict=True)) / 2
        big = float((sum(grads) / sum(counts)).square().sum())
        want.update_two_batch(small, 2 / sum(1 / c for c in counts), big, sum(counts))
    assert got.steps == want.steps == 2
    assert got.m2 == pytest.approx(want.m2, rel=1e-5)
    assert got.cross == pytest.approx(want.cross, rel=1e-4)


class Finetune(torch.nn.Module):
    """A frozen backbone and a head, given {"x", "labels"} rows; records what it trains on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = torch.nn.Linear(6, 5).double().requires_grad_(False)
        self.head = torch.nn.Linear(5, 3).double()
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.backbone(x)))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            self.seen.append((x.clone(), labels.clone()))
        return {"loss": F.cross_entropy(self.logits(x), labels)}


class UnfreezeAtEpoch1(transformers.TrainerCallback):
    def on_epoch_begin(self, args, state, control, model=None, **kwargs) -> None:
        if state.epoch >= 1:
            model.backbone.requires_grad_(True)


def test_the_estimate_follows_a_backbone_unfrozen_during_training(tmp_path: Path) -> None:
    """The hooks were put on the parameters trainable at train start: once the backbone
    trained too, the head's n·Δ was logged as the model's. Every step must equal the
    two-batch estimate over the parameters that train in that step."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 6, generator=g, dtype=torch.float64), torch.zeros(16, dtype=torch.long)
    model = Finetune()
    callback = integration.DiversityCallback(every=1, decay=0.0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=0.0, weight_decay=0.0, num_train_epochs=2, logging_steps=1000,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    rows = [{"x": a, "labels": b} for a, b in zip(x, y, strict=True)]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows,
                                   callbacks=[UnfreezeAtEpoch1(), callback])
    trainer.train()
    got = [r["gradient_diversity/batch_bound"] for r in trainer.state.log_history
           if "gradient_diversity/batch_bound" in r]
    head = list(model.head.parameters())
    want = []
    for step in range(len(model.seen) // 2):  # two steps an epoch, the backbone from epoch 1
        params = head if step < 2 else list(model.backbone.parameters()) + head
        grads = [torch.cat([d.reshape(-1) for d in torch.autograd.grad(
            F.cross_entropy(model.logits(a), b), params)]) for a, b in model.seen[2 * step:
                                                                               2 * step + 2]]
        reference = OnlineDiversity(16, decay=0.0)
        reference.update_two_batch(sum(float(d.square().sum()) for d in grads) / 2, 4,
                                   float((sum(grads) / 2).square().sum()), 8)
        want.append(reference.batch_bound)
    assert len(model.seen) == 8
    assert got == pytest.approx(want, rel=1e-9)


class Classifier(torch.nn.Module):
    """Logits of {"x", "labels"} rows, and their mean cross-entropy when given labels (its
    forward takes no **kwargs: the Trainer divides its loss by the accumulation steps)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                                       torch.nn.Linear(5, 3)).double()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None
                ) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"logits": logits} if labels is None else {
            "logits": logits, "loss": F.cross_entropy(logits, labels)}


class MeanFromLogits(transformers.Trainer):
    """A subclass computing the loss itself from the logits: the micro-batch's mean."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        loss = F.cross_entropy(outputs["logits"], labels)
        return (loss, outputs) if return_outputs else loss


def classify(tmp_path: Path, trainer: type = transformers.Trainer, reduction: str | None = None,
             rows: int = 10, accumulation: int = 2, model: torch.nn.Module | None = None,
             **options) -> integration.DiversityCallback:
    """``rows`` rows in micro-batches of 3, ``accumulation`` a step: with 10 and 2, the last
    step's are 3 and 1 examples; with 24 and 3, the last step has 2 micro-batches."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, 6, generator=g, dtype=torch.float64)
    y = torch.randint(3, (rows,), generator=g)
    callback = integration.DiversityCallback(every=1, decay=None, reduction=reduction)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=3,
        gradient_accumulation_steps=accumulation, learning_rate=0.0, weight_decay=0.0,
        num_train_epochs=2, logging_steps=1000, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0)
    trainer(model=model or Classifier(), args=args, callbacks=[callback], **options,
            train_dataset=[{"x": x[i], "labels": y[i]} for i in range(rows)]).train()
    return callback


def test_a_loss_computed_outside_the_model_is_refused_unless_its_reduction_is_said(
        tmp_path: Path) -> None:
    """A compute_loss_func (here Σ loss / num_items_in_batch) or a subclass's compute_loss
    from the logits weighs the micro-batch's examples as the callback cannot see: taken for
    a mean, an outside review's Σ / num_items_in_batch was 28 % off, silently. Refused in
    one line now, unless ``reduction`` is given; a subclass's mean said so gives what the
    model's own mean loss gives, step for step."""
    def summed(outputs, labels, num_items_in_batch=None):
        return F.cross_entropy(outputs["logits"], labels, reduction="sum") / num_items_in_batch

    for options in ({"compute_loss_func": summed}, {"trainer": MeanFromLogits}):
        with pytest.raises(BatchboundError) as info:
            classify(tmp_path, **options)
        said = str(info.value)
        assert "computes the loss outside Classifier's forward" in said and "\n" not in said
    own = classify(tmp_path)  # the model's own loss: nothing to say
    said = classify(tmp_path, trainer=MeanFromLogits, reduction="mean")
    assert said.monitor.steps == own.monitor.steps == 4
    assert said.monitor.m2 == pytest.approx(own.monitor.m2, rel=1e-12)
    assert said.monitor.cross == pytest.approx(own.monitor.cross, rel=1e-12)


def test_a_loss_the_trainer_leaves_undivided_is_read_as_the_trainer_leaves_it(
        tmp_path: Path) -> None:
    """The Trainer divides a loss by the accumulation steps unless ``loss_is_scaled_for_ga``,
    which a ``compute_loss_func`` sets by default; such a loss is normalised over the whole
    step (Transformers' contract): Σ loss / ``num_items_in_batch`` said to be a sum, read as
    divided by k, weighed steps of 9 and 6 examples wrongly against each other. Now it
    gives what the model's own mean gives, step for step (micro-batches of 3 alike, steps of
    3, 3 and 2 of them); so does a subclass that divides its mean by k itself and says so."""
    def summed(outputs, labels, num_items_in_batch=None):
        return F.cross_entropy(outputs["logits"], labels, reduction="sum") / num_items_in_batch

    class DividesItself(MeanFromLogits):
        loss_is_scaled_for_ga = True

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, False, num_items_in_batch)
            return loss / self.current_gradient_accumulation_steps

    own = classify(tmp_path, rows=24, accumulation=3)
    for reduction, options in (("sum", {"compute_loss_func": summed}),
                               ("mean", {"trainer": DividesItself})):
        said = classify(tmp_path, rows=24, accumulation=3, reduction=reduction, **options)
        assert said.monitor.steps == own.monitor.steps == 6
        assert said.monitor.m2 == pytest.approx(own.monitor.m2, rel=1e-12)
        assert said.monitor.cross == pytest.approx(own.monitor.cross, rel=1e-12)


def test_a_refusal_takes_the_callbacks_hooks_off_the_model(tmp_path: Path) -> None:
    """Raised inside the model's forward, the refusal ends ``train`` without
    ``on_train_end``: the hooks it left refused the user's retry on the same model (another
    Trainer, even one without the callback) with an unrelated error (an outside review)."""
    model = Classifier()
    with pytest.raises(BatchboundError, match="computes the loss outside"):
        classify(tmp_path, trainer=MeanFromLogits, model=model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all(not p._backward_hooks for p in model.parameters())
    said = classify(tmp_path, trainer=MeanFromLogits, reduction="mean", model=model)
    assert said.monitor.steps == 4


def test_a_callback_restored_from_a_checkpoint_has_its_reduction_said() -> None:
    """With restore_callback_states_from_checkpoint the Trainer builds the callback from no
    arguments and sets the attributes its checkpoint saved: the reduction is then said (the
    saved run passed the check on a loss outside the model, or came before it); a
    checkpoint from before this check was refused as if none were said (an outside review)."""
    saved = integration.DiversityCallback(every=3).state()
    restored = integration.DiversityCallback(**saved["args"])
    for name, value in saved["attributes"].items():
        setattr(restored, name, value)
    assert restored.reduction == "mean"  # said: no refusal of a loss outside the model
    assert restored.settings() == {k: saved["attributes"][k] for k in restored.settings()}


class OwnSumBeside(transformers.Trainer):
    """A subclass that leaves the labels in (the model computes its mean loss) and returns
    its own sum from the logits: the model's loss is never backpropagated."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        loss = F.cross_entropy(outputs["logits"], inputs["labels"], reduction="sum")
        return (loss, outputs) if return_outputs else loss


class PlusATerm(transformers.Trainer):
    """A subclass that builds on the model's own loss (a penalty added)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, False, num_items_in_batch)
        return loss + 0.0 * sum(p.square().sum() for p in model.parameters())


def test_a_model_loss_the_backward_never_reaches_is_refused(tmp_path: Path) -> None:
    """The model's output holds its loss, but the Trainer backpropagates another, computed
    beside it: read as the model's mean, an outside review's own sum was 12.5 % high. The
    first micro-batch's backward must reach a loss the model returned; one built on it (a
    penalty added) passes, unchecked in its scale."""
    with pytest.raises(BatchboundError) as info:
        classify(tmp_path, trainer=OwnSumBeside)
    said = str(info.value)
    assert "does not use the loss the model returned" in said and "\n" not in said
    assert classify(tmp_path, trainer=OwnSumBeside, reduction="sum").monitor.steps == 4
    assert classify(tmp_path, trainer=PlusATerm).monitor.steps == 4
