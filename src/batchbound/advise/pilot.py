"""The pilot at a small batch B0, and the branched probe.

The pilot trains the first fraction of the user's plan (or, given only a target, up to the
target) with batchbound's trainer, and keeps, at every step, what the step's own cheap
estimator of the noise scale gives (``ESTIMATORS``):

- ``two_batch`` (default): McCandlish et al.'s two-batch estimate from the step's two
  micro-batches of B0/2 (any model; no per-example work);
- ``norms``: per-example squared norms from the layer rules in the step's own backward;
- ``exact``: exact n·Δ over the whole training set every ``exact_every_epochs`` (costly: one
  pass over the data each time; the old behaviour, kept as an option).

The model's state is kept at a few iterations for the probe (Merrill et al. 2025, *Critical
Batch Size Revisited*), which branches short runs from them at B0·2^k, each over the same
number of examples, and reports the largest batch whose loss decrease keeps up with B0's: at
least (1 − tolerance) of it, for that batch and every smaller one.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchbound.advise.trajectory import Segment, Step, segments
from batchbound.data import Dataset
from batchbound.errors import BatchboundError, InterruptedWorkError
from batchbound.train.config import TrainConfig
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Parts, Trainer
from batchbound.train.optimizers import adam_preconditioner, build_optimizer, coupled_decay
from batchbound.train.result import RunResult

ESTIMATORS = ("two_batch", "norms", "exact")
KEPT_STATES = 3


class _PilotTrainer(Trainer):
    """The trainer, keeping each step's raw (M2, C) estimate and the model's state at a few
    iterations."""

    def __init__(self, *args: Any, keep_every: int, precondition: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.keep_every = max(1, keep_every)
        # the two-batch estimate in the optimiser's own metric (Adam's 1/(√v̂ + ε)); a step
        # before the optimiser has one is not estimated
        self.precondition = precondition and self.monitor.mode == "two_batch"
        self.steps: list[Step] = []
        self.decays = coupled_decays(self)
        # (iteration, epoch, model state, optimiser state): branches resume both
        self.states: list[tuple[int, float, dict[str, torch.Tensor], dict[str, Any]]] = []

    def train_step(self, stop_requested: bool, time_exceeded: bool) -> dict[str, bool]:
        estimator = self.monitor.estimator
        before = estimator.steps if estimator is not None else 0
        if self.precondition:
            weights = adam_preconditioner(self.optimizer, self.params)
            if weights is None and self.iteration >= 1:  # stepped, yet no second moment
                self.precondition = False  # not Adam's kind: the Euclidean estimate
            self.monitor.weights = weights
        if self.decays is not None:  # the gradient the optimiser steps on: G + λθ, per
            # example λθ under the mean convention, λθ/B under the sum (the step is B·mean)
            per = 1.0 if self.config.convention == "mean" else 1.0 / self.batch_size
            self.monitor.shift = [None if decay == 0 else p.detach() * (decay * per)
                                  for p, decay in zip(self.params, self.decays, strict=True)]
        flags = super().train_step(stop_requested, time_exceeded)
        skipped = self.precondition and self.monitor.weights is None
        if estimator is not None and estimator.steps > before and estimator.last is not None \
                and not skipped:
            m2, cross = estimator.last
            self.steps.append(Step(self.iteration, self.last_batch_loss, m2, cross))
        if self.iteration % self.keep_every == 0:
            self.states.append((self.iteration, self.sampler.epoch,
                                copy.deepcopy(self.model.state_dict()),
                                copy.deepcopy(self.optimizer.state_dict())))
        return flags


def coupled_decays(trainer: Trainer) -> list[float] | None:
    """Each trainable parameter's weight decay λ where the optimiser adds λθ to the gradient
    it steps on (``coupled_decay``: SGD's and Adam's L2, not AdamW's), None where no
    parameter has one. The decay is the same for every example: it moves the mean gradient
    G the noise scale divides by, not Σ, so the pilot's estimate takes G + λθ. Refused when
    it cannot be told whether a decay is coupled, or under ``exact``, whose n·Δ over the
    training set has no place for it."""
    group_of = {id(p): group for group in trainer.optimizer.param_groups for p in group["params"]}
    decays = [float(group_of[id(p)].get("weight_decay", 0.0) or 0.0) for p in trainer.params]
    if not any(decays):
        return None
    parts, config = trainer.parts, trainer.config
    make = parts.optimizer if parts.optimizer is not None else \
        (lambda params: build_optimizer(params, config))
    try:
        coupled = coupled_decay(make)
    except Exception as exc:  # a user's optimiser may refuse a float64 probe
        raise BatchboundError(
            f"cannot tell whether the optimizer's weight decay enters its gradient (a probe on "
            f"two float64 coordinates raised {type(exc).__name__}), which changes the noise "
            "scale's G: set weight_decay=0, or decouple it (AdamW)") from None
    if not coupled:
        return None
    if config.diversity_every_epochs is not None:  # the exact estimator's cadence
        raise BatchboundError(
            "the exact estimator measures n·Δ of the loss's gradients, and the optimizer's "
            "coupled weight decay adds λθ to the gradient it steps on: use --estimator "
            "two_batch or norms (which take it), or decouple the decay (AdamW)")
    return decays


@dataclass
class PilotRun:
    """What the pilot measured: B_noise segments, the iterations it trained (to the target
    in target mode), its result, and kept states for the probe."""

    segments: list[Segment]
    iterations: int
    result: RunResult
    states: list[tuple[int, float, dict[str, torch.Tensor], dict[str, Any]]]
    estimator: str
    metric: str = "euclidean"  # "adam": the two-batch estimate in Adam's 1/(√v̂ + ε)

    @property
    def seconds(self) -> float:
        return float(self.result.final.get("seconds", math.nan))


def pilot_config(config: TrainConfig, iterations: int | None, estimator: str,
                 exact_every_epochs: float) -> TrainConfig:
    """The pilot's config: ``iterations`` steps (planned mode) or to the first target."""
    if estimator not in ESTIMATORS:
        raise BatchboundError(f"unknown estimator {estimator!r}; choose from "
                              f"{', '.join(ESTIMATORS)}")
    cheap: dict[str, Any] = {"online_diversity": "off", "diversity_every_epochs": None}
    if estimator == "two_batch":
        if config.batch_size < 2:
            raise BatchboundError("the two-batch estimator needs B0 >= 2 (two micro-batches)")
        micro = config.micro_batch if config.micro_batch and config.micro_batch < \
            config.batch_size else max(1, config.batch_size // 2)
        cheap = {"online_diversity": "two_batch", "micro_batch": micro,
                 "diversity_every_epochs": None}
    elif estimator == "norms":
        cheap = {"online_diversity": "norms", "diversity_every_epochs": None}
    else:
        cheap["diversity_every_epochs"] = exact_every_epochs
    if iterations is not None:
        return config.replace(max_iterations=iterations, max_epochs=None, targets=(),
                              eval_every_epochs=None, eval_every_iterations=iterations,
                              eval_growth=None, stop_at_targets=False, **cheap)
    return config.replace(eval_every_epochs=exact_every_epochs / 4, eval_every_iterations=None,
                          eval_growth=None, stop_at_targets=True, targets=config.targets[:1],
                          **cheap)


def run_pilot(config: TrainConfig, data: Dataset, device: torch.device, *,
              iterations: int | None = None, estimator: str = "two_batch",
              exact_every_epochs: float = 0.1, parts: Parts | None = None,
              progress: bool = False, precondition: bool = False) -> PilotRun:
    """Train the pilot (see ``pilot_config``); BatchboundError if it diverges or, in target
    mode, stops short, since nothing can be predicted from it. ``precondition``: the
    two-batch noise scale in an Adam-type optimiser's metric, tr(PΣ)/GᵀPG with
    P = 1/(√v̂ + ε), the noise scale of the steps it takes (its first step not estimated)."""
    pilot = pilot_config(config, iterations, estimator, exact_every_epochs)
    # states for the probe: KEPT_STATES over a planned pilot; every exact_every_epochs (the
    # target's iteration is not known in advance) in target mode
    keep_every = (iterations // KEPT_STATES if iterations is not None else
                  round(exact_every_epochs * data.n_train / config.batch_size))
    trainer = _PilotTrainer(pilot, DistContext(device=device), dataset=data, parts=parts,
                            progress=progress, keep_every=keep_every,
                            precondition=precondition)
    result = trainer.run()
    refusal = result.start_refusal()
    if refusal is not None:
        raise BatchboundError(refusal)
    if result.status == "diverged":
        raise BatchboundError(f"the pilot at batch {config.batch_size} diverged "
                              f"({result.message}); lower --lr")
    if result.status == "stopped":  # SIGINT or SIGTERM: nothing of the pilot is kept
        raise InterruptedWorkError(f"the pilot was {result.message}; advise keeps nothing of "
                                   "it, so a rerun starts it again")
    if result.status != "complete":
        raise BatchboundError(f"the pilot ended {result.status}: {result.message}")
    trained = trainer.iteration
    if iterations is None:
        target = result.targets[0]
        if not target.reached or target.iteration is None:
            raise BatchboundError(
                f"the pilot at batch {config.batch_size}, lr {config.lr:g} did not reach "
                f"{target.name} within its limits ({result.message}); raise --max-epochs or "
                "choose a reachable target")
        if target.iteration == 0:
            raise BatchboundError(f"the untrained model already meets {target.name}: "
                                  "nothing to predict")
        trained = target.iteration
    if estimator == "exact":
        segs = _exact_segments(result, trained)
    else:
        segs = segments([s for s in trainer.steps if s.iteration <= trained], data.n_train,
                        "without_replacement" if pilot.sampling == "epoch"
                        else "with_replacement")
    kept = [s for s in trainer.states if s[0] <= trained]
    return PilotRun(segs, trained, result, kept, estimator,
                    "adam" if trainer.precondition else "euclidean")


def _exact_segments(result: RunResult, trained: int) -> list[Segment]:
    """Exact n·Δ measurements as segments (no sampling error), each with the batch loss of
    the steps since the previous measurement."""
    bounds = [(i, v) for i, _, _, v in result.curve("batch_bound") if i < trained]
    if not bounds:
        raise BatchboundError("the pilot has no exact n·Δ measurement to predict from")
    losses = result.curve("batch_loss")
    out, start = [], 1
    for iteration, bound in bounds:
        window = [v for i, _, _, v in losses if start <= i <= max(iteration, start)]
        loss = sum(window) / len(window) if window else math.nan
        if not math.isfinite(bound) or bound < 1 - 1e-9:
            raise BatchboundError(f"the pilot's n·Δ must be finite and >= 1, got {bound!r} "
                                  "(a zero gradient?)")
        out.append(Segment(start, max(iteration, start), bound - 1.0, 0.0, loss))
        start = iteration + 1
    if not math.isfinite(out[0].loss):  # the measurement at initialisation: no step before
        out[0] = Segment(out[0].start, out[0].end, out[0].noise, 0.0,
                         out[1].loss if len(out) > 1 else 1.0)
    return out


@dataclass
class ProbePoint:
    iteration: int
    epoch: float
    batch_bound: float
    empirical_cbs: int | None  # None: not even B0's own branch made progress
    progress: dict[int, float]  # batch -> loss decrease over the branch

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "iteration": self.iteration,
                "batch_bound": self.batch_bound, "empirical_cbs": self.empirical_cbs,
                "loss_decrease": {str(b): v for b, v in self.progress.items()}}


def probe(run: PilotRun, config: TrainConfig, data: Dataset, device: torch.device,
          lr: Callable[[int], float], bound_at: Callable[[int], float], *, points: int = 3,
          tolerance: float = 0.1, largest: int | None = None, parts: Parts | None = None,
          log: Callable[[str], None] = lambda _: None) -> list[ProbePoint]:
    """Branch from ``points`` of the pilot's kept states, spread over it; see the module
    docstring. Each branch sees the same examples budget: 4 steps of the largest batch.
    ``bound_at(iteration)``: the pilot's n·Δ there, shown beside the probe's answer."""
    b0 = config.batch_size
    top = min(largest or data.n_train, data.n_train)
    ladder = [b0 << k for k in range(20) if b0 << k <= top]
    budget = 4 * ladder[-1]
    states = run.states
    if len(states) < points:
        raise BatchboundError(f"the pilot kept {len(states)} states, the probe needs "
                              f"{points}; lengthen the pilot")
    picks = sorted({round(i * (len(states) - 1) / (points - 1)) for i in range(points)})
    out = []
    for index in picks:
        iteration, epoch, state, _ = states[index]
        progress = {batch: _branch(config, data, device, state, batch, lr(batch),
                                   budget // batch, parts) for batch in ladder}
        base = progress[b0]
        keeps = None
        if base > 0:
            for batch in ladder:
                if progress[batch] >= (1 - tolerance) * base:
                    keeps = batch
                else:
                    break
        bound = bound_at(iteration)
        log(f"probe at iteration {iteration}: n·Δ = {bound:.4g}, empirical critical batch "
            f"{keeps}")
        out.append(ProbePoint(iteration, epoch, bound, keeps, progress))
    return out


def _branch(config: TrainConfig, data: Dataset, device: torch.device,
            state: dict[str, torch.Tensor], batch: int, lr: float, steps: int,
            parts: Parts | None) -> float:
    """Train loss decrease over ``steps`` steps at ``batch`` from ``state`` (−inf when the
    branch diverges)."""
    branch = config.replace(batch_size=batch, lr=lr, strategy="blr", targets=(),
                            max_iterations=steps, max_epochs=None, eval_every_epochs=None,
                            eval_every_iterations=steps, eval_growth=None,
                            diversity_every_epochs=None, online_diversity="off",
                            micro_batch=None)
    trainer = Trainer(branch, DistContext(device=device), dataset=data, parts=parts)
    trainer.model.load_state_dict(state)
    result = trainer.run()
    losses = [v for _, _, _, v in result.curve("train_loss")]
    if result.status == "diverged" or not math.isfinite(losses[-1]):
        return -math.inf
    return losses[0] - losses[-1]
