"""The training loop: synchronous data-parallel mini-batch SGD, one short named step at a time.

    evaluate (iteration 0)
    while no limit reached:
        train_step        data → compute → communication (all-reduce) → step
        divergence check  non-finite or > divergence_factor × initial loss: status diverged
        evaluate          every eval_every_* ; record targets reached
        callbacks         train/callbacks.py: snapshots every snapshot_every_epochs, the
                          exact Δ every diversity_every_epochs, the batch policy every k
                          iterations (adaptive(...), warmup(...))
        checkpoint        every checkpoint_every iterations, and on SIGTERM/SIGINT
    final evaluation; final_probes at w* (train/probes.py) when the run is complete

The global batch B is drawn identically on every rank (same sampler seed); rank r takes its
slice (see distributed.py). Each rank backpropagates Σ_{i∈slice} f_i · scale, scale = 1/B
(``mean``) or 1 (``sum``), and the flat gradient buffer is all-reduced with SUM, so P
processes compute exactly what one would, up to the order of float additions.
"""

from __future__ import annotations

import copy
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from batchbound import kernels
from batchbound.data import BatchSampler, Dataset, apply_transform, load_dataset
from batchbound.data.identity import data_digest
from batchbound.diversity import PreparedStats, measure
from batchbound.diversity.hooks import OutputKinds, check_outputs_read
from batchbound.diversity.losses import check_shape, resolve_loss
from batchbound.diversity.rule_check import output_kinds
from batchbound.environment import restart_count
from batchbound.errors import BatchboundError, NonFiniteLossError, UserCodeError
from batchbound.models import build_model
from batchbound.train.cadence import EPS, next_due
from batchbound.train.callbacks import Callback, Snapshots, callbacks_for
from batchbound.train.checkpoint import (
    StopFlag,
    load_checkpoint,
    overwrite_refusal,
    save_checkpoint,
)
from batchbound.train.config import TrainConfig
from batchbound.train.distributed import (
    DistContext,
    all_reduce_sum,
    resolve_device,
    setup,
    shard,
    teardown,
)
from batchbound.train.evaluate import evaluate
from batchbound.train.mechanisms import apply_to_worker, example_gradients, worker_seed
from batchbound.train.monitor import OnlineMonitor
from batchbound.train.optimizers import build_optimizer, user_optimizer
from batchbound.train.progress import Progress
from batchbound.train.result import RunResult, TargetResult
from batchbound.train.stall import collective_fault
from batchbound.train.timing import PhaseTimer, interleaved_medians, inverted, monotone


def train_in_group(
    config: TrainConfig,
    *,
    dataset: Dataset | None = None,
    checkpoint_path: str | Path | None = None,
    resume: bool = False,
    progress: bool = False,
    stall_timeout: float | None = None,
    keep_checkpoint: bool = False,
) -> RunResult:
    """Train in this process: alone, or as one rank of the process group that is already
    initialised or that torchrun's environment describes (its collectives bounded by
    ``stall_timeout`` seconds). ``batchbound.train.train`` decides whether to spawn local
    processes first (launch.py) and calls this in each. ``keep_checkpoint``: refuse to start
    afresh over an existing checkpoint (``_agreed``)."""
    if resume and checkpoint_path is None:
        raise BatchboundError("resume needs a checkpoint path")
    owns_group = not torch.distributed.is_initialized()  # setup() may create it (torchrun)
    ctx = setup(config.device, stall_timeout)
    finished = False
    try:
        if ctx.world_size != config.workers:
            raise BatchboundError(
                f"config says workers={config.workers} but the process group has "
                f"{ctx.world_size} ranks; set --workers to the torchrun world size"
            )
        # only asked for by train(), which has checked torchrun's environment (a local
        # rank's is not torchrun's: no MASTER_ADDR)
        restarted = keep_checkpoint and restart_count() > 0
        over = keep_checkpoint and checkpoint_path is not None and Path(checkpoint_path).exists()
        resume = _agreed(ctx, resume, restarted, over, checkpoint_path)
        trainer = Trainer(
            config, ctx, dataset=dataset, checkpoint_path=checkpoint_path, progress=progress
        )
        if resume and checkpoint_path is None:
            raise BatchboundError("another rank resumes from its checkpoint: give every rank "
                                  "the same --checkpoint")
        result = trainer.run(resume=resume)
        finished = True
        return result
    finally:
        if owns_group:  # leave a group we created; a caller's own group is theirs to close
            teardown(synchronise=finished)


def _agreed(ctx: DistContext, resume: bool, restarted: bool, over: bool,
            checkpoint: str | Path | None) -> bool:
    """Every rank resumes when one does (a MAX all-reduce): under torchrun each rank decides
    from its agent's restart count, and an agent that replaced a lost node counts none while
    the others count one; its ranks would start afresh beside resumed ones (other weights,
    iteration 0, on the same all-reduced gradients). A rank that cannot read the checkpoint
    is refused by its load, in one line.

    ``over``: this rank would start afresh over a checkpoint it was asked to keep;
    ``restarted``: its torchrun agent has restarted the group. When no
    rank resumes and no agent has restarted (a fresh torchrun launch, or a single process,
    rerun without --resume after a kill), every rank refuses, in the same line: an agent's
    restart reruns the same command and resumes by itself (launch.py), a fresh launch must
    say so. Decided from the same reduced flags on every rank, so all stop or none does."""
    flags = [resume, restarted, over]
    if ctx.distributed:
        reduced = torch.tensor([1.0 if f else 0.0 for f in flags], device=ctx.device)
        torch.distributed.all_reduce(reduced, op=torch.distributed.ReduceOp.MAX)
        flags = [v > 0 for v in reduced.tolist()]
    resume, restarted, over = flags
    if over and not resume and not restarted:
        raise overwrite_refusal(checkpoint)
    return resume


