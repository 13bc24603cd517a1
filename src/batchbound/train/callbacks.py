"""What the training loop does besides training, one named callback each, in the shape
Lightning users know:

    on_train_start(trainer)       once the run starts: a fresh run after evaluating its
                                  starting point, a resumed one after loading its checkpoint
    on_train_batch_end(trainer)   after each step the run goes on from (past the divergence
                                  check and the evaluation that may end it)
    state_dict() / load_state_dict(state)   what a checkpoint keeps

The trainer builds them from its config (``callbacks_for``) and calls them in this order:
``Snapshots`` (the weights every few passes), ``DiversityMeasurement`` (the exact Δ every few
passes) and ``BatchPolicyCallback`` (the adaptive batch and batch-size warmup). Their state
rides in the checkpoint under the names the trainer gave it before they were callbacks, so
those checkpoints resume.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError
from batchbound.train.adaptive import BatchPolicy
from batchbound.train.branch_trend import growth, next_test, trend_point
from batchbound.train.branches import B0_EVALUATIONS
from batchbound.train.cadence import EPS, next_due
from batchbound.train.lr_rules import lr_rule

if TYPE_CHECKING:
    from batchbound.train.loop import Trainer

WARM_DECAY = 0.99  # warmup's estimate: an average over about the last 100 steps
BRANCH_EVAL = 1024  # the branch trigger's branches are evaluated on a fixed subset this size
class Callback:
    """The hooks, each doing nothing; a callback overrides what it needs."""

    def on_train_start(self, trainer: Trainer) -> None:
        """Once the run starts (fresh: ``trainer.iteration == 0``; or resumed)."""

    def on_train_batch_end(self, trainer: Trainer) -> None:
        """After each step the run goes on from."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state``, which holds every callback's keys (and may lack some)."""


class Snapshots(Callback):
    """The flat trainable weights at epoch 0 and every ``every`` epochs, kept by rank 0
    (every rank holds the same weights); the run's last point is added by its result."""

    def __init__(self, every: float) -> None:
        self.every = every
        self.next_epoch = every
        self.kept: list[tuple[int, float, np.ndarray]] = []  # (iteration, epoch, weights)

    def on_train_start(self, trainer: Trainer) -> None:
        if not trainer.ctx.is_main:
            self.kept = []  # a resumed rank other than 0 keeps none
        if trainer.iteration == 0:
            self.take(trainer)

    def on_train_batch_end(self, trainer: Trainer) -> None:
        if trainer.sampler.epoch + EPS >= self.next_epoch:
            self.take(trainer)

    def take(self, trainer: Trainer) -> None:
        if trainer.ctx.is_main and (not self.kept or self.kept[-1][0] != trainer.iteration):
            self.kept.append((trainer.iteration, trainer.sampler.epoch, trainer.flat_weights()))
        self.next_epoch = next_due(self.next_epoch, trainer.sampler.epoch, self.every)

    def state_dict(self) -> dict[str, Any]:
        return {"next_snapshot_epoch": self.next_epoch, "snapshots": self.kept}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_epoch = state.get("next_snapshot_epoch", self.next_epoch)
        # saved as tensors (a checkpoint holds no numpy); kept as numpy arrays
        self.kept = [(i, e, w.numpy()) for i, e, w in state.get("snapshots", [])]


