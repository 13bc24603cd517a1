"""TrainConfig: everything that defines a training run, validated before any work starts.

A run is identified by ``config.config_hash()``: the hash of its canonical dict without the
fields that only say where things live (``data_dir``). Checks that need the data set (B ≤ n,
accuracy targets only on classification, the model built on the meta device, its memory)
are in ``preflight.py``, through ``validate_against(dataset)``, which ``train()`` calls
before building the model. A field's declared ``choices`` are enforced from its metadata.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchbound.config import check_types, config_hash, to_plain
from batchbound.errors import BatchboundError
from batchbound.spec import did_you_mean
from batchbound.train.adaptive import BatchPolicy, parse_batch_policy
from batchbound.train.mechanisms import GRANULARITIES, Mechanism, parse_mechanism
from batchbound.train.optimizers import ADAPTIVE, OPTIMIZERS
from batchbound.train.probes import PROBES
from batchbound.train.schedule import Strategy, parse_strategy, strategy_help

CONVENTIONS = ("mean", "sum")
SAMPLINGS = ("epoch", "replacement")
ONLINE_MODES = ("off", "norms", "two_batch")
DEVICES = ("auto", "cpu", "cuda")
DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")  # cuda:i picks a GPU; nothing else parses
DTYPES = ("float32", "float64")
# metric -> direction: a target is reached when the metric is >= (acc) or <= (loss) threshold
TARGET_METRICS = {"train_acc": ">=", "train_loss": "<=", "test_acc": ">=", "test_loss": "<="}
# Fields that say where things are, not what the run is: left out of the hash.
NOT_HASHED = ("data_dir",)
# Fields added after stores keyed runs by config_hash(): hashed only when they differ from
# their default, so a config that leaves them alone keeps the key it had before they existed
# (and finds its stored runs and checkpoints). A new field goes here, not into the hash.
HASHED_WHEN_SET = ("snapshot_every_epochs", "final_probes", "micro_batch", "eval_growth",
                   "optimizer", "betas", "eps", "data_files", "eval_test")


@dataclass(frozen=True)
class Target:
    """Reached the first time ``metric`` is >= threshold (accuracies) or <= (losses)."""

    metric: str
    threshold: float

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or self.metric not in TARGET_METRICS:
            raise BatchboundError(
                f"unknown target metric {self.metric!r}; choose from {', '.join(TARGET_METRICS)}"
            )
        check_types(self, lambda _, problem: BatchboundError(
            f"target {self.metric} threshold: {problem}"))
        if self.metric.endswith("_acc") and not 0 < self.threshold <= 1:
            raise BatchboundError(
                f"target {self.metric} is a fraction in (0, 1], got {self.threshold} "
                "(write 0.95, not 95)"
            )
        if self.metric.endswith("_loss") and self.threshold < 0:  # never reached
            raise BatchboundError(
                f"target {self.metric} must be >= 0 (a loss is never negative), got "
                f"{self.threshold}"
            )

    @property
    def name(self) -> str:
        return f"{self.metric}{TARGET_METRICS[self.metric]}{self.threshold:g}"

    def reached(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if TARGET_METRICS[self.metric] == ">=":
            return value >= self.threshold
        return value <= self.threshold


def option(default: Any, group: str, help: str | Callable[[], str], **cli: Any) -> Any:
    """A TrainConfig field with its group and help: ``batchbound train``'s flags, their help
    and their defaults are generated from these (cli/train.py). ``cli`` holds argparse
    extras: ``flags`` (the option strings, default ``--field-name``), ``choices``,
    ``metavar``, ``parse`` (the flag's argparse type, for a field that is one string on the
    command line), or ``flags=()`` for a field the CLI sets another way. ``help`` may be a
    function, called when the help is shown (a registry's names, read then)."""
    return field(default=default, metadata={"group": group, "help": help, **cli})


def _betas(value: Any) -> Any:
    """betas as a tuple of two floats; "0.9,0.95" (the CLI's) is read as one. Anything else
    is left for check_types to refuse with the field's name."""
    if isinstance(value, str):
        try:
            value = [float(v) for v in value.split(",")]
        except ValueError:
            raise BatchboundError(f"betas is two numbers as B1,B2 (e.g. 0.9,0.95), got "
                                  f"{value!r}") from None
    if isinstance(value, list):
        value = tuple(float(v) if isinstance(v, int) and not isinstance(v, bool) else v
                      for v in value)
    return value


# The groups, in the order --help shows them.
GROUPS = {
    "data": "what is trained on",
    "optimisation": "the optimiser",
    "stopping": "targets and limits",
    "evaluation": "evaluation and monitoring",
    "mechanisms": "mechanisms and batch policy",
    "execution": "where and how it runs",
    "records": "kept for later analyses",
}


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run, in flat fields (a stored run's dict and its hash do
    not depend on the grouping); each field's group and help are in its metadata."""

    # what is trained on
    dataset: str = option("digits", "data", "data set spec (see `batchbound data list`)",
                          flags=())
    transform: str | None = option(None, "data", "data transform spec, e.g. 'replicate(r=4)'")
    data_dir: str | None = option(None, "data", "where user files live (not hashed)", flags=())
    data_files: str | None = option(None, "data", "fingerprint of the files the data set is "
                                    "read from (batchbound.data.identity), set by studies",
                                    flags=())
    model: str = option("fc(depth=2,params=4000)", "data", "model spec (see `batchbound models`), "
                        "or your own factory as MODULE:CALLABLE (e.g. mymodels:small_cnn)")
    loss: str | None = option(None, "data", "per-example loss; default by the data's task: "
                              "cross_entropy, mse, or sequence_cross_entropy for text")
    # the optimiser
    batch_size: int = option(64, "optimisation", "global batch size B, split across workers",
                             flags=("--batch-size", "-B"))
    lr: float = option(0.1, "optimisation", "base learning rate η0, which the strategy scales")
    strategy: str = option("blr", "optimisation", strategy_help)  # the registry's, at --help
    optimizer: str = option(
        "sgd", "optimisation", "sgd | adamw | adam; for adamw and adam, advise's default rate "
        "rule when the batch changes is the square root, η0·√(B/B0)", choices=tuple(OPTIMIZERS))
    momentum: float = option(0.0, "optimisation", "SGD momentum (sgd only)")
    betas: tuple[float, float] = option(
        (0.9, 0.999), "optimisation", "Adam's (β1, β2), as 0.9,0.95 (adamw and adam)",
        parse=_betas, metavar="B1,B2")
    eps: float = option(1e-8, "optimisation", "Adam's ε (adamw and adam)")
    weight_decay: float = option(0.0, "optimisation", "weight decay: L2 in the gradient for "
                                 "sgd and adam, decoupled for adamw")
    convention: str = option("mean", "optimisation",
                             "mean: w -= η·(1/B)Σg_i; sum: w -= η·Σg_i (the papers')",
                             choices=CONVENTIONS)
    sampling: str = option("epoch", "optimisation",
                           "epoch: permutations without replacement; replacement: i.i.d.",
                           choices=SAMPLINGS)
    seed: int = option(0, "optimisation", "seed for the model, the sampler and mechanisms")
    workers: int = option(1, "execution", "worker processes P (under torchrun: WORLD_SIZE)",
                          flags=("--workers", "-P"))
    micro_batch: int | None = option(
        None, "execution", "examples per micro-step: each worker accumulates its share of B "
        "in ⌈B/(P·m)⌉ micro-steps before the one all-reduce (exact; memory no longer limits "
        "B; gives two_batch micro-batches on one process)", metavar="M")
    # stopping
    targets: tuple[Target, ...] = option((), "stopping", "targets", flags=())
    stop_at_targets: bool = option(True, "stopping", "stop once every target is reached",
                                   flags=())
    max_epochs: float | None = option(100.0, "stopping", "epoch limit")
    max_iterations: int | None = option(None, "stopping", "iteration limit")
    max_seconds: float | None = option(None, "stopping",
                                         "limit on the training seconds (evaluations not counted)")
    divergence_factor: float | None = option(
        10.0, "stopping", "diverged when the batch loss exceeds this × the initial loss")
    # evaluation
    eval_every_epochs: float | None = option(0.5, "evaluation", "evaluate every k epochs")
    eval_growth: float | None = option(
        None, "evaluation", "evaluate at k, k·q, k·q², ... epochs (k: --eval-every-epochs), "
        "not every k: epochs to a target then carry the same relative resolution (q − 1) at "
        "every batch size, for far fewer evaluations", metavar="Q")
    eval_every_iterations: int | None = option(
        None, "evaluation", "evaluate every k iterations (replaces --eval-every-epochs)")
    eval_subset: int | None = option(None, "evaluation",
                                     "train metrics on this many fixed examples (default: "
                                     "all of them)")
    eval_batch_size: int = option(4096, "evaluation", "examples per evaluation chunk")
    eval_test: str = option(
        "every", "evaluation", "when to evaluate the test split: every (at each evaluation) | "
        "last (at the run's last evaluation only: where train metrics drive the run, evaluating "
        "10 000 test examples each time can cost more than the training)",
        choices=("every", "last"))
    # diversity
    diversity_every_epochs: float | None = option(
        None, "evaluation", "measure the exact Δ and n·Δ over the whole train set every k "
        "epochs ([width] uses 10)")
    online_diversity: str = option(
        "off", "evaluation", "per-iteration estimate of Δ: norms (per-example norms from the "
        "step's backward) | two_batch (small-batch against global gradients)",
        choices=ONLINE_MODES)
    mechanism: str = option("none", "mechanisms",
                            "none | dropconnect(p=..) | sgld(sigma=..) | quantization")
    mechanism_granularity: str = option(
        "worker", "mechanisms", "where the mechanism acts: example (on each example's "
        "gradient, as [diversity]'s theory; exact, costly) | worker (on each worker's summed "
        "gradient before the all-reduce, cheap)",
        flags=("--granularity",), choices=GRANULARITIES)
    batch_policy: str = option(
        "fixed", "mechanisms",
        "fixed | adaptive(delta=..,min=..,max=..,every=..[,source=online][,pick=time]) | "
        "warmup(every=..,steps=..,z=..,max=..,lr=auto or a strategy's rule) (the branch "
        "trigger) | warmup(trigger=noise,every=..,fraction=..,max=..,lr=noise or a rule)")
    # bookkeeping
    checkpoint_every: int | None = option(None, "execution",
                                          "iterations between periodic checkpoints")
    device: str = option("auto", "execution", "auto (cuda when available) | cpu | cuda[:i]")
    dtype: str = option("float32", "execution", "parameter and data dtype", choices=DTYPES)
    # kept for later analyses (both in HASHED_WHEN_SET)
    snapshot_every_epochs: float | None = option(
        None, "records", "keep the flat weights at epoch 0, every k epochs and at the end")
    final_probes: tuple[str, ...] = option(
        (), "records", f"measure at the final weights: {' | '.join(PROBES)}", metavar="PROBE")

    def __post_init__(self) -> None:
        """Normalise, then check: types, sizes, the fields' declared choices, ranges, limits,
        and the spec strings and how the fields combine; each a one-line BatchboundError."""
        if not isinstance(self.targets, (list, tuple)):
            raise BatchboundError(f"targets is a list of {{metric, threshold}}, got "
                                  f"{self.targets!r}")
        object.__setattr__(self, "targets", tuple(_target(t) for t in self.targets))
        object.__setattr__(self, "final_probes", _probes(self.final_probes))
        object.__setattr__(self, "betas", _betas(self.betas))
        # every field against its annotation first (a file's "64" or NaN), then the ranges
        check_types(self, lambda name, problem: BatchboundError(f"{name}: {problem}"))
        self._check_sizes()
        for f in dataclasses.fields(self):  # the choices the fields declare (--help shows them)
            if "choices" in f.metadata:
                _choice(f.name, getattr(self, f.name), f.metadata["choices"])
        self._warmup_defaults()
        if not DEVICE.fullmatch(self.device):
            raise BatchboundError(f"unknown device {self.device!r}; choose from "
                                  f"{', '.join(DEVICES)} or cuda:i (a GPU's index)")
        self._check_ranges()
        self._check_limits()
        self._check_combinations()

    def _check_sizes(self) -> None:
        _positive_int("batch_size", self.batch_size)
        _positive_int("workers", self.workers)
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise BatchboundError(f"lr must be a positive number, got {self.lr!r}")
        if self.workers > self.batch_size:
            raise BatchboundError(
                f"more workers ({self.workers}) than examples in the global batch "
                f"({self.batch_size}): every worker needs at least one example"
            )

    def _check_ranges(self) -> None:
        if not 0 <= self.momentum < 1:
            raise BatchboundError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise BatchboundError(f"weight_decay must be >= 0, got {self.weight_decay}")
        _check_optimizer(self)
        if len({t.name for t in self.targets}) != len(self.targets):
            raise BatchboundError("the same target is given twice")
        for name in ("max_epochs", "max_seconds", "eval_every_epochs", "diversity_every_epochs",
                     "snapshot_every_epochs"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise BatchboundError(f"{name} must be > 0 (or unset), got {value}")
        for name in ("max_iterations", "eval_every_iterations", "eval_subset", "checkpoint_every",
                     "micro_batch"):
            value = getattr(self, name)
            if value is not None:
                _positive_int(name, value)
        _positive_int("eval_batch_size", self.eval_batch_size)

    def _check_limits(self) -> None:
        """The run ends, evaluates, and can tell a divergence."""
        if self.max_epochs is None and self.max_iterations is None and self.max_seconds is None:
            raise BatchboundError(
                "no limit: set max_epochs, max_iterations or max_seconds so the run ends "
                "even when a target is never reached"
            )
        if self.eval_every_epochs is None and self.eval_every_iterations is None:
            raise BatchboundError("set eval_every_epochs or eval_every_iterations")
        if self.eval_growth is not None:
            if not (math.isfinite(self.eval_growth) and self.eval_growth > 1):
                raise BatchboundError(f"eval_growth must be > 1 (or unset), got "
                                      f"{self.eval_growth}")
            if self.eval_every_epochs is None or self.eval_every_iterations is not None:
                raise BatchboundError("eval_growth spaces evaluations in epochs: set "
                                      "eval_every_epochs (the first one) and not "
                                      "eval_every_iterations")
        if self.divergence_factor is not None and not self.divergence_factor > 1:
            raise BatchboundError(
                f"divergence_factor must be > 1 (or unset to disable), got {self.divergence_factor}"
            )

    def _check_combinations(self) -> None:
        """The spec strings parse now (a typo fails before any work) and fit together."""
        self.parsed_strategy()
        mechanism = self.parsed_mechanism()
        tested = [t.name for t in self.targets if t.metric.startswith("test_")]
        if self.eval_test == "last" and tested:
            raise BatchboundError(f"target {tested[0]} needs the test split at every evaluation;"
                                  " eval_test = 'last' evaluates it only at the end")
        if self.online_diversity != "off" and not mechanism.is_identity:
            raise BatchboundError(
                "online_diversity estimates the plain gradient's diversity and cannot be "
                "combined with a mechanism; measure a mechanism's Δ with "
                "diversity_every_epochs or batchbound.diversity.mechanisms"
            )
        policy = self.parsed_batch_policy()
        if self.micro_batch is not None and self.micro_batch >= self.batch_size and (
                not policy.adaptive):
            raise BatchboundError(
                f"micro_batch {self.micro_batch} is not below batch_size {self.batch_size}: "
                "there is nothing to accumulate; leave micro_batch unset")
        if self.online_diversity == "two_batch" and self.workers < 2 and (
                self.micro_batch is None or self.micro_batch >= self.batch_size):
            raise BatchboundError(
                "online_diversity=two_batch needs at least two small batches per step: "
                "workers >= 2, or micro_batch below batch_size")
        if policy.adaptive and policy.source == "online" and self.online_diversity == "off":
            raise BatchboundError(
                "adaptive(source=online) needs online_diversity=norms or two_batch"
            )
        if policy.adaptive and not policy.warmup and policy.min < self.workers:
            raise BatchboundError(
                f"adaptive batch min={policy.min} is below the number of workers {self.workers}"
            )

    def _warmup_defaults(self) -> None:
        """Batch-size warmup decides from the online estimate: two_batch unless one is set,
        from two micro-batches of B0/2 on one process (so that B also grows in whole
        micro-batches); its rate rule replaces the strategy's batch scaling."""
        if not self.batch_policy.startswith("warmup"):
            return
        policy = self.parsed_batch_policy()
        if not policy.warmup:
            return
        if policy.trigger == "branch":
            # plain `warmup` meant the noise trigger before the branch trigger became the
            # default, and the branch trigger tested every K steps before its cadence became
            # doubling example counts: name both, so the key differs and no stored run is
            # reused under the new meaning
            text = self.batch_policy.strip()
            for part in ("trigger=branch", "cadence=doubling"):
                if part.split("=")[0] not in text:
                    text = f"{text[:-1]},{part})" if text.endswith(")") else f"warmup({part})"
            object.__setattr__(self, "batch_policy", text)
        if parse_strategy(self.strategy).name != "blr":
            raise BatchboundError("batch policy warmup sets the rate itself (its lr= rule); "
                                  "use strategy blr")
        if self.online_diversity == "off":
            object.__setattr__(self, "online_diversity", "two_batch")
        if self.workers == 1 and self.micro_batch is None:
            if self.batch_size < 2:
                raise BatchboundError("batch policy warmup needs B0 >= 2 (two micro-batches)")
            object.__setattr__(self, "micro_batch", self.batch_size // 2)
        unit = (self.micro_batch or -(-self.batch_size // self.workers)) * self.workers
        if self.batch_size % unit:
            raise BatchboundError(f"batch policy warmup grows B in whole micro-batches: B0 = "
                                  f"{self.batch_size} must be a multiple of micro_batch × "
                                  f"workers = {unit}")

    # ---- parsed views of the spec strings -------------------------------------------------
    def parsed_strategy(self) -> Strategy:
        return parse_strategy(self.strategy)

    def parsed_mechanism(self) -> Mechanism:
        return parse_mechanism(self.mechanism)

    def parsed_batch_policy(self) -> BatchPolicy:
        return parse_batch_policy(self.batch_policy)

    # ---- checks that need the data ---------------------------------------------------------
    def validate_against(self, dataset: Any, model_given: bool = False) -> None:
        """Raise BatchboundError if this config cannot run on ``dataset`` (a Dataset):
        ``preflight.py``'s checks, the model built on the meta device and its memory
        estimated. ``model_given``: the caller trains a module of its own."""
        from batchbound.train.preflight import preflight

        preflight(self, dataset, model_given)

    # ---- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise BatchboundError(
                f"unknown train config field(s) {', '.join(unknown)}"
                f"{did_you_mean(unknown, sorted(names))}; "
                f"fields: {', '.join(sorted(names))}"
            )
        return cls(**data)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def config_hash(self) -> str:
        """Hash of the fields that define the run: NOT_HASHED left out, HASHED_WHEN_SET
        fields only when they are not at their default."""
        defaults = {f.name: to_plain(f.default) for f in dataclasses.fields(self)
                    if f.name in HASHED_WHEN_SET}
        identity = {
            k: v for k, v in self.to_dict().items()
            if k not in NOT_HASHED and not (k in defaults and v == defaults[k])
        }
        return config_hash(identity)


def _target(value: Any) -> Target:
    if isinstance(value, Target):
        return value
    if isinstance(value, dict):
        if set(value) != {"metric", "threshold"}:
            raise BatchboundError(f"a target is {{metric, threshold}}, got {value!r}")
        return Target(**value)
    if isinstance(value, (list, tuple)) and len(value) == 2:
        metric, threshold = value
        if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):
            threshold = float(threshold)
        return Target(metric, threshold)
    raise BatchboundError(f"a target is {{metric, threshold}}, got {value!r}")


def _check_optimizer(config: TrainConfig) -> None:
    """The optimiser's name and its own settings; a setting another optimiser would ignore
    is refused, not dropped."""
    _choice("optimizer", config.optimizer, tuple(OPTIMIZERS))
    if not all(0 <= b < 1 for b in config.betas):
        raise BatchboundError(f"betas must each be in [0, 1), got {config.betas}")
    if not config.eps > 0:
        raise BatchboundError(f"eps must be > 0, got {config.eps}")
    adam = config.optimizer in ADAPTIVE
    if adam and config.momentum != 0:
        raise BatchboundError(f"momentum is SGD's; {config.optimizer} uses betas "
                              "(e.g. --betas 0.9,0.95)")
    if not adam and (config.betas != (0.9, 0.999) or config.eps != 1e-8):
        raise BatchboundError("betas and eps are Adam's; set optimizer adamw or adam")
    if adam and "linear_error" in config.final_probes:  # it takes the step as SGD's
        raise BatchboundError(f"final probe linear_error measures SGD's step; it does not "
                              f"describe {config.optimizer}'s")


def _probes(value: Any) -> tuple[str, ...]:
    """final_probes as a tuple in PROBES' order (so equal sets hash alike); a string is one
    name or a comma-separated list. Unknown or repeated names raise BatchboundError."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise BatchboundError(f"final_probes is a list of probe names, got {value!r}")
    unknown = [v for v in value if v not in PROBES]
    if unknown:
        raise BatchboundError(
            f"unknown final probe(s) {', '.join(map(repr, unknown))}; choose from "
            f"{', '.join(PROBES)}"
        )
    if len(set(value)) != len(value):
        raise BatchboundError(f"a final probe is given twice: {list(value)}")
    return tuple(name for name in PROBES if name in value)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BatchboundError(f"{name} must be a positive integer, got {value!r}")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise BatchboundError(f"unknown {name} {value!r}; choose from {', '.join(choices)}")


def target_list(**thresholds: float | list[float] | None) -> tuple[Target, ...]:
    """``target_list(train_acc=[0.9, 0.95], test_acc=0.9)`` -> Targets, for the CLI and tests."""
    out: list[Target] = []
    for metric, values in thresholds.items():
        if values is None:
            continue
        for value in values if isinstance(values, (list, tuple)) else [values]:
            out.append(Target(metric, float(value)))
    return tuple(out)


__all__ = ["TARGET_METRICS", "Target", "TrainConfig", "target_list"]