class StepTimes(NamedTuple):
    steps: list[float]  # seconds of the trainer's step per size, non-decreasing in the size
    forwards: list[float]  # of the forward alone
    unsettled: str | None  # why these cannot be trusted (the rounds did not settle), or None
    sizes: tuple[int, ...] = ()  # the sizes timed: those asked for, from the first that runs


def time_steps(
    config: TrainConfig, data: Dataset, sizes: list[int] | tuple[int, ...], budget_s: float = 0.2,
    parts: Parts | None = None,
) -> StepTimes:
    """Seconds of the trainer's step, and of the forward pass alone, at each micro-batch size
    (``sizes`` increasing), on one process with a throwaway model: medians over rounds that
    interleave every size (``interleaved_medians``, about ``budget_s`` per size and kind in
    all), made non-decreasing in the size (``monotone``). ``unsettled`` says why they are not
    to be trusted: the rounds did not settle, or a smaller size timed well above a larger."""
    timed = config.replace(workers=1, lr=1e-9, online_diversity="off",
                           diversity_every_epochs=None, batch_policy="fixed", targets=())
    trainer = Trainer(timed, DistContext(device=resolve_device(config.device)), dataset=data,
                      parts=parts)
    trainer.initial_loss = 1.0
    sizes = list(sizes)
    if sizes != sorted(set(sizes)):
        raise BatchboundError(f"time_steps needs increasing sizes, got {sizes}")

    def step(m: int) -> None:
        trainer.batch_size = m
        trainer.train_step(False, False)

    def forward(m: int) -> None:
        x, y = trainer.data.x_train[:m], trainer.data.y_train[:m]
        trainer.loss_fn(trainer.model(x), y).sum()

    sizes = _sizes_that_run(step, sizes)
    actions = [functools.partial(f, m) for f in (step, forward) for m in sizes]
    medians, settled = interleaved_medians(actions, 2 * budget_s * len(sizes))
    steps, forwards = medians[:len(sizes)], medians[len(sizes):]
    reason = None if settled else "the step's timings did not settle over interleaved rounds"
    reason = inverted(sizes, steps) or reason
    return StepTimes(monotone(steps), monotone(forwards), reason, tuple(sizes))


def _sizes_that_run(step: Callable[[int], None], sizes: list[int]) -> list[int]:
    """``sizes`` from the first at which the model's step runs: a user's model may not train
    on too few examples (BatchNorm1d in train mode needs two). None runs: one line naming the
    model's error."""
    for i, m in enumerate(sizes):
        try:
            step(m)
        except BatchboundError as exc:
            if not isinstance(exc, UserCodeError):
                raise
            if i == len(sizes) - 1:
                raise
            continue
        except Exception as exc:  # the user's model: any error, named in the refusal
            if i == len(sizes) - 1:
                first = (str(exc).strip().splitlines() or [""])[0]
                raise BatchboundError(
                    f"the model's training step fails at every micro-batch timed "
                    f"({sizes[0]} to {m} examples): {type(exc).__name__}: {first}") from exc
            continue
        return sizes[i:]
    return sizes


def _scaled(grad: torch.Tensor, scale: float, param: torch.Tensor) -> torch.Tensor:
    """``scale·grad`` as ``param``'s gradient: in place when the dtype already matches."""
    if grad.dtype == param.dtype:
        return grad.mul_(scale).view_as(param)
    return (grad * scale).to(param.dtype).view_as(param)


