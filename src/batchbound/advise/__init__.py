"""``batchbound.advise``: how many workers, what batch size, how long.

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
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchbound.advise.answer import Row, best_row, candidate_rows, finish, worker_counts
from batchbound.advise.inputs import from_objects
from batchbound.advise.iterations import (
    STRATEGIES,
    Pilot,
    lr_scale,
    minimum_iterations,
    predict_iterations,
)
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
from batchbound.advise.trajectory import Trajectory, extrapolate
from batchbound.advise.warmup import WarmupPlan, warmup_schedule
from batchbound.data import Dataset, apply_transform, load_dataset
from batchbound.errors import BatchboundError
from batchbound.models import build_model, count_parameters
from batchbound.train.config import Target, TrainConfig
from batchbound.train.distributed import resolve_device
from batchbound.train.loop import Parts
from batchbound.train.lr_rules import LR_RULES


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
        return json.dumps(self.to_dict(), indent=2)

    @property
    def best_rows(self) -> list[Row]:
        """The fastest batch per worker count (every row when none is marked)."""
        return [r for r in self.rows if r.best] or self.rows

    def table(self) -> str:
        lines = ["| workers | batch | lr | iterations (interval) | s/iteration (compute + comm.) "
                 "| s to target (interval) | speedup | efficiency |", "|" + "---|" * 8]
        for r in self.best_rows:
            mark = " ←" if r is self.recommended else ""
            low, high = r.iterations_interval
            s_low, s_high = r.seconds_interval
            lines.append(
                f"| {r.workers}{mark} | {r.batch_size} | {r.lr:.4g} | {r.iterations:.0f} "
                f"({low:.0f}–{high:.0f}) | {r.seconds_per_iteration:.3g} "
                f"({r.compute_seconds:.3g} + {r.communication_seconds:.3g}) | "
                f"{r.seconds_to_target:.3g} ({s_low:.3g}–{s_high:.3g}) | "
                f"{r.speedup:.2f}× | {r.efficiency:.0%} |")
        return "\n".join(lines)

    def summary(self) -> str:
        r = self.recommended
        warning = self.extra.get("timing_warning")
        stop = (f"beyond {self.workers_stop_paying} worker"
                f"{'s' if self.workers_stop_paying > 1 else ''}, doubling saves less than 10 %"
                if self.workers_stop_paying else "every doubling of workers in the table pays")
        if warning:
            stop = (f"the step timing cannot be trusted ({warning}), so which worker count "
                    f"pays is uncertain: rerun on a quiet machine (as timed: {stop})")
        where = "the pilot" if self.pilot is not None else "the study's reference runs"
        bound = (f"n·Δ over {where}: {self.batch_bound:.4g}." if math.isfinite(self.batch_bound)
                 else f"n·Δ was not measured in {where}.")
        low, high = r.iterations_interval
        span = f" ({low:.0f}–{high:.0f})" if math.isfinite(low) and math.isfinite(high) else ""
        return (f"use {r.workers} worker(s) at batch {r.batch_size} (lr {r.lr:.4g}): about "
                f"{r.iterations:.0f}{span} iterations, {r.seconds_to_target:.3g} s to the "
                f"target; {stop}. {bound}")


def advise(
    config: TrainConfig | nn.Module | Callable[[], nn.Module],
    data: Any = None,
    loss: str | Callable[..., Any] | None = None,
    *,
    optimizer: Callable[..., torch.optim.Optimizer] | None = None,
    batch_size: int = 16,
    lr: float = 0.1,
    seed: int = 0,
    device: str = "auto",
    targets: tuple[Target, ...] = (),
    planned_epochs: float | None = None,
    planned_iterations: int | None = None,
    pilot_fraction: float = 0.1,
    estimator: str = "two_batch",
    max_workers: int | None = None,
    cluster: str | Path | Cluster | None = None,
    overlap: str = "none",
    strategy: str = "noise",
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
    name or per-example callable), ``optimizer`` (``params -> Optimizer``, default SGD) and
    ``batch_size``, ``lr``, ``seed``, ``device``, ``targets``.

    The plan: ``planned_epochs`` or ``planned_iterations`` at B0; the pilot trains the first
    ``pilot_fraction`` of it and stops, and the rows predict what reaches the plan's end.
    Without a plan the pilot trains to the first target (as long as the job, so state the
    plan when you can). ``estimator``: two_batch | norms | exact (``pilot.py``).
    ``max_workers``: the largest P (default: this machine's cores, or the cluster's).
    ``cluster``: a cluster file or ``Cluster`` to model communication (and compute, with
    ``examples_per_second``) instead of timing it here. ``overlap``: ``"none"``
    (batchbound's trainer) or ``"backward"`` (DDP)."""
    if isinstance(config, TrainConfig):
        data_set, parts = _data_of(config), None
    else:
        config, data_set, parts = from_objects(config, data, loss, optimizer,
                                               batch_size=batch_size, lr=lr, seed=seed,
                                               device=device, targets=tuple(targets))
    planned = _planned(config, data_set, planned_epochs, planned_iterations, pilot_fraction)
    _check_options(config, strategy, overlap, probe_tolerance, estimator, planned)
    # what the pilot would refuse, refused before the timing and the pilot: a user's model
    # factory is built and run on one example here, its shapes named on a mismatch
    config.validate_against(data_set, model_given=parts is not None and parts.model is not None)
    spec, limit = _worker_limit(max_workers, cluster)
    device_ = resolve_device(config.device)
    n = data_set.n_train
    pilot_steps = None if planned is None else min(planned, math.ceil(pilot_fraction * planned))
    micro_limit = min(n, spec.max_micro_batch if spec and spec.max_micro_batch else n)
    counts = worker_counts(limit)
    payload = _payload(config, data_set, parts)
    others = OtherWork()
    with others:
        curves, communication = _timings(config, data_set, spec, counts, micro_limit, payload,
                                         None, log, parts)
    log(_pilot_plan(config, planned, pilot_steps, curves[1], estimator))
    run = run_pilot(config, data_set, device_, iterations=pilot_steps, estimator=estimator,
                    exact_every_epochs=diversity_every_epochs, parts=parts, progress=progress)
    horizon = planned if planned is not None else run.iterations
    path = extrapolate(run.segments, run.iterations, horizon, config.batch_size, config.lr)
    log(f"pilot: {run.iterations} iterations; B_noise {run.segments[0].noise:.4g} at the "
        f"start, {run.segments[-1].noise:.4g} at its end; κ = B_noise·L = {path.kappa:.3g}")
    busy = _timing_check(config, data_set, curves.get(1), others, parts, spec)
    rows = _prediction_rows(config, path, strategy, counts, n, micro_limit, curves,
                            communication, overlap, busy)
    best = [r for r in rows if r.best]
    recommended, stop = finish(best)
    points = None
    if with_probe:
        log("probe: branching short runs from the pilot")
        points = probe(run, pilot_config(config, pilot_steps, estimator, diversity_every_epochs),
                       data_set, device_, lambda b: _lr(config, strategy, path.central, b),
                       lambda i: 1.0 + path.central.noise_scale(i), tolerance=probe_tolerance,
                       largest=micro_limit, parts=parts, log=log)
    goal = (f"the training loss the planned {planned} iterations at B0 reach" if planned
            else config.targets[0].name)
    assumptions = (
        f"Iterations to {goal}: McCandlish et al.'s model applied step by step along the "
        f"planned run at B0 = {config.batch_size}; {path.assumption}; the pilot's lr taken as "
        f"the best at B0. Learning rate per batch: strategy '{strategy}' "
        f"({_RULES[strategy]}), constant through training (no warm-up or decay). "
        + _seconds_text(spec, overlap, payload, micro_limit, "timed on this machine"))
    return Advice(
        batch_bound=path.central.mean_batch_bound(),
        rows=rows, recommended=recommended, workers_stop_paying=stop,
        assumptions=assumptions,
        pilot=_pilot_record(config, run, path, planned, pilot_fraction, goal),
        probe=points,
        warmup=warmup_schedule(path.central, max_batch=micro_limit) if planned else None,
        extra={"n": n, "strategy": strategy, "overlap": overlap,
               "timing": "cluster" if spec is not None else "measured",
               "timing_reliable": busy is None, "timing_warning": busy},
        source=path.central, curves=curves, communication=communication)


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
    if strategy not in STRATEGIES:
        raise BatchboundError(f"unknown strategy {strategy!r}; choose from "
                              f"{', '.join(STRATEGIES)}")
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


