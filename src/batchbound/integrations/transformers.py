"""``DiversityCallback`` for a Hugging Face ``Trainer``: the online batch-size bound n·Δ, the
noise scale and Δ, logged every ``every`` optimizer steps with the Trainer's own logs (into
``trainer.state.log_history``), with no change to the model.

    trainer = Trainer(model=model, args=TrainingArguments(..., gradient_accumulation_steps=4),
                      train_dataset=train_set, callbacks=[DiversityCallback()])

**Where the numbers come from.** With gradient_accumulation_steps = k ≥ 2, tensor hooks on the
parameters see each micro-batch's gradient before it is added to ``.grad`` (one norm and one
dot product with ``.grad`` per parameter per micro-batch, kept on the device; one host sync
per ``every`` steps): the micro-batches are McCandlish et al.'s small batches and their
accumulated sum the big one, taken before the Trainer clips or unscales it. The Trainer's
own normalisation is undone:

- a model that does not take ``num_items_in_batch`` (plain ``nn.Module``\\ s returning
  ``{"loss": mean over the batch}``): each micro-batch's loss is divided by the number of
  micro-batches in the step; examples are counted along dim 0 of the inputs
  (``reduction="sum"`` if the model's loss is the batch's sum);
- a model that does (Transformers' own models given ``labels``): its loss is a sum over
  label tokens divided by the step's ``num_items_in_batch``, so the examples are **tokens**:
  batch_bound and noise_scale are in tokens, and Δ (which needs n in tokens) is not logged.
  Each micro-batch's weight is the number of tokens its loss sums over (``labels != -100``,
  shifted for ``ForCausalLMLoss`` unless ``shift_labels`` is given), counted on the device;
  the divisor is the Trainer's, whatever it counted. Other losses that take
  ``num_items_in_batch`` are refused, and so is a model given it whose forward computes a
  loss that does not divide by it (BertForMaskedLM's micro-batch mean): the first
  micro-batch is run twice more, in eval mode without gradients, with the divisor N and 2N.

A micro-batch is one ``training_step`` of the Trainer, bounded by its own events: a loss that
runs the model again on the same examples (a consistency term) is one micro-batch, on other
examples it is refused; forwards outside the steps (another callback's, such as
BranchWarmupCallback's branches) are not counted. An fp16 GradScaler's scale is undone (bf16
has none); steps with inf/NaN gradients, which the scaler skips, are not folded in. n is
``len(train_dataset)`` unless given.

**Limits.** HF callbacks never see the DDP-wrapped model, so the communication hook of
batchbound.integrations.ddp cannot be registered: under DDP each rank estimates from its own
micro-batches (still unbiased, noisier than the global estimate; rank 0's is logged), and
that needs k ≥ 2 too (with ``average_tokens_across_devices`` the Trainer's ×P is undone;
tensor, context or sequence parallelism is not supported). ``label_smoothing_factor`` and
``compute_loss_func`` pop the labels: on a model given ``num_items_in_batch`` that is
refused (no labels reach the forward); otherwise a loss the model's output does not hold
(those, or a Trainer subclass's ``compute_loss``) is refused unless ``reduction`` is given,
and what is then said, or a subclass that rescales the model's own loss, is not checked.
Reporting integrations (``report_to``) run before user callbacks in the Trainer, so to have
them record these keys add the callback with ``DiversityCallback().attach(trainer)`` (it goes
in front of them) instead of ``callbacks=[...]``.

**Checkpoints.** The callbacks here are ExportableState objects: their state (the estimate,
a warmup's) is written into each checkpoint's trainer_state.json and continued on
``resume_from_checkpoint``, with or without ``restore_callback_states_from_checkpoint``
(with it the Trainer replaces the callback by a new instance).
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from batchbound.diversity.loss_scale import loss_scale_of
from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError, warn
from batchbound.integrations.common import (
    MicroBatchNorms,
    StepRecords,
    check_options,
    continue_estimate,
    dataset_size,
    diversity_metrics,
    require,
)
from batchbound.integrations.hf_checkpoints import (
    checkpoint_state,
    resume_accumulation,
    resumed_inside_epoch,
)
from batchbound.integrations.warmup import AccumulationWarmup, BranchWarmup
from batchbound.train.adaptive import BRANCH_EVERY, BRANCH_STEPS

transformers = require("transformers", "hf")
_losses = require("transformers.loss.loss_utils", "hf")
ExportableState = transformers.trainer_callback.ExportableState

_IGNORE = -100  # the label the Trainer (and its models' losses) ignore
_SAY_IT = (
    "so DiversityCallback cannot see how it weighs each micro-batch's examples; say it: "
    "DiversityCallback(reduction='mean') for a mean over the micro-batch's examples, 'sum' for "
    "their sum (where the Trainer leaves the loss undivided, a compute_loss_func's: divided "
    "by the accumulation steps, or by num_items_in_batch, as Transformers expects), or "
    "measure with batchbound.diversity.watch and a per-example loss")
NO_LABELS = (
    "the model takes num_items_in_batch but its forward got no labels: the Trainer computes "
    "the loss outside the model (label_smoothing_factor, compute_loss_func), so "
    "DiversityCallback cannot count the tokens that loss sums over; train without them, or "
    "measure with batchbound.diversity.watch and a per-example loss")
# Losses Σ cross-entropy over label tokens / num_items_in_batch, by which tokens they sum.
_TOKEN_LOSSES = {
    rule: [getattr(_losses, name) for name in names if hasattr(_losses, name)]
    for rule, names in (("shifted", ("ForCausalLMLoss",)),
                        ("all", ("ForMaskedLMLoss", "ForTokenClassification")),
                        # sequence, image, audio and video classifiers: Σ over the labelled
                        # examples / N (a loss that ignores N, BCE or MSE, fails the probe)
                        ("examples", ("ForSequenceClassificationLoss",)))
}


class DiversityCallback(transformers.TrainerCallback, ExportableState):
    """Adds ``gradient_diversity/{batch_bound,noise_scale,diversity}`` and their ``_se`` to the
    Trainer's logs every ``every`` optimizer steps; ``monitor`` is the OnlineDiversity behind
    them and ``metrics`` the last values, and after training the final ones (also for a run
    shorter than ``every``, which logs none). The estimate is saved with the Trainer's
    checkpoints (``state``) and continued on ``resume_from_checkpoint``."""

    def __init__(
        self,
        every: int = 50,
        *,
        n: int | None = None,
        reduction: str | None = None,
        decay: float | None = 0.95,
        sampling: str = "without_replacement",
    ) -> None:
        check_options(every, "mean" if reduction is None else reduction, n)
        OnlineDiversity(n, decay=decay, sampling=sampling)  # validates decay and sampling
        # as given: None (a mean) is not said, and a loss computed outside the model is then
        # refused (``_after_forward``); a callback restored from a checkpoint has it said (its
        # run passed that check, or came before it)
        self.every, self.n, self.reduction = every, n, reduction
        self.decay, self.sampling = decay, sampling
        self.monitor: OnlineDiversity | None = None
        self.metrics: dict[str, float] = {}
        self.unit = "examples"  # or "tokens", once the first training forward shows it
        self._attached = False
        self._records: StepRecords | None = None
        self._norms: MicroBatchNorms | None = None
        self._forward: RemovableHandle | None = None
        self._output: RemovableHandle | None = None
        self._trainer: weakref.ref | None = None  # ``attach``'s; else found at train start
        self._divided = True  # whether the Trainer divides the loss by the micro-batches
        # while ``_output`` reads the first micro-batch's outputs: the model losses hooked
        # (None: none read yet), and whether its backward reached one of them
        self._loss_hooks: list[RemovableHandle] | None = None
        self._loss_used = False
        self._scaler: Any = None
        self._world = 1
        self._device = torch.device("cpu")
        # The Trainer's own events bound the micro-batches (a training_step each): a step
        # runs from on_step_begin to on_pre_optimizer_step, a micro-batch ends at
        # on_substep_end or there; its first training forward opens it. Forwards outside a
        # step (another callback's, such as BranchWarmupCallback's branches) and a loss's
        # further forwards within a micro-batch (a consistency term) open none.
        self._stepping = False
        self._opened: int | None = None  # the open micro-batch's examples
        self._micro_batches = 0  # ended in this step
        self._items: Any = None  # num_items_in_batch of this step (token-normalised losses)
        self._token_rule: str | None = None  # "shifted" (causal LM) or "all" label tokens
        self._token_factor = 1.0
        # labelled tokens (on the device) and sequences of this step, and their sums over
        # the steps the token estimate averages, weighted as it weighs them (``decay``)
        self._step_tokens: Tensor | None = None
        self._step_sequences = 0
        self._label_tokens: Tensor | None = None
        self._label_sequences = 0.0
        self._probe: Tensor | None = None  # does the loss divide by num_items_in_batch?
        self._pending: dict[str, float] = {}
        # a checkpoint's estimate, to continue (``state``); set by the Trainer's own restore
        # (restore_callback_states_from_checkpoint), else read from the resumed TrainerState
        self.saved: dict[str, Any] | None = None
        self.was_attached = False  # the callback this one was restored from was (``attach``)

    def attach(self, trainer: Any) -> DiversityCallback:
        """Add this callback ahead of the Trainer's reporting integrations (TensorBoard, W&B,
        ...), so that they record its keys too; returns self."""
        callbacks = trainer.callback_handler.callbacks
        flow = [i for i, cb in enumerate(callbacks)
                if isinstance(cb, transformers.DefaultFlowCallback)]
        callbacks.insert(flow[0] + 1 if flow else 0, self)
        self._trainer = weakref.ref(trainer)
        self._attached = True
        return self

    # ------------------------------------------------------- checkpoints (ExportableState)

    def settings(self) -> dict[str, Any]:
        """The constructor's arguments, by the attributes that hold them."""
        return {"every": self.every, "n": self.n, "reduction": self.reduction or "mean",
                "decay": self.decay, "sampling": self.sampling}

    def state(self) -> dict[str, Any]:
        """What the Trainer writes into a checkpoint's trainer_state.json: the settings, and
        the estimate so far (the steps not folded yet included; one host read). All as
        attributes: with restore_callback_states_from_checkpoint the Trainer builds the
        callback anew from ``args`` (none here, so that a subclass with its own constructor
        is built too) and sets the attributes on it."""
        return {"args": {}, "attributes": {**self.settings(), "saved": self._saved(),
                                           "was_attached": self._attached}}

    def _saved(self) -> dict[str, Any] | None:
        if self.monitor is None or self._records is None:
            return self.saved  # not started: a restored estimate not continued yet, or None
        # no probe read here: only the saving rank calls this, and a refusal raised on it
        # alone would leave the others waiting in their next collective; a resumed run
        # probes again and is refused at its first fold, as every rank of this one will be
        self._records.fold()
        tokens = self._label_tokens
        return {"monitor": self.monitor.state_dict(), "unit": self.unit,
                "label_tokens": None if tokens is None else float(tokens),
                "label_sequences": self._label_sequences}

    def _restore(self, args: Any, state: Any) -> dict[str, Any] | None:
        """On a run resumed from a checkpoint, the estimate it saved; what it saved."""
        saved = checkpoint_state(self, state)
        if saved is None:
            return None
        assert self.monitor is not None
        monitor = self.monitor if saved["unit"] != "tokens" else OnlineDiversity(
            None, decay=self.decay, sampling=self.sampling)  # in tokens: no n
        if not continue_estimate(monitor, saved["monitor"]):
            return None
        self.monitor, self.unit = monitor, saved["unit"]
        tokens = saved["label_tokens"]
        self._label_tokens = None if tokens is None else torch.tensor(
            tokens, dtype=torch.float64, device=self._device)
        self._label_sequences = float(saved["label_sequences"])
        return saved

    # ------------------------------------------------------------------ set-up

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       optimizer: Any = None, train_dataloader: Any = None,
                       **kwargs: Any) -> None:
        if args.gradient_accumulation_steps < 2:
            raise BatchboundError(
                "DiversityCallback compares micro-batches with the step they add up to: it needs "
                "gradient_accumulation_steps ≥ 2 (HF callbacks cannot reach the DDP wrapper for "
                "the communication hook; in your own DDP loop use "
                "batchbound.integrations.ddp)")
        if args.n_gpu > 1:
            raise BatchboundError("DiversityCallback does not support torch.nn.DataParallel "
                                  "(n_gpu > 1 in one process); launch one process per GPU")
        if model is None:
            raise BatchboundError("the Trainer passed no model to DiversityCallback")
        self._remove_hooks()  # a run of this Trainer that stopped on an exception left them
        trainer = self._trainer() if self._trainer is not None else _calling_trainer()
        self._divided = trainer is None or _divides_loss(trainer)
        self._world = args.world_size
        averaged = getattr(args, "average_tokens_across_devices", False) and self._world > 1
        self._token_factor = float(self._world) if averaged else 1.0
        n = self.n if self.n is not None else dataset_size(train_dataloader)
        self._device = next(model.parameters()).device
        self.monitor = OnlineDiversity(n, decay=self.decay, sampling=self.sampling)
        self._restore(args, state)
        self._records = StepRecords(self.monitor)
        # Under DDP the all-reduce may rewrite .grad (bucket views) while backward runs: there
        # the hooks take their norms and dots as the gradients arrive (MicroBatchNorms).
        self._norms = MicroBatchNorms(model.parameters(), fused=self._world == 1, names={
            id(p): name for name, p in model.named_parameters()})
        self._forward = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        self._loss_used = False
        if self.reduction is None:  # the outputs show whether the loss is the model's
            self._output = model.register_forward_hook(self._after_forward)
        self._scaler = getattr(optimizer, "scaler", None)
        report_to = [r for r in (args.report_to or []) if r != "none"]
        if report_to and not self._attached and self.was_attached:
            warn(f"batchbound: restore_callback_states_from_checkpoint=True made the Trainer "
                 f"put a new {type(self).__name__} in place of the one attach() put ahead of "
                 f"the report_to={report_to} integrations, behind them, so they will not "
                 "record gradient_diversity/*; without that option the estimate is restored "
                 "all the same, into the callback you attached")
        elif report_to and not self._attached:
            warnings.warn(f"report_to={report_to} integrations run before callbacks passed to "
                          "Trainer(callbacks=...), so they will not record gradient_diversity/*; "
                          "use DiversityCallback().attach(trainer) instead", stacklevel=2)

    def _before_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A micro-batch's first training forward opens it: its size and loss weight."""
        if not (self._stepping and module.training and torch.is_grad_enabled()):
            return
        assert self._norms is not None
        b = _batch_size(args, kwargs)
        if self._opened is not None:
            if b != self._opened:
                raise self._refused(
                    f"the Trainer's loss ran the model on {b} examples after {self._opened} "
                    "in one micro-batch: DiversityCallback cannot tell which examples the "
                    "micro-batch's gradient is the mean over; run further forwards on the "
                    "same examples, or measure with batchbound.diversity.watch")
            return  # the same examples again: part of the same micro-batch's loss
        self._opened = b
        items = kwargs.get("num_items_in_batch")
        if items is None:
            self._norms.start(float(b), float(b) if self.reduction == "sum" else 1.0)
            return
        self._outputs_read()  # the loss is the model's, checked by the probe
        if kwargs.get("shift_labels") is None and kwargs.get("labels") is None:
            raise self._refused(NO_LABELS)  # before the probe, which reads the model's loss
        if self._token_rule is None:  # the first micro-batch given num_items_in_batch
            self._use_tokens(module)
            self._probe = _divides_by_items(module, args, kwargs, items)
        self._items = items
        labels = kwargs.get("shift_labels")
        if labels is None:
            labels = kwargs["labels"]
            if self._token_rule == "shifted":
                labels = labels[..., 1:]
        count = labels.ne(_IGNORE).sum().to(torch.float64)  # the items its loss sums over
        self._norms.start(count, count)
        self._step_tokens = count if self._step_tokens is None else self._step_tokens + count
        self._step_sequences += int(labels.shape[0]) if labels.dim() > 1 else 1

    def _after_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        """The first micro-batch's training forwards, where the user did not say the
        reduction: a loss computed outside the model (a ``compute_loss_func``,
        ``label_smoothing_factor``, a Trainer subclass's ``compute_loss``) weighs the
        micro-batch's examples in a way the callback cannot see; assuming a mean put an
        outside review's Σ loss / ``num_items_in_batch`` 28 % off. Refused unless
        ``reduction`` is given: an output that holds no loss at once, and one whose loss the
        backward never reaches (a subclass's own loss from the logits beside it: 12.5 % off)
        when the micro-batch closes (``_check_model_loss``)."""
        if not (self._opened is not None and module.training):
            return
        loss = _loss_of(output)
        if loss is None and self._loss_hooks is None:  # the micro-batch's first forward
            raise self._refused(
                f"the Trainer computes the loss outside {type(module).__name__}'s forward "
                f"(its output holds none: a compute_loss_func, label_smoothing_factor or a "
                f"Trainer subclass's compute_loss), {_SAY_IT}")
        self._loss_hooks = self._loss_hooks or []
        if loss is not None and loss.requires_grad:
            self._loss_hooks.append(loss.register_hook(self._model_loss_used))

    def _model_loss_used(self, grad: Tensor) -> None:
        self._loss_used = True

    def _check_model_loss(self) -> None:
        """At the first micro-batch's end: its backward reached a loss the model returned
        (the loss the Trainer took, or one it built on; any scaling of it is not checked)."""
        hooks = self._loss_hooks
        if hooks is None:
            return
        self._outputs_read()
        if hooks and not self._loss_used:
            raise self._refused(
                "the Trainer's loss does not use the loss the model returned (a Trainer "
                f"subclass's compute_loss computes its own), {_SAY_IT}")

    def _refused(self, message: str) -> BatchboundError:
        """The error to raise, the hooks taken off the model first: raised inside the model's
        forward or a step, it ends the Trainer's ``train`` without ``on_train_end``, and a
        retry on the same model (another Trainer) met the stale hooks."""
        self._remove_hooks()
        self._stepping, self._opened = False, None
        return BatchboundError(message)

    def _outputs_read(self) -> None:
        """No output left to read: the hooks removed (no cost on the steps after)."""
        if self._output is not None:
            self._output.remove()
            self._output = None
        for hook in self._loss_hooks or ():
            hook.remove()
        self._loss_hooks = None

    def _use_tokens(self, module: nn.Module) -> None:
        """The loss is Σ over label tokens / num_items_in_batch: know which tokens."""
        loss = getattr(module, "loss_function", None)
        self._token_rule = next((rule for rule, known in _TOKEN_LOSSES.items()
                                 if any(loss is fn for fn in known)), None)
        if self._token_rule is None and loss is None:  # a plain module: its **kwargs
            raise self._refused(
                f"the Trainer passes num_items_in_batch to {type(module).__name__}, whose "
                "forward takes **kwargs (the Trainer then leaves the loss undivided by the "
                "accumulation steps, for the model to divide by the batch's items), and the "
                "model has no Hugging Face loss_function whose items DiversityCallback can "
                "count; set model.accepts_loss_kwargs = False (or drop **kwargs from its "
                "forward) for a loss that is its micro-batch's mean")
        if self._token_rule is None:
            raise self._refused(
                f"the model takes num_items_in_batch, but its loss "
                f"({getattr(loss, '__name__', type(module).__name__)}) is not one whose tokens "
                "DiversityCallback can count (ForCausalLMLoss, ForMaskedLMLoss, "
                "ForTokenClassification, ForSequenceClassificationLoss); give the model a loss "
                "that is its batch's mean")
        if self._token_rule == "examples":  # the items are examples: n and Δ still hold
            return
        if self.unit == "tokens":  # a resumed run's estimate, in tokens already
            return
        self.unit = "tokens"  # n counts examples, not tokens: Δ is not defined here
        assert self._records is not None
        self.monitor = OnlineDiversity(None, decay=self.decay, sampling=self.sampling)
        self._records.monitor = self.monitor

    def _check_probe(self) -> None:
        """Refuse, before any number is read, a model whose forward is given
        num_items_in_batch but computes a loss that does not divide by it (one host read,
        at the first fold)."""
        probe, self._probe = self._probe, None
        if probe is not None and not bool(probe):
            raise self._refused(
                "the model takes num_items_in_batch but its loss does not divide by it a sum "
                "over tokens (its forward computes its own loss, such as a micro-batch's "
                "mean, or adds a term of the whole micro-batch, such as a mixture of experts' "
                "load-balancing loss with output_router_logits=True): DiversityCallback "
                "cannot weigh such micro-batches exactly; measure with "
                "batchbound.diversity.watch or measure() and a per-example loss")

    # ------------------------------------------------------------------- a step

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._stepping, self._opened, self._micro_batches = True, None, 0

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._check_model_loss()
        self._opened = None
        self._micro_batches += 1

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._check_model_loss()
        micro_batches = self._micro_batches + 1
        self._stepping, self._opened, self._micro_batches = False, None, 0
        if self._norms is None or self._records is None:
            return
        self._norms.stop()
        if self._token_rule is not None:
            # each micro-batch: Σ over its tokens / N, times P when the Trainer averages
            # tokens across ranks (it multiplies the loss by the number of processes)
            items = self._items
            total = items.to(torch.float64) if isinstance(items, Tensor) else float(items)
            constant = self._token_factor / total
        elif self._divided or self.reduction != "sum":  # divided by the micro-batches, k
            constant = 1.0 / micro_batches
        else:  # left undivided by the Trainer, a sum is normalised over the step's examples
            constant = 1.0 / sum(float(b) for b in self._norms.window.sizes)
        row = self._norms.record(constant, loss_scale_of(self._scaler, self._device))
        if row is not None:
            self._records.add(row)
        self._count_labels(row is not None)

    def _count_labels(self, recorded: bool) -> None:
        """Fold this step's labelled tokens and sequences into τ's sums as the monitor folds
        the step's row: the same exponential weights (``decay``; None: every step alike),
        so that B_noise_tokens / τ divides the window's estimate by the window's τ."""
        tokens, sequences = self._step_tokens, self._step_sequences
        self._step_tokens, self._step_sequences = None, 0
        if not recorded or tokens is None:
            return
        keep = 1.0 if self.decay is None else self.decay
        self._label_tokens = (tokens if self._label_tokens is None
                              else keep * self._label_tokens + tokens)
        self._label_sequences = keep * self._label_sequences + sequences

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._records is None or state.global_step % self.every:
            return
        self._check_probe()
        self.metrics = diversity_metrics(self._records.fold())
        if self.metrics:
            self._pending = dict(self.metrics)
            control.should_log = True

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None,
               **kwargs: Any) -> None:
        if self._pending and logs is not None:
            _log_into(logs, state, self._pending)
            self._pending = {}

    # ------------------------------------------------------------------ the end

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._records is not None:  # the final estimate in ``metrics``, logged or not
            self._check_probe()
            self.metrics = diversity_metrics(self._records.fold())
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        if self._norms is not None:
            self._norms.remove()
            self._norms = None
        if self._forward is not None:
            self._forward.remove()
            self._forward = None
        self._outputs_read()


