"""The study spec: one TOML file naming everything a batch-size sweep varies.

A study is a grid: data sets × model shapes × batch sizes × seeds, with a learning-rate
strategy and a grid of step sizes tuned per (data set, model, batch size) by a named rule.
Every section is a frozen dataclass that validates itself; a bad key raises BatchboundError
naming the key (``[batches] sizes: ...``) before any run starts. See ``docs/study.md``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchbound.config import INT64_MAX, check_types, load_toml, to_plain
from batchbound.errors import BatchboundError
from batchbound.spec import did_you_mean, parse_spec
from batchbound.train.config import TARGET_METRICS, TrainConfig
from batchbound.train.lr_rules import LR_RULES

TUNING_RULES = {
    "lowest_loss_2_epochs": "[width]: train every η for tune_epochs (2) epochs, keep the lowest "
    "training loss",
    "fewest_steps": "Shallue et al.: keep the η that reaches the first target in the fewest "
    "iterations (ties and misses broken by the lowest final training loss)",
    "none": "no tuning: the grid must hold exactly one η",
}
# each_batch: tune η per batch size ([width]). base_batch: tune η0 at the smallest batch size
# only and let the strategy scale it ([inefficiency]'s BLR/LSR/SRSR comparison).
TUNE_AT = ("each_batch", "base_batch")
# each: tune η per data set. first: tune on the first data set and use its η for every data
# set, so that runs compared across data sets share it ([diversity]'s stability pairs train
# "the same mini-batch SGD algorithm" on two data sets that differ in one example).
TUNE_DATA = ("each", "first")


# A plan is built in memory before any run starts: bigger sweeps are split into studies.
MAX_RUNS = 100_000

# A study's name is a folder (runs/<name>/): one path component, never '.', '..' or hidden.
STUDY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def _fail(section: str, key: str, problem: str) -> BatchboundError:
    return BatchboundError(f"study spec [{section}] {key}: {problem}")


def _check_types(section: str, obj: Any) -> None:
    """Every field against its annotation, before any check does arithmetic with it."""
    check_types(obj, lambda key, problem: _fail(section, key, problem))


def check_study_name(name: Any) -> str:
    """``name`` if it can name a study's folder; else BatchboundError."""
    if not isinstance(name, str) or not STUDY_NAME.fullmatch(name):
        raise _fail("study", "name", "need 1-100 letters, digits, '-', '_' or '.', starting "
                    f"with a letter or digit (it names the study's folder), got {name!r}")
    return name