@dataclass(frozen=True)
class Parts:
    """What a caller hands the trainer instead of the config's names (Python only): a module
    (trained as a copy, so the caller's stays untouched), a per-example loss
    ``(outputs, targets) -> (n,)``, and an optimizer factory ``params -> Optimizer`` (the
    trainer still sets its learning rate from the config's strategy)."""

    model: nn.Module | None = None
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        ctx: DistContext,
        *,
        dataset: Dataset | None = None,
        checkpoint_path: str | Path | None = None,
        progress: bool = False,
        parts: Parts | None = None,
    ) -> None:
        self.config, self.ctx = config, ctx
        parts = parts or Parts()
        data = dataset if dataset is not None else load_dataset(config.dataset, config.data_dir)
        if config.transform:
            data = apply_transform(data, config.transform, config.seed)
        config.validate_against(data, model_given=parts.model is not None)
        self.parts, self.source = parts, data  # what a branch (train/branches.py) is built from
        dtype = getattr(torch, config.dtype)
        self.data = data.to(ctx.device, dtype)
        self.n = data.n_train
        self.classification = data.task in ("classification", "text")  # has an accuracy
        # dict batches' targets are their packed rows, not labels: no accuracy against them,
        # whatever shape the model's logits have
        self.labelled = data.task != "batch"
        self.loss_fn = parts.loss or resolve_loss(config.loss, data.task)
        self.strategy = config.parsed_strategy()
        self.mechanism = config.parsed_mechanism()
        self.policy = config.parsed_batch_policy()

        torch.manual_seed(config.seed)
        self.model = (copy.deepcopy(parts.model) if parts.model is not None else
                      build_model(config.model, data.input_shape, data.num_outputs,
                                  seed=config.seed))
        self.model.to(device=ctx.device, dtype=dtype).train()
        self.names = [name for name, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.numels = [p.numel() for p in self.params]
        if not self.params:
            raise BatchboundError(f"{type(self.model).__name__} has no trainable parameters "
                                  "(none with requires_grad): nothing to train")
        self.optimizer = (user_optimizer(parts.optimizer, self.params) if parts.optimizer
                          else build_optimizer(self.params, config))
        self.sampler = BatchSampler(
            self.n, config.seed, replacement=config.sampling == "replacement"
        )
        # mechanism draws differ per rank (independent workers) and are checkpointed
        self.generator = torch.Generator(device=ctx.device)
        self.generator.manual_seed(worker_seed(config.seed, ctx.rank))
        self.monitor = OnlineMonitor(config.online_diversity, self.n, ctx, config.sampling,
                                     config.micro_batch)
        self.prepared_stats: PreparedStats | None = None  # made on the first monitored step
        self._kinds: OutputKinds | None = None  # outputs with no examples' dimension
        self._backward_seed: tuple[float, torch.Tensor] | None = None  # (scale, tensor), reused

        self.eval_train = self.train_subset(config.eval_subset or self.n, config.seed)

        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        # the data a checkpoint was trained on: a resume on other data is refused
        self.data_digest = data_digest(data) if self.checkpoint_path is not None else None
        self.timer = PhaseTimer(ctx.device)
        self.progress = Progress(
            progress and ctx.is_main,
            config.max_epochs if config.max_epochs else config.max_iterations,
            "epoch" if config.max_epochs else "it",
        )
        # run state (all of it goes into checkpoints)
        self.iteration = 0
        self.train_seconds = 0.0
        self.batch_size = config.batch_size
        self.lr = math.nan
        self.lr_factor = 1.0  # batch-size warmup's changes to the rate
        self.branch_steps = 0  # the branch trigger's cost: its branches' steps and examples
        self.branch_examples = 0
        self.initial_loss: float | None = None
        self.last_batch_loss = math.nan
        self.next_eval_epoch = config.eval_every_epochs or math.inf
        self.last_eval_iteration = -1
        self.test_iteration = -1  # where the test split was last evaluated (eval_test = "last")
        self.metrics: dict[str, float] = {}
        self.curves: list[tuple[int, float, float, str, float]] = []
        self.targets = [TargetResult(t.name, t.metric, t.threshold) for t in config.targets]
        self.status, self.message = "complete", ""
        self._step_cost: Callable[[int], float] | None = None  # pick=time's t(B), timed once
        self.probe_values: dict[str, float] = {}  # final_probes' results (not checkpointed:
        self.probe_seconds: dict[str, float] = {}  # they run once the training has ended)
        self.callbacks: list[Callback] = callbacks_for(self)

    # ---------------------------------------------------------------- the loop
    def run(self, resume: bool = False) -> RunResult:
        stop = StopFlag().install()
        try:
            if resume:
                self.load_checkpoint()
            else:
                self.evaluate_step()
                self.record("batch_size", self.batch_size)
            for callback in self.callbacks:
                callback.on_train_start(self)
            while not self.limit_reached():
                flags = self.train_step(stop.requested, self.time_exceeded())
                if self.diverged():
                    break
                if flags["time"]:
                    self.message = f"max_seconds={self.config.max_seconds:g} reached"
                    break
                if self.after_step():
                    self.message = "all targets reached"
                    break
                if flags["stop"]:
                    self.status = "stopped"
                    self.message = f"stopped by {stop.signal_name or 'a signal on another rank'}"
                    self.checkpoint_step()
                    break
            if self.status == "complete":
                self.last_evaluation()
            if self.status == "complete" and self.config.final_probes:
                self.probe_step()
        except NonFiniteLossError as exc:
            # the per-example engines refuse non-finite losses: that is divergence, not bad input
            if self.initial_loss is None:
                raise
            self.status = "diverged"
            self.message = f"non-finite loss at iteration {self.iteration + 1}: {exc}"
        except BatchboundError as exc:
            if not isinstance(exc, UserCodeError):
                raise  # bad input: the caller's error, not a result
            self._crashed(exc, str(exc))  # the user's model, run by a measurement
        except Exception as exc:  # a crash mid-run is a recorded result, not a lost one
            self._crashed(exc, f"{type(exc).__name__}: {exc}")
        finally:
            stop.close()
            self.progress.close()
        return self.result()

    def _crashed(self, exc: Exception, message: str) -> None:
        self.status, self.message = "failed", message
        if self.ctx.distributed:  # a silent or lost peer: one line that names it
            fault = collective_fault(exc, self.ctx.rank, self.ctx.world_size,
                                     self.iteration, self.checkpoint_path)
            if fault is not None:
                raise fault from None
            raise exc

    def after_step(self) -> bool:
        """The cadenced steps after an iteration; True once every target is reached."""
        if self.eval_due():
            self.evaluate_step()
            if self.all_targets_reached():
                return True
        for callback in self.callbacks:
            callback.on_train_batch_end(self)
        if self.checkpoint_due():
            self.checkpoint_step()
        return False

    # ---------------------------------------------------------------- steps
    def train_step(self, stop_requested: bool, time_exceeded: bool) -> dict[str, bool]:
        timer, ctx = self.timer, self.ctx
        started = time.perf_counter()
        timer.start()
        batch = self.batch_size
        lr = self.strategy.lr(self.config.lr, batch, self.sampler.epoch) * self.lr_factor
        if lr != self.lr:
            self.lr = lr
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.record("lr", lr)
        local = self.sampler.next_indices(batch)
        if ctx.distributed:
            local = shard(local, ctx.rank, ctx.world_size)
        if ctx.device.type != "cpu":
            local = local.to(ctx.device, non_blocking=True)
        x, y = self.data.x_train[local], self.data.y_train[local]
        timer.lap("data")

        scale = 1.0 / batch if self.config.convention == "mean" else 1.0
        grads, loss_sum, monitor_extras = self.accumulate_gradients(x, y, scale)
        if self.config.mechanism_granularity == "worker" and not self.mechanism.is_identity:
            apply_to_worker(self.mechanism, grads, scale, self.generator)
        timer.lap("compute")

        extras = [loss_sum, float(stop_requested), float(time_exceeded), *monitor_extras]
        extras_sum, sent = self.all_reduce(grads, extras)
        timer.lap("communication")

        self.optimizer.step()
        timer.lap("step")
        timer.end_iteration(batch, sent)

        self.iteration += 1
        self.train_seconds += time.perf_counter() - started
        self.last_batch_loss = extras_sum[0] / batch
        self.record("batch_loss", self.last_batch_loss)
        if self.monitor.active:
            t0 = time.perf_counter()
            for metric, value in self.monitor.update(grads, scale, extras_sum[3:], batch).items():
                self.record(metric, value)
            timer.totals["monitor"] += time.perf_counter() - t0
            if self.policy.adaptive and self.policy.source == "online":  # the policy's input
                self.train_seconds += time.perf_counter() - t0
        if self.progress.enabled:
            self.progress.update(
                self.sampler.epoch,
                self.iteration,
                self.last_batch_loss,
                self.metrics.get("train_acc"),
                timer.samples / max(self.train_seconds, 1e-12),
                batch,
            )
        return {"stop": extras_sum[1] > 0, "time": extras_sum[2] > 0}

    def accumulate_gradients(
        self, x: torch.Tensor, y: torch.Tensor, scale: float
    ) -> tuple[list[torch.Tensor], float, list[float]]:
        """This rank's share in micro-batches of ``micro_batch`` examples (one pass without
        it): their gradients summed, set as ``.grad`` and returned, with the loss sum and the
        monitor's extras. Each micro-batch's backward starts from no gradient, so the sum
        is formed here once per micro-batch, as autograd's own accumulation would."""
        two_batch = self.monitor.mode == "two_batch"
        if not self.config.micro_batch:  # the usual step: one pass
            grads, loss_sum, extras = self.compute_gradients(x, y, scale)
            if two_batch:
                extras = [self.monitor.small_batch_sq(grads, scale, len(x))]
            return grads, loss_sum, extras
        total: list[torch.Tensor] | None = None
        loss_sum, extras, small_sq = 0.0, [0.0], 0.0
        reached = [False] * len(self.params)  # by some micro-batch's loss (its .grad is set)
        for xs, ys in zip(x.split(self.config.micro_batch), y.split(self.config.micro_batch),
                          strict=True):
            grads, loss, more = self.compute_gradients(xs, ys, scale)
            reached = [r or p.grad is not None for r, p in zip(reached, self.params, strict=True)]
            if two_batch:
                small_sq += self.monitor.small_batch_sq(grads, scale, len(xs))
            if total is None:
                total, extras = grads, more
            else:
                for t, g in zip(total, grads, strict=True):
                    t.add_(g)
                extras = [a + b for a, b in zip(extras, more, strict=True)]
            loss_sum += loss
        assert total is not None
        for p, g, r in zip(self.params, total, reached, strict=True):
            # one process: a parameter no micro-batch reached keeps no .grad, as in one pass
            # (_grads_or_zeros), so weight decay and momentum skip it alike
            p.grad = g if r or self.ctx.distributed else None
        return total, loss_sum, [small_sq] if two_batch else extras

    def compute_gradients(
        self, x: torch.Tensor, y: torch.Tensor, scale: float
    ) -> tuple[list[torch.Tensor], float, list[float]]:
        """This rank's gradients (already scaled), its loss sum, and what the monitor needs."""
        if self.config.mechanism_granularity == "example" and not self.mechanism.is_identity:
            losses, grads = example_gradients(
                self.mechanism, self.model, x, y, self.loss_fn, scale, self.generator
            )
            for p, g in zip(self.params, grads, strict=True):
                p.grad = g
            return grads, float(losses.sum()), []
        if self.monitor.needs_norms:  # one backward gives gradients and per-example norms
            if self.prepared_stats is None:
                self.prepared_stats = PreparedStats(self.model, self.loss_fn)
            stats = self.prepared_stats(x, y)
            grads = [
                _scaled(stats.grad_sum[name], scale, p)
                for name, p in zip(self.names, self.params, strict=True)
            ]
            for p, g in zip(self.params, grads, strict=True):
                p.grad = g
            return grads, float(stats.losses.sum()), [float(stats.total_sq_norms.sum())]
        self.optimizer.zero_grad(set_to_none=True)
        kinds = self._kinds
        if kinds is None and len(y) > 1:  # once, before the forward whose graph is read
            try:
                kinds = output_kinds(self.model, x, dict(zip(self.names, self.params,
                                                             strict=True)))
            except BatchboundError:  # it runs at no other size here: the shape rule alone,
                kinds = OutputKinds()  # and read again at the next size if this one fails
        outputs = self.model(x)  # a model that cannot take this size raises here (timing)
        self._kinds = kinds
        losses = self.loss_fn(outputs, y)
        check_shape(losses, len(y))  # a user's scalar loss would be summed as if one example
        total = losses.sum()
        # an output of the whole batch read into each example's loss (a load-balancing loss)
        # makes the objective change with how the batch is split among workers; by its
        # shape at other batch sizes, so that n experts at a batch of n are seen too
        check_outputs_read(total, outputs, len(y), kinds)
        # seeding backward with `scale` equals (total·scale).backward() bit for bit, without
        # the extra multiply and its autograd node (~40 µs a step on a small model)
        if self._backward_seed is None or self._backward_seed[0] != scale:
            self._backward_seed = (scale, torch.full_like(total, scale))
        total.backward(self._backward_seed[1])
        return self._grads_or_zeros(), total.item(), []

    def _grads_or_zeros(self) -> list[torch.Tensor]:
        """Each parameter's gradient; zeros for one the loss did not reach (a branch, an
        output the loss ignores), so that the monitor's norms and the all-reduce see every
        parameter. On one process its .grad stays None (the optimizer skips it, as in plain
        PyTorch); across ranks it is the zeros, which the all-reduce fills with the other
        ranks' gradients (DDP's own convention for unused parameters); one no rank reached
        then has a zero gradient that weight decay and momentum act on, unlike on one
        process (docs/train.md, exactness rules: a known limit)."""
        grads = []
        for p in self.params:
            g = p.grad
            if g is None:
                g = torch.zeros_like(p)
                if self.ctx.distributed:
                    p.grad = g
            grads.append(g)
        return grads

    def all_reduce(self, grads: list[torch.Tensor], extras: list[float]) -> tuple[list[float], int]:
        """SUM gradients and the extras across ranks in one flat buffer; returns the summed
        extras and the payload bytes this rank sent (0 on one process)."""
        if not self.ctx.distributed:
            return extras, 0
        flat = torch.cat([g.reshape(-1) for g in grads] + [grads[0].new_tensor(extras)])
        all_reduce_sum(flat)
        for g, chunk in zip(grads, flat[: -len(extras)].split(self.numels), strict=True):
            g.copy_(chunk.view_as(g))
        return flat[-len(extras) :].tolist(), flat.numel() * flat.element_size()

    def last_evaluation(self) -> None:
        """The run's last evaluation, which carries the test split whatever ``eval_test``."""
        if self.last_eval_iteration != self.iteration:
            self.evaluate_step(last=True)
        elif self.data.n_test > 0 and self.test_iteration != self.iteration:
            started = time.perf_counter()
            self.evaluate_test(self.metrics)
            self.timer.totals["eval"] = (self.timer.totals.get("eval", 0.0)
                                         + time.perf_counter() - started)

    def evaluate_test(self, metrics: dict[str, float]) -> None:
        """Test loss (and accuracy) into ``metrics`` and the run's records."""
        test = evaluate(
            self.model,
            self.data.x_test,
            self.data.y_test,
            self.loss_fn,
            self.ctx,
            self.config.eval_batch_size,
            self.classification,
            self.labelled,
        )
        for name, value in test.items():
            metrics[f"test_{name}"] = value
            self.record(f"test_{name}", value)
        self.test_iteration = self.iteration

    def evaluate_step(self, last: bool = False) -> None:
        started = time.perf_counter()
        cfg, data = self.config, self.data
        train = evaluate(
            self.model,
            *self.eval_train,
            self.loss_fn,
            self.ctx,
            cfg.eval_batch_size,
            self.classification,
            self.labelled,
        )
        metrics = {f"train_{k}": v for k, v in train.items()}
        for name, value in metrics.items():
            self.record(name, value)
        if data.n_test > 0 and (cfg.eval_test == "every" or last):
            self.evaluate_test(metrics)
        self.metrics = metrics
        self.progress.evaluated(metrics.get("train_acc"))
        if self.initial_loss is None:
            self.initial_loss = metrics["train_loss"]
        for target, goal in zip(self.targets, cfg.targets, strict=True):
            split = goal.metric.split("_", 1)[0]  # a split evaluated without the metric:
            if f"{split}_loss" in metrics and goal.metric not in metrics:  # never reached
                raise BatchboundError(
                    f"the target {goal.name} needs {goal.metric}, which this run cannot "
                    "measure (a model that returns an output object rather than a tensor "
                    "of logits has a loss, not an accuracy): target a loss instead")
            if not target.reached and goal.reached(metrics.get(goal.metric, math.nan)):
                target.reached = True
                target.iteration = self.iteration
                target.epoch = self.sampler.epoch
                target.seconds = self.train_seconds
        self.last_eval_iteration = self.iteration
        if cfg.eval_every_iterations is None:
            self.next_eval_epoch = next_due(self.next_eval_epoch, self.sampler.epoch,
                                            cfg.eval_every_epochs,  # type: ignore[arg-type]
                                            cfg.eval_growth)
        self.timer.totals.setdefault("eval", 0.0)
        self.timer.totals["eval"] += time.perf_counter() - started

    def measure_diversity(self) -> float:
        """Exact Δ over the whole train set (each rank measures its share; all-reduced)."""
        started = time.perf_counter()
        x = self.data.x_train[self.ctx.rank :: self.ctx.world_size]
        y = self.data.y_train[self.ctx.rank :: self.ctx.world_size]
        report = measure(self.model, (x, y), self.loss_fn, chunk_size=256)
        self.record("diversity", report.diversity)
        self.record("batch_bound", report.batch_bound)
        self.timer.totals.setdefault("diversity", 0.0)
        self.timer.totals["diversity"] += time.perf_counter() - started
        return float(report.diversity)

    @property
    def snapshots(self) -> list[tuple[int, float, np.ndarray]]:
        """(iteration, epoch, weights) kept so far by the Snapshots callback (rank 0)."""
        kept = [c for c in self.callbacks if isinstance(c, Snapshots)]
        return kept[0].kept if kept else []

    def flat_weights(self) -> np.ndarray:
        """The trainable parameters in ``model.parameters()`` order, one float32 vector."""
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).to("cpu", torch.float32)
                              for p in self.params])
        return flat.numpy()

    def probe_step(self) -> None:
        """The final probes at w* (train/probes.py), after training: not training time. A
        probe that raises leaves the run complete, without its values, and says so in the
        message (under several ranks it raises, as any error does)."""
        from batchbound.train.probes import FinalState, run_probes

        state = FinalState(
            model=self.model,
            x=self.data.x_train,
            y=self.data.y_train,
            loss_fn=self.loss_fn,
            ctx=self.ctx,
            config=self.config,
            batch_size=self.batch_size,
            lr=self.strategy.lr(self.config.lr, self.batch_size, self.sampler.epoch),
        )
        try:
            self.probe_values, self.probe_seconds = run_probes(self.config.final_probes, state)
        except Exception as exc:
            if self.ctx.distributed:
                raise
            note = f"final probes failed: {type(exc).__name__}: {exc}"
            self.message = f"{self.message}; {note}" if self.message else note

    def branch(self, batch: int, lr: float, steps: int, evaluations: int, seed: int,
               subset: int) -> list[tuple[int, float]]:
        """(examples, train loss on a fixed subset of ``subset``) along ``steps`` steps at
        ``batch`` and rate ``lr`` from this run's current weights and optimiser state, in a
        separate trainer on this process (this run's model, optimiser, sampler and random
        state are left as they were); a diverged branch ends at +inf. Its steps and examples
        are added to the run's branch cost."""
        from batchbound.train.checkpoint import rng_state, set_rng_state

        every = max(1, steps // evaluations)
        run = self.config.replace(
            batch_size=batch, lr=lr, strategy="blr", batch_policy="fixed", seed=seed,
            targets=(), max_iterations=steps, max_epochs=None, max_seconds=None,
            eval_every_epochs=None, eval_every_iterations=every, eval_growth=None,
            diversity_every_epochs=None, online_diversity="off", micro_batch=None,
            snapshot_every_epochs=None, final_probes=(), checkpoint_every=None, workers=1,
            transform=None, eval_subset=subset if subset < self.n else None)
        saved = rng_state()
        try:
            trainer = Trainer(run, DistContext(device=self.ctx.device), dataset=self.source,
                              parts=self.parts)
            # every branch (the replicate's other data order too) is read on one subset,
            # this run's: the branch's seed would pick another, and the subsets' difference
            # would pass for chance variation between B0's two runs
            trainer.eval_train = self.train_subset(subset, self.config.seed)
            trainer.model.load_state_dict(self.model.state_dict())
            state = copy.deepcopy(self.optimizer.state_dict())
            for group in state["param_groups"]:
                group["lr"] = lr
            trainer.optimizer.load_state_dict(state)
            result = trainer.run()
        finally:
            set_rng_state(saved)
        self.branch_steps += trainer.iteration
        self.branch_examples += trainer.iteration * batch
        curve = [(i * batch, v) for i, _, _, v in result.curve("train_loss")]
        if result.status == "diverged":
            curve.append((steps * batch, math.inf))
        return curve

    def train_subset(self, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed train subset of ``size`` examples drawn from ``seed`` that the training
        loss is evaluated on (the whole train set when it is no larger); branches pass their
        parent run's seed, so that every branch is read on one subset."""
        if size >= self.n:
            return self.data.x_train, self.data.y_train
        pick = torch.randperm(self.n, generator=torch.Generator().manual_seed(seed))
        pick = pick[:size].to(self.ctx.device)
        return self.data.x_train[pick], self.data.y_train[pick]

    def set_batch_size(self, new: int) -> None:
        """The global batch from the next step on (a batch policy's decision), recorded."""
        if new != self.batch_size:
            self.batch_size = new
            self.record("batch_size", new)

    def step_cost(self, candidates: list[int]) -> Callable[[int], float]:
        """t(B): seconds of one iteration at global batch B, for the policy's candidates: this
        machine's step at ⌈B/P⌉ examples, timed once, plus the all-reduce as this run has
        measured it so far; averaged over ranks so that every rank picks the same B."""
        if self._step_cost is None:
            workers = self.ctx.world_size
            micro = [math.ceil(b / workers) for b in candidates]
            sizes = sorted(set(micro))
            with torch.random.fork_rng(devices=[]):  # the throwaway model reseeds torch
                steps = time_steps(self.config.replace(transform=None), self.data, sizes,
                                   budget_s=0.02)
            step = dict(zip(steps.sizes, steps.steps, strict=True))
            communication = self.timer.totals["communication"] / max(self.timer.iterations, 1)
            # a size the model cannot step at (below the first that runs) costs inf: not picked
            seconds = torch.tensor([step.get(m, math.inf) + communication for m in micro],
                                   dtype=torch.float64, device=self.ctx.device)
            all_reduce_sum(seconds)
            table = dict(zip(candidates, (seconds / workers).tolist(), strict=True))
            self._step_cost = table.__getitem__
        return self._step_cost

    def diverged(self) -> bool:
        loss, factor = self.last_batch_loss, self.config.divergence_factor
        if not math.isfinite(loss):
            self.status, self.message = "diverged", f"non-finite loss at iteration {self.iteration}"
        elif factor is not None and self.initial_loss is not None and self.initial_loss > 0 \
                and loss > factor * self.initial_loss:  # a multiple of a loss at or below 0
            # is no bound above it (−3 > 10 × −2.7): every such run read as diverged at once
            self.status = "diverged"
            self.message = (
                f"loss {loss:.4g} > {factor:g} × initial {self.initial_loss:.4g} at iteration "
                f"{self.iteration}"
            )
        return self.status == "diverged"

    # ---------------------------------------------------------------- cadences and limits
    def limit_reached(self) -> bool:
        cfg = self.config
        if cfg.max_iterations is not None and self.iteration >= cfg.max_iterations:
            self.message = self.message or f"max_iterations={cfg.max_iterations} reached"
            return True
        if cfg.max_epochs is not None and self.sampler.epoch >= cfg.max_epochs - EPS:
            self.message = self.message or f"max_epochs={cfg.max_epochs:g} reached"
            return True
        return False

    def time_exceeded(self) -> bool:
        limit = self.config.max_seconds
        return limit is not None and self.train_seconds >= limit

    def eval_due(self) -> bool:
        every = self.config.eval_every_iterations
        if every is not None:
            return self.iteration % every == 0
        return self.sampler.epoch + EPS >= self.next_eval_epoch

    def checkpoint_due(self) -> bool:
        every = self.config.checkpoint_every
        return (
            self.checkpoint_path is not None and every is not None and self.iteration % every == 0
        )

    def all_targets_reached(self) -> bool:
        return (
            bool(self.targets)
            and self.config.stop_at_targets
            and all(t.reached for t in self.targets)
        )

    # ---------------------------------------------------------------- records
    def record(self, metric: str, value: float) -> None:
        self.curves.append(
            (self.iteration, self.sampler.epoch, self.train_seconds, metric, float(value))
        )

    def result(self) -> RunResult:
        final = {
            **self.metrics,
            "eval_iteration": self.last_eval_iteration,  # when the metrics above were taken
            "batch_loss": self.last_batch_loss,
            "iterations": self.iteration,
            "epochs": self.sampler.epoch,
            "seconds": self.train_seconds,
            "batch_size": self.batch_size,
            "lr": self.lr,
            **self.probe_values,
        }
        if self.policy.warmup and self.policy.trigger == "branch":  # the policy's cost
            final["policy_branch_steps"] = self.branch_steps
            final["policy_branch_examples"] = self.branch_examples
        timings = self.timer.summary(self.ctx.world_size)
        timings["train_seconds"] = self.train_seconds
        for extra in ("eval", "diversity", "checkpoint"):
            timings[f"{extra}_seconds"] = self.timer.totals.get(extra, 0.0)
        if self.probe_seconds:
            timings["probe_seconds"] = sum(self.probe_seconds.values())
            timings["probes"] = dict(self.probe_seconds)
        snapshots = [(epoch, weights) for _, epoch, weights in self.snapshots]
        if self.config.snapshot_every_epochs and self.ctx.is_main and (
            not self.snapshots or self.snapshots[-1][0] != self.iteration
        ):  # the run's last point; not kept in self.snapshots, so a resume cannot repeat it
            snapshots.append((self.sampler.epoch, self.flat_weights()))
        return RunResult(
            config=self.config,
            config_hash=self.config.config_hash(),
            status=self.status,
            targets=[TargetResult(**t.to_dict()) for t in self.targets],
            curves=list(self.curves),
            timings=timings,
            final=final,
            message=self.message,
            environment={
                "world_size": self.ctx.world_size,
                "backend": self.ctx.backend,
                "device": str(self.ctx.device),
                "torch": torch.__version__,
                "kernels": kernels.describe(),
                "threads": torch.get_num_threads(),
                "n_train": self.n,
            },
            snapshots=snapshots,
        )

    # ---------------------------------------------------------------- checkpoints
    _STATE = (
        "iteration",
        "train_seconds",
        "batch_size",
        "lr",
        "lr_factor",
        "branch_steps",
        "branch_examples",
        "initial_loss",
        "last_batch_loss",
        "next_eval_epoch",
        "last_eval_iteration",
        "test_iteration",  # else a finished run resumed evaluates its test split twice
        "metrics",
        "curves",
        "status",
        "message",
    )

    def state_dict(self) -> dict[str, Any]:
        """The run state a checkpoint keeps: the trainer's and every callback's."""
        state = {name: getattr(self, name) for name in self._STATE}
        for callback in self.callbacks:
            state.update(callback.state_dict())
        return state

    def checkpoint_step(self) -> None:
        if self.checkpoint_path is None:
            return
        started = time.perf_counter()
        generators = [self.generator.get_state()]
        if self.ctx.distributed:
            gathered: list[Any] = [None] * self.ctx.world_size
            torch.distributed.all_gather_object(gathered, generators[0].cpu())
            generators = gathered
        if self.ctx.is_main:
            save_checkpoint(
                self.checkpoint_path,
                {
                    "config_hash": self.config.config_hash(),
                    "data": self.data_digest,
                    "model": self.model.state_dict(),
                    "optimizer": self.optimizer.state_dict(),
                    "sampler": self.sampler.state_dict(),
                    "generators": generators,
                    "monitor": self.monitor.state_dict(),
                    "timer": self.timer.state_dict(),
                    "targets": [t.to_dict() for t in self.targets],
                    "state": self.state_dict(),
                },
            )
        self.timer.totals.setdefault("checkpoint", 0.0)
        self.timer.totals["checkpoint"] += time.perf_counter() - started

    def load_checkpoint(self) -> None:
        from batchbound.train.checkpoint import set_rng_state

        assert self.checkpoint_path is not None
        # refused there, before anything is applied, unless it is this config's checkpoint
        saved = load_checkpoint(self.checkpoint_path, self.config.config_hash())
        if saved.get("data") not in (None, self.data_digest):  # older ones did not say
            raise BatchboundError(
                f"checkpoint {self.checkpoint_path} was trained on other data than "
                f"{self.config.dataset} holds now (its files changed since: {saved['data']} "
                f"then, {self.data_digest} now); resume on the same data, or start afresh")
        try:
            if len(saved["generators"]) != self.ctx.world_size:
                raise BatchboundError(
                    f"checkpoint was written by {len(saved['generators'])} workers, "
                    f"this run has {self.ctx.world_size}"
                )
            self.model.load_state_dict(saved["model"])
            _check_finite_weights(self.model, self.checkpoint_path)
            self.optimizer.load_state_dict(saved["optimizer"])
            self.sampler.load_state_dict(saved["sampler"])
            self.generator.set_state(saved["generators"][self.ctx.rank])
            self.monitor.load_state_dict(saved["monitor"])
            self.timer.load_state_dict(saved["timer"])
            self.targets = [TargetResult(**t) for t in saved["targets"]]
            for name in self._STATE:  # only the run state's names, whatever the file holds
                if name in saved["state"]:  # one added later keeps its fresh value
                    value = saved["state"][name]
                    wanted = _unfit(value, getattr(self, name))
                    if wanted:
                        raise BatchboundError(
                            f"checkpoint {self.checkpoint_path} does not fit this run (its "
                            f"{name} is {value!r}, where a run's is {wanted})")
                    setattr(self, name, value)
            for callback in self.callbacks:
                callback.load_state_dict(saved["state"])
            set_rng_state(saved["rng"])
        except BatchboundError:  # says what does not fit already
            raise
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
            reason = " ".join(str(exc).split())[:200]
            raise BatchboundError(
                f"checkpoint {self.checkpoint_path} does not fit this run "
                f"({type(exc).__name__}: {reason})"
            ) from None
        self.status, self.message = "complete", ""


def _unfit(value: Any, fresh: Any) -> str | None:
    """None where a checkpoint's run-state ``value`` is of the kind of the fresh run's, else
    what that kind is: a count a whole number no lower than a fresh run starts it (0, or -1
    for "not yet"), a number any number, nan only where a fresh run starts with nan (a None
    the run starts with: either, or None), anything else its type (an edited file's
    ``iteration = "abc"`` failed mid-run; ``iteration = -5`` ran on)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(fresh, bool):
        return None if isinstance(value, bool) else "True or False"
    if isinstance(fresh, int):
        least = min(fresh, 0)
        fits = number and isinstance(value, int) and value >= least
        return None if fits else f"a whole number of at least {least}"
    if isinstance(fresh, float) or fresh is None:
        nan_ok = isinstance(fresh, float) and math.isnan(fresh)
        fits = (number and (nan_ok or not math.isnan(value))) or (value is None and fresh is None)
        return None if fits else ("a number" + ("" if nan_ok else " (not nan)")
                                  + (" or None" if fresh is None else ""))
    return None if isinstance(value, type(fresh)) else f"a {type(fresh).__name__}"


def _check_finite_weights(model: nn.Module, path: Path | str) -> None:
    """A checkpoint's trained parameters all finite: training resumed from a nan or an inf
    (an edited or damaged file) makes only nans. Buffers and frozen parameters may hold -inf
    by design (an attention mask)."""
    bad = [name for name, p in model.named_parameters()
           if p.requires_grad and p.is_floating_point() and not bool(torch.isfinite(p).all())]
    if bad:
        raise BatchboundError(
            f"checkpoint {path} holds weights that are not finite (nan or inf in "
            f"{', '.join(bad[:3])}{' and others' if len(bad) > 3 else ''}); resume from an "
            "earlier checkpoint, or start afresh")