def _divides_by_items(module: nn.Module, args: tuple, kwargs: dict, items: Any) -> Tensor:
    """Whether the model's loss is its sum over tokens divided by ``num_items_in_batch``, as
    the token weights assume, by construction: the same micro-batch through the model twice
    in eval mode (no dropout, no gradient), with the divisor N and 2N, must give losses in
    the ratio 2 (a forward that computes its own loss, BertForMaskedLM's micro-batch mean,
    gives the same loss twice). A 0-dim bool tensor, read at the first fold."""
    losses = []
    was_training = module.training
    try:
        module.eval()
        with torch.no_grad():
            for divisor in (items, items * 2):
                out = module(*args, **{**kwargs, "num_items_in_batch": divisor})
                loss = out["loss"] if isinstance(out, dict) else out[0]
                losses.append(loss.detach().to(torch.float64))
    finally:
        module.train(was_training)
    once, twice = losses
    return torch.isclose(once, 2 * twice, rtol=1e-3, atol=0.0)


def _log_into(logs: dict, state: Any, values: dict) -> None:
    """Add ``values`` to this log call and to the copy the Trainer appended before on_log."""
    logs.update(values)
    history = state.log_history
    if history and history[-1].get("step") == state.global_step:
        history[-1].update(values)


def _grow(warmup: Any, factor: float, args: Any, optimizer: Any, lr_scheduler: Any
          ) -> dict[str, float]:
    """Apply a warmup's growth by ``factor`` to the Trainer (accumulation steps, the rates);
    its metrics to log, or {} when it did not grow."""
    if factor == 1.0:
        return {}
    args.gradient_accumulation_steps = warmup.accumulation
    if optimizer is not None:
        warmup.scale_rates(optimizer, factor, lr_scheduler)
    return warmup.metrics()


