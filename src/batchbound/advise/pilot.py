"""The pilot run at a small batch B0 (exact n·Δ along the way) and the branched probe.

The pilot trains to the target, measuring exact Δ every ``diversity_every_epochs``, and keeps
the model's state at each measurement. The probe (Merrill et al. 2025, *Critical Batch Size
Revisited*) branches short runs from some of those states at B0·2^k, each over the same
number of examples, and reports the largest batch whose loss decrease keeps up with B0's:
at least (1 − tolerance) of it, for that batch and every smaller one.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchbound.advise.iterations import Pilot
from batchbound.data import Dataset
from batchbound.errors import BatchboundError
from batchbound.train.config import TrainConfig
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Trainer
from batchbound.train.result import RunResult


class _KeepingTrainer(Trainer):
    """A trainer that keeps (iteration, epoch, model state) at each exact Δ measurement."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.states: list[tuple[int, float, dict[str, torch.Tensor]]] = []

    def measure_diversity(self) -> float:
        value = super().measure_diversity()
        state = copy.deepcopy(self.model.state_dict())
        self.states.append((self.iteration, self.sampler.epoch, state))
        return value


@dataclass
class PilotRun:
    pilot: Pilot
    result: RunResult
    states: list[tuple[int, float, dict[str, torch.Tensor]]]


def run_pilot(config: TrainConfig, data: Dataset, device: torch.device) -> PilotRun:
    """Train ``config`` (one process) to its target; BatchboundError if it diverges or
    stops short, since nothing can be predicted from it."""
    trainer = _KeepingTrainer(config, DistContext(device=device), dataset=data)
    result = trainer.run()
    target = result.targets[0]
    if result.status == "diverged":
        raise BatchboundError(f"the pilot at batch {config.batch_size} diverged "
                              f"({result.message}); lower --lr")
    if not target.reached or target.iteration is None:
        raise BatchboundError(
            f"the pilot at batch {config.batch_size}, lr {config.lr:g} did not reach "
            f"{target.name} within its limits ({result.message}); raise --max-epochs or "
            "choose a reachable target")
    if target.iteration == 0:
        raise BatchboundError(f"the untrained model already meets {target.name}: nothing to "
                              "predict")
    bounds = [(i, v) for i, _, _, v in result.curve("batch_bound") if i < target.iteration]
    pilot = Pilot(config.batch_size, config.lr, target.iteration,
                  tuple(i for i, _ in bounds), tuple(v for _, v in bounds))
    kept = [s for s in trainer.states if s[0] < target.iteration]
    return PilotRun(pilot, result, kept)


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
          lr: Callable[[int], float], *, points: int = 3, tolerance: float = 0.1,
          largest: int | None = None, log: Callable[[str], None] = lambda _: None,
          ) -> list[ProbePoint]:
    """Branch from ``points`` of the pilot's kept states, spread over it; see the module
    docstring. Each branch sees the same examples budget: 4 steps of the largest batch."""
    b0 = config.batch_size
    top = min(largest or data.n_train, data.n_train)
    ladder = [b0 << k for k in range(20) if b0 << k <= top]
    budget = 4 * ladder[-1]
    states = run.states
    if len(states) < points:
        raise BatchboundError(f"the pilot measured n·Δ at {len(states)} points before the "
                              f"target, the probe needs {points}; lower --diversity-every")
    picks = sorted({round(i * (len(states) - 1) / (points - 1)) for i in range(points)})
    bounds = dict(zip(run.pilot.bound_iterations, run.pilot.batch_bounds, strict=True))
    out = []
    for index in picks:
        iteration, epoch, state = states[index]
        progress = {}
        for batch in ladder:
            progress[batch] = _branch(config, data, device, state, batch, lr(batch),
                                      budget // batch)
        base = progress[b0]
        keeps = None
        if base > 0:
            for batch in ladder:
                if progress[batch] >= (1 - tolerance) * base:
                    keeps = batch
                else:
                    break
        log(f"probe at iteration {iteration}: n·Δ = {bounds[iteration]:.4g}, empirical "
            f"critical batch {keeps}")
        out.append(ProbePoint(iteration, epoch, bounds[iteration], keeps, progress))
    return out


def _branch(config: TrainConfig, data: Dataset, device: torch.device,
            state: dict[str, torch.Tensor], batch: int, lr: float, steps: int) -> float:
    """Train loss decrease over ``steps`` steps at ``batch`` from ``state`` (−inf when the
    branch diverges)."""
    branch = config.replace(batch_size=batch, lr=lr, strategy="blr", targets=(),
                            max_iterations=steps, max_epochs=None, eval_every_epochs=None,
                            eval_every_iterations=steps, diversity_every_epochs=None)
    trainer = Trainer(branch, DistContext(device=device), dataset=data)
    trainer.model.load_state_dict(state)
    result = trainer.run()
    losses = [v for _, _, _, v in result.curve("train_loss")]
    if result.status == "diverged" or not math.isfinite(losses[-1]):
        return -math.inf
    return losses[0] - losses[-1]
