"""From a study spec to the concrete runs it implies.

A study runs in two phases:

1. **tune**: for each (data set, model, batch size, mechanism), one run per step size on the
   grid (``tune_seeds`` seeds each). Under [width]'s rule these last ``tune_epochs``
   epochs; under ``fewest_steps`` they are full runs to the targets.
2. **final**: the chosen step size at every seed. A final run whose config equals a tuning
   run (``fewest_steps``, first seed) is the same run: same config hash, stored once.

With ``tune_at = "base_batch"`` ([inefficiency]'s strategies) the step size is tuned only at the
smallest batch size and the strategy (blr/lsr/srsr) carries it to the others. With
``tune_data = "first"`` it is tuned on the first data set only and used for every data set
(stability's neighbouring pairs share their step size).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from batchbound.errors import BatchboundError
from batchbound.study.adapter import config_key, train_fields
from batchbound.study.spec import DataSpec, StudySpec

TUNE, FINAL = "tune", "final"
Cell = tuple[str, str, int, str, str]  # data, model spec, batch size, mechanism, strategy


@dataclass(frozen=True)
class ModelShape:
    """A concrete model spec plus what the analyses group by. ``depth``/``width`` follow the
    family's convention (fc: hidden layers and their width; lenet/resnet: the head's)."""

    spec: str
    depth: int | None = None
    width: int | float | None = None
    params: int | None = None
    family: str = "fc"
    name: str | None = None  # set when the short label would not tell two shapes apart

    @property
    def label(self) -> str:
        if self.name is not None:
            return self.name
        if self.depth is None:
            return self.spec
        family = "" if self.family in ("fc", "linear") else f"{self.family} "
        return f"{family}L={self.depth}" + (f" K={self.width}" if self.width is not None else "")


@dataclass(frozen=True)
class DataInfo:
    n_train: int
    input_shape: tuple[int, ...]
    d_out: int
    task: str = "classification"
    files: str | None = None  # fingerprint of the files read (batchbound.data.identity)


@dataclass(frozen=True)
class PlannedRun:
    key: str
    role: str
    data: str
    model: ModelShape
    batch_size: int
    lr: float
    seed: int
    mechanism: str
    strategy: str
    epochs: float
    n_train: int
    fields: Mapping[str, Any] = field(compare=False, repr=False)

    def group(self) -> Cell:
        """What a tuning rule chooses a step size for."""
        return (self.data, self.model.spec, self.batch_size, self.mechanism, self.strategy)

    def labels(self) -> dict[str, Any]:
        return {
            "data": self.data,
            "model": self.model.spec,
            "model_label": self.model.label,
            "depth": self.model.depth,
            "width": self.model.width,
            "params": self.model.params,
            "batch_size": self.batch_size,
            "lr": self.lr,
            "seed": self.seed,
            "mechanism": self.mechanism,
            "strategy": self.strategy,
            "n_train": self.n_train,
        }


def data_info(data: DataSpec) -> DataInfo:
    """Load a data set once to learn n, the input shape and the output width."""
    from batchbound.data.identity import fingerprint, recording
    from batchbound.study.adapter import load_data

    with recording() as read:
        ds = load_data(data)
    return DataInfo(ds.n_train, tuple(int(s) for s in ds.input_shape), ds.num_outputs, ds.task,
                    fingerprint(read))


MAX_BUDGET_ERROR = 0.1


def model_shapes(spec: StudySpec, info: DataInfo) -> list[ModelShape]:
    """The explicit specs, or the family sweep solved for width at each depth. Every spec is
    built once on the meta device here, so a bad one fails the plan, not every run."""
    from batchbound.models import budget_counts_weights_only, describe_model, family_sweep

    models = spec.models
    if models.specs:
        shapes = []
        for text in models.specs:
            described = describe_model(text, info.input_shape, info.d_out)
            # fc/linear budgets count weights only ([width]); other families count everything
            weights_only = budget_counts_weights_only(described.family)
            shapes.append(ModelShape(text, described.depth, described.width or None,
                                     described.weights if weights_only else described.params,
                                     described.family))
        return _distinct_labels(shapes)
    rows = family_sweep(models.family, int(models.params), models.depths, info.input_shape,
                        info.d_out, options=models.options)
    # depth 0 has no width to solve; any deeper row far off the budget means it is unreachable
    missed = [r for r in rows if r.depth > 0 and abs(r.relative_error) > MAX_BUDGET_ERROR]
    if missed:
        r = missed[0]
        raise BatchboundError(
            f"study spec [models] params: the {models.family} sweep cannot meet {r.budget:,} "
            f"parameters at depth {r.depth} (closest: {r.params:,}, {r.spec}); change params "
            f"or the options that fix the rest of the network"
        )
    return [ModelShape(row.spec, row.depth, row.width, row.params, models.family)
            for row in rows]


def _distinct_labels(shapes: list[ModelShape]) -> list[ModelShape]:
    """Shapes whose short labels clash (fc(depth=2,width=36) with relu and with tanh) are
    labelled by their spec instead: the analyses group runs by label."""
    counts = Counter(shape.label for shape in shapes)
    return [replace(shape, name=shape.spec) if counts[shape.label] > 1 else shape
            for shape in shapes]


def _check_batches(spec: StudySpec, data: DataSpec, info: DataInfo) -> None:
    too_big = [b for b in spec.batch_sizes if b > info.n_train]
    if too_big:
        raise BatchboundError(
            f"study spec [batches] sizes: {too_big} exceed the {info.n_train} training examples "
            f"of {data.label}"
        )
    workers = spec.train.workers
    if any(b < workers for b in spec.batch_sizes):
        raise BatchboundError(f"study spec [train] workers: {workers} workers need every batch "
                              f"size >= {workers}")


def _run(spec: StudySpec, role: str, cell: tuple[DataSpec, ModelShape, int, str, str],
         info: DataInfo, lr: float, seed: int, epochs: float, with_targets: bool) -> PlannedRun:
    data, shape, batch, mechanism, strategy = cell
    fields = train_fields(spec, data, shape.spec, batch, lr, strategy, seed, mechanism, epochs,
                          with_targets)
    if info.files is not None:  # data read from files: their content is part of the run
        fields["data_files"] = info.files
    return PlannedRun(config_key(fields), role, data.label, shape, batch, float(lr), seed,
                      mechanism, strategy, epochs, info.n_train, fields)


@dataclass(frozen=True)
class Plan:
    spec: StudySpec
    shapes: dict[str, list[ModelShape]]
    infos: dict[str, DataInfo]

    def cells(self) -> Iterable[tuple[DataSpec, ModelShape, int, str, str]]:
        for data in self.spec.data:
            for shape in self.shapes[data.label]:
                for strategy in self.spec.lr.strategies:
                    for batch in self.spec.batch_sizes:
                        for mechanism in self.spec.train.mechanisms:
                            yield data, shape, batch, mechanism, strategy

    def tuning_runs(self) -> list[PlannedRun]:
        lr = self.spec.lr
        if lr.tuning == "none":
            return []
        full = lr.tuning == "fewest_steps"
        epochs = self.spec.train.max_epochs if full else lr.tune_epochs
        seeds = self.spec.train.seeds[: lr.tune_seeds]
        base = self.spec.batch_sizes[0]
        runs = []
        for cell in self.cells():
            if lr.tune_at == "base_batch" and cell[2] != base:
                continue
            if lr.tune_data == "first" and cell[0] != self.spec.data[0]:
                continue
            for eta in lr.grid:
                for seed in seeds:
                    runs.append(_run(self.spec, TUNE, cell, self.infos[cell[0].label], eta,
                                     seed, epochs, with_targets=full))
        return runs

    def final_runs(self, chosen: Mapping[Cell, float],
                   only_cell: Cell | None = None) -> list[PlannedRun]:
        """Final runs given the chosen step size per tuning cell (data, model, batch,
        mechanism); with ``only_cell``, just the finals that cell's η decides."""
        runs = []
        base = self.spec.batch_sizes[0]
        for grid_cell in self.cells():
            data, shape, batch, mechanism, strategy = grid_cell
            lookup_batch = base if self.spec.lr.tune_at == "base_batch" else batch
            tuned_on = self.spec.data[0] if self.spec.lr.tune_data == "first" else data
            cell = (tuned_on.label, shape.spec, lookup_batch, mechanism, strategy)
            if only_cell is not None and cell != only_cell:
                continue
            if self.spec.lr.tuning == "none":
                eta = self.spec.lr.grid[0]
            elif cell in chosen:
                eta = chosen[cell]
            else:
                raise BatchboundError(f"no tuned step size for {cell}")
            for seed in self.spec.train.seeds:
                runs.append(_run(self.spec, FINAL, grid_cell, self.infos[data.label], eta,
                                 seed, self.spec.train.max_epochs, with_targets=True))
        return runs

    def final_count(self) -> int:
        return sum(1 for _ in self.cells()) * len(self.spec.train.seeds)