def _batch_size(args: tuple, kwargs: dict) -> int:
    """Examples in a micro-batch: dim 0 of ``labels`` or else of the first tensor input."""
    labels = kwargs.get("labels")
    candidates = [labels] if isinstance(labels, Tensor) else []
    candidates += [t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)]
    for t in candidates:
        if t.dim() > 0:
            return int(t.shape[0])
    raise BatchboundError("DiversityCallback needs a tensor input with the examples along dim 0")


class BatchWarmupCallback(DiversityCallback):
    """Batch-size warmup in a Hugging Face Trainer: DiversityCallback's estimate (over about
    the last 100 steps by default), acted on by ``batchbound.integrations.warmup``'s rule:
    every ``every`` optimizer steps it decides whether the global batch (per-device batch ×
    gradient_accumulation_steps × ranks) should double, and doubles
    ``args.gradient_accumulation_steps`` at the next epoch's start (the Trainer groups an
    epoch's micro-batches into steps from its first batch, so a mid-epoch change would split
    a step); the optimizer's rate and the scheduler's base rates change by ``lr``. Under DDP
    each rank decides from its own estimate (see DiversityCallback's limits), which can
    differ between ranks: use it on one process, or check the logged ``warmup/*`` agree.
    Adds ``warmup/batch_size`` and ``warmup/accumulation`` to the logs."""

    def __init__(self, every: int = 25, *, max_batch: int | None = None,
                 fraction: float = 0.5, lr: str = "noise", n: int | None = None,
                 reduction: str | None = None, decay: float | None = 0.99,
                 sampling: str = "without_replacement") -> None:
        super().__init__(every, n=n, reduction=reduction, decay=decay, sampling=sampling)
        self.options = {"every": every, "max_batch": max_batch, "fraction": fraction, "lr": lr}
        AccumulationWarmup(1, **self.options)  # checks the options now
        self.warmup: AccumulationWarmup | None = None
        self._warm_log: dict[str, float] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.warmup = AccumulationWarmup(args.per_device_train_batch_size,
                                         args.gradient_accumulation_steps, args.world_size,
                                         **self.options)
        super().on_train_begin(args, state, control, **kwargs)  # a resumed run's: _restore

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "options": self.options}

    def _saved(self) -> dict[str, Any] | None:
        saved = super()._saved()
        if self.monitor is None or saved is None or self.warmup is None:
            return saved
        return {**saved, "warmup": self.warmup.state_dict()}

    def _restore(self, args: Any, state: Any) -> dict[str, Any] | None:
        saved = super()._restore(args, state)
        if saved is not None and saved.get("warmup") is not None and self.warmup is not None:
            self.warmup.load_state_dict(saved["warmup"])
            resume_accumulation(args, state, self.warmup)
        return saved

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        super().on_step_end(args, state, control, **kwargs)
        if self._warm_log:  # a change made at this epoch's start, logged with its first step
            self._pending.update(self._warm_log)
            self._warm_log = {}
            control.should_log = True
        if self.warmup is None or self._records is None:
            return
        if not self.warmup.deciding():
            self.warmup.step(self.monitor, ready=False)  # counts the step; reads nothing
            return
        self._records.fold()
        self.warmup.step(self.estimate(), ready=False)

    def estimate(self) -> Any:
        """The estimate in the warmup's unit, sequences (the batch is per-device batch ×
        accumulation × ranks sequences): the monitor itself, or, when the model's loss made it
        one in tokens, B_noise_tokens / τ with τ the labelled tokens per sequence over the
        steps the estimate averages, weighted as it weighs them (a batch of B sequences is
        B·τ tokens; one host read)."""
        assert self.monitor is not None
        if self.unit != "tokens" or self._label_tokens is None:
            return self.monitor
        return PerSequence(self.monitor, float(self._label_tokens) / self._label_sequences)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self.warmup is None or self.monitor is None or resumed_inside_epoch(state):
            return
        factor = self.warmup.apply(self.estimate()) if self.warmup.pending else 1.0
        self._warm_log = _grow(self.warmup, factor, args, optimizer,
                               lr_scheduler) or self._warm_log


