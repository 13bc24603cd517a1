"""``batchbound.advise.advice``: the advice itself, ``advise()``, ``advise_from_study()`` and
``Advice`` (re-exported by ``batchbound.advise``).

``advise(config)`` (or ``advise(model, data, ...)`` with a user's objects, ``inputs.py``) runs
a pilot at B0 over the first fraction of the planned run, or to the target (``pilot.py``),
with a cheap estimate of the noise scale at every step; extrapolates the noise scale over the
rest of the plan (``trajectory.py``); predicts iterations at other batch sizes, with an
interval (``iterations.py``); times steps and all-reduces here or models them for a
described cluster (``timing.py``); and picks the time-optimal batch per worker count
(``answer.py``). With ``with_probe=True`` it also branches short runs from the pilot: the
empirical critical batch beside n·Δ.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchbound import kernels
from batchbound.advise.answer import (
    Row,
    best_row,
    candidate_rows,
    finish,
    on_iterations,
    worker_counts,
)
from batchbound.advise.critical import (
    CAP,
    MIN_STEPS,
    BranchPlan,
    Combined,
    CriticalPoint,
    Inconclusive,
    TooShort,
    combine,
    measure,
    plan_branches,
    trajectories,
)
from batchbound.advise.inputs import from_objects
from batchbound.advise.iterations import (
    NOISE,
    Pilot,
    lr_scale,
    minimum_iterations,
    predict_iterations,
)
from batchbound.advise.model_error import ModelError, error_for, job_key
from batchbound.advise.pilot import ESTIMATORS, PilotRun, ProbePoint, pilot_config, probe, run_pilot
from batchbound.advise.study import StudySource
from batchbound.advise.timing import (
    OVERLAPS,
    Cluster,
    ComputeCurve,
    OtherWork,
    busy_reason,
    load_cluster,
    micro_batch_sizes,
    time_allreduce,
    time_compute,
    time_workers,
)
from batchbound.advise.trajectory import MIN_SEGMENT_STEPS, Trajectory, extrapolate
from batchbound.advise.warmup import WarmupPlan, warmup_schedule
from batchbound.data import Dataset, apply_transform, load_dataset
from batchbound.environment import usable_cores
from batchbound.errors import BatchboundError
from batchbound.models import build_model, count_parameters
from batchbound.train.config import Target, TrainConfig
from batchbound.train.distributed import resolve_device
from batchbound.train.loop import Parts
from batchbound.train.lr_rules import lr_rule
from batchbound.train.optimizers import (
    build_optimizer,
    is_adaptive,
    scales_per_coordinate,
    step_lag,
    unscaled_start,
    user_optimizer,
)

CRITICAL_BATCH = ("branches", "noise")  # where the rows' critical batch comes from
BUDGET = 0.1  # pilot + branches: this fraction of the plan's examples, by default
UNSCALED_HORIZON = 1000  # steps read for an optimiser's unscaled start (RAdam's: 5 to ~20)
BRANCH_POINTS = 1  # pilot states the branches start from (the last kept: the pilot's end)


@dataclass
class Advice:
    batch_bound: float  # n·Δ averaged over the pilot's steps
    rows: list[Row]
    recommended: Row
    workers_stop_paying: int | None
    assumptions: str
    pilot: dict[str, Any] | None = None  # what the prediction came from: a pilot run ...
    study: dict[str, Any] | None = None  # ... or a study's measured iterations
    probe: list[ProbePoint] | None = None
    warmup: WarmupPlan | None = None  # the batch-size warmup the pilot implies (a plan given)
    extra: dict[str, Any] = field(default_factory=dict)
    # what the rows were computed from (not in the JSON): the pilot, and per worker count
    source: Pilot | None = field(default=None, repr=False)
    curves: dict[int, ComputeCurve] = field(default_factory=dict, repr=False)
    communication: dict[int, float] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "batch_bound": self.batch_bound if math.isfinite(self.batch_bound) else None,
            "rows": [r.to_dict() for r in self.rows],
            "recommended": {key: self.recommended.to_dict()[key] for key in (
                "workers", "batch_size", "lr", "iterations", "iterations_interval",
                "seconds_to_target", "seconds_interval")},
            "workers_stop_paying": self.workers_stop_paying,
            "assumptions": self.assumptions,
            **({"pilot": self.pilot} if self.pilot is not None else {}),
            **({"study": self.study} if self.study is not None else {}),
            **self.extra,
        }
        if self.probe is not None:
            out["probe"] = [p.to_dict() for p in self.probe]
        if self.warmup is not None:
            out["warmup"] = self.warmup.to_dict()
        return out

    def to_json(self) -> str:
        """Strict JSON: a non-finite number (a diverged branch's loss, an unknown standard
        error) is null, as in the rows, not the NaN/Infinity other parsers reject."""
        return json.dumps(_plain(self.to_dict()), indent=2, allow_nan=False)

    @property
    def best_rows(self) -> list[Row]:
        """The fastest batch per worker count (every row when none is marked)."""
        return [r for r in self.rows if r.best] or self.rows

    @property
    def on_seconds(self) -> bool:
        """Whether the rows' seconds were trusted (else the answer is on iterations alone)."""
        return self.extra.get("recommended_on", "seconds") == "seconds"

    def table(self) -> str:
        """The best batch per worker count, and the pilot's own B0 on one worker (marked
        "B0"), as Markdown; seconds "unknown" where the timing cannot be trusted."""
        lines = ["| workers | batch | lr | iterations (interval) | s/iteration (compute + comm.) "
                 "| s to goal (interval) | speedup | efficiency |", "|" + "---|" * 8]
        b0 = (self.pilot or {}).get("batch_size")
        shown = [r for r in self.rows if r.best or (r.workers == 1 and r.batch_size == b0)]
        one = next((r for r in shown if r.best and r.workers == 1), None)
        for r in shown or self.rows:
            mark = (" ←" if r is self.recommended else "") + (
                " (B0)" if r.workers == 1 and r.batch_size == b0 else "")
            low, high = r.iterations_interval
            s_low, s_high = r.seconds_interval
            speedup = r.speedup
            if not r.best and one is not None:  # B0's row: against the best one-worker row
                speedup = one.seconds_to_target / r.seconds_to_target
            beside = ""
            if math.isfinite(r.noise_iterations):  # branches and n·Δ, joined; both beside
                (b_low, b_high), (n_low, n_high) = r.branch_interval, r.noise_interval
                beside = (f"; branches {r.branch_iterations:.0f} ({b_low:.0f}–{b_high:.0f}) "
                          f"weight {r.branch_weight:.0%}, n·Δ {r.noise_iterations:.0f} "
                          f"({n_low:.0f}–{n_high:.0f})" + (" disagree" if r.disagree else ""))
            seconds = ("unknown | unknown | – | – " if not math.isfinite(r.seconds_per_iteration)
                       else f"{r.seconds_per_iteration:.3g} ({r.compute_seconds:.3g} + "
                       f"{r.communication_seconds:.3g}) | {r.seconds_to_target:.3g} "
                       f"({s_low:.3g}–{s_high:.3g}) | {speedup:.2f}× | "
                       f"{speedup / r.workers:.0%} ")
            lines.append(f"| {r.workers}{mark} | {r.batch_size} | {r.lr:.4g} | "
                         f"{r.iterations:.0f} ({low:.0f}–{high:.0f}){beside} | {seconds}|")
        return "\n".join(lines)

    def summary(self) -> str:
        r = self.recommended
        warning = self.extra.get("timing_warning")
        goal = (self.pilot or self.study or {}).get("target", "the target")
        where = "the pilot" if self.pilot is not None else "the study's reference runs"
        bound = (f"n·Δ over {where}: {self.batch_bound:.4g}." if math.isfinite(self.batch_bound)
                 else f"n·Δ was not measured in {where}.")
        low, high = r.iterations_interval
        span = f" ({low:.0f}–{high:.0f})" if math.isfinite(low) and math.isfinite(high) else ""
        lines = []
        rule = self.extra.get("strategy")
        rule = f", rate rule {rule}" if rule else ""
        if not self.on_seconds:
            # S_min as the answer used it (the branches' when they predict), else the pilot's
            fewest = self.extra.get("minimum_iterations",
                                    (self.pilot or {}).get("minimum_iterations", math.nan))
            lines.append(
                f"the seconds cannot be trusted here ({warning}), so this answer is on "
                f"iterations alone: use batch {r.batch_size} (lr {r.lr:.4g}{rule}): about "
                f"{r.iterations:.0f}{span} iterations to {goal}, the smallest batch within "
                f"twice the fewest iterations any batch needs (S_min ≈ {fewest:.0f}), the "
                f"critical batch; how many workers pay is unknown: rerun on a quiet machine, "
                f"or give --cluster to model the seconds. {bound}")
        else:
            stop = (f"beyond {self.workers_stop_paying} worker"
                    f"{'s' if self.workers_stop_paying > 1 else ''}, doubling saves less than "
                    "10 %" if self.workers_stop_paying
                    else "every doubling of workers in the table pays")
            if warning:  # a study's recorded steps: only the all-reduce was timed here
                stop = (f"the timing here cannot be trusted ({warning}), so which worker "
                        f"count pays is uncertain (as timed: {stop})")
            lines.append(
                f"use {r.workers} worker(s) at batch {r.batch_size} (lr {r.lr:.4g}{rule}): "
                f"about "
                f"{r.iterations:.0f}{span} iterations, {r.seconds_to_target:.3g} s to {goal}; "
                f"{stop}. {bound}")
        pilot = self.pilot or {}
        final = pilot.get("final_loss")
        if final:
            lines.append(f"predicted training loss at the plan's end: {final[0]:.4g} "
                         f"({final[1]:.4g}–{final[2]:.4g}), extrapolated from the pilot.")
        if pilot.get("seconds") is not None:
            lines.append(f"the pilot ran {pilot['iterations']} iterations in "
                         f"{pilot['seconds']:.3g} s (training only)"
                         + (f", {pilot['wall_seconds']:.3g} s in all with its evaluations "
                            "and estimates" if pilot.get("wall_seconds") else "") + ".")
        return "\n".join(lines)