def _check_kinds(shapes: list[ModelShape], data: DataSpec, info: DataInfo) -> None:
    """Token models (gpt, lstm) on text sets, the others on features, and models that fit
    in memory: fail the plan, not every run."""
    import torch

    from batchbound.models import build_model, check_fits, model_shape
    from batchbound.models.layers import check_task

    for shape in shapes:
        with torch.device("meta"):
            model = build_model(shape.spec, info.input_shape, info.d_out)
        check_task(model_shape(model), info.task, data.label)
        check_fits(shape.spec, model)  # a model too big for memory fails the plan


def make_plan(spec: StudySpec) -> Plan:
    infos, shapes = {}, {}
    for data in spec.data:
        info = data_info(data)
        _check_batches(spec, data, info)
        infos[data.label] = info
        shapes[data.label] = model_shapes(spec, info)
        _check_kinds(shapes[data.label], data, info)
    return Plan(spec, shapes, infos)


# A rough CPU cost model, calibrated on the demo (digits, 2 shared cores): forward+backward
# ≈ 6 flops per weight per example at an effective 2 GFLOP/s, a fixed cost per optimiser step
# (the trainer's bookkeeping dominates for small nets), per evaluation, and per exact Δ
# measurement (one per-example-norm pass over the training set).
FLOPS_PER_SECOND = 2e9
SECONDS_PER_STEP = 2e-3
SECONDS_PER_EVAL = 1e-2
SECONDS_PER_DIVERSITY = 0.1


def estimate_seconds(run: PlannedRun) -> float:
    """Upper-bound seconds for one run (final runs usually stop early at their target)."""
    examples = run.epochs * run.n_train
    weights = run.model.params or 10_000
    steps = examples / run.batch_size
    first, growth = float(run.fields.get("eval_every_epochs") or 1.0), run.fields.get("eval_growth")
    evals = min(steps, run.epochs / first if growth is None else
                1 + math.log(max(run.epochs / first, 1.0), float(growth)))
    every = run.fields.get("diversity_every_epochs")
    measurements = 1 + run.epochs / float(every) if every else 0.0  # one at initialisation
    return (examples * 6 * weights / FLOPS_PER_SECOND + steps * SECONDS_PER_STEP
            + evals * SECONDS_PER_EVAL + measurements * SECONDS_PER_DIVERSITY)
