"""DiversityCallback on a real Hugging Face Trainer (CPU, gradient_accumulation_steps=2):
the keys reach state.log_history, and equal the two-batch estimate computed by hand from the
micro-batches the model actually saw, for a plain nn.Module returning {"loss": mean} and for
a tiny GPT-2 whose loss the Trainer normalises by the step's label tokens; attach() puts the
keys in front of the report_to integrations (TensorBoard here)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError

if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed (pip install 'batchbound[hf]')",
                allow_module_level=True)
# installed but broken (e.g. a mismatched torchvision): this import fails, naming the cause
from batchbound.integrations import transformers as integration

transformers = integration.transformers
DiversityCallback = integration.DiversityCallback

PREFIX = "gradient_diversity/"


class Pairs(Dataset):
    def __init__(self, n: int, d: int = 6, classes: int = 3) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, d, generator=g, dtype=torch.float64)
        self.y = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Net(nn.Module):
    """A plain module the Trainer can train; it records the batches it is given."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training:
            self.seen.append((x.detach().clone(), labels.detach().clone()))
        return {"loss": F.cross_entropy(self.body(x), labels)}


def arguments(tmp_path: Path, **kwargs) -> transformers.TrainingArguments:
    defaults = dict(output_dir=str(tmp_path), per_device_train_batch_size=4,
                    gradient_accumulation_steps=2, learning_rate=0.0, weight_decay=0.0,
                    num_train_epochs=2, logging_steps=1000, save_strategy="no", report_to=[],
                    use_cpu=True, disable_tqdm=True, seed=0)
    return transformers.TrainingArguments(**{**defaults, **kwargs})


def two_batch_reference(grads: list[torch.Tensor], sizes: list[float], weighted: bool,
                        monitor: OnlineDiversity) -> None:
    """One step by hand: micro-batch mean gradients → McCandlish et al.'s pair."""
    small = sum(float(g.double().square().sum()) for g in grads) / len(grads)
    harmonic = len(sizes) / sum(1 / b for b in sizes)
    if weighted:  # loss normalised by the step's total count: the mean over all its items
        big = sum(b * g for b, g in zip(sizes, grads, strict=True)) / sum(sizes)
        big_size = sum(sizes)
    else:  # each micro-batch's mean / k
        big = sum(grads) / len(grads)
        big_size = 1 / sum(1 / (len(sizes) ** 2 * b) for b in sizes)
    monitor.update_two_batch(small, harmonic, float(big.double().square().sum()), big_size)