def _check_keys(section: str, table: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise BatchboundError(
            f"study spec [{section}]: unknown key(s) {', '.join(unknown)}"
            f"{did_you_mean(unknown, sorted(allowed))}; "
            f"valid keys: {', '.join(sorted(allowed))}"
        )


@dataclass(frozen=True)
class DataSpec:
    """One data set: a registry spec string plus an optional transform spec."""

    dataset: str
    transform: str | None = None

    def __post_init__(self) -> None:
        _check_types("data", self)
        parse_spec(self.dataset)
        if self.transform is not None:
            parse_spec(self.transform)

    @property
    def label(self) -> str:
        return self.dataset if self.transform is None else f"{self.dataset} | {self.transform}"


@dataclass(frozen=True)
class ModelsSpec:
    """Explicit model specs, or a family sweep at a fixed parameter count over depths."""

    specs: tuple[str, ...] = ()
    family: str | None = None
    params: int | None = None
    depths: tuple[int, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_types("models", self)
        sweep = self.family is not None
        if bool(self.specs) == sweep:
            raise _fail("models", "specs/family", "give either specs = [...] or a family sweep "
                        "(family, params, depths), not both and not neither")
        for text in self.specs:
            parse_spec(text)
        if sweep:
            if self.params is None or self.params < 1:
                raise _fail("models", "params", f"a family sweep needs params >= 1, got "
                            f"{self.params!r}")
            if not self.depths or any(d < 0 for d in self.depths):
                raise _fail("models", "depths", f"need a list of integers >= 0, got "
                            f"{list(self.depths)!r}")
            if len(set(self.depths)) != len(self.depths):
                raise _fail("models", "depths", "repeated depth")


@dataclass(frozen=True)
class LRSpec:
    """The learning-rate strategy, the step-size grid and the rule that picks from it."""

    strategies: tuple[str, ...] = ("blr",)
    grid: tuple[float, ...] = (0.1,)
    tuning: str = "lowest_loss_2_epochs"
    tune_epochs: float = 2.0
    tune_seeds: int = 1
    tune_at: str = "each_batch"
    tune_data: str = "each"

    def __post_init__(self) -> None:
        _check_types("lr", self)
        if self.tune_at not in TUNE_AT:
            raise _fail("lr", "tune_at", f"choose from {', '.join(TUNE_AT)}")
        if self.tune_data not in TUNE_DATA:
            raise _fail("lr", "tune_data", f"choose from {', '.join(TUNE_DATA)}")
        if not self.strategies or len(set(self.strategies)) != len(self.strategies):
            raise _fail("lr", "strategy", "need one strategy or a list of distinct ones")
        for text in self.strategies:
            name = parse_spec(text).name
            if name not in LR_RULES:
                raise _fail("lr", "strategy", f"unknown strategy {name!r}; choose from "
                            f"{', '.join(LR_RULES)} (e.g. 'lsr(base_batch=32,warmup_epochs=2)')")
        if not self.grid or any(not x > 0 for x in self.grid):
            raise _fail("lr", "grid", f"need a non-empty list of step sizes > 0, got "
                        f"{list(self.grid)!r}")
        if len(set(self.grid)) != len(self.grid):
            raise _fail("lr", "grid", "repeated step size")
        if self.tuning not in TUNING_RULES:
            raise _fail("lr", "tuning", f"unknown rule {self.tuning!r}; choose from "
                        f"{', '.join(TUNING_RULES)}")
        if self.tuning == "none" and len(self.grid) != 1:
            raise _fail("lr", "grid", "tuning = 'none' needs exactly one step size")
        if not self.tune_epochs > 0:
            raise _fail("lr", "tune_epochs", f"must be > 0, got {self.tune_epochs!r}")
        if self.tune_seeds < 1:
            raise _fail("lr", "tune_seeds", f"must be >= 1, got {self.tune_seeds!r}")


# The TrainSpec fields every run's TrainConfig takes under its own name (with the type its
# stored value has always had: keys hash the values), and those only runs with targets take
# (tuning runs skip Δ along training, snapshots and probes). Declared once: the spec's check
# (TrainConfig itself, at load) and the adapter's run fields both read them.
RUN_FIELDS: dict[str, Callable[[Any], Any]] = {
    "momentum": float, "weight_decay": float, "convention": str, "sampling": str,
    "workers": int, "eval_every_epochs": float, "mechanism_granularity": str,
    "stop_at_targets": bool}
FINAL_RUN_FIELDS: dict[str, Any] = {  # name: its value in a run without targets
    "diversity_every_epochs": None, "snapshot_every_epochs": None, "final_probes": []}


@dataclass(frozen=True)
class TrainSpec:
    """What every run shares: targets, budget, optimiser, cadences and execution."""

    targets: tuple[tuple[str, float], ...] = (("train_acc", 0.95),)
    max_epochs: float = 20.0
    stop_at_targets: bool = True  # false: every run lasts max_epochs (curves compared per pass)
    epochs_budget: float | None = None  # E for "largest B within E epochs"; None: max_epochs/2
    momentum: float = 0.0
    weight_decay: float = 0.0
    convention: str = "mean"
    sampling: str = "epoch"
    eval_every_epochs: float = 0.25
    diversity_every_epochs: float | None = 1.0  # 0: no exact Δ (a pass over n per measurement)
    mechanisms: tuple[str, ...] = ("none",)
    mechanism_granularity: str = "worker"  # example: [diversity]'s per-example draws (costly)
    workers: int = 1
    snapshot_every_epochs: float | None = None  # keep weights per pass (stability pairs)
    final_probes: tuple[str, ...] = ()  # measurements at the final weights (train/probes.py)
    checkpoint_every_epochs: float | None = 1.0
    repeats: int = 2
    seed: int = 0
    # any other TrainConfig field, passed to every run only when set (so stored keys stay)
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_types("train", self)
        if not self.targets:
            raise _fail("train", "targets", "need at least one target, e.g. {train_acc = 0.95}")
        for metric, _ in self.targets:
            if metric not in TARGET_METRICS:
                raise _fail("train", "targets", f"unknown metric {metric!r}; choose from "
                            f"{', '.join(TARGET_METRICS)}")
        if self.workers < 1:
            raise _fail("train", "workers", f"must be >= 1, got {self.workers!r}")
        if self.repeats < 1:
            raise _fail("train", "repeats", f"must be >= 1, got {self.repeats!r}")
        if self.seed + self.repeats - 1 > INT64_MAX:
            raise _fail("train", "seed", f"seeds {self.seed} to {self.seed + self.repeats - 1} "
                        f"do not fit in a 64-bit integer (at most {INT64_MAX})")
        if not self.mechanisms:
            raise _fail("train", "mechanisms", "need at least one, e.g. ['none']")
        self._check_with_trainer()
        if self.epochs_budget is not None and not 0 < self.epochs_budget <= self.max_epochs:
            raise _fail("train", "epochs_budget", f"must be in (0, max_epochs], got "
                        f"{self.epochs_budget!r}")
        if self.checkpoint_every_epochs is not None and not self.checkpoint_every_epochs > 0:
            raise _fail("train", "checkpoint_every_epochs", "must be > 0 (or omitted)")

    def _check_with_trainer(self) -> None:
        """The values every run's TrainConfig gets are checked by TrainConfig itself (limits,
        cadences, target ranges, momentum, convention, probes, mechanisms), once, now, and
        not only when a run starts."""
        for mechanism in self.mechanisms:
            try:
                TrainConfig(**self.run_fields(with_targets=True), max_epochs=self.max_epochs,
                            mechanism=mechanism, batch_size=self.workers, seed=self.seed,
                            **self.overrides)
            except BatchboundError as exc:
                raise BatchboundError(f"study spec [train]: {exc}") from None

    def run_fields(self, with_targets: bool) -> dict[str, Any]:
        """The TrainConfig fields this spec gives every run (``RUN_FIELDS``, and with
        targets ``FINAL_RUN_FIELDS``); a run's own (data, model, B, η, strategy, seed,
        epochs, mechanism) come from the plan, the spec's other fields from ``overrides``."""
        out = {name: kind(getattr(self, name)) for name, kind in RUN_FIELDS.items()}
        out["targets"] = ([{"metric": m, "threshold": float(t)} for m, t in self.targets]
                          if with_targets else [])
        for name, without in FINAL_RUN_FIELDS.items():
            value = getattr(self, name) if with_targets else without
            out[name] = list(value) if isinstance(value, tuple) else value
        if out["diversity_every_epochs"] == 0:  # TOML has no None: 0 turns the exact Δ off
            out["diversity_every_epochs"] = None
        return out

    @property
    def budget(self) -> float:
        return self.epochs_budget if self.epochs_budget is not None else self.max_epochs / 2

    @property
    def seeds(self) -> tuple[int, ...]:
        return tuple(range(self.seed, self.seed + self.repeats))


@dataclass(frozen=True)
class StudySpec:
    name: str
    data: tuple[DataSpec, ...]
    models: ModelsSpec
    batch_sizes: tuple[int, ...]
    lr: LRSpec = LRSpec()
    train: TrainSpec = TrainSpec()
    description: str = ""

    def __post_init__(self) -> None:
        check_study_name(self.name)
        if not isinstance(self.description, str):
            raise _fail("study", "description", f"expected a string, got {self.description!r}")
        if not self.data:
            raise _fail("data", "datasets", "need at least one data set")
        sizes = self.batch_sizes
        if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1
                            for b in sizes):
            raise _fail("batches", "sizes", f"need a list of integers >= 1, got {sizes!r}")
        labels = [d.label for d in self.data]
        if len(set(labels)) != len(labels):
            raise _fail("data", "datasets", "the same data set is listed twice")
        if len(set(sizes)) != len(sizes):
            raise _fail("batches", "sizes", "repeated batch size")
        if list(sizes) != sorted(sizes):
            raise _fail("batches", "sizes", "list them in increasing order")
        tuning, final = self.run_count()
        if tuning + final > MAX_RUNS:
            raise BatchboundError(
                f"study spec plans {tuning + final:,} runs ({tuning:,} tuning + {final:,} "
                f"final: {self.cell_count():,} grid cells × {self.train.repeats:,} repeats); "
                f"a study holds at most {MAX_RUNS:,}: fewer repeats, batch sizes, models or "
                "step sizes, or split it into several studies")

    def cell_count(self) -> int:
        """Data sets × models × strategies × batch sizes × mechanisms."""
        models = len(self.models.specs) or len(self.models.depths)
        return (len(self.data) * models * len(self.lr.strategies) * len(self.batch_sizes)
                * len(self.train.mechanisms))

    def run_count(self) -> tuple[int, int]:
        """(tuning runs, final runs) the plan will hold, counted without building it (a
        final that repeats a tuning run's config is counted twice: an upper bound)."""
        cells, lr = self.cell_count(), self.lr
        tuned = cells // len(self.batch_sizes) if lr.tune_at == "base_batch" else cells
        tuned = tuned // len(self.data) if lr.tune_data == "first" else tuned
        tuning = 0 if lr.tuning == "none" else tuned * len(lr.grid) * min(
            lr.tune_seeds, self.train.repeats)
        return tuning, cells * self.train.repeats

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)


