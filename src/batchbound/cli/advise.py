"""``batchbound advise``: how many workers, what batch size, how long.

A pilot over the first fraction of the planned run (or to a target) estimates the noise scale
at every step; a model of iterations against batch size, extrapolated over the plan, and timed
(or described) steps and all-reduces turn it into seconds per worker count, with intervals."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

from matplotlib.backend_bases import FigureCanvasBase

from batchbound.advise import advise, advise_from_study
from batchbound.advise.figure import plot_advice
from batchbound.advise.iterations import strategies
from batchbound.advise.pilot import ESTIMATORS
from batchbound.advise.timing import OVERLAPS
from batchbound.cli.commands import SUMMARY
from batchbound.cli.common import add_config_flags, add_data_arguments, writable_file
from batchbound.errors import BatchboundError, FaultError
from batchbound.files import write_through
from batchbound.study.measured import load_advice_input
from batchbound.train import TARGET_METRICS, TrainConfig, target_list
from batchbound.train.config import GROUPS
from batchbound.train.lr_rules import rules_help

# The TrainConfig fields a pilot takes from the command line (the schema's flags and help).
# The others do not apply to a one-process pilot whose cadences advise sets itself:
# PILOT_EXCLUDED says why, and a test keeps the two lists covering every field.
PILOT_FIELDS = ("transform", "model", "loss", "batch_size", "lr", "optimizer", "momentum",
                "betas", "eps", "weight_decay",
                "convention", "sampling", "seed", "micro_batch", "max_epochs",
                "divergence_factor", "eval_subset", "eval_batch_size", "device", "dtype")
PILOT_EXCLUDED = {
    "dataset": "--dataset", "data_dir": "--data-dir", "targets": "--target-*",
    "data_files": "a study's record of the files its data came from, not a pilot's",
    "strategy": "advise's --strategy is the rate rule of its rows",
    "workers": "the pilot runs on one process; --max-workers sets the rows",
    "stop_at_targets": "set by advise", "max_iterations": "set from the plan",
    "max_seconds": "the pilot's length is the plan's fraction",
    "eval_every_epochs": "set by advise", "eval_every_iterations": "set by advise",
    "eval_growth": "set by advise (the pilot evaluates by iterations)",
    "eval_test": "the pilot reads train metrics; its test split is evaluated as the default",
    "diversity_every_epochs": "--diversity-every", "online_diversity": "--estimator",
    "mechanism": "advise predicts plain SGD", "mechanism_granularity": "as mechanism",
    "batch_policy": "the rows are fixed batches; the warmup schedule is printed beside",
    "checkpoint_every": "a pilot is not resumed", "snapshot_every_epochs": "not a pilot's",
    "final_probes": "not a pilot's",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "advise",
        help=SUMMARY["advise"],
        description=(
            "State the planned run (--planned-epochs or --planned-iterations at B0 = "
            "--batch-size) and advise trains a pilot over its first --pilot-fraction (10 % by "
            "default), estimating the gradient noise scale at every step; extrapolates it over "
            "the rest of the plan (B_noise·L continuing its trend over the pilot: constant, "
            "or rising as on language models); predicts, with an interval, the iterations "
            "each batch size needs to reach what the plan reaches (McCandlish et al.'s "
            "model, step by step); "
            "times the step and the all-reduce here, or models them for a cluster file; and "
            "prints, for P = 1, 2, 4, … workers, the time-optimal batch, its iterations and "
            "seconds, the recommended (P, B), and the worker count past which doubling saves "
            "less than 10 %. Given a target instead of a plan, the pilot trains to the target."
        ),
    )
    groups = {name: parser.add_argument_group(f"the pilot: {title}")
              for name, title in GROUPS.items()}
    add_data_arguments(groups["data"])
    # the pilot's options, from TrainConfig's schema, as `batchbound train` has them; B0 is
    # --batch-size (default 16 here) and its lr η0 is taken as the best at B0
    add_config_flags(groups, PILOT_FIELDS, defaults={"batch_size": 16})
    parser.set_defaults(batch_size=16)
    for metric in TARGET_METRICS:
        parser.add_argument(f"--target-{metric.replace('_', '-')}", dest=f"target_{metric}",
                            type=float, metavar="X", help=f"the target: {metric} reaches X")
    parser.add_argument("--planned-epochs", type=float, metavar="E",
                        help="the job you plan: E epochs at B0; the pilot trains a fraction of "
                        "it and advise predicts what reaches its end")
    parser.add_argument("--planned-iterations", type=int, metavar="K",
                        help="the job you plan: K iterations at B0 (instead of epochs)")
    parser.add_argument("--pilot-fraction", type=float, default=None, metavar="F",
                        help="the pilot trains this fraction of the plan (default: half of "
                        "--budget, or 0.1 with --critical-batch noise)")
    parser.add_argument("--budget", type=float, default=None, metavar="F",
                        help="the pilot and the branches together train at most this fraction "
                        "of the plan's examples (default 0.1, or twice --pilot-fraction); "
                        "each part's cost is printed before it starts. Every branch takes at "
                        "least 10 steps: a budget given too small for that is refused; at "
                        "the default the branches are then not run, the pilot takes the "
                        "whole budget, and the answer says so")
    parser.add_argument("--critical-batch", choices=("branches", "noise"), default="branches",
                        help="branches (default, with a plan): the critical batch measured by "
                        "short runs at B0·2^k from the pilot's states (Merrill et al. 2025) "
                        "predicts the iterations, the noise scale's prediction shown beside; "
                        "noise: from the noise scale n·Δ − 1 alone")
    parser.add_argument("--estimator", choices=ESTIMATORS, default="two_batch",
                        help="the noise scale along the pilot: two_batch (default; the step's "
                        "two micro-batches), norms (per-example norms from the step's "
                        "backward), exact (exact n·Δ over the data every --diversity-every "
                        "epochs: costly)")
    parser.add_argument("--strategy", choices=strategies(), default=None,
                        help="the learning rate at batch B: noise (default for sgd) "
                        "η0·(1+B_lo/B0)/(1+B_lo/B), B_lo the pilot's lowest noise scale "
                        "n·Δ−1 (times 1 + μ with SGD momentum μ); "
                        f"{rules_help()} (srsr is the default for --optimizer adamw "
                        "and adam). With --from-study: which of the study's "
                        "strategies to read (needed when it ran several)")
    parser.add_argument("--max-workers", "-P", type=int,
                        help="largest worker count (default: the cores advise may run on, or the "
                        "cluster file's max_workers)")
    parser.add_argument("--cluster", metavar="FILE.toml",
                        help="model a cluster: [network] bandwidth_gbytes_per_s, latency_us; "
                        "[cluster] max_workers; optional [device] examples_per_second, "
                        "max_micro_batch")
    parser.add_argument("--overlap", choices=OVERLAPS, default="none",
                        help="none: all-reduce after the backward, as batchbound train "
                        "(default); backward: overlapped with it, as DDP")
    parser.add_argument("--probe", action="store_true",
                        help="branch short runs from the pilot at B0·2^k: the empirical "
                        "critical batch beside n·Δ at 3 points")
    parser.add_argument("--probe-tolerance", type=float, default=0.1,
                        help="a batch keeps up when its loss decrease is at least (1 − this) "
                        "of B0's over the same examples (default 0.1)")
    parser.add_argument("--from-study", metavar="STORE",
                        help="use a study's measured iterations to its target and its runs' "
                        "step times instead of a pilot (the data, model, lr and target flags "
                        "are then the study's)")
    parser.add_argument("--study", help="with --from-study: the study, when the store holds "
                        "several")
    parser.add_argument("--study-model", metavar="LABEL",
                        help="with --from-study: the model as the report names it (e.g. "
                        "'L=2 K=30'), when the study has several")
    parser.add_argument("--diversity-every", "--diversity-every-epochs", type=float,
                        default=0.1, metavar="EPOCHS",
                        help="with --estimator exact: exact n·Δ every this many pilot epochs "
                        "(default 0.1); with a target, the pilot evaluates 4 times as often")
    parser.add_argument("--figure", metavar="PNG", type=figure_format,
                        help="write time to target against P here")
    parser.add_argument("--json", action="store_true", help="print the advice as JSON")
    parser.set_defaults(func=run_command)
    parser.unrecognized_hints = _train_flags_advise_does_not_take(parser)


def figure_format(text: str) -> Path:
    """``--figure``'s path, checked as it is parsed: a writable file whose suffix names a
    format matplotlib draws (none: a PNG), not a ValueError after the whole advice."""
    path = writable_file(text)
    suffix = path.suffix[1:].lower()
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise argparse.ArgumentTypeError(
            f"cannot draw {text}: .{suffix} is no figure format; end it in "
            f"{', '.join('.' + f for f in sorted(formats))} (no suffix: a PNG)")
    return path


def run_command(args: argparse.Namespace) -> int:
    targets = target_list(**{m: getattr(args, f"target_{m}")
                             for m in TARGET_METRICS})
    if args.from_study and args.probe:
        raise BatchboundError("--probe branches a pilot; it does not apply to --from-study")
    if not (math.isfinite(args.diversity_every) and args.diversity_every > 0):
        raise BatchboundError(f"--diversity-every must be a positive number of epochs, got "
                              f"{args.diversity_every:g}")  # it was named eval_every_epochs
    values = {name: getattr(args, name) for name in PILOT_FIELDS
              if getattr(args, name) is not None}
    config = TrainConfig.from_dict({**values, "dataset": args.dataset,
                                    "data_dir": args.data_dir, "targets": targets,
                                    "eval_every_epochs": args.diversity_every})

    def log(text: str) -> None:
        print(f"advise: {text}", file=sys.stderr, flush=True)

    if args.from_study:
        measured = load_advice_input(args.from_study, args.study, args.study_model,
                                     args.strategy)
        advice = advise_from_study(measured, max_workers=args.max_workers,
                                   cluster=args.cluster, overlap=args.overlap, log=log)
    else:
        advice = advise(config, planned_epochs=args.planned_epochs,
                        planned_iterations=args.planned_iterations,
                        pilot_fraction=args.pilot_fraction, estimator=args.estimator,
                        max_workers=args.max_workers, cluster=args.cluster,
                        overlap=args.overlap, strategy=args.strategy,
                        critical_batch=args.critical_batch, budget=args.budget,
                        diversity_every_epochs=args.diversity_every, with_probe=args.probe,
                        probe_tolerance=args.probe_tolerance,
                        progress=sys.stderr.isatty() and not args.json, log=log)
    if args.json:
        print(advice.to_json(), flush=True)
    else:
        _print_advice(advice)
    if args.figure:  # after the advice: a figure that cannot be written must not lose it
        try:
            write_through(args.figure, lambda tmp: plot_advice(advice, tmp), ".png")
        except OSError as exc:
            raise FaultError(f"cannot write the figure {args.figure}: {exc.strerror or exc}; "
                             "the advice is printed above") from None
        log(f"figure written to {args.figure}")
    return 0


def _print_advice(advice: Any) -> None:
    print(advice.table())
    print()
    print(advice.summary())
    if advice.warmup is not None:
        print(f"\n{advice.warmup.text()}")
    if advice.probe:
        print("\nempirical critical batch (probe) beside n·Δ:")
        for p in advice.probe:
            print(f"  epoch {p.epoch:.2f}: n·Δ = {p.batch_bound:.4g}, keeps up to "
                  f"B = {p.empirical_cbs}")
    print(f"\nassumptions: {advice.assumptions}", flush=True)


def _train_flags_advise_does_not_take(parser: argparse.ArgumentParser) -> dict[str, str]:
    """``batchbound train``'s flags for the fields a pilot does not take, each with why
    (PILOT_EXCLUDED): `advise --workers 2` says that --max-workers sets the rows."""
    taken = set(parser._option_string_actions)
    hints = {}
    for f in dataclasses.fields(TrainConfig):
        flags = f.metadata.get("flags", (f"--{f.name.replace('_', '-')}",))
        for flag in flags:
            why = PILOT_EXCLUDED.get(f.name, "")
            if why and flag not in taken:  # a flag named as the reason is advise's own
                hints[flag] = f"batchbound train's: {'use ' if why[0] == '-' else ''}{why}"
    return hints