def flat_grad(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def test_plain_module_matches_hand_two_batch(tmp_path: Path) -> None:
    n = 44  # 11 micro-batches of 4 per epoch: the last step of each epoch has one (skipped)
    model, data = Net(), Pairs(n)
    callback = DiversityCallback(every=1, decay=None)
    trainer = transformers.Trainer(model=model, args=arguments(tmp_path), train_dataset=data,
                                   callbacks=[callback])
    trainer.train()
    rows = [r for r in trainer.state.log_history if PREFIX + "batch_bound" in r]
    # by hand, from the micro-batches the model saw, two per optimizer step
    reference, expected = OnlineDiversity(n, decay=None), []
    steps_per_epoch = [list(range(0, 10, 2)), [10]]
    for epoch in range(2):
        base = 11 * epoch
        for start in steps_per_epoch[0]:
            micro = model.seen[base + start: base + start + 2]
            grads = [flat_grad(model.body, F.cross_entropy(model.body(x), y)) for x, y in micro]
            two_batch_reference(grads, [len(y) for _, y in micro], False, reference)
            expected.append(reference.to_dict())
        expected.append(reference.to_dict())  # the one-micro-batch step adds nothing
    assert len(model.seen) == 22
    assert len(rows) == len(expected) == 12
    for row, want in zip(rows, expected, strict=True):
        assert row[PREFIX + "batch_bound"] == pytest.approx(want["batch_bound"], rel=1e-9)
        assert row[PREFIX + "diversity"] == pytest.approx(want["diversity"], rel=1e-9)
    last = rows[-1]
    assert {k for k in last if k.startswith(PREFIX)} == {
        PREFIX + k for k in ("batch_bound", "batch_bound_se", "noise_scale", "noise_scale_se",
                             "diversity", "diversity_se")}
    assert last[PREFIX + "noise_scale"] == pytest.approx(last[PREFIX + "batch_bound"] - 1)
    assert callback.monitor.steps == 10


class Tokens(Dataset):
    def __init__(self, n: int, length: int = 9, vocab: int = 17) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=17, n_positions=16, n_embd=8, n_layer=1,
                                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def test_token_normalised_loss_counts_tokens(tmp_path: Path) -> None:
    model, data = tiny_gpt2(), Tokens(32)
    seen: list[torch.Tensor] = []
    handle = model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["input_ids"].clone()) if m.training else None,
        with_kwargs=True)
    callback = DiversityCallback(every=2, decay=None)
    trainer = transformers.Trainer(model=model, args=arguments(tmp_path, num_train_epochs=1),
                                   train_dataset=data, callbacks=[callback])
    trainer.train()
    handle.remove()
    assert callback.unit == "tokens"
    rows = [r for r in trainer.state.log_history if PREFIX + "batch_bound" in r]
    assert len(rows) == 2
    assert not any(k.startswith(PREFIX + "diversity") for k in rows[-1])  # n is in examples
    # by hand: per micro-batch the mean over its shifted label tokens
    reference = OnlineDiversity(None, decay=None)
    for start in range(0, len(seen), 2):
        grads, sizes = [], []
        for ids in seen[start:start + 2]:
            grads.append(flat_grad(model, model(input_ids=ids, labels=ids).loss))
            sizes.append(float(ids[:, 1:].numel()))
        two_batch_reference(grads, sizes, True, reference)
    assert callback.monitor.steps == reference.steps == 4
    assert rows[-1][PREFIX + "batch_bound"] == pytest.approx(reference.batch_bound, rel=1e-4)
    assert callback.monitor.cross == pytest.approx(reference.cross, rel=1e-4)


def test_attach_reaches_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    trainer = transformers.Trainer(
        model=Net(), args=arguments(tmp_path, report_to=["tensorboard"]),
        train_dataset=Pairs(16))
    DiversityCallback(every=2).attach(trainer)
    trainer.train()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = [EventAccumulator(str(p.parent)) for p in tmp_path.rglob("events.*")]
    assert events
    tags = set()
    for acc in events:
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert "train/" + PREFIX + "batch_bound" in tags  # the TensorBoard integration wrote it
    history = [r for r in trainer.state.log_history if PREFIX + "batch_bound" in r]
    assert history and math.isfinite(history[-1][PREFIX + "batch_bound"])


def test_needs_accumulation(tmp_path: Path) -> None:
    trainer = transformers.Trainer(model=Net(), args=arguments(
        tmp_path, gradient_accumulation_steps=1), train_dataset=Pairs(8),
        callbacks=[DiversityCallback()])
    with pytest.raises(BatchboundError, match="gradient_accumulation_steps"):
        trainer.train()


class TakesAnyKeyword(Net):
    """A forward with **kwargs, as users write it: the Trainer passes num_items_in_batch."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor, **kwargs) -> dict[str, torch.Tensor]:
        return super().forward(x, labels)


def test_a_plain_module_taking_any_keyword_is_told_how_to_opt_out(tmp_path: Path) -> None:
    """The refusal named a loss ("not one whose tokens DiversityCallback can count") where
    the cause is the forward's **kwargs; the way out it names works."""
    trainer = transformers.Trainer(model=TakesAnyKeyword(), args=arguments(tmp_path),
                                   train_dataset=Pairs(8), callbacks=[DiversityCallback()])
    with pytest.raises(BatchboundError, match=r"\*\*kwargs.*accepts_loss_kwargs = False"):
        trainer.train()
    model = TakesAnyKeyword()
    model.accepts_loss_kwargs = False
    callback = DiversityCallback(every=1, decay=None)
    transformers.Trainer(model=model, args=arguments(tmp_path), train_dataset=Pairs(16),
                         callbacks=[callback]).train()
    assert callback.monitor.steps == 4