@kernels.on_threads
def advise(
    config: TrainConfig | nn.Module | Callable[[], nn.Module],
    data: Any = None,
    loss: str | Callable[..., Any] | None = None,
    *,
    optimizer: str | Callable[..., torch.optim.Optimizer] | None = None,
    batch_size: int = 16,
    lr: float | None = None,
    seed: int = 0,
    device: str = "auto",
    targets: tuple[Target, ...] = (),
    planned_epochs: float | None = None,
    planned_iterations: int | None = None,
    pilot_fraction: float | None = None,
    estimator: str = "two_batch",
    max_workers: int | None = None,
    cluster: str | Path | Cluster | None = None,
    overlap: str = "none",
    strategy: str | None = None,
    critical_batch: str = "branches",
    budget: float | None = None,
    diversity_every_epochs: float = 0.1,
    with_probe: bool = False,
    probe_tolerance: float = 0.1,
    progress: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> Advice:
    """How many workers, what batch size, how long, for a planned run or to a target.

    ``config``: a TrainConfig (model and data by name; its batch size is the pilot's B0, its
    lr η0, its first target the target), or a user's ``nn.Module`` / zero-argument factory
    with ``data`` (a Dataset, an (x, y) pair, a torch Dataset or a DataLoader), ``loss`` (a
    name or per-example callable), ``optimizer`` and ``batch_size``, ``lr``, ``seed``,
    ``device``, ``targets``. ``optimizer``: a name (sgd, adamw, adam; with a TrainConfig it
    replaces the config's) or a factory ``params -> Optimizer`` (a user's objects only). The
    pilot's rate η0 is ``lr``, else the one the optimizer sets, else 0.1; both given and
    different is refused.

    The plan: ``planned_epochs`` or ``planned_iterations`` at B0; the pilot trains the first
    ``pilot_fraction`` of it and stops, and the rows predict what reaches the plan's end.
    Without a plan the pilot trains to the first target (as long as the job, so state the
    plan when you can). ``estimator``: two_batch | norms | exact (``pilot.py``).
    ``critical_batch``: ``"branches"`` (default, with a plan) predicts from the critical
    batch measured by short branches from the pilot's states (``critical.py``), the noise
    scale's prediction shown beside; ``"noise"`` from the noise scale alone. ``budget``: the
    pilot and the branches together train at most this fraction of the plan's examples
    (default 0.1, or twice ``pilot_fraction`` when that is given); ``pilot_fraction``
    defaults to half of it with branches, else 0.1.
    ``strategy``: the rows' rate rule; default ``noise`` for SGD and ``srsr`` (η0·√(B/B0))
    for Adam-type optimisers.
    ``max_workers``: the largest P (default: the cores this process may run on, or the
    cluster's).
    ``cluster``: a cluster file or ``Cluster`` to model communication (and compute, with
    ``examples_per_second``) instead of timing it here. ``overlap``: ``"none"``
    (batchbound's trainer) or ``"backward"`` (DDP)."""
    named = optimizer if isinstance(optimizer, str) else None
    if isinstance(config, TrainConfig):
        if optimizer is not None and named is None:
            raise BatchboundError("with a TrainConfig, optimizer is a name (sgd, adamw, adam); "
                                  "a factory goes with your own model")
        config = config.replace(optimizer=named) if named else config
        data_set, parts = _data_of(config), None
    else:
        config, data_set, parts = from_objects(config, data, loss, None if named else optimizer,
                                               batch_size=batch_size, lr=lr, seed=seed,
                                               device=device, targets=tuple(targets))
        config = config.replace(optimizer=named) if named else config
    adaptive = _adaptive(config, parts)
    strategy = strategy if strategy is not None else ("srsr" if adaptive else "noise")
    if critical_batch not in CRITICAL_BATCH:
        raise BatchboundError(f"unknown critical batch source {critical_batch!r}; choose from "
                              f"{', '.join(CRITICAL_BATCH)}")
    branches = critical_batch == "branches" and (planned_epochs is not None
                                                 or planned_iterations is not None)
    given = budget is not None
    if given and not (isinstance(budget, (int, float)) and not isinstance(budget, bool)
                      and 0 < budget <= 1):  # nan fails too
        raise BatchboundError(f"the budget must be in (0, 1], a fraction of the plan's "
                              f"examples, got {budget!r}")
    if budget is None:  # the pilot and the branches: half each
        budget = BUDGET if pilot_fraction is None else 2 * pilot_fraction
    pilot_given = pilot_fraction is not None
    if pilot_fraction is None:
        pilot_fraction = budget / 2 if branches else 0.1
    planned = _planned(config, data_set, planned_epochs, planned_iterations, pilot_fraction)
    _check_options(config, strategy, overlap, probe_tolerance, estimator, planned)
    if branches and not (pilot_fraction < budget <= 1):
        raise BatchboundError(
            f"the budget {budget:g} must exceed the pilot fraction {pilot_fraction:g} (the "
            "branches get the rest) and be <= 1" if given else
            f"the pilot fraction {pilot_fraction:g} leaves the branches no budget (by default "
            f"twice it, {budget:g}, at most 1): lower --pilot-fraction, give --budget, or use "
            "--critical-batch noise")
    # what the pilot would refuse, refused before the timing and the pilot: a user's model
    # factory is built and run on one example here, its shapes named on a mismatch
    config.validate_against(data_set, model_given=parts is not None and parts.model is not None)
    spec, limit = _worker_limit(max_workers, cluster)
    device_ = resolve_device(config.device)
    error = error_for(_job(config, parts))  # the model's recorded error, read before any work
    n = data_set.n_train
    pilot_steps = None if planned is None else min(planned, math.ceil(pilot_fraction * planned))
    micro_limit = min(n, spec.max_micro_batch if spec and spec.max_micro_batch else n)
    counts = worker_counts(limit)
    branch_plan, skipped = None, None
    if branches and planned is not None and pilot_steps is not None:  # refused before timing
        spent = pilot_steps * config.batch_size
        left = math.floor(budget * planned * config.batch_size) - spent
        try:
            branch_plan = plan_branches(config.batch_size, n, micro_limit, left,
                                        planned * config.batch_size, BRANCH_POINTS)
        except TooShort as exc:
            if given:  # the user's budget: theirs to raise
                raise
            # advise's own budget: branches too short to measure anything are not run; the
            # pilot takes the whole budget (as with --critical-batch noise) unless its
            # fraction was given
            wanted = (spent + exc.needed) / (planned * config.batch_size)
            skipped = (f"not run: the default budget left them {left} examples, and 3 "
                       f"branches of {MIN_STEPS} steps at 2·B0 = {2 * config.batch_size} take "
                       f"{exc.needed} (shorter ones read the transient after a branch starts, "
                       f"not the critical batch); "
                       + ("the pilot took the whole budget instead " if not pilot_given else "")
                       + (f"(--budget {math.ceil(100 * wanted) / 100:g} runs them)"
                          if wanted <= 1 else "(a longer plan runs them)"))
            if not pilot_given:
                pilot_fraction = budget
                pilot_steps = min(planned, math.ceil(pilot_fraction * planned))
    # an Adam-type optimiser's first step has no second moment to weight the two-batch
    # estimate by (pilot.py): it is not estimated
    unestimated = 1 if adaptive and estimator == "two_batch" else 0
    if estimator != "exact" and pilot_steps is not None and \
            pilot_steps - unestimated < MIN_SEGMENT_STEPS:
        # one estimate per step at most: a pilot this short is refused after the timing and
        # the pilot anyway; here it costs nothing, and the answer names the fraction needed
        needed = math.ceil(100 * (MIN_SEGMENT_STEPS + unestimated) / planned) / 100
        raise BatchboundError(
            f"the pilot's {pilot_fraction:g} of the planned {planned} iterations is "
            f"{pilot_steps} step{'s' if pilot_steps != 1 else ''}; the noise scale needs at "
            f"least {MIN_SEGMENT_STEPS}"
            + (" estimated ones (an Adam-type optimiser's first step is not: it has no "
               "second moment yet)" if unestimated else "") + ": give "
            + (f"--pilot-fraction {needed:g} or more, or " if needed <= 1 else "")
            + "a longer plan (--planned-epochs or --planned-iterations)")
    if skipped:  # said once the pilot is known to run: a refusal above is its only line
        log(f"branches {skipped}")
    payload = _payload(config, data_set, parts)
    others = OtherWork()
    with others:
        curves, communication = _timings(config, data_set, spec, counts, micro_limit, payload,
                                         None, log, parts)
    log(_pilot_plan(config, planned, pilot_steps, curves[1], estimator))
    started = time.perf_counter()
    run = run_pilot(config, data_set, device_, iterations=pilot_steps, estimator=estimator,
                    exact_every_epochs=diversity_every_epochs, parts=parts, progress=progress,
                    precondition=adaptive)
    pilot_wall = time.perf_counter() - started
    horizon = planned if planned is not None else run.iterations
    lag, lag_failed = _lag(config, parts)
    path = extrapolate(run.segments, run.iterations, horizon, config.batch_size, config.lr, lag)
    momentum = 0.0 if adaptive else _momentum(config, parts)

    def rate(batch: int) -> float:
        return _lr(config, strategy, path.central, batch, momentum)
    log(f"pilot: {run.iterations} iterations; B_noise {run.segments[0].noise:.4g} at the "
        f"start, {run.segments[-1].noise:.4g} at its end; κ = B_noise·L = {path.kappa:.3g}")
    measured, inconclusive = None, skipped
    if branch_plan is not None:
        log(branch_plan.text(curves[1].step))
        try:
            points = measure(run.states, pilot_config(config, pilot_steps, estimator,
                                                      diversity_every_epochs),
                             data_set, device_, branch_plan,
                             rate, parts=parts,
                             log=log)
            measured = (points, trajectories(points, path.central, config.batch_size,
                                             config.lr, run.iterations, horizon))
        except Inconclusive as exc:  # said in the answer; the noise scale predicts instead
            inconclusive = str(exc)
            log(f"branches inconclusive: {inconclusive}; the noise scale predicts")
    busy = _timing_check(config, data_set, curves, others, parts, spec)
    rows = _prediction_rows(config, path, strategy, counts, n, micro_limit, curves,
                            communication, overlap, adaptive, measured[1] if measured else None,
                            error, momentum)
    fewest = _fewest(path, measured[1] if measured else None)
    if busy:  # seconds not to be trusted: the answer on iterations alone, the same each time
        recommended, stop = on_iterations(rows, fewest), None
    else:
        recommended, stop = finish([r for r in rows if r.best])
        _against_one_worker(rows)
    points = None
    if with_probe:
        log("probe: branching short runs from the pilot")
        points = probe(run, pilot_config(config, pilot_steps, estimator, diversity_every_epochs),
                       data_set, device_, rate,
                       lambda i: 1.0 + path.central.noise_scale(i), tolerance=probe_tolerance,
                       largest=micro_limit, parts=parts, log=log)
    goal = (f"the training loss the planned {planned} iterations at B0 reach" if planned
            else config.targets[0].name)
    critical_text = (_critical_text(measured[0], rows, branch_plan) if measured else
                     "the critical batch taken as the noise scale B_noise = n·Δ − 1"
                     + ("" if critical_batch == "noise" else
                        f" (the branches were inconclusive: {inconclusive}; a larger --budget "
                        "gives them more examples)" if inconclusive else
                        " (the branches need a plan: --planned-epochs or --planned-iterations)"))
    named_optimizer = config.optimizer if parts is None or parts.optimizer is None else "yours"
    optimiser_text = (f"optimizer {named_optimizer}"
                      + (" (Adam-type: the rate rule's steps taken as the tuned rate's, "
                         "S(B)/S(B0))" if adaptive else "")
                      + _metric_text(run.metric, adaptive, estimator)
                      + (f" with momentum μ = {momentum:g}, kept at every batch: the rate "
                         f"rule scales η and with it the effective step η/(1 − μ) (= "
                         f"{config.lr / (1 - momentum):.4g} at B0), the only way the model "
                         "sees the rate (as the ratio η(B)/η0)"
                         + ("; the noise rule's B_lo taken (1 + μ) times over: heavy ball's "
                            "stable rate is (1 + μ) times SGD's" if strategy == NOISE else "")
                         if momentum else "")
                      + (f"; its start-up lag could not be measured on a scalar ({lag_failed}):"
                         " the loss trend counted from step 0" if lag_failed else ""))
    assumptions = (
        f"Iterations to {goal}: McCandlish et al.'s model applied step by step along the "
        f"planned run at B0 = {config.batch_size}; {critical_text}; noise scale: "
        f"{path.assumption}; the pilot's lr taken as the best at B0; {optimiser_text}; "
        f"interval: {error.text()}. "
        f"Learning rate per batch: strategy '{strategy}' ({_rule_text(strategy)}"
        f"{'; the default for Adam-type optimisers' if adaptive and strategy == 'srsr' else ''})"
        f", constant through training (no warm-up or decay). "
        + _seconds_text(spec, overlap, payload, micro_limit, "timed on this machine"))
    return Advice(
        # over the pilot's own steps and segments, as the answer says: the central trajectory
        # runs on over the plan, its last pilot steps already interpolated towards the
        # extrapolated noise scale
        batch_bound=Pilot(config.batch_size, config.lr, run.iterations,
                          tuple(round(s.middle) for s in path.segments),
                          tuple(1.0 + s.noise for s in path.segments)).mean_batch_bound(),
        rows=rows, recommended=recommended, workers_stop_paying=stop,
        assumptions=assumptions,
        pilot={**_pilot_record(config, run, path, planned, pilot_fraction, goal),
               "wall_seconds": pilot_wall, "metric": run.metric},
        probe=points,
        warmup=warmup_schedule(path.central, max_batch=micro_limit) if planned else None,
        extra={"n": n, "strategy": strategy, "overlap": overlap,
               "optimizer": named_optimizer, "momentum": momentum,
               "critical_batch": "branches" if measured else "noise",
               "model_error": error.to_dict(),
               **({"branches": [{**p.to_dict(), "capped": _capped(p.high, p)}
                                for p in measured[0]]} if measured else {}),
               **({"branches_inconclusive": inconclusive} if inconclusive else {}),
               "timing": "cluster" if spec is not None else "measured",
               "timing_reliable": busy is None, "timing_warning": busy,
               "recommended_on": "iterations" if busy else "seconds",
               "minimum_iterations": fewest},
        source=path.central, curves=curves, communication=communication)


def _against_one_worker(rows: list[Row]) -> None:
    """Every row's speedup and efficiency against the best one-worker row (``finish`` fills
    the best rows'; the others' would keep the dataclass's 1.0 in the JSON)."""
    one = next(r for r in rows if r.best and r.workers == 1)
    for row in rows:
        if not row.best:
            row.speedup = one.seconds_to_target / row.seconds_to_target
            row.efficiency = row.speedup / row.workers


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _adaptive(config: TrainConfig, parts: Parts | None) -> bool:
    """Whether the run's optimiser is Adam-type: by name, or a user's factory whose
    optimiser has Adam's betas or scales each coordinate's step by its own (RMSprop,
    Adagrad: ``scales_per_coordinate``)."""
    if parts is None or parts.optimizer is None:
        return is_adaptive(config.optimizer)
    probe_param = torch.zeros(1, requires_grad=True)
    adaptive = "betas" in user_optimizer(parts.optimizer, [probe_param]).defaults
    try:
        adaptive = adaptive or scales_per_coordinate(parts.optimizer)
        unscaled = unscaled_start(parts.optimizer, UNSCALED_HORIZON) if adaptive else 0
    except Exception:  # it refuses a float64 scalar or needs a closure: the betas decide
        return adaptive
    if unscaled >= UNSCALED_HORIZON:  # it never scales a coordinate: SGD's steps, metric
        return False
    if unscaled:
        raise BatchboundError(
            f"the optimizer takes its first {unscaled} steps unscaled, as SGD does, and "
            "scales each coordinate by its own after (RAdam before its rectification): "
            "neither metric, Euclidean or 1/(√v̂ + ε), is the one all its steps take, and "
            "its unscaled steps' size follows the gradient's scale, so its start-up lag "
            "has no one value; use Adam or AdamW")
    return adaptive


def _metric_text(metric: str, adaptive: bool, estimator: str) -> str:
    """The metric the pilot's noise scale is in, said beside an Adam-type optimiser: its
    own, or the Euclidean one, which is not the metric its steps take."""
    if metric == "adam":
        return ("; the noise scale measured in its own metric, squared norms weighted by "
                "1/(√v̂ + ε) (preconditioned SGD's tr(PΣ)/GᵀPG)")
    if not adaptive:
        return ""
    why = ("the optimiser keeps no second moment exp_avg_sq to weight by"
           if estimator == "two_batch" else
           f"only --estimator two_batch weights by it, {estimator} does not")
    return f"; the noise scale in the Euclidean metric, not the 1/(√v̂ + ε) its steps take ({why})"


def _job(config: TrainConfig, parts: Parts | None) -> tuple[Any, ...]:
    """The job's identity for the model's recorded errors; a model, loss or optimiser handed
    over as Python objects matches no recorded job."""
    if parts is not None and (parts.model or parts.loss or parts.optimizer):
        return ("yours", id(parts))
    return job_key(config.dataset, config.model, config.optimizer, config.momentum,
                   config.batch_size, config.lr)


def _momentum(config: TrainConfig, parts: Parts | None) -> float:
    """SGD's momentum μ: the config's, or a user's factory optimiser's default (0 without)."""
    if parts is None or parts.optimizer is None:
        return config.momentum
    probe_param = torch.zeros(1, requires_grad=True)
    made = user_optimizer(parts.optimizer, [probe_param])
    return float(made.defaults.get("momentum", 0.0) or 0.0)


def _lag(config: TrainConfig, parts: Parts | None) -> tuple[float, str | None]:
    """The steps the run's optimiser (the config's or the user's factory's) takes to build
    up its steady step (``step_lag``), and why it could not be measured (then 0: the loss
    trend counts from step 0, as before the lag was known)."""
    make = parts.optimizer if parts is not None and parts.optimizer is not None else \
        (lambda params: build_optimizer(params, config))
    try:
        return step_lag(make), None
    except Exception as exc:  # a user's optimiser may refuse a float64 scalar,
        # need a closure (L-BFGS) or a GPU: the lag is a refinement, not worth the answer
        return 0.0, f"{type(exc).__name__}: {exc}".splitlines()[0]


def _critical_text(points: list[CriticalPoint], rows: list[Row], plan: BranchPlan | None
                   ) -> str:
    """How the branches measured the critical batch, and where they and the noise scale
    disagree."""
    def bound(value: float, point: CriticalPoint) -> str:  # the cap is a bound, not a value
        return f"≥ {value:.3g}" if _capped(value, point) else f"{value:.3g}"

    def said(point: CriticalPoint) -> str:  # the point's own words, its cap shown as a bound
        text = point.text()
        if point.below is None:
            text = text.replace(
                f"{point.critical_batch:.3g} ({point.low:.3g}–{point.high:.3g})",
                f"{bound(point.critical_batch, point)} ({point.low:.3g}–"
                f"{bound(point.high, point)})", 1)
        return text

    at = ", ".join(f"{said(p)} at iteration {p.iteration}" for p in points)
    ladder = f"B = {', '.join(map(str, plan.ladder))}" if plan else "B0·2^k"
    text = (f"the critical batch measured by short branches from the pilot's states at "
            f"{ladder} over the same examples (Merrill et al. 2025): {at}; before iteration "
            f"{points[0].iteration} (the first branch point) it is assumed to be that point's "
            f"value, though the critical batch rises early in training; past the pilot "
            f"(trajectories in critical.py) low stays at its low end, high grows as the noise "
            f"scale's trend, and the central value half way between in log (times the square "
            f"root of that growth); each row's iterations join the branches' prediction and "
            f"the noise scale's (the prior) in log, weighted by the precision of their "
            f"intervals (the branches' share is shown per row)")
    if any(_capped(p.high, p) for p in points):
        text += (f"; '≥ X': within the branches' noise a larger batch kept up with B0, so "
                 f"the fit cannot tell B_crit above X = {CAP}× the largest branch: a lower "
                 f"bound")
    split = sorted({r.batch_size for r in rows if r.disagree})
    if split:
        text += (f"; at B = {', '.join(map(str, split))} the branches and the noise scale "
                 f"predict iterations whose intervals do not overlap, so the interval spans "
                 f"both")
    return text


def _capped(value: float, point: CriticalPoint) -> bool:
    """Whether a fitted value is the fit's cap (CAP × the largest branch), a lower bound."""
    return value >= CAP * max(point.ratios)


def _data_of(config: TrainConfig) -> Dataset:
    data = load_dataset(config.dataset, config.data_dir)
    if config.transform:
        data = apply_transform(data, config.transform, config.seed)
    return data


def _planned(config: TrainConfig, data: Dataset, epochs: float | None, iterations: int | None,
             fraction: float) -> int | None:
    """The planned iterations at B0, or None (to a target)."""
    if epochs is not None and iterations is not None:
        raise BatchboundError("give the plan as epochs or as iterations, not both")
    if not (isinstance(fraction, (int, float)) and 0 < fraction <= 1):
        raise BatchboundError(f"the pilot fraction must be in (0, 1], got {fraction!r}")
    if epochs is not None:
        if not (math.isfinite(epochs) and epochs > 0):
            raise BatchboundError(f"planned epochs must be > 0, got {epochs!r}")
        return max(1, math.ceil(epochs * data.n_train / config.batch_size))
    if iterations is not None:
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise BatchboundError(f"planned iterations must be a positive integer, got "
                                  f"{iterations!r}")
        return iterations
    if not config.targets:
        raise BatchboundError("state the plan (--planned-epochs or --planned-iterations at "
                              "B0) or a target (--target-train-acc and the like)")
    return None


def _check_options(config: TrainConfig, strategy: str, overlap: str, probe_tolerance: float,
                   estimator: str, planned: int | None) -> None:
    if config.workers != 1:
        raise BatchboundError("the pilot runs on one process; leave workers at 1")
    lr_rule(strategy, "strategy", extra=(NOISE,))  # the registry now, not at import
    if overlap not in OVERLAPS:
        raise BatchboundError(f"unknown overlap {overlap!r}; choose from {', '.join(OVERLAPS)}")
    if not 0 < probe_tolerance < 1:
        raise BatchboundError(f"probe tolerance must be in (0, 1), got {probe_tolerance}")
    if estimator not in ESTIMATORS:
        raise BatchboundError(f"unknown estimator {estimator!r}; choose from "
                              f"{', '.join(ESTIMATORS)}")
    if planned is not None and config.targets:
        raise BatchboundError("give a plan or a target, not both: with a plan, advise "
                              "predicts what the plan's end reaches")


def _pilot_plan(config: TrainConfig, planned: int | None, steps: int | None,
                curve: ComputeCurve, estimator: str) -> str:
    """The pilot's length and its cost, said before it starts."""
    micro = max(1, config.batch_size // 2) if estimator == "two_batch" else config.batch_size
    per_step = curve.step(micro) * config.batch_size / micro * (2 if estimator == "norms" else 1)
    if planned is not None and steps is not None:
        return (f"pilot: {steps} of the {planned} planned iterations at B0 = "
                f"{config.batch_size} ({100 * steps / planned:.3g} %), estimator {estimator}: "
                f"about {steps * per_step:.3g} s")
    return (f"pilot: batch {config.batch_size}, lr {config.lr:g}, to {config.targets[0].name} "
            f"(as long as the job; state --planned-epochs to shorten it), estimator "
            f"{estimator}: about {per_step:.3g} s per iteration")


def _timing_check(config: TrainConfig, data: Dataset, curves: dict[int, ComputeCurve],
                  others: OtherWork, parts: Parts | None, spec: Cluster | None) -> str | None:
    """Why the step timing cannot be trusted, or None: other processes' CPU while timing,
    rounds that did not settle or a step slower at a smaller batch (``time_steps``), and the
    step at B0 timed again after the pilot disagreeing."""
    curve = curves.get(1)
    if (spec is not None and spec.examples_per_second) or curve is None:
        return None
    size = min(config.batch_size, data.n_train)
    with others:
        retimed = time_compute(config, data, [size], kernels.threads(), parts=parts).step(size)
    unsettled = [f"P = {p}: {c.unsettled}" if p > 1 else c.unsettled
                 for p, c in curves.items() if c.unsettled]
    reasons = [r for r in (busy_reason(others.cores, curve.step(size), retimed), *unsettled) if r]
    return "; ".join(reasons) or None


def _lr(config: TrainConfig, strategy: str, pilot: Pilot, batch: int,
        momentum: float = 0.0) -> float:
    scale = lr_scale(strategy, batch, pilot, momentum)
    return config.lr * scale * (pilot.batch_size / batch if config.convention == "sum" else 1.0)


def _prediction_rows(config: TrainConfig, path: Trajectory, strategy: str, counts: list[int],
                     n: int, micro_limit: int, curves: dict[int, ComputeCurve],
                     communication: dict[int, float], overlap: str, adaptive: bool = False,
                     measured: tuple[Pilot, Pilot, Pilot] | None = None,
                     error: ModelError | None = None, momentum: float = 0.0) -> list[Row]:
    """Every candidate (P, B) with its iterations, interval and seconds (see answer.py).
    An Adam-type optimiser's steps follow the tuned-rate relation whatever its rate rule
    (the SGD quadratic's penalty does not describe Adam); ``measured``: the branches'
    (central, low, high) critical batch, which then predicts, the noise scale beside it;
    ``error``: the model's own measured error, joined to each iterations' interval."""
    model = "noise" if adaptive else strategy

    def from_noise(batch: int) -> tuple[float, tuple[float, float]]:
        scale = lr_scale(strategy, batch, path.central, momentum)
        ends = [predict_iterations(p, batch, model, scale) for p in (path.high, path.low)]
        return predict_iterations(path.central, batch, model, scale), (min(ends), max(ends))

    def both(batch: int) -> Combined:
        noise, noise_interval = from_noise(batch)
        if measured is None:
            return Combined(noise, noise_interval, noise, noise_interval, False)
        central, low, high = (predict_iterations(p, batch, "noise") for p in measured)
        return combine(central, (min(low, high), max(low, high)), noise, noise_interval)

    def iterations(batch: int) -> float:
        return both(batch).iterations

    def interval(batch: int) -> tuple[float, float]:
        row = both(batch)
        if error is None:
            return row.interval
        return error.widen(row.iterations, row.interval, batch, config.batch_size)

    spread = 0.1  # the step timing's own uncertainty, when it is trusted (docs/advise.md)
    rows = []
    for workers in counts:
        rows += candidate_rows(workers, n, micro_limit, curves[workers], communication[workers],
                               overlap, iterations, lambda b: _lr(config, strategy,
                                                                  path.central, b, momentum),
                               interval, spread)
    for row in rows:
        beside = both(row.batch_size)
        row.pilot_interval = beside.interval
        if measured is not None:
            row.noise_iterations, row.noise_interval = beside.noise_iterations, \
                beside.noise_interval
            row.branch_iterations, row.branch_interval = beside.branch_iterations, \
                beside.branch_interval
            row.branch_weight, row.disagree = beside.branch_weight, beside.disagree
    if not any(r.best for r in rows):
        raise BatchboundError("no batch size is predicted to reach the target")
    return rows


def _fewest(path: Trajectory, measured: tuple[Pilot, Pilot, Pilot] | None) -> float:
    """S_min of what the rows predict from: the noise scale's, joined with the branches' as
    the rows are (``combine``) when they ran."""
    def ends(paths: tuple[Pilot, Pilot, Pilot]) -> tuple[float, tuple[float, float]]:
        central, low, high = (minimum_iterations(p) for p in paths)
        return central, (min(low, high), max(low, high))

    noise = ends((path.central, path.low, path.high))
    return noise[0] if measured is None else combine(*ends(measured), *noise).iterations


def _pilot_record(config: TrainConfig, run: PilotRun, path: Trajectory, planned: int | None,
                  fraction: float, goal: str) -> dict[str, Any]:
    return {
        "batch_size": config.batch_size, "lr": config.lr, "iterations": run.iterations,
        "planned_iterations": planned, "fraction": fraction if planned else None,
        "seconds": run.seconds, "estimator": run.estimator, "target": goal,
        "minimum_iterations": minimum_iterations(path.central),
        "kappa": path.kappa, "kappa_se": path.kappa_se, "loss_exponent": path.loss_exponent,
        "kappa_growth": path.kappa_growth, "kappa_trend": list(path.kappa_trend),
        "lag": path.lag,
        "final_loss": list(path.final_loss) if planned else None,
        "segments": [{"start": s.start, "end": s.end, "noise_scale": s.noise, "se": s.se,
                      "loss": s.loss} for s in path.segments],
        "batch_bounds": [[i, b] for i, b in zip(path.central.bound_iterations,
                                                path.central.batch_bounds, strict=True)],
    }


@kernels.on_threads
def advise_from_study(
    source: StudySource | dict[str, Any],
    *,
    max_workers: int | None = None,
    cluster: str | Path | Cluster | None = None,
    overlap: str = "none",
    log: Callable[[str], None] = lambda _: None,
) -> Advice:
    """The advice from a study's measured iterations to its first target and the step
    times its runs recorded, instead of a pilot. ``source``: one model's plain data from
    ``batchbound.study.measured.advice_input`` (or ``load_advice_input(store, study, model,
    strategy)``), or the StudySource made from it (``study.py``)."""
    if overlap not in OVERLAPS:
        raise BatchboundError(f"unknown overlap {overlap!r}; choose from {', '.join(OVERLAPS)}")
    spec, limit = _worker_limit(max_workers, cluster)
    if isinstance(source, dict):
        source = StudySource.from_input(source)
    config = TrainConfig.from_dict(source.config).replace(workers=1)
    data = load_dataset(config.dataset, config.data_dir)
    if config.transform:
        data = apply_transform(data, config.transform, config.seed)
    measured = source.iterations
    micro_limit = min(source.n, spec.max_micro_batch if spec and spec.max_micro_batch
                      else source.n)
    counts = worker_counts(limit)
    payload = _payload(config, data)
    log(f"{source.study}, {source.model}: k(B) measured at B = {list(measured.batches)}")
    others = OtherWork()
    with others:
        curves, communication = _timings(config, data, spec, counts, micro_limit, payload,
                                         source.step, log)
    busy = busy_reason(others.cores, 1.0, 1.0) if spec is None else None
    rows = _rows(counts, source.n, micro_limit, curves, communication, overlap, measured.at,
                 measured.lr)
    recommended, stop = finish(rows)
    fit = (f"S(B) = S_min(1 + B_crit/B) fitted to its reached runs (B_crit = "
           f"{measured.b_crit:.3g}) interpolates between grid batches"
           if math.isfinite(measured.b_crit) else
           "no critical-batch fit (fewer than 3 batches reached the target, or the fit is "
           "not identified), so k is interpolated log-log between grid batches")
    assumptions = (
        f"Iterations: measured by study {source.study!r} for {source.model} (median over "
        f"seeds to {source.target}) at B = {list(measured.batches)}; {fit}; nothing outside "
        f"the grid or beside a batch that missed is advised. Learning rate per batch: the "
        f"study's own (strategy {source.strategy or 'blr'}), geometric between grid batches. "
        + _seconds_text(spec, overlap, payload, micro_limit,
                        "from the study's recorded step times (median per micro-batch; the "
                        "forward assumed a third of it)"))
    return Advice(
        batch_bound=source.batch_bound, rows=rows, recommended=recommended,
        workers_stop_paying=stop, assumptions=assumptions, study=source.describe(),
        extra={"n": source.n, "strategy": source.strategy, "overlap": overlap,
               "timing": "cluster" if spec is not None else "measured",
               "timing_reliable": busy is None, "timing_warning": busy},
        curves=curves, communication=communication)


def _worker_limit(max_workers: int | None, cluster: str | Path | Cluster | None
                  ) -> tuple[Cluster | None, int]:
    spec = load_cluster(cluster) if isinstance(cluster, (str, Path)) else cluster
    cores = usable_cores()  # the cores it may run on (taskset, a Slurm cpuset), not the node's
    limit = max_workers if max_workers is not None else (spec.max_workers if spec else cores)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise BatchboundError(f"max workers must be a positive integer, got {limit!r}")
    if spec is None and limit > cores:
        raise BatchboundError(f"this process may run on {cores} cores (its CPU affinity), so at "
                              f"most {cores} local workers can be timed; pass --cluster FILE "
                              f"to model {limit}")
    return spec, limit


def _payload(config: TrainConfig, data: Dataset, parts: Parts | None = None) -> int:
    """Bytes all-reduced per iteration: the gradient and the trainer's 3 extras."""
    model = parts.model if parts is not None and parts.model is not None else build_model(
        config.model, data.input_shape, data.num_outputs, seed=config.seed)
    params = count_parameters(model)
    return (params + 3) * (4 if config.dtype == "float32" else 8)


def _seconds_text(spec: Cluster | None, overlap: str, payload: int, micro_limit: int,
                  one_worker: str) -> str:
    where = ("modelled for the cluster file (ring all-reduce, α–β)" if spec is not None else
             f"one worker's step {one_worker}; for P > 1 local workers the all-reduce, "
             "waiting for the slower peer included, timed by running the trainer's real step "
             "in lockstep on P gloo processes")
    return (f"Seconds: {where}; communication {_OVERLAP[overlap]}; {payload} bytes "
            f"all-reduced per iteration. Batches B = P·2^k up to micro-batch {micro_limit}. "
            "Evaluation time excluded, as in batchbound train's target seconds.")


def _timings(config: TrainConfig, data: Dataset, spec: Cluster | None, counts: list[int],
             micro_limit: int, payload: int, one_worker: ComputeCurve | None,
             log: Callable[[str], None], parts: Parts | None = None,
             ) -> tuple[dict[int, ComputeCurve], dict[int, float]]:
    """Per worker count: one worker's compute curve and the all-reduce seconds. The curve is
    ``one_worker`` when given (a study's recorded steps); else timed here on the threads
    training computes on (``kernels.threads()``) for one worker, and for local P > 1 by
    running the real step in lockstep (``time_workers``), which also times the all-reduce.
    A cluster file models the all-reduce, and the compute too with examples_per_second."""
    given = one_worker
    n = data.n_train
    curves: dict[int, ComputeCurve] = {}
    communication: dict[int, float] = {}
    for workers in counts:
        if spec is None and workers > 1 and parts is not None:
            # a Python object cannot be rebuilt in fresh processes: its compute is timed here,
            # the all-reduce on P gloo processes
            threads = kernels.threads()
            largest = min(micro_limit, n // workers)
            log(f"timing the step here ({threads} threads) and the all-reduce of {payload} "
                f"bytes on {workers} local processes")
            curves[workers] = given if given is not None else time_compute(
                config, data, micro_batch_sizes(largest), threads, parts=parts)
            communication[workers] = time_allreduce(workers, payload, threads)
            continue
        if spec is None and workers > 1:
            largest = min(micro_limit, n // workers)
            # with the step given, only the all-reduce is wanted: one small micro-batch
            sizes = micro_batch_sizes(largest) if given is None else [min(8, largest)]
            log(f"timing the step on {workers} local processes at micro-batches {sizes}")
            timed, communication[workers] = time_workers(config, workers, sizes,
                                                         kernels.threads())
            curves[workers] = given if given is not None else timed
            continue
        if spec is not None and spec.examples_per_second:
            curves[workers] = ComputeCurve.from_rate(spec.examples_per_second)
        else:
            if one_worker is None:
                log(f"timing the step at micro-batches 1 .. {micro_limit}")
                one_worker = time_compute(config, data, micro_batch_sizes(micro_limit),
                                          kernels.threads(), parts=parts)
            curves[workers] = one_worker
        communication[workers] = (spec.allreduce_seconds(workers, payload) if spec is not None
                                  else 0.0)
    return curves, communication


def _rows(counts: list[int], n: int, micro_limit: int, curves: dict[int, ComputeCurve],
          communication: dict[int, float], overlap: str, iterations: Callable[[int], float],
          lr: Callable[[int], float]) -> list[Row]:
    rows = []
    for workers in counts:
        row = best_row(workers, n, micro_limit, curves[workers], communication[workers],
                       overlap, iterations, lr)
        if row is not None:
            rows.append(row)
    if not rows:
        raise BatchboundError("no batch size is predicted to reach the target")
    return rows


_OVERLAP = {"none": "after the backward, not overlapped (as batchbound train does)",
            "backward": "overlapping the backward (as DDP does)"}


def _rule_text(strategy: str) -> str:
    rule = lr_rule(strategy, "strategy", extra=(NOISE,))
    return (f"η(B) = {rule.formula}" if rule is not None else
            "η(B) = η0·(1 + B_lo/B0)/(1 + B_lo/B), B_lo the pilot's lowest noise scale")