class PerSequence:
    """A token-unit estimate read per sequence of τ labelled tokens on average: B_noise / τ
    (and its standard error), n·Δ = 1 + B_noise / τ; what the warmup's rule reads."""

    def __init__(self, tokens: OnlineDiversity, per_sequence: float) -> None:
        if not per_sequence > 0:
            raise BatchboundError("the token estimate has seen no labelled tokens")
        self.tokens, self.per_sequence = tokens, per_sequence

    @property
    def noise_scale(self) -> float:
        return self.tokens.noise_scale / self.per_sequence

    @property
    def batch_bound(self) -> float:
        return 1.0 + self.noise_scale

    @property
    def batch_bound_se(self) -> float:
        return self.tokens.batch_bound_se / self.per_sequence


class BranchWarmupCallback(transformers.TrainerCallback, ExportableState):
    """Batch-size warmup in a Hugging Face Trainer with the branch trigger (batchbound's
    trainer's default, ``batchbound.integrations.warmup.BranchWarmup``, at its cadence: first
    after ``every``·B0 examples, then at doubling example counts; at ``on_step_end``, which
    the Trainer hands the model, its optimizer and the train loader) short branches from the
    current weights and optimiser state at B, 2B
    and 4B, copied, run and restored; the examples come from ``train_dataloader.dataset``
    through the loader's own ``collate_fn``, the loss is the model's output ``loss`` (the
    model is called with the collated batch as keyword arguments, the unwrapped module under
    DDP). A growth (×2 or ×4) decided is made at the next epoch's start (the Trainer groups
    an epoch's micro-batches from its first batch), with the rates by ``lr`` (auto: srsr).
    Every rank runs the same branches and, under
    torch.distributed, the ranks agree on the doubling. Adds ``warmup/batch_size``,
    ``warmup/accumulation``, ``warmup/branch_steps`` and ``warmup/branch_examples`` to the
    logs."""

    def __init__(self, every: int = BRANCH_EVERY, *, max_batch: int | None = None,
                 steps: int = BRANCH_STEPS, z: float = 1.0, lr: str = "auto") -> None:
        self.options = {"every": every, "max_batch": max_batch, "steps": steps, "z": z,
                        "lr": lr}
        BranchWarmup(1, **self.options)  # checks the options now
        self.warmup: BranchWarmup | None = None
        self._warm_log: dict[str, float] = {}
        self.saved: dict[str, Any] | None = None  # as DiversityCallback's: a checkpoint's

    def settings(self) -> dict[str, Any]:
        return {"options": self.options}

    def state(self) -> dict[str, Any]:
        """What the Trainer writes into a checkpoint (``ExportableState``): the settings, and
        the warmup's state, to continue it on resume_from_checkpoint (as DiversityCallback's)."""
        saved = {"warmup": self.warmup.state_dict()} if self.warmup is not None else self.saved
        return {"args": {}, "attributes": {**self.settings(), "saved": saved}}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        saved = checkpoint_state(self, state)
        if saved is not None:
            self.warmup = self._new_warmup(args)
            self.warmup.load_state_dict(saved["warmup"])
            resume_accumulation(args, state, self.warmup)

    def _new_warmup(self, args: Any) -> BranchWarmup:
        return BranchWarmup(args.per_device_train_batch_size, args.gradient_accumulation_steps,
                            args.world_size, seed=args.seed, **self.options)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                    optimizer: Any = None, train_dataloader: Any = None,
                    **kwargs: Any) -> None:
        if model is None or optimizer is None or train_dataloader is None:
            raise BatchboundError("BranchWarmupCallback needs the model, optimizer and "
                                  "train_dataloader the Trainer hands its callbacks")
        raw = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        module = getattr(model, "module", model)  # DDP's wrapper: branch on the module
        if self.warmup is None:
            self.warmup = self._new_warmup(args)
        if self._warm_log:  # a change made at this epoch's start, logged with its first step
            control.should_log = True
        dataset, collate = train_dataloader.dataset, train_dataloader.collate_fn
        device = next(module.parameters()).device

        def loss_of(indices: torch.Tensor) -> torch.Tensor:
            batch = collate([dataset[int(i)] for i in indices])
            out = module(**{k: v.to(device) if torch.is_tensor(v) else v
                            for k, v in batch.items()})
            return out["loss"] if isinstance(out, dict) else out[0]

        self.warmup.step(module, raw, loss_of, len(dataset), ready=False)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self.warmup is None or resumed_inside_epoch(state):
            return
        self._warm_log = _grow(self.warmup, self.warmup.apply(), args, optimizer,
                               lr_scheduler) or self._warm_log

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None,
               **kwargs: Any) -> None:
        if logs is not None and self._warm_log:
            _log_into(logs, state, self._warm_log)
            self._warm_log = {}