def test_a_run_shorter_than_every_leaves_its_estimate_in_metrics(tmp_path: Path) -> None:
    callback = DiversityCallback(decay=None)  # every=50, over 4 steps: nothing logged
    transformers.Trainer(model=Net(), args=arguments(tmp_path), train_dataset=Pairs(16),
                         callbacks=[callback]).train()
    assert callback.monitor.steps == 4
    assert callback.metrics[PREFIX + "batch_bound"] == callback.monitor.batch_bound


class Recording(transformers.Trainer):
    """Keeps each optimizer step's weights and micro-batches; on odd steps (``again``) its
    loss runs the model a second time on the same examples (a consistency term)."""

    again = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        x, y = inputs["x"], inputs["labels"]
        if not self.steps or self.steps[-1][2] != self.state.global_step:
            self.steps.append(({k: v.clone() for k, v in model.state_dict().items()}, [],
                               self.state.global_step))
        self.steps[-1][1].append((x, y))
        return step_loss(model, x, y, self.again and self.state.global_step % 2 == 1)


def step_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, again: bool) -> torch.Tensor:
    loss = model(x, y)["loss"]
    return loss + 0.5 * model(0.9 * x, y)["loss"] if again else loss


def recorded_reference(trainer: Recording, n: int) -> OnlineDiversity:
    """The two-batch estimate by hand from the steps' own micro-batches and weights."""
    reference = OnlineDiversity(n, decay=None)
    for state, micro, step in trainer.steps:
        model = Net()
        model.load_state_dict(state)
        again = trainer.again and step % 2 == 1
        grads = [flat_grad(model.body, step_loss(model, x, y, again)) for x, y in micro]
        if len(grads) > 1:
            two_batch_reference(grads, [len(y) for _, y in micro], False, reference)
    return reference


def test_a_loss_that_runs_the_model_again_on_some_steps(tmp_path: Path) -> None:
    """The micro-batches were counted by training forwards: a second forward on odd steps
    read their micro-batch gradients 2× too large, the bound 41 % off (an outside review).
    The Trainer's own events count them now."""
    trainer = Recording(model=Net(), args=arguments(tmp_path, learning_rate=0.05),
                        train_dataset=Pairs(24), callbacks=[DiversityCallback(every=1,
                                                                              decay=None)])
    trainer.again, trainer.steps = True, []
    trainer.train()
    callback = next(c for c in trainer.callback_handler.callbacks
                    if isinstance(c, DiversityCallback))
    reference = recorded_reference(trainer, 24)
    assert callback.monitor.steps == reference.steps == 6
    assert callback.monitor.m2 == pytest.approx(reference.m2, rel=1e-9)
    assert callback.monitor.batch_bound == pytest.approx(reference.batch_bound, rel=1e-9)


def test_branch_warmup_beside_the_diversity_callback(tmp_path: Path) -> None:
    """BranchWarmupCallback's branches run the model with gradients between steps; the
    diversity callback counted them into the next step (a bound 12× off)."""
    diversity = DiversityCallback(every=1, decay=None)
    branches = integration.BranchWarmupCallback(every=2, steps=1)
    trainer = Recording(model=Net(), args=arguments(tmp_path, learning_rate=0.05),
                        train_dataset=Pairs(40), callbacks=[branches, diversity])
    trainer.steps = []
    trainer.train()
    assert branches.warmup is not None and branches.warmup.branch_steps > 0
    reference = recorded_reference(trainer, 40)
    assert diversity.monitor.steps == reference.steps
    assert diversity.monitor.m2 == pytest.approx(reference.m2, rel=1e-9)
    assert diversity.monitor.batch_bound == pytest.approx(reference.batch_bound, rel=1e-9)


class OtherExamples(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        x, y = inputs["x"], inputs["labels"]
        return model(x, y)["loss"] + model(x[:2], y[:2])["loss"]


def test_a_second_forward_on_other_examples_is_refused(tmp_path: Path) -> None:
    trainer = OtherExamples(model=Net(), args=arguments(tmp_path), train_dataset=Pairs(16),
                            callbacks=[DiversityCallback()])
    with pytest.raises(BatchboundError, match="on 2 examples after 4 in one micro-batch"):
        trainer.train()
