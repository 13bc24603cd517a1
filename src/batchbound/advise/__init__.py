"""``batchbound.advise``: how many workers, what batch size, how long.

``advise(config)`` runs a pilot at ``config.batch_size`` (B0) to ``config``'s first target
with exact n·Δ along the way, predicts iterations at other batch sizes from it
(``iterations.py``), times steps and all-reduces here or models them for a described cluster
(``timing.py``), and picks the time-optimal batch per worker count (``answer.py``). With
``probe=True`` it also branches short runs from the pilot (``pilot.py``): the empirical
critical batch beside n·Δ.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchbound.advise.answer import Row, best_row, finish, worker_counts
from batchbound.advise.iterations import (
    STRATEGIES,
    Pilot,
    lr_scale,
    minimum_iterations,
    predict_iterations,
)
from batchbound.advise.pilot import ProbePoint, probe, run_pilot
from batchbound.advise.study import load_study_source
from batchbound.advise.timing import (
    OVERLAPS,
    Cluster,
    ComputeCurve,
    load_cluster,
    micro_batch_sizes,
    time_compute,
    time_workers,
)
from batchbound.data import Dataset, apply_transform, load_dataset
from batchbound.errors import BatchboundError
from batchbound.models import build_model, count_parameters
from batchbound.train.config import TrainConfig
from batchbound.train.distributed import resolve_device


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
    extra: dict[str, Any] = field(default_factory=dict)
    # what the rows were computed from (not in the JSON): the pilot, and per worker count
    source: Pilot | None = field(default=None, repr=False)
    curves: dict[int, ComputeCurve] = field(default_factory=dict, repr=False)
    communication: dict[int, float] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "batch_bound": self.batch_bound if math.isfinite(self.batch_bound) else None,
            "rows": [r.to_dict() for r in self.rows],
            "recommended": {"workers": self.recommended.workers,
                            "batch_size": self.recommended.batch_size,
                            "lr": self.recommended.lr},
            "workers_stop_paying": self.workers_stop_paying,
            "assumptions": self.assumptions,
            **({"pilot": self.pilot} if self.pilot is not None else {}),
            **({"study": self.study} if self.study is not None else {}),
            **self.extra,
        }
        if self.probe is not None:
            out["probe"] = [p.to_dict() for p in self.probe]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        lines = ["| workers | batch | lr | iterations | s/iteration (compute + comm.) | "
                 "s to target | speedup | efficiency |", "|" + "---|" * 8]
        for r in self.rows:
            mark = " ←" if r is self.recommended else ""
            lines.append(
                f"| {r.workers}{mark} | {r.batch_size} | {r.lr:.4g} | {r.iterations:.0f} | "
                f"{r.seconds_per_iteration:.3g} ({r.compute_seconds:.3g} + "
                f"{r.communication_seconds:.3g}) | {r.seconds_to_target:.3g} | "
                f"{r.speedup:.2f}× | {r.efficiency:.0%} |")
        return "\n".join(lines)

    def summary(self) -> str:
        r = self.recommended
        stop = (f"beyond {self.workers_stop_paying} worker"
                f"{'s' if self.workers_stop_paying > 1 else ''}, doubling saves less than 10 %"
                if self.workers_stop_paying else "every doubling of workers in the table pays")
        where = "the pilot" if self.pilot is not None else "the study's reference runs"
        bound = (f"n·Δ over {where}: {self.batch_bound:.4g}." if math.isfinite(self.batch_bound)
                 else f"n·Δ was not measured in {where}.")
        return (f"use {r.workers} worker(s) at batch {r.batch_size} (lr {r.lr:.4g}): about "
                f"{r.iterations:.0f} iterations, {r.seconds_to_target:.3g} s to the target; "
                f"{stop}. {bound}")


def advise(
    config: TrainConfig,
    *,
    max_workers: int | None = None,
    cluster: str | Path | Cluster | None = None,
    overlap: str = "none",
    strategy: str = "noise",
    diversity_every_epochs: float = 0.1,
    with_probe: bool = False,
    probe_tolerance: float = 0.1,
    log: Callable[[str], None] = lambda _: None,
) -> Advice:
    """The advice for training ``config`` (its batch size is the pilot's B0, its lr η0, its
    first target the target). ``max_workers``: the largest P (default: this machine's
    cores, or the cluster's max_workers). ``cluster``: a cluster file or ``Cluster`` to
    model communication (and compute, with ``examples_per_second``) instead of timing it
    here. ``overlap``: ``"none"`` (batchbound's trainer) or ``"backward"`` (DDP)."""
    if not config.targets:
        raise BatchboundError("advise needs a target (--target-train-acc and the like)")
    if config.workers != 1:
        raise BatchboundError("the pilot runs on one process; leave workers at 1")
    if strategy not in STRATEGIES:
        raise BatchboundError(f"unknown strategy {strategy!r}; choose from "
                              f"{', '.join(STRATEGIES)}")
    if overlap not in OVERLAPS:
        raise BatchboundError(f"unknown overlap {overlap!r}; choose from {', '.join(OVERLAPS)}")
    if not 0 < probe_tolerance < 1:
        raise BatchboundError(f"probe tolerance must be in (0, 1), got {probe_tolerance}")
    spec, limit = _worker_limit(max_workers, cluster)

    data = load_dataset(config.dataset, config.data_dir)
    if config.transform:
        data = apply_transform(data, config.transform, config.seed)
    # evaluated 4 times per Δ measurement: the target's iteration is known to that grain
    pilot_config = config.replace(diversity_every_epochs=diversity_every_epochs,
                                  eval_every_epochs=diversity_every_epochs / 4,
                                  eval_every_iterations=None, stop_at_targets=True,
                                  targets=config.targets[:1])
    pilot_config.validate_against(data)
    device = resolve_device(config.device)
    log(f"pilot: batch {config.batch_size}, lr {config.lr:g}, to {config.targets[0].name}")
    run = run_pilot(pilot_config, data, device)
    pilot = run.pilot
    n = data.n_train
    mean_bound = pilot.mean_batch_bound()
    log(f"pilot: {pilot.iterations} iterations; n·Δ {pilot.batch_bounds[0]:.4g} at the start, "
        f"{pilot.batch_bounds[-1]:.4g} at the last measurement, {mean_bound:.4g} on average")

    def lr(batch: int) -> float:
        scale = lr_scale(strategy, batch, pilot)
        return config.lr * scale * (pilot.batch_size / batch if config.convention == "sum"
                                    else 1.0)

    micro_limit = min(n, spec.max_micro_batch if spec and spec.max_micro_batch else n)
    counts = worker_counts(limit)
    payload = _payload(config, data)
    curves, communication = _timings(config, data, spec, counts, micro_limit, payload, None,
                                     log)
    rows = _rows(counts, n, micro_limit, curves, communication, overlap,
                 lambda b: predict_iterations(pilot, b, strategy), lr)
    recommended, stop = finish(rows)
    points = None
    if with_probe:
        log("probe: branching short runs from the pilot")
        points = probe(run, pilot_config, data, device, lr, tolerance=probe_tolerance,
                       largest=micro_limit, log=log)
    assumptions = (
        f"Iterations: McCandlish et al.'s quadratic model applied step by step along a pilot "
        f"of {pilot.iterations} iterations at B0 = {pilot.batch_size}, with B_noise = n·Δ − 1 "
        f"(exact Δ every {diversity_every_epochs:g} epochs) and the pilot's lr taken as the "
        f"best at B0. Learning rate per batch: strategy '{strategy}' "
        f"({_RULES[strategy]}), constant through training (no warm-up or decay). "
        + _seconds_text(spec, overlap, payload, micro_limit, "timed on this machine"))
    return Advice(
        batch_bound=mean_bound,
        rows=rows,
        recommended=recommended,
        workers_stop_paying=stop,
        assumptions=assumptions,
        pilot={"batch_size": pilot.batch_size, "lr": pilot.lr, "iterations": pilot.iterations,
               "seconds": run.result.targets[0].seconds, "target": config.targets[0].name,
               "minimum_iterations": minimum_iterations(pilot),
               "batch_bounds": [[i, b] for i, b in zip(pilot.bound_iterations,
                                                       pilot.batch_bounds, strict=True)]},
        probe=points,
        extra={"n": n, "strategy": strategy, "overlap": overlap,
               "timing": "cluster" if spec is not None else "measured"},
        source=pilot,
        curves=curves,
        communication=communication,
    )


def advise_from_study(
    store: str | Path,
    *,
    study: str | None = None,
    model: str | None = None,
    strategy: str | None = None,
    max_workers: int | None = None,
    cluster: str | Path | Cluster | None = None,
    overlap: str = "none",
    log: Callable[[str], None] = lambda _: None,
) -> Advice:
    """The advice from a study's measured iterations to its first target and the step
    times its runs recorded (``study.py``), instead of a pilot. ``model`` is a display name
    (``L=2 K=30``), needed when the study has several; ``strategy`` likewise."""
    if overlap not in OVERLAPS:
        raise BatchboundError(f"unknown overlap {overlap!r}; choose from {', '.join(OVERLAPS)}")
    spec, limit = _worker_limit(max_workers, cluster)
    source = load_study_source(store, study, model, strategy)
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
    curves, communication = _timings(config, data, spec, counts, micro_limit, payload,
                                     source.step, log)
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
               "timing": "cluster" if spec is not None else "measured"},
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


def _payload(config: TrainConfig, data: Dataset) -> int:
    """Bytes all-reduced per iteration: the gradient and the trainer's 3 extras."""
    params = count_parameters(build_model(config.model, data.input_shape, data.num_outputs))
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
             log: Callable[[str], None]) -> tuple[dict[int, ComputeCurve], dict[int, float]]:
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
                one_worker = time_compute(config, data, micro_batch_sizes(micro_limit), cores)
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
_RULES = {
    "noise": "η(B) = η0·(1 + B_lo/B0)/(1 + B_lo/B), B_lo the pilot's lowest noise scale",
    "blr": "η(B) = η0",
    "lsr": "η(B) = η0·B/B0",
    "srsr": "η(B) = η0·√(B/B0)",
}
__all__ = ["Advice", "Cluster", "Pilot", "advise", "advise_from_study", "load_cluster",
           "predict_iterations"]