def _timing_check(config: TrainConfig, data: Dataset, curve: ComputeCurve | None,
                  others: OtherWork, parts: Parts | None, spec: Cluster | None) -> str | None:
    """Whether the step timing can be trusted: what other processes took while timing, and
    the step at B0 timed again after the pilot."""
    if (spec is not None and spec.examples_per_second) or curve is None:
        return None
    size = min(config.batch_size, data.n_train)
    with others:
        retimed = time_compute(config, data, [size], os.cpu_count() or 1, parts=parts).step(size)
    return busy_reason(others.cores, curve.step(size), retimed)


def _lr(config: TrainConfig, strategy: str, pilot: Pilot, batch: int) -> float:
    scale = lr_scale(strategy, batch, pilot)
    return config.lr * scale * (pilot.batch_size / batch if config.convention == "sum" else 1.0)


def _prediction_rows(config: TrainConfig, path: Trajectory, strategy: str, counts: list[int],
                     n: int, micro_limit: int, curves: dict[int, ComputeCurve],
                     communication: dict[int, float], overlap: str,
                     busy: str | None) -> list[Row]:
    """Every candidate (P, B) with its iterations, interval and seconds (see answer.py)."""

    def iterations(batch: int) -> float:
        return predict_iterations(path.central, batch, strategy)

    def interval(batch: int) -> tuple[float, float]:
        scale = lr_scale(strategy, batch, path.central)
        ends = [predict_iterations(p, batch, strategy, scale) for p in (path.high, path.low)]
        return min(ends), max(ends)

    spread = 0.25 if busy else 0.1  # the step timing's own uncertainty (see README)
    rows = []
    for workers in counts:
        rows += candidate_rows(workers, n, micro_limit, curves[workers], communication[workers],
                               overlap, iterations, lambda b: _lr(config, strategy,
                                                                  path.central, b),
                               interval, spread)
    if not any(r.best for r in rows):
        raise BatchboundError("no batch size is predicted to reach the target")
    return rows


