"""The HF DiversityCallback's estimate is saved with the Trainer's checkpoints and continued
on resume_from_checkpoint: a run stopped at step 5 and resumed ends with the estimate of the
run that was never stopped (the same steps folded in, to rounding), with the Trainer's own
restore of callback states or without it, in examples and in tokens. A second train()
that does not resume starts afresh. The batch-size warmups continue too: resumed inside an
epoch they grow where the unbroken run grew; resumed after a growth, they go on at the
grown accumulation and say that the Trainer skipped batches counted at the given one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed (pip install 'batchbound[hf]')",
                allow_module_level=True)
from test_integrations_transformers import Net, Pairs, Tokens, arguments, tiny_gpt2
from test_integrations_warmup import Digits, HFNet

from batchbound.integrations import transformers as integration

transformers = integration.transformers
DiversityCallback = integration.DiversityCallback


def _train(tmp_path: Path, model, data, resume: str | None = None, make=None, **options):
    """The DiversityCallbacks after training; ``make``: the callbacks (one of every=3)."""
    callbacks = make() if make is not None else [DiversityCallback(every=3)]
    args = arguments(tmp_path, learning_rate=0.05, save_strategy="steps", save_steps=5,
                     **options)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    # the Trainer's own restore puts a copy of the callback in place of the one it was given
    return [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, DiversityCallback)]


def checkpoint_5(tmp_path: Path) -> str:
    return str(tmp_path / "a" / "checkpoint-5")


def _same_estimate(resumed: DiversityCallback, unbroken: DiversityCallback) -> None:
    a, b = resumed.monitor.state_dict(), unbroken.monitor.state_dict()
    assert a["steps"] == b["steps"] > 5
    for part in ("sums", "fast"):
        for key, value in b[part].items():
            assert a[part][key] == pytest.approx(value, rel=1e-9, abs=1e-12), (part, key)
    assert resumed.metrics == pytest.approx(unbroken.metrics, rel=1e-9)


@pytest.mark.parametrize("restore", [False, True])
def test_a_resumed_run_continues_the_estimate(tmp_path: Path, restore: bool) -> None:
    (unbroken,) = _train(tmp_path / "a", Net(), Pairs(48),
                         restore_callback_states_from_checkpoint=restore)
    (resumed,) = _train(tmp_path / "b", Net(), Pairs(48), resume=checkpoint_5(tmp_path),
                        restore_callback_states_from_checkpoint=restore)
    assert unbroken.monitor.steps == 12  # 6 optimizer steps of 2 micro-batches an epoch
    _same_estimate(resumed, unbroken)


def test_a_resumed_token_estimate_continues_in_tokens(tmp_path: Path) -> None:
    (unbroken,) = _train(tmp_path / "a", tiny_gpt2(), Tokens(48))
    (resumed,) = _train(tmp_path / "b", tiny_gpt2(), Tokens(48), resume=checkpoint_5(tmp_path))
    assert resumed.unit == unbroken.unit == "tokens"
    assert resumed.monitor.n is None
    _same_estimate(resumed, unbroken)
    assert float(resumed._label_tokens) == pytest.approx(float(unbroken._label_tokens))


def test_the_resumed_run_counts_its_own_examples_and_another_decay_starts_afresh(
        tmp_path: Path) -> None:
    """n enters only when the estimate is read: the resumed run's own n is kept (it was the
    checkpoint's, silently). An estimate made with another decay weighs its steps otherwise:
    the run's starts afresh, and says so."""
    (unbroken,) = _train(tmp_path / "a", Net(), Pairs(48))
    (resumed,) = _train(tmp_path / "b", Net(), Pairs(48), resume=checkpoint_5(tmp_path),
                        make=lambda: [DiversityCallback(every=3, n=96)])
    assert resumed.monitor.n == 96 and unbroken.monitor.n == 48
    assert resumed.monitor.state_dict()["sums"] == pytest.approx(
        unbroken.monitor.state_dict()["sums"], rel=1e-9)
    with pytest.warns(UserWarning, match="made with decay=0.95, this run's callback has "
                                         "decay=None; its estimate starts afresh"):
        (afresh,) = _train(tmp_path / "c", Net(), Pairs(48), resume=checkpoint_5(tmp_path),
                           make=lambda: [DiversityCallback(every=3, decay=None)])
    assert afresh.monitor.steps == 12 - 5


@pytest.mark.parametrize("restore", [False, True])
def test_two_callbacks_alike_both_continue(tmp_path: Path, restore: bool) -> None:
    """The Trainer keeps a list for them, appended to at every save (6 entries by step 10):
    each takes the latest entry of its settings (it warned and both started afresh)."""
    two = lambda: [DiversityCallback(every=3), DiversityCallback(every=3)]  # noqa: E731
    unbroken = _train(tmp_path / "a", Net(), Pairs(48), make=two,
                      restore_callback_states_from_checkpoint=restore)
    resumed = _train(tmp_path / "b", Net(), Pairs(48), resume=checkpoint_5(tmp_path), make=two,
                     restore_callback_states_from_checkpoint=restore)
    assert len(resumed) == 2
    for callback in resumed:
        _same_estimate(callback, unbroken[0])


class Tagged(DiversityCallback):
    """A user's subclass with a constructor of its own."""

    def __init__(self, tag: str = "run") -> None:
        super().__init__(every=3)
        self.tag = tag


