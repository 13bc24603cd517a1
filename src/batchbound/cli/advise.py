"""``batchbound advise``: how many workers, what batch size, how long.

A pilot over the first fraction of the planned run (or to a target) estimates the noise scale
at every step; a model of iterations against batch size, extrapolated over the plan, and timed
(or described) steps and all-reduces turn it into seconds per worker count, with intervals."""

from __future__ import annotations

import argparse
import sys

from batchbound.advise import advise, advise_from_study
from batchbound.advise.figure import plot_advice
from batchbound.advise.iterations import STRATEGIES
from batchbound.advise.pilot import ESTIMATORS
from batchbound.advise.timing import OVERLAPS
from batchbound.cli.common import add_data_arguments, add_model_argument, writable_file
from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig, target_list


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "advise",
        help="how many workers and what batch size, and how long",
        description=(
            "State the planned run (--planned-epochs or --planned-iterations at B0 = "
            "--batch-size) and advise trains a pilot over its first --pilot-fraction (10 % by "
            "default), estimating the gradient noise scale at every step; extrapolates it over "
            "the rest of the plan; predicts, with an interval, the iterations each batch size "
            "needs to reach what the plan reaches (McCandlish et al.'s model, step by step); "
            "times the step and the all-reduce here, or models them for a cluster file; and "
            "prints, for P = 1, 2, 4, … workers, the time-optimal batch, its iterations and "
            "seconds, the recommended (P, B), and the worker count past which doubling saves "
            "less than 10 %. Given a target instead of a plan, the pilot trains to the target."
        ),
    )
    add_data_arguments(parser)
    add_model_argument(parser, default="fc(depth=2,params=4000)")
    parser.add_argument("--lr", type=float, default=0.1,
                        help="the pilot's learning rate η0, taken as the best at B0 "
                        "(default 0.1)")
    parser.add_argument("--batch-size", "-B", type=int, default=16,
                        help="the pilot's batch B0 (default 16)")
    for metric in ("train_acc", "train_loss", "test_acc", "test_loss"):
        parser.add_argument(f"--target-{metric.replace('_', '-')}", dest=f"target_{metric}",
                            type=float, metavar="X", help=f"the target: {metric} reaches X")
    parser.add_argument("--planned-epochs", type=float, metavar="E",
                        help="the job you plan: E epochs at B0; the pilot trains a fraction of "
                        "it and advise predicts what reaches its end")
    parser.add_argument("--planned-iterations", type=int, metavar="K",
                        help="the job you plan: K iterations at B0 (instead of epochs)")
    parser.add_argument("--pilot-fraction", type=float, default=0.1, metavar="F",
                        help="the pilot trains this fraction of the plan (default 0.1)")
    parser.add_argument("--estimator", choices=ESTIMATORS, default="two_batch",
                        help="the noise scale along the pilot: two_batch (default; the step's "
                        "two micro-batches), norms (per-example norms from the step's "
                        "backward), exact (exact n·Δ over the data every --diversity-every "
                        "epochs: costly)")
    parser.add_argument("--strategy", choices=STRATEGIES, default=None,
                        help="the learning rate at batch B: noise (default) η0·(1+B_lo/B0)/"
                        "(1+B_lo/B), B_lo the pilot's lowest noise scale n·Δ−1; blr η0; lsr "
                        "η0·B/B0; srsr η0·√(B/B0). With --from-study: which of the study's "
                        "strategies to read (needed when it ran several)")
    parser.add_argument("--max-workers", "-P", type=int,
                        help="largest worker count (default: this machine's cores, or the "
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
    parser.add_argument("--diversity-every", type=float, default=0.1, metavar="EPOCHS",
                        help="with --estimator exact: exact n·Δ every this many pilot epochs "
                        "(default 0.1); with a target, the pilot evaluates 4 times as often")
    parser.add_argument("--max-epochs", type=float, default=100.0,
                        help="the pilot's epoch limit (default 100)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--figure", metavar="PNG", type=writable_file,
                        help="write time to target against P here")
    parser.add_argument("--json", action="store_true", help="print the advice as JSON")
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    targets = target_list(**{m: getattr(args, f"target_{m}")
                             for m in ("train_acc", "train_loss", "test_acc", "test_loss")})
    if args.from_study and args.probe:
        raise BatchboundError("--probe branches a pilot; it does not apply to --from-study")
    config = TrainConfig(dataset=args.dataset, data_dir=args.data_dir, model=args.model,
                         lr=args.lr, batch_size=args.batch_size, targets=targets,
                         max_epochs=args.max_epochs, eval_every_epochs=args.diversity_every,
                         seed=args.seed, device=args.device)

    def log(text: str) -> None:
        print(f"advise: {text}", file=sys.stderr, flush=True)

    if args.from_study:
        advice = advise_from_study(args.from_study, study=args.study, model=args.study_model,
                                   strategy=args.strategy, max_workers=args.max_workers,
                                   cluster=args.cluster, overlap=args.overlap, log=log)
    else:
        if args.strategy is None:
            args.strategy = "noise"
        advice = advise(config, planned_epochs=args.planned_epochs,
                        planned_iterations=args.planned_iterations,
                        pilot_fraction=args.pilot_fraction, estimator=args.estimator,
                        max_workers=args.max_workers, cluster=args.cluster,
                        overlap=args.overlap, strategy=args.strategy,
                        diversity_every_epochs=args.diversity_every, with_probe=args.probe,
                        probe_tolerance=args.probe_tolerance,
                        progress=sys.stderr.isatty() and not args.json, log=log)
    if args.figure:
        plot_advice(advice, args.figure)
        log(f"figure written to {args.figure}")
    if args.json:
        print(advice.to_json())
        return 0
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
    print(f"\nassumptions: {advice.assumptions}")
    return 0