def _pilot_record(config: TrainConfig, run: PilotRun, path: Trajectory, planned: int | None,
                  fraction: float, goal: str) -> dict[str, Any]:
    return {
        "batch_size": config.batch_size, "lr": config.lr, "iterations": run.iterations,
        "planned_iterations": planned, "fraction": fraction if planned else None,
        "seconds": run.seconds, "estimator": run.estimator, "target": goal,
        "minimum_iterations": minimum_iterations(path.central),
        "kappa": path.kappa, "kappa_se": path.kappa_se, "loss_exponent": path.loss_exponent,
        "final_loss": list(path.final_loss) if planned else None,
        "segments": [{"start": s.start, "end": s.end, "noise_scale": s.noise, "se": s.se,
                      "loss": s.loss} for s in path.segments],
        "batch_bounds": [[i, b] for i, b in zip(path.central.bound_iterations,
                                                path.central.batch_bounds, strict=True)],
    }


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
    cores = os.cpu_count() or 1
    limit = max_workers if max_workers is not None else (spec.max_workers if spec else cores)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise BatchboundError(f"max workers must be a positive integer, got {limit!r}")
    if spec is None and limit > cores:
        raise BatchboundError(f"this machine has {cores} cores, so at most {cores} local "
                              f"workers can be timed; pass --cluster FILE to model {limit}")
    return spec, limit


def _payload(config: TrainConfig, data: Dataset, parts: Parts | None = None) -> int:
    """Bytes all-reduced per iteration: the gradient and the trainer's 3 extras."""
    model = parts.model if parts is not None and parts.model is not None else build_model(
        config.model, data.input_shape, data.num_outputs)
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
    ``one_worker`` when given (a study's recorded steps); else timed here: with every core
    for one worker, and for local P > 1 by running the real step in lockstep
    (``time_workers``), which also times the all-reduce. A cluster file models the
    all-reduce, and the compute too with examples_per_second."""
    cores = os.cpu_count() or 1
    given = one_worker
    n = data.n_train
    curves: dict[int, ComputeCurve] = {}
    communication: dict[int, float] = {}
    for workers in counts:
        if spec is None and workers > 1 and parts is not None:
            # a Python object cannot be rebuilt in fresh processes: its compute is timed here
            # with this worker's share of the cores, the all-reduce on P gloo processes
            threads = max(1, cores // workers)
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
                                                         max(1, cores // workers))
            curves[workers] = given if given is not None else timed
            continue
        if spec is not None and spec.examples_per_second:
            curves[workers] = ComputeCurve.from_rate(spec.examples_per_second)
        else:
            if one_worker is None:
                log(f"timing the step at micro-batches 1 .. {micro_limit}")
                one_worker = time_compute(config, data, micro_batch_sizes(micro_limit), cores,
                                          parts=parts)
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
_RULES = {"noise": "η(B) = η0·(1 + B_lo/B0)/(1 + B_lo/B), B_lo the pilot's lowest noise scale",
          **{name: f"η(B) = {rule.formula}" for name, rule in LR_RULES.items()}}
__all__ = ["Advice", "Cluster", "Pilot", "advise", "advise_from_study", "load_cluster",
           "predict_iterations"]