def _batch_sizes(table: dict[str, Any]) -> tuple[int, ...]:
    _check_keys("batches", table, {"sizes", "min", "max"})
    if "sizes" in table:
        if "min" in table or "max" in table:
            raise _fail("batches", "sizes", "give sizes = [...] or min/max powers of two, not both")
        return _list("batches", "sizes", table["sizes"])
    if "min" not in table or "max" not in table:
        raise _fail("batches", "sizes", "give sizes = [...] or min = 2^a and max = 2^b")
    low, high = table["min"], table["max"]
    for key, value in (("min", low), ("max", high)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1 or (
                value & (value - 1)):
            raise _fail("batches", key, f"must be a power of two, got {value!r}")
    if low > high:
        raise _fail("batches", "min", f"min {low} is above max {high}")
    return tuple(2**k for k in range(low.bit_length() - 1, high.bit_length()))


def _targets(value: Any) -> tuple[tuple[str, float], ...]:
    """``{train_acc = 0.95}`` or several thresholds per metric, ``{train_acc = [0.9, 0.95]}``;
    each (metric, threshold) is a target of its own, analysed on its own."""
    if not isinstance(value, dict):
        raise _fail("train", "targets", "write a table, e.g. targets = {train_acc = 0.95}")
    out = []
    for metric, given in value.items():
        thresholds = given if isinstance(given, list) else [given]
        if not thresholds:
            raise _fail("train", "targets", f"{metric} has an empty list of thresholds")
        for threshold in thresholds:
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
                raise _fail("train", "targets", f"{metric} threshold must be a number, got "
                            f"{threshold!r}")
            if (str(metric), float(threshold)) in out:
                raise _fail("train", "targets", f"{metric} = {threshold:g} is given twice")
            out.append((str(metric), float(threshold)))
    return tuple(out)


def _lr(table: dict[str, Any]) -> LRSpec:
    """``strategy`` is one spec string or a list (a grid dimension, for comparisons)."""
    table = dict(table)
    strategies = _strings("lr", "strategy", table.pop("strategy", "blr"))
    if "grid" in table:
        table["grid"] = _list("lr", "grid", table["grid"])
    return LRSpec(strategies=strategies, **table)


def _list(section: str, key: str, value: Any) -> tuple[Any, ...]:
    """A TOML array as a tuple; anything else (a string is iterable too) is refused here."""
    if not isinstance(value, list):
        raise _fail(section, key, f"expected a list, e.g. [1, 2], got {value!r}")
    return tuple(value)


def _strings(section: str, key: str, value: Any) -> tuple[Any, ...]:
    """Spec strings: one string or a list of them."""
    return (value,) if isinstance(value, str) else _list(section, key, value)


def _table(section: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BatchboundError(f"study spec [{section}]: expected a table, got {value!r}")
    return dict(value)


def _params(value: Any) -> Any:
    """A parameter budget; TOML reads 4e3 as a float, which means the integer 4000."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _data(entry: Any) -> DataSpec:
    if isinstance(entry, str):
        return DataSpec(entry)
    if isinstance(entry, dict):
        _check_keys("data", entry, {"dataset", "transform"})
        if "dataset" not in entry:
            raise _fail("data", "datasets", f"entry {entry!r} has no dataset = '...'")
        return DataSpec(entry["dataset"], entry.get("transform"))
    raise _fail("data", "datasets", f"each entry is a spec string or a table, got {entry!r}")


# TrainConfig fields a study sets per run from its grid, never from [train]
GRID_FIELDS = {"dataset": "[data]", "transform": "[data]", "data_dir": "--data-dir",
               "model": "[models]", "batch_size": "[batches]", "lr": "[lr]",
               "strategy": "[lr] strategy", "mechanism": "[train] mechanisms",
               "targets": "[train] targets",
               "data_files": "the data's files (batchbound.data.identity)"}


def _train_overrides(table: dict[str, Any]) -> dict[str, Any]:
    """[train]: TrainSpec's own keys, and any other TrainConfig field as an override that
    TrainConfig itself validates (one schema); the grid's fields are refused here."""
    own = {f for f in TrainSpec.__dataclass_fields__ if f != "overrides"}
    config = set(TrainConfig.__dataclass_fields__)
    for key in table:
        if key in GRID_FIELDS and key not in own:
            raise _fail("train", key, f"set by the study's grid ({GRID_FIELDS[key]}), not "
                        "[train]")
    _check_keys("train", table, own | (config - set(GRID_FIELDS)))
    overrides = {k: table.pop(k) for k in list(table) if k not in own}
    return {**table, **({"overrides": overrides} if overrides else {})}


def study_from_dict(raw: dict[str, Any]) -> StudySpec:
    """Build and validate a StudySpec from the parsed TOML tables."""
    _check_keys("top level", raw, {"study", "data", "models", "batches", "lr", "train"})
    for section in ("study", "data", "models", "batches"):
        if section not in raw:
            raise BatchboundError(f"study spec: missing section [{section}]")
    study = _table("study", raw["study"])
    _check_keys("study", study, {"name", "description"})
    data = _table("data", raw["data"])
    _check_keys("data", data, {"datasets"})
    datasets = data.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise _fail("data", "datasets", "need a list of data set specs, e.g. ['digits'] or "
                    "[{dataset = 'digits', transform = 'replicate(k=2)'}]")
    models = _table("models", raw["models"])
    _check_keys("models", models, {"specs", "family", "params", "depths", "options"})
    lr = _table("lr", raw.get("lr", {}))
    _check_keys("lr", lr, {"strategy", "grid", "tuning", "tune_epochs", "tune_seeds", "tune_at",
                           "tune_data"})
    train = _train_overrides(_table("train", raw.get("train", {})))
    if "targets" in train:
        train["targets"] = _targets(train["targets"])
    for key in ("mechanisms", "final_probes"):
        if key in train:
            train[key] = _strings("train", key, train[key])
    return StudySpec(
        name=study.get("name", ""),
        description=study.get("description", ""),
        data=tuple(_data(d) for d in datasets),
        models=ModelsSpec(
            specs=_strings("models", "specs", models.get("specs", [])),
            family=models.get("family"),
            params=_params(models.get("params")),
            depths=_list("models", "depths", models.get("depths", [])),
            options=models.get("options", {}),
        ),
        batch_sizes=_batch_sizes(_table("batches", raw["batches"])),
        lr=_lr(lr),
        train=TrainSpec(**train),
    )


def load_study(path: str | Path) -> StudySpec:
    """Read a study TOML file, or a packaged preset by name (see ``preset_names()``)."""
    return study_from_dict(load_toml(resolve_study_path(path), "study spec"))


def _presets_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "presets"


def preset_names() -> list[str]:
    return sorted(p.stem for p in _presets_dir().glob("*.toml"))


def resolve_study_path(path: str | Path) -> Path:
    """A file path, or the name of a packaged preset (``width-depth-digits``)."""
    candidate = Path(path)
    if candidate.exists() and not candidate.is_dir():
        return candidate
    preset = _presets_dir() / f"{path}.toml"
    if STUDY_NAME.fullmatch(str(path)) and preset.exists():  # a name, never ../x
        return preset
    if candidate.is_dir():
        raise BatchboundError(f"study spec {path} is a directory, not a TOML file")
    raise BatchboundError(
        f"no study file {str(path)!r} and no preset of that name; presets: "
        f"{', '.join(preset_names()) or 'none'}"
    )
