"""Batch-size warmup in your own loop: how many micro-batches to accumulate next.

The rule is the trainer's (``batchbound.train.adaptive``, ``warmup``): every ``every``
optimizer steps the global batch B = micro-batch × accumulation × ranks doubles when
2B ≤ fraction·(B_noise − its standard error), up to ``max_batch``, never down, and the rate
changes by ``lr`` (McCandlish et al.'s rule by default). B_noise comes from an online estimate
the loop already keeps (``OnlineDiversity``: the DDP communication hook's, or a
DiversityCallback's monitor), so every rank decides the same.

    warmup = AccumulationWarmup(micro_batch=32, world_size=dist.get_world_size())
    ...after each optimizer step:
    factor = warmup.step(state.monitor)          # state: gns_hook_state(...)
    warmup.scale_rates(optimizer, factor)
    for _ in range(warmup.accumulation): ...     # the next step's micro-batches

Change the accumulation only where a new accumulation group starts (``ready``): the
Lightning and Hugging Face callbacks wait for such a boundary.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch

from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError
from batchbound.train.adaptive import BRANCH_EVERY, BRANCH_STEPS, BatchPolicy
from batchbound.train.branch_trend import growth, next_test, trend_point
from batchbound.train.branches import B0_EVALUATIONS
from batchbound.train.lr_rules import lr_rule


class _Accumulating:
    """What both warmups share: B = micro-batch × accumulation × ranks, grown by doubling the
    accumulation, with its step count, a doubling pending until an accumulation boundary, and
    their state."""

    def __init__(self, micro_batch: int, accumulation: int, world_size: int,
                 every: int) -> None:
        for name, value in (("micro_batch", micro_batch), ("accumulation", accumulation),
                            ("world_size", world_size), ("every", every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BatchboundError(f"warmup: {name} must be a positive integer, got "
                                      f"{value!r}")
        self.micro_batch, self.accumulation, self.world_size = micro_batch, accumulation, world_size
        self.start = self.batch_size  # B0, where the rate rule's s(B/B0) is 1
        self.steps = 0
        self.pending = False  # a doubling decided, waiting for an accumulation boundary
        self.history: list[tuple] = []

    @property
    def batch_size(self) -> int:
        return self.micro_batch * self.accumulation * self.world_size

    @staticmethod
    def scale_rates(optimizer: Any, factor: float, scheduler: Any = None) -> None:
        """Multiply every parameter group's rate (the documented lever) by ``factor``, and a
        torch scheduler's base rates, which it would otherwise restore."""
        if factor == 1.0:
            return
        for group in optimizer.param_groups:
            group["lr"] *= factor
        if scheduler is not None and hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * factor for lr in scheduler.base_lrs]

    def metrics(self) -> dict[str, float]:
        return {"warmup/batch_size": float(self.batch_size),
                "warmup/accumulation": float(self.accumulation)}

    def state_dict(self) -> dict[str, Any]:
        return {"accumulation": self.accumulation, "steps": self.steps,
                "pending": self.pending, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accumulation, self.steps = int(state["accumulation"]), int(state["steps"])
        self.pending = bool(state["pending"])
        self.history = [tuple(h) for h in state["history"]]


class AccumulationWarmup(_Accumulating):
    """The accumulation a loop should use next; ``history`` holds (optimizer step, batch,
    accumulation, n·Δ estimate) at every decision."""

    def __init__(self, micro_batch: int, accumulation: int = 1, world_size: int = 1, *,
                 every: int = 25, max_batch: int | None = None, fraction: float = 0.5,
                 lr: str = "noise") -> None:
        super().__init__(micro_batch, accumulation, world_size, every)
        self.policy = BatchPolicy(adaptive=True, source="online", pick="warmup",
                                  max=max_batch or 1 << 30, every=every, fraction=fraction,
                                  lr=lr)

    def deciding(self) -> bool:
        """Whether the next ``step`` decides (so the caller folds its estimate first)."""
        return (self.steps + 1) % self.policy.every == 0 or self.pending

    def step(self, monitor: OnlineDiversity, ready: bool = True) -> float:
        """Call after every optimizer step; returns the factor for the rate (1.0 when the
        batch did not change). ``ready``: a new accumulation group of twice the size could
        start now (the callbacks pass their framework's alignment)."""
        self.steps += 1
        if self.steps % self.policy.every == 0 and not self.pending:
            noise = monitor.noise_scale
            wanted = self.policy.warmed(self.batch_size, noise, monitor.batch_bound_se)
            self.history.append((self.steps, self.batch_size, self.accumulation,
                                 monitor.batch_bound))
            self.pending = wanted > self.batch_size
        return self.apply(monitor) if ready else 1.0

    def apply(self, monitor: OnlineDiversity) -> float:
        """Double the accumulation if a doubling is pending; the rate's factor (else 1.0)."""
        if not self.pending:
            return 1.0
        old = self.batch_size
        self.accumulation *= 2
        self.pending = False
        self.history.append((self.steps, self.batch_size, self.accumulation,
                             monitor.batch_bound))
        return self.policy.lr_change(old, self.batch_size, monitor.noise_scale, self.start)


# the branch trigger, for loops that are not batchbound's trainer (train/branches.py's test)
BRANCH_EVAL = 1024  # the branches are evaluated on a fixed subset of this many examples


class BranchWarmup(_Accumulating):
    """Batch-size warmup with the branch trigger (``--batch-policy warmup``'s default) in your
    own loop (train/branch_trend.py): the first test once the loop has trained on
    ``every``·B0 examples, each next one at the first every·B0·2^j beyond the last; a test
    runs short branches from the current weights and optimiser state at B, 2B and 4B, each
    over ``steps``·4B examples at the rate rule's rates (``lr``: auto = srsr, η0·√(B/B0)),
    read on B's trend line; B grows by 4 when the critical batch's interval lies at or above
    4B, by 2 at or above 2B (each rung's band ± z σ), never past ``max_batch``, never down.
    The branches copy the model and the optimiser (state, rates, gradients and the
    torch random state), run, and restore them. ``loss_of(indices)`` is the mean training
    loss of those train-set examples on ``model``; every rank runs the same branches (same
    seed, the whole train set) and, under torch.distributed, the doubling is the one all
    ranks reach. ``branch_steps`` and ``branch_examples`` are the policy's cost.

        warmup = BranchWarmup(micro_batch=32, world_size=P)
        ...after each optimizer step:
        factor = warmup.step(model, optimizer, loss_of, n)
        warmup.scale_rates(optimizer, factor)
        for _ in range(warmup.accumulation): ...     # the next step's micro-batches
    """

    def __init__(self, micro_batch: int, accumulation: int = 1, world_size: int = 1, *,
                 every: int = BRANCH_EVERY, max_batch: int | None = None,
                 steps: int = BRANCH_STEPS,
                 z: float = 1.0, lr: str = "auto",
                 seed: int = 0) -> None:
        super().__init__(micro_batch, accumulation, world_size, every)
        self.policy = BatchPolicy(adaptive=True, source="online", pick="warmup",
                                  max=max_batch or 1 << 30, every=every, lr=lr,
                                  trigger="branch", steps=steps, z=z)
        rule = lr_rule(self.policy.branch_rule(), "lr rule")
        assert rule is not None
        self.rule, self.seed = rule, seed
        self.branch_steps = self.branch_examples = 0  # history: step, B, k, B_crit, low
        self.growth = 1  # the factor of the growth pending (pending: growth > 1)
        self.examples = 0  # trained on, and the count the next test is due at
        self.due = every * self.start

    def step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             loss_of: Callable[[torch.Tensor], torch.Tensor], n: int,
             ready: bool = True) -> float:
        """Call after every optimizer step; the rate's factor (1.0 when B did not change).
        ``ready``: a new accumulation group of twice the size could start now."""
        self.steps += 1
        self.examples += self.batch_size
        if self.examples >= self.due and not self.pending:
            self.due = next_test(self.examples, self.policy.every * self.start)
            self.growth = self.decide(model, optimizer, loss_of, n)
            self.pending = self.growth > 1
        return self.apply() if ready else 1.0

    def decide(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               loss_of: Callable[[torch.Tensor], torch.Tensor], n: int) -> int:
        """The test: the factor B grows by (1, 2 or 4)."""
        old = self.batch_size
        top = min(self.policy.max, n)
        if 2 * old > top:
            return 1
        ladder = [b for b in (old, 2 * old, 4 * old) if b <= n]
        examples = self.policy.steps * ladder[-1]
        pick = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed))
        subset = pick[:min(n, BRANCH_EVAL)]
        saved = Saved(model, optimizer)

        def run(batch: int, evaluations: int, seed: int) -> list[tuple[int, float]]:
            steps = examples // batch
            try:
                curve = branch_run(model, optimizer, loss_of, n, batch,
                                   self.rule.scale(batch / old), steps,
                                   max(1, steps // evaluations), seed, subset)
            finally:
                saved.restore()
            self.branch_steps += steps
            self.branch_examples += steps * batch
            return curve

        point = trend_point(run, ladder, self.seed + self.steps, self.steps,
                            min(B0_EVALUATIONS, examples // old), self.policy.z)
        factor = growth(point)
        while factor > 1 and factor * old > top:
            factor //= 2
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            flag = torch.tensor([float(factor)], device=next(model.parameters()).device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
            factor = int(flag.item())
        self.history.append((self.steps, old, self.accumulation,
                             point.critical_batch if point else math.nan,
                             point.low if point else math.nan))
        return factor

    def apply(self) -> float:
        """Grow the accumulation by the pending factor, if any; the rate's factor (else 1.0)."""
        if not self.pending:
            return 1.0
        old = self.batch_size
        self.accumulation *= self.growth
        self.pending, self.growth = False, 1
        return self.rule.scale(self.batch_size / self.start) / self.rule.scale(old / self.start)

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), "warmup/branch_steps": float(self.branch_steps),
                "warmup/branch_examples": float(self.branch_examples)}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "branch_steps": self.branch_steps,
                "branch_examples": self.branch_examples, "growth": self.growth,
                "examples": self.examples, "due": self.due}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.branch_steps = int(state["branch_steps"])
        self.branch_examples = int(state["branch_examples"])
        # a state saved before these keys: a pending doubling, the cadence from its steps
        self.growth = int(state.get("growth", 2 if self.pending else 1))
        self.examples = int(state.get("examples", self.steps * self.batch_size))
        self.due = int(state.get("due", next_test(self.examples,
                                                  self.policy.every * self.start)))


class Saved:
    """A model's and an optimiser's state (weights, buffers, optimiser state and rates,
    gradients) and the torch random state, copied now and put back by ``restore``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.weights = copy.deepcopy(model.state_dict())
        self.state = copy.deepcopy(optimizer.state_dict())
        self.grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        self.rng = torch.get_rng_state()
        self.cuda = (torch.cuda.get_rng_state_all() if torch.cuda.is_available()
                     and torch.cuda.is_initialized() else None)

    def restore(self) -> None:
        self.model.load_state_dict(self.weights)
        self.optimizer.load_state_dict(copy.deepcopy(self.state))
        for p, g in zip(self.model.parameters(), self.grads, strict=True):
            p.grad = None if g is None else g.clone()
        torch.set_rng_state(self.rng)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def branch_run(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               loss_of: Callable[[torch.Tensor], torch.Tensor], n: int, batch: int,
               factor: float, steps: int, every: int, seed: int, subset: torch.Tensor
               ) -> list[tuple[int, float]]:
    """(examples, mean loss on ``subset``) along ``steps`` steps at ``batch`` (examples drawn
    without replacement, the order from ``seed``), the rates × ``factor``; a diverged branch
    ends at +inf. Changes the model and optimiser: the caller restores them."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=generator)
    for group in optimizer.param_groups:
        group["lr"] *= factor

    def evaluate() -> float:
        with torch.no_grad():
            return float(loss_of(subset))

    curve, at = [(0, evaluate())], 0
    for step in range(1, steps + 1):
        if at + batch > n:
            order, at = torch.randperm(n, generator=generator), 0
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(order[at:at + batch])
        at += batch
        if not math.isfinite(float(loss.detach())):
            return [*curve, (step * batch, math.inf)]
        loss.backward()
        optimizer.step()
        if step % every == 0 or step == steps:
            value = evaluate()
            curve.append((step * batch, value if math.isfinite(value) else math.inf))
            if not math.isfinite(value):
                break
    return curve