class DiversityMeasurement(Callback):
    """The exact Δ and n·Δ over the whole train set at initialisation (where the bound
    starts) and every ``every`` epochs (``Trainer.measure_diversity``)."""

    def __init__(self, every: float) -> None:
        self.every = every
        self.next_epoch = every

    def on_train_start(self, trainer: Trainer) -> None:
        if trainer.iteration == 0:
            trainer.measure_diversity()

    def on_train_batch_end(self, trainer: Trainer) -> None:
        if trainer.sampler.epoch + EPS >= self.next_epoch:
            trainer.measure_diversity()
            self.next_epoch = next_due(self.next_epoch, trainer.sampler.epoch, self.every)

    def state_dict(self) -> dict[str, Any]:
        return {"next_diversity_epoch": self.next_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_epoch = state.get("next_diversity_epoch", self.next_epoch)


class BatchPolicyCallback(Callback):
    """``--batch-policy adaptive(...)`` and ``warmup(...)`` (train/adaptive.py): every
    ``policy.every`` iterations, a new global batch size. The seconds deciding takes are the
    policy's own, so they count as training time."""

    def __init__(self, policy: BatchPolicy, trainer: Trainer) -> None:
        self.policy = policy
        # warmup decides from a longer average than the monitor's (about 20 steps), which is
        # too noisy to act on when B_noise ≫ B
        estimator = trainer.monitor.estimator
        self.warm = (OnlineDiversity(trainer.n, decay=WARM_DECAY, sampling=estimator.sampling)
                     if policy.warmup and policy.trigger == "noise" and estimator is not None
                     else None)
        self.folded = 0  # the monitor's steps folded into ``warm``
        # the branch trigger's cadence (train/branch_trend.py): examples trained on, and the
        # count the next test is due at
        self.examples = 0
        self.due = policy.every * trainer.config.batch_size

    def on_train_start(self, trainer: Trainer) -> None:
        estimator = trainer.monitor.estimator
        self.folded = estimator.steps if estimator is not None else 0

    def on_train_batch_end(self, trainer: Trainer) -> None:
        estimator = trainer.monitor.estimator
        if self.warm is not None and estimator is not None and estimator.steps > self.folded:
            self.warm.update(*estimator.last)
            self.folded = estimator.steps
        if self.policy.warmup and self.policy.trigger == "branch":
            self.examples += trainer.batch_size
            if self.examples >= self.due:
                self.due = next_test(self.examples, self.policy.every * trainer.config.batch_size)
                self.branch_up(trainer)
        elif trainer.iteration % self.policy.every == 0:
            if self.policy.warmup:
                self.warm_up(trainer)
            else:
                self.adapt(trainer)

    def adapt(self, trainer: Trainer) -> None:
        """B = clip(⌊δ·n·Δ̂⌋ + 1, min, max), or with pick=time the B of least time per unit
        of progress; Δ̂ from the online monitor or an exact measurement."""
        started = time.perf_counter()
        policy, ctx = self.policy, trainer.ctx
        if policy.source == "online":
            diversity = trainer.monitor.diversity_estimate()
        else:
            diversity = trainer.measure_diversity()
        if policy.pick == "time":
            new = policy.time_optimal(trainer.n, diversity, ctx.world_size,
                                      trainer.step_cost(policy.candidates(ctx.world_size)))
        else:
            new = policy.batch_size(trainer.n, diversity)
        trainer.train_seconds += time.perf_counter() - started
        trainer.set_batch_size(max(min(new, trainer.n), ctx.world_size))

    def warm_up(self, trainer: Trainer) -> None:
        """Double B when the online B_noise allows, and change the rate by the policy's
        rule. The estimate is global (the monitor's sums ride the gradient all-reduce), so
        every rank decides the same."""
        started = time.perf_counter()
        warm = self.warm
        assert warm is not None  # TrainConfig gives warmup an online estimate
        noise, se = warm.noise_scale, warm.batch_bound_se
        trainer.record("warmup_noise_scale", noise)
        trainer.record("warmup_noise_scale_se", se)
        old = trainer.batch_size
        new = min(self.policy.warmed(old, noise, se), trainer.n)
        if new != old:
            trainer.lr_factor *= self.policy.lr_change(old, new, noise,
                                                       start=trainer.config.batch_size)
            trainer.set_batch_size(new)
            self.warm = OnlineDiversity(trainer.n, decay=WARM_DECAY, sampling=warm.sampling)
        trainer.train_seconds += time.perf_counter() - started

    def branch_up(self, trainer: Trainer) -> None:
        """The branch trigger (train/branch_trend.py): short branches from the current state
        at B, 2B (and 4B, where the train set holds it) at the rate rule's rates, read on B's
        trend line; B grows by 4 when the critical batch's interval lies at or above 4B, by 2
        at or above 2B, and the rate follows the same rule. The branches' seconds, steps and
        examples are the policy's cost. Every rank runs the same branches (same seed, the
        whole train set); the growth is the least all ranks reach (an all-reduced minimum),
        so it is the same everywhere."""
        started = time.perf_counter()
        policy, old = self.policy, trainer.batch_size
        top = min(policy.max, trainer.n)
        if 2 * old > top:
            return
        rule = lr_rule(policy.branch_rule(), "lr rule")
        assert rule is not None  # branch_rule names a registered rule
        ladder = [b for b in (old, 2 * old, 4 * old) if b <= trainer.n]
        examples = policy.steps * ladder[-1]
        epoch = trainer.sampler.epoch
        base = trainer.strategy.lr(trainer.config.lr, old, epoch) * trainer.lr_factor

        def run(batch: int, evaluations: int, seed: int) -> list[tuple[int, float]]:
            return trainer.branch(batch, base * rule.scale(batch / old), examples // batch,
                                  evaluations, seed, min(trainer.n, BRANCH_EVAL))

        # a data order per test, the same on a resume (the seed and the iteration)
        point = trend_point(run, ladder, trainer.config.seed + trainer.iteration,
                            trainer.iteration, min(B0_EVALUATIONS, examples // old), policy.z)
        factor = growth(point)
        while factor > 1 and factor * old > top:
            factor //= 2
        if trainer.ctx.distributed:
            flag = torch.tensor([float(factor)], device=trainer.ctx.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
            factor = int(flag.item())
        # every test: its growth (1 where B's branch did not fall by its trend: no point)
        trainer.record("warmup_growth", factor)
        if point is not None:
            trainer.record("warmup_critical_batch", point.critical_batch)
            trainer.record("warmup_critical_batch_low", point.low)
            trainer.record("warmup_branch_spread", point.spread)  # σ of r, floored
        if factor > 1:
            start = trainer.config.batch_size
            trainer.lr_factor *= rule.scale(factor * old / start) / rule.scale(old / start)
            trainer.set_batch_size(factor * old)
        trainer.train_seconds += time.perf_counter() - started

    def state_dict(self) -> dict[str, Any]:
        return {"warm_state": self.warm.state_dict() if self.warm is not None else {},
                "warm_trigger": self.policy.trigger if self.policy.warmup else "",
                "warm_examples": self.examples, "warm_due": self.due}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.policy.warmup and state.get("warm_state") and (
                state.get("warm_trigger", "noise") != self.policy.trigger):
            raise BatchboundError(
                f"this checkpoint's warmup used trigger={state.get('warm_trigger', 'noise')}, "
                f"this run's is trigger={self.policy.trigger}: add it to --batch-policy")
        self.examples = int(state.get("warm_examples", self.examples))
        self.due = int(state.get("warm_due", self.due))
        if self.warm is not None and state.get("warm_state"):
            self.warm.load_state_dict(state["warm_state"])


def callbacks_for(trainer: Trainer) -> list[Callback]:
    """The callbacks a run's config asks for, in the order the loop calls them."""
    config = trainer.config
    out: list[Callback] = []
    if config.snapshot_every_epochs:
        out.append(Snapshots(config.snapshot_every_epochs))
    if config.diversity_every_epochs:
        out.append(DiversityMeasurement(config.diversity_every_epochs))
    if trainer.policy.adaptive:
        out.append(BatchPolicyCallback(trainer.policy, trainer))
    return out
