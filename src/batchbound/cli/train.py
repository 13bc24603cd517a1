"""``batchbound train``: synchronous data-parallel SGD on one process, P local processes
(``--workers P``) or under torchrun, until targets or limits; prints epochs, iterations and
seconds to each target (``--json``: one JSON object on stdout)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from batchbound.cli.common import add_data_arguments
from batchbound.config import load_toml
from batchbound.errors import BatchboundError
from batchbound.train import RunResult, TrainConfig, target_list, train
from batchbound.train.probes import PROBES

# CLI flag dest -> TrainConfig field, for flags that map one to one
_FIELDS = {
    "dataset": "dataset",
    "data_dir": "data_dir",
    "transform": "transform",
    "model": "model",
    "loss": "loss",
    "batch_size": "batch_size",
    "lr": "lr",
    "strategy": "strategy",
    "momentum": "momentum",
    "weight_decay": "weight_decay",
    "convention": "convention",
    "sampling": "sampling",
    "seed": "seed",
    "workers": "workers",
    "max_epochs": "max_epochs",
    "max_iterations": "max_iterations",
    "max_seconds": "max_seconds",
    "eval_every_epochs": "eval_every_epochs",
    "eval_every_iterations": "eval_every_iterations",
    "eval_subset": "eval_subset",
    "divergence_factor": "divergence_factor",
    "diversity_every_epochs": "diversity_every_epochs",
    "online_diversity": "online_diversity",
    "mechanism": "mechanism",
    "granularity": "mechanism_granularity",
    "batch_policy": "batch_policy",
    "checkpoint_every": "checkpoint_every",
    "device": "device",
    "dtype": "dtype",
    "snapshot_every_epochs": "snapshot_every_epochs",
    "final_probes": "final_probes",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train with synchronous data-parallel mini-batch SGD until targets or limits",
        description=(
            "Synchronous data-parallel mini-batch SGD (seed 002): each of P workers computes "
            "gradients on its share of the global batch B, an all-reduce sums them, the model "
            "steps. Records when each target is first reached (epochs, iterations, seconds). "
            "Flags override a --config TOML file; unset flags keep TrainConfig's defaults."
        ),
    )
    parser.add_argument("--config", help="a TOML file with TrainConfig fields")
    add_data_arguments(parser)
    parser.set_defaults(dataset=None)  # unset: the --config file's, else TrainConfig's digits
    parser.add_argument("--transform", help="data transform spec, e.g. 'replicate(r=4)'")
    parser.add_argument("--model", help="model spec, e.g. 'fc(depth=2,params=4000)'")
    parser.add_argument(
        "--loss", choices=["cross_entropy", "mse"], help="per-example loss; default by task"
    )
    opt = parser.add_argument_group("optimiser")
    opt.add_argument("--batch-size", "-B", type=int, help="global batch size B (default 64)")
    opt.add_argument("--lr", type=float, help="base learning rate η0 (default 0.1)")
    opt.add_argument(
        "--strategy",
        help="blr | lsr(base_batch=m0,warmup_epochs=W) | "
        "srsr(base_batch=m0,warmup_epochs=W), optional decay=step|cosine",
    )
    opt.add_argument("--momentum", type=float, help="SGD momentum (default 0)")
    opt.add_argument("--weight-decay", type=float, help="L2 weight decay (default 0)")
    opt.add_argument(
        "--convention",
        choices=["mean", "sum"],
        help="mean: w -= γ·mean g_i (default); sum: w -= γ·Σg_i (the seeds')",
    )
    opt.add_argument(
        "--sampling",
        choices=["epoch", "replacement"],
        help="epoch: permutations (default); replacement: i.i.d. uniform",
    )
    opt.add_argument("--seed", type=int, help="seed for model, sampler and mechanisms (default 0)")
    opt.add_argument(
        "--workers",
        "-P",
        type=int,
        help="local worker processes (default 1; under torchrun: WORLD_SIZE)",
    )
    stop = parser.add_argument_group("targets and limits")
    for metric in ("train_acc", "train_loss", "test_acc", "test_loss"):
        stop.add_argument(
            f"--target-{metric.replace('_', '-')}",
            dest=f"target_{metric}",
            type=float,
            nargs="+",
            action="extend",
            metavar="X",
            help=f"stop once {metric} reaches X (several allowed: 0.9 0.95 0.99)",
        )
    stop.add_argument(
        "--no-stop-at-targets",
        action="store_true",
        help="keep training after every target is reached",
    )
    stop.add_argument("--max-epochs", type=float, help="epoch limit (default 100)")
    stop.add_argument("--max-iterations", type=int, help="iteration limit")
    stop.add_argument("--max-seconds", type=float, help="training wall-time limit")
    stop.add_argument(
        "--divergence-factor",
        type=float,
        help="diverged when the batch loss exceeds this × initial loss (default 10)",
    )
    ev = parser.add_argument_group("evaluation and monitoring")
    ev.add_argument(
        "--eval-every-epochs", type=float, help="evaluate every this many epochs (default 0.5)"
    )
    ev.add_argument("--eval-every-iterations", type=int, help="evaluate every k iterations")
    ev.add_argument("--eval-subset", type=int, help="train metrics on this many fixed examples")
    ev.add_argument(
        "--diversity-every-epochs",
        type=float,
        help="measure the exact Δ and n·Δ every this many epochs",
    )
    ev.add_argument(
        "--online-diversity",
        choices=["off", "norms", "two_batch"],
        help="cheap per-iteration diversity estimate (default off)",
    )
    ev.add_argument(
        "--snapshot-every-epochs",
        type=float,
        help="keep the flat weights (float32) at epoch 0, every this many epochs and at the end",
    )
    ev.add_argument(
        "--final-probes",
        nargs="+",
        metavar="PROBE",
        help=f"measure at the final weights: {' | '.join(PROBES)} (several allowed)",
    )
    mech = parser.add_argument_group("mechanisms and batch policy")
    mech.add_argument(
        "--mechanism", help="none | dropconnect(p=..) | sgld(sigma=..) | quantization"
    )
    mech.add_argument(
        "--granularity",
        choices=["example", "worker"],
        help="example: per-example gradients (exact, costly); worker (default)",
    )
    mech.add_argument(
        "--batch-policy",
        help="fixed | adaptive(delta=..,min=..,max=..,every=..[,source=online][,pick=time])",
    )
    run = parser.add_argument_group("running")
    run.add_argument("--checkpoint", help="checkpoint file (written periodically and on SIGTERM)")
    run.add_argument("--checkpoint-every", type=int, help="iterations between checkpoints")
    run.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    run.add_argument("--device", help="auto (cuda if available) | cpu | cuda")
    run.add_argument("--dtype", choices=["float32", "float64"], help="default float32")
    run.add_argument("--output", "-o", help="write the full RunResult (curves, timings) as JSON")
    run.add_argument(
        "--json",
        action="store_true",
        help="print a JSON summary on stdout: status, targets, final, config_hash",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_command)


def build_config(args: argparse.Namespace) -> TrainConfig:
    values: dict[str, Any] = load_toml(args.config) if args.config else {}
    for dest, name in _FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None:
            values[name] = value
    targets = target_list(
        **{
            m: getattr(args, f"target_{m}")
            for m in ("train_acc", "train_loss", "test_acc", "test_loss")
        }
    )
    if targets:
        values["targets"] = targets
    if args.no_stop_at_targets:
        values["stop_at_targets"] = False
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and args.workers is None:
        values["workers"] = world
    return TrainConfig.from_dict(values)


def run_command(args: argparse.Namespace) -> int:
    config = build_config(args)
    if args.resume and not args.checkpoint:
        raise BatchboundError("--resume needs --checkpoint PATH")
    result = train(
        config,
        checkpoint_path=args.checkpoint,
        resume=args.resume,
        progress=not args.no_progress and not args.json,
    )
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(result.to_json(indent=1))
    if args.json:
        print(json.dumps(result.summary(), allow_nan=False))
    else:
        print_human(result)
    return 1 if result.status == "failed" else 0


def print_human(result: RunResult, file: Any = None) -> None:
    out = file or sys.stdout
    final = result.final
    print(f"status: {result.status} ({result.message})", file=out)
    print(
        f"ran {final['iterations']} iterations, {final['epochs']:.2f} epochs, "
        f"{final['seconds']:.2f} s training time; B={final['batch_size']}, "
        f"workers={result.config.workers}",
        file=out,
    )
    for t in result.targets:
        if t.reached:
            print(
                f"  {t.name}: reached after {t.epoch:.2f} epochs, {t.iteration} iterations, "
                f"{t.seconds:.2f} s",
                file=out,
            )
        else:
            print(f"  {t.name}: not reached", file=out)
    shown = [k for k in ("train_loss", "train_acc", "test_loss", "test_acc") if k in final]
    when = final.get("eval_iteration", final["iterations"])
    print(
        f"last evaluation (iteration {when}): " + ", ".join(f"{k}={final[k]:.4f}" for k in shown),
        file=out,
    )
    probed = [k for k in PROBE_KEYS if k in final]
    if probed:
        print("final probes: " + ", ".join(f"{k}={final[k]:.4g}" for k in probed), file=out)
    if result.snapshots:
        print(f"snapshots: {len(result.snapshots)} (epochs {result.snapshots[0][0]:.3g} to "
              f"{result.snapshots[-1][0]:.3g})", file=out)
    print(f"config hash: {result.config_hash}", file=out)


# what print_human shows of the final probes' values
PROBE_KEYS = ("osg_mean", "osg_sd", "linear_error", "linear_error_sd", "final_lr",
              "final_train_loss")