def _loss_of(output: Any) -> Tensor | None:
    """The loss a model's output holds where the Trainer reads it: ``output["loss"]`` of a
    mapping (a ModelOutput), else ``output[0]``, a single number; None if it holds none."""
    if isinstance(output, dict):
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)) and output:
        loss = output[0]
    else:
        loss = output
    return loss if isinstance(loss, Tensor) and loss.numel() == 1 else None


def _calling_trainer() -> Any:
    """The Trainer whose ``on_train_begin`` this is, from the call stack (its events carry
    the model and the optimizer, not the Trainer); None if none is found."""
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, transformers.Trainer):
            return candidate
        frame = frame.f_back
    return None


def _divides_loss(trainer: Any) -> bool:
    """Whether ``trainer`` divides a loss its model is not given ``num_items_in_batch`` for
    by the accumulation steps, by the Trainer's own rule (``training_step``): unless
    ``loss_is_scaled_for_ga`` says so, which by default a ``compute_loss_func`` does. A loss
    left undivided is normalised over the whole step, as Transformers documents that flag:
    a mean by the k micro-batches (the same constant), a sum by the step's examples (Σ loss
    / ``num_items_in_batch``); a micro-batch's mean not divided at all breaks that contract,
    and is not seen (an outside review: 29 % high with steps of 3 and 2 micro-batches)."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = getattr(trainer, "compute_loss_func", None) is not None
    return not scaled
