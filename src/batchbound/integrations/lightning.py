"""``DiversityCallback`` for a Lightning ``Trainer``: the online batch-size bound n·Δ, the
noise scale and Δ, logged every ``every`` optimizer steps through the trainer's own loggers,
with no change to the LightningModule.

    trainer = L.Trainer(accumulate_grad_batches=4, callbacks=[DiversityCallback()])

Where the two batch sizes of McCandlish et al.'s estimator come from (no per-example work):

- **DDP with P ≥ 2 ranks** (``strategy="ddp"``/``"ddp_spawn"``): the callback registers
  batchbound.integrations.ddp's communication hook on the DDP-wrapped model at train start;
  each rank's local gradient (accumulated over its micro-batches) is the small batch, DDP's
  average the big one, and the ranks' local norms travel inside the gradient all-reduce.
  Every rank holds the same global estimate; rank 0 logs it.
- **One process, accumulate_grad_batches = k ≥ 2**: tensor hooks on the parameters see each
  micro-batch's gradient before it is added to ``.grad`` (one norm, and one dot product with
  ``.grad``, per parameter per micro-batch); the micro-batches are the small batches, their
  accumulated sum the big one. Lightning divides each micro-batch's loss by k, which is
  undone here.

Anything else (one process without accumulation, FSDP/DeepSpeed, manual optimisation) is
refused at train start with a BatchboundError. ``reduction`` says whether
``training_step``'s loss is the mean (default) or the sum over its batch; the batch size is
the first dimension its tensors share (``examples_in``: a batch whose tensors of one or more
dimensions disagree on it is refused; Lightning's ``extract_batch_size`` answered 1 for a
dict whose first entry is a 0-dim tensor). A 16-mixed GradScaler's loss scale is undone (bf16
has none), and steps the scaler skips for inf/NaN gradients are not folded in. n (for Δ) is
``len(train_dataloader.dataset)`` unless given; without it only batch_bound and noise_scale
are logged. With ``ddp_spawn`` the numbers live in the spawned processes: read them from the
logger.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from batchbound.diversity.loss_scale import loss_scale_of
from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError
from batchbound.integrations.common import (
    MicroBatchNorms,
    StepRecords,
    Window,
    check_options,
    continue_estimate,
    dataset_size,
    diversity_metrics,
    require,
)
from batchbound.integrations.ddp import GNSHookState, gns_hook, gns_hook_state
from batchbound.integrations.warmup import AccumulationWarmup, BranchWarmup
from batchbound.train.adaptive import BRANCH_EVERY, BRANCH_STEPS

L = require("lightning.pytorch", "lightning")
GradientAccumulationScheduler = L.callbacks.GradientAccumulationScheduler


class DiversityCallback(L.Callback):
    """Logs ``gradient_diversity/{batch_bound,noise_scale,diversity}`` and their ``_se``
    every ``every`` optimizer steps; ``monitor`` is the OnlineDiversity behind them and
    ``metrics`` the last values logged, and after training the final ones (also for a run
    shorter than ``every``, which logs none)."""

    def __init__(
        self,
        every: int = 50,
        *,
        n: int | None = None,
        reduction: str = "mean",
        decay: float | None = 0.95,
        sampling: str = "without_replacement",
    ) -> None:
        check_options(every, reduction, n)
        OnlineDiversity(n, decay=decay, sampling=sampling)  # validates decay and sampling
        self.every, self.n, self.reduction = every, n, reduction
        self.decay, self.sampling = decay, sampling
        self.monitor: OnlineDiversity | None = None
        self.metrics: dict[str, float] = {}
        self.mode: str | None = None  # "ddp" or "accumulation" once training starts
        self._records: StepRecords | None = None
        self._norms: MicroBatchNorms | None = None
        self._hook_state: GNSHookState | None = None
        self._window = Window()
        self._batch_size = 0
        self._steps = 0
        self._scaler: Any = None
        self._restored: dict[str, Any] | None = None

    # ------------------------------------------------------------------ set-up

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not pl_module.automatic_optimization:
            raise BatchboundError("DiversityCallback follows Lightning's automatic optimisation "
                                  "(it undoes its 1/accumulate_grad_batches); manual "
                                  "optimisation is not supported")
        n = self.n if self.n is not None else dataset_size(trainer.train_dataloader)
        self.monitor = OnlineDiversity(n, decay=self.decay, sampling=self.sampling)
        if self._restored is not None:
            continue_estimate(self.monitor, self._restored)
        self._scaler = getattr(trainer.precision_plugin, "scaler", None)
        if trainer.world_size > 1:
            model = trainer.strategy.model
            if not isinstance(model, DistributedDataParallel):
                raise BatchboundError(
                    f"DiversityCallback on {trainer.world_size} processes needs a DDP strategy "
                    f"(the model wrapped in DistributedDataParallel), got "
                    f"{type(trainer.strategy).__name__}")
            self._hook_state = gns_hook_state(self.monitor, 1, loss_scale=self._scaler)
            try:
                model.register_comm_hook(self._hook_state, gns_hook)
            except RuntimeError as exc:
                raise BatchboundError(f"DiversityCallback could not register its DDP "
                                      f"communication hook ({exc}); a DDP model takes one hook, "
                                      "so drop the strategy's ddp_comm_hook") from exc
            self._records, self.mode = self._hook_state.records, "ddp"
        elif _accumulates(trainer):
            self._norms = MicroBatchNorms(pl_module.parameters(), names={
                id(p): name for name, p in pl_module.named_parameters()})
            self._records, self.mode = StepRecords(self.monitor), "accumulation"
        else:
            raise BatchboundError(
                "DiversityCallback compares small and big batches that training already has: it "
                "needs DDP with ≥ 2 ranks (Trainer(strategy='ddp', devices=2)) or "
                "accumulate_grad_batches ≥ 2; for one process without accumulation use "
                "batchbound.diversity.watch in your own step")

    # ------------------------------------------------------------------- a step

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_size = examples_in(batch)

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        b = float(self._batch_size)
        weight = 1.0 if self.reduction == "mean" else b
        if self._norms is not None:
            self._norms.start(b, weight)
        elif self._hook_state is not None:
            self._window.add(b, weight)
            self._hook_state.set_window(
                self._window.total_weight() / trainer.accumulate_grad_batches,
                self._window.effective_size())

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._norms is not None:
            self._norms.stop()

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        if self._records is None:
            return
        if self._norms is not None:
            row = self._norms.record(1.0 / trainer.accumulate_grad_batches,
                                     loss_scale_of(self._scaler, pl_module.device))
            if row is not None:
                self._records.add(row)
        elif self._hook_state is not None:
            self._hook_state.end_step()
            self._window = Window()
        self._steps += 1
        if self._steps % self.every == 0:
            self._log(trainer)

    def _log(self, trainer: L.Trainer) -> None:
        assert self._records is not None
        self.metrics = diversity_metrics(self._records.fold())
        if self.metrics and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self.metrics, step=trainer.global_step)

    # ------------------------------------------------------------------ the end

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._records is not None:  # the final estimate in ``metrics``, logged or not
            self.metrics = diversity_metrics(self._records.fold())  # (a run under ``every``)
        self._remove()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._remove()

    def _remove(self) -> None:
        if self._norms is not None:
            self._norms.remove()
            self._norms = None

    def state_dict(self) -> dict[str, Any]:
        if self._records is not None:
            self._records.fold()
        if self.monitor is None:
            return {}
        return {"monitor": self.monitor.state_dict(), "steps": self._steps}  # steps: the cadence

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = state_dict.get("monitor")
        self._steps = int(state_dict.get("steps", self._steps))
        if self.monitor is not None and self._restored is not None:
            continue_estimate(self.monitor, self._restored)


class BatchWarmupCallback(DiversityCallback):
    """Batch-size warmup in a Lightning run: DiversityCallback's estimate (over about the
    last 100 steps by default), acted on by ``batchbound.integrations.warmup``'s rule: every
    ``every`` optimizer steps the global batch (the loader's batch × accumulate_grad_batches
    × ranks) doubles when 2B ≤ fraction·(B_noise − SE), up to ``max_batch``, by doubling
    ``trainer.accumulate_grad_batches`` where a group of the new size can start (so a step
    never mixes the two); the optimizers' rates (and their schedulers' base rates) change by
    ``lr``. The estimate is global under DDP, so every rank changes at the same batch. Logs
    ``warmup/batch_size`` and ``warmup/accumulation`` beside ``gradient_diversity/*``.
    Needs what DiversityCallback needs: DDP with ≥ 2 ranks, or accumulate_grad_batches ≥ 2."""

    def __init__(self, every: int = 25, *, max_batch: int | None = None,
                 fraction: float = 0.5, lr: str = "noise", n: int | None = None,
                 reduction: str = "mean", decay: float | None = 0.99,
                 sampling: str = "without_replacement") -> None:
        super().__init__(every, n=n, reduction=reduction, decay=decay, sampling=sampling)
        self.options = {"every": every, "max_batch": max_batch, "fraction": fraction, "lr": lr}
        AccumulationWarmup(1, **self.options)  # checks the options now
        self.warmup: AccumulationWarmup | None = None
        self._warm_restored: dict[str, Any] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        resume_accumulation(trainer, self._warm_restored)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        k = trainer.accumulate_grad_batches
        if (batch_idx + 1) % k or self._records is None:  # no optimizer step this batch
            return
        if self.warmup is None:
            self.warmup = AccumulationWarmup(self._batch_size, k, trainer.world_size,
                                             **self.options)
            if self._warm_restored is not None:
                self.warmup.load_state_dict(self._warm_restored)
        if self.warmup.deciding():
            self._records.fold()
        assert self.monitor is not None
        factor = self.warmup.step(self.monitor, ready=(batch_idx + 1) % (2 * k) == 0)
        if factor == 1.0 and self.warmup.accumulation == k:
            return
        trainer.accumulate_grad_batches = self.warmup.accumulation
        schedulers = {id(c.scheduler.optimizer): c.scheduler for c in trainer.lr_scheduler_configs}
        for optimizer in trainer.optimizers:
            self.warmup.scale_rates(optimizer, factor, schedulers.get(id(optimizer)))
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self.warmup.metrics(), step=trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.warmup is not None:
            state["warmup"] = self.warmup.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._warm_restored = state_dict.get("warmup")


class BranchWarmupCallback(L.Callback):
    """Batch-size warmup in a Lightning run with the branch trigger (batchbound's trainer's
    default, ``batchbound.integrations.warmup.BranchWarmup``, at its cadence: first after
    ``every``·B0 examples, then at doubling example counts), short branches from the
    module's current weights and its optimiser's state at B, 2B and 4B (copied, run,
    restored); B (the loader's batch × accumulate_grad_batches × ranks) grows by 2 (or 4),
    by multiplying ``trainer.accumulate_grad_batches`` where a group of the new size can
    start, when the critical batch's interval lies at or above 2B (or 4B); the rates follow
    ``lr`` (auto: srsr, η0·√(B/B0)). The branches draw from
    ``train_dataloader.dataset`` (collated by the loader's own ``collate_fn``) and take their loss
    from ``loss(module, batch)``, by default the module's ``training_step(batch, 0)`` (its
    loss, or its dict's "loss"): pass ``loss`` when training_step logs or has side effects.
    Under DDP the branches run on the unwrapped module on every rank with the same seed and
    the ranks agree on the doubling. One optimiser, automatic optimisation. Logs
    ``warmup/batch_size``, ``warmup/accumulation``, ``warmup/branch_steps`` and
    ``warmup/branch_examples`` (the policy's cost)."""

    def __init__(self, every: int = BRANCH_EVERY, *, max_batch: int | None = None,
                 steps: int = BRANCH_STEPS, z: float = 1.0, lr: str = "auto", seed: int = 0,
                 loss: Any = None) -> None:
        super().__init__()
        self.options = {"every": every, "max_batch": max_batch, "steps": steps, "z": z,
                        "lr": lr, "seed": seed}
        BranchWarmup(1, **self.options)  # checks the options now
        self.loss = loss
        self.warmup: BranchWarmup | None = None
        self._warm_restored: dict[str, Any] | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        resume_accumulation(trainer, self._warm_restored)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        k = trainer.accumulate_grad_batches
        if (batch_idx + 1) % k:  # no optimizer step this batch
            return
        if len(trainer.optimizers) != 1 or not pl_module.automatic_optimization:
            raise BatchboundError("BranchWarmupCallback needs one optimiser and automatic "
                                  "optimisation (the branches step it themselves)")
        optimizer = trainer.optimizers[0]
        if self.warmup is None:
            self.warmup = BranchWarmup(examples_in(batch), k, trainer.world_size,
                                       **self.options)
            if self._warm_restored is not None:
                self.warmup.load_state_dict(self._warm_restored)
        dataset, collate = _dataset_and_collate(trainer.train_dataloader)
        loss = self.loss or _training_step_loss

        def loss_of(indices: torch.Tensor) -> torch.Tensor:
            items = collate([dataset[int(i)] for i in indices])
            return loss(pl_module, pl_module.transfer_batch_to_device(items, pl_module.device,
                                                                      0))

        factor = self.warmup.step(pl_module, optimizer, loss_of, len(dataset), ready=False)
        # a group of the new size (growth × k batches) can start after this batch
        if self.warmup.pending and (batch_idx + 1) % (self.warmup.growth * k) == 0:
            factor = self.warmup.apply()
        if factor == 1.0 and self.warmup.accumulation == k:
            return
        trainer.accumulate_grad_batches = self.warmup.accumulation
        schedulers = {id(c.scheduler.optimizer): c.scheduler for c in trainer.lr_scheduler_configs}
        self.warmup.scale_rates(optimizer, factor, schedulers.get(id(optimizer)))
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(self.warmup.metrics(), step=trainer.global_step)

    def state_dict(self) -> dict[str, Any]:
        return {"warmup": self.warmup.state_dict()} if self.warmup is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._warm_restored = state_dict.get("warmup")


def resume_accumulation(trainer: L.Trainer, restored: dict[str, Any] | None) -> None:
    """A run resumed from a checkpoint goes on at the accumulation its warmup had grown to,
    from its first batch (the warmup itself is rebuilt at the first optimizer step)."""
    if restored is not None:
        trainer.accumulate_grad_batches = int(restored["accumulation"])


def _dataset_and_collate(loader: Any) -> tuple[Any, Any]:
    """The train loader's data set and its own collate_fn: the branches' batches must be
    the loop's (a padding collator's rows cannot be stacked by default_collate)."""
    dataset, collate = getattr(loader, "dataset", None), getattr(loader, "collate_fn", None)
    if (dataset is None or collate is None or not hasattr(dataset, "__len__")
            or isinstance(dataset, torch.utils.data.IterableDataset)):
        raise BatchboundError(
            "BranchWarmupCallback draws its branches' examples from one train DataLoader "
            f"over a map-style dataset (its .dataset and .collate_fn); got "
            f"{type(loader).__name__}")
    return dataset, collate


def _training_step_loss(module: L.LightningModule, batch: Any) -> torch.Tensor:
    out = module.training_step(batch, 0)
    return out["loss"] if isinstance(out, dict) else out


def examples_in(batch: Any) -> int:
    """The examples in a batch (a tensor, or dicts, lists and tuples of them): the first
    dimension that its tensors of one or more dimensions share. A 0-dim tensor (one value
    for the whole batch) counts none; tensors that disagree are refused, since the loss's
    1/b could be over either."""
    sizes: dict[int, str] = {}

    def walk(value: Any, where: str) -> None:
        if isinstance(value, torch.Tensor):
            if value.dim() > 0:
                sizes.setdefault(int(value.shape[0]), where or "the batch")
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, f"{where}[{key!r}]" if where else repr(key))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{where}[{i}]" if where else f"[{i}]")

    walk(batch, "")
    if len(sizes) == 1:
        return next(iter(sizes))
    if not sizes:
        raise BatchboundError("DiversityCallback found no tensor with the examples along its "
                              "first dimension in the batch")
    (a, first), (b, second) = list(sizes.items())[:2]
    raise BatchboundError(
        f"the batch's tensors disagree on the number of examples (dim 0: {a} in {first}, "
        f"{b} in {second}): DiversityCallback cannot tell what training_step's loss is over; "
        "keep values that are not one per example out of the batch")


def _accumulates(trainer: L.Trainer) -> bool:
    """Whether steps add up micro-batches, now or from a later epoch: a
    GradientAccumulationScheduler sets ``accumulate_grad_batches`` at each epoch's start,
    after ``on_train_start`` (its steps of one micro-batch are skipped)."""
    scheduled = [k for callback in trainer.callbacks
                 if isinstance(callback, GradientAccumulationScheduler)
                 for k in callback.scheduling.values()]
    return max([trainer.accumulate_grad_batches, *scheduled]) >= 2