def test_a_subclass_is_rebuilt_by_the_trainers_restore(tmp_path: Path) -> None:
    """The Trainer's restore builds the callback from the saved args: those were the
    constructor's, and a subclass taking others failed there (TypeError); now none are
    saved, and the settings and the estimate are put on it as attributes."""
    (unbroken,) = _train(tmp_path / "a", Net(), Pairs(48), make=lambda: [Tagged()],
                         restore_callback_states_from_checkpoint=True)
    (resumed,) = _train(tmp_path / "b", Net(), Pairs(48), resume=checkpoint_5(tmp_path),
                        make=lambda: [Tagged()], restore_callback_states_from_checkpoint=True)
    assert type(resumed) is Tagged and resumed.every == 3
    _same_estimate(resumed, unbroken)


def test_attach_then_the_trainers_restore_says_the_callback_moved(tmp_path: Path) -> None:
    """The Trainer appends the callbacks it restores, behind report_to's integrations."""
    pytest.importorskip("tensorboard")

    def train(folder: Path, resume: str | None = None) -> None:
        args = arguments(folder, learning_rate=0.05, save_strategy="steps", save_steps=5,
                         report_to=["tensorboard"], restore_callback_states_from_checkpoint=True)
        trainer = transformers.Trainer(model=Net(), args=args, train_dataset=Pairs(48))
        DiversityCallback(every=3).attach(trainer)
        trainer.train(resume_from_checkpoint=resume)

    train(tmp_path / "a")
    with pytest.warns(UserWarning, match="put a new DiversityCallback in place of the one "
                                         "attach\\(\\) put ahead"):
        train(tmp_path / "b", checkpoint_5(tmp_path))


class Failing(Net):
    """Raises on its fifth training forward."""

    def forward(self, x, labels):
        if self.training and len(self.seen) == 4:
            self.seen.append((x, labels))
            raise KeyboardInterrupt
        return super().forward(x, labels)


def test_training_again_after_an_exception_leaves_no_hooks_behind(tmp_path: Path) -> None:
    model, callback = Failing(), DiversityCallback(every=3)
    trainer = transformers.Trainer(model=model, args=arguments(tmp_path, num_train_epochs=1),
                                   train_dataset=Pairs(48), callbacks=[callback])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert len(model._forward_pre_hooks) == 1  # the stopped run's
    trainer.train()
    assert len(model._forward_pre_hooks) == 0 and callback.monitor.steps == 6


def test_a_second_train_without_resuming_starts_afresh(tmp_path: Path) -> None:
    callback = DiversityCallback(every=3)
    trainer = transformers.Trainer(model=Net(), args=arguments(tmp_path, num_train_epochs=1),
                                   train_dataset=Pairs(48), callbacks=[callback])
    trainer.train()
    first = callback.monitor.steps
    trainer.train()
    assert callback.monitor.steps == first == 6


# ------------------------------------------------ the batch-size warmups, resumed

def _warm(tmp_path: Path, make, resume: str | None = None, save_steps: int = 40):
    """Five epochs of digits at B0 = 8 × 2; (callback, [(step, accumulation)])."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, gradient_accumulation_steps=2,
        learning_rate=0.1, lr_scheduler_type="constant", optim="sgd", num_train_epochs=5,
        logging_steps=1000, save_strategy="steps", save_steps=save_steps, report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0)
    callback, steps = make(), []

    class Steps(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append((state.global_step, args.gradient_accumulation_steps))

    trainer = transformers.Trainer(model=HFNet(), args=args, train_dataset=Digits(),
                                   callbacks=[callback, Steps()])
    trainer.train(resume_from_checkpoint=resume)
    return callback, steps


@pytest.mark.parametrize("make", [
    lambda: integration.BatchWarmupCallback(every=10, fraction=1.0),
    lambda: integration.BranchWarmupCallback(every=20, steps=4, lr="lsr"),
], ids=["batch", "branch"])
def test_a_resumed_warmup_grows_where_the_unbroken_one_did(tmp_path: Path, make) -> None:
    """Stopped at step 40, inside the first epoch, with a growth decided that waits for the
    next epoch's start (the Trainer calls on_epoch_begin on resuming too): the resumed run
    grows at the same steps, by the same factors, with the same decisions."""
    unbroken, steps = _warm(tmp_path / "a", make)
    resumed, resumed_steps = _warm(tmp_path / "b", make,
                                   resume=str(tmp_path / "a" / "checkpoint-40"))
    assert unbroken.warmup.accumulation > 2, unbroken.warmup.history
    assert unbroken.warmup.history[0][0] < 40  # decided before the checkpoint
    assert resumed_steps == steps[40:]
    assert resumed.warmup.history == unbroken.warmup.history
    if isinstance(unbroken, DiversityCallback):
        _same_estimate(resumed, unbroken)


def test_resuming_after_a_growth_says_the_trainer_skips_at_the_given_accumulation(
        tmp_path: Path) -> None:
    make = lambda: integration.BatchWarmupCallback(every=10, fraction=1.0)  # noqa: E731
    _warm(tmp_path / "a", make)
    with pytest.warns(UserWarning, match="gradient_accumulation_steps=4.*counted the epochs "
                                         "and batches it skips on resume at 2"):
        _, steps = _warm(tmp_path / "b", make, resume=str(tmp_path / "a" / "checkpoint-120"))
    assert steps[0] == (121, 4)  # it goes on at the batch the warmup had grown to
