"""``batchbound train``: synchronous data-parallel SGD on one process, P local processes
(``--workers P``) or under torchrun, until targets or limits; prints epochs, iterations and
seconds to each target (``--json``: one JSON object on stdout)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from batchbound.cli.claim import claim_outputs
from batchbound.cli.commands import SUMMARY
from batchbound.cli.common import (
    EXIT_STOPPED,
    add_config_flags,
    add_data_arguments,
    creatable_file,
    writable_file,
)
from batchbound.config import load_toml
from batchbound.errors import BatchboundError, FaultError
from batchbound.files import write_new, write_whole
from batchbound.train import TARGET_METRICS, RunResult, TrainConfig, target_list, train
from batchbound.train.config import GROUPS
from batchbound.train.stall import DEFAULT_STALL_TIMEOUT, resume_hint
from batchbound.train.tensorboard import check_logdir, check_replaceable, write_run


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help=SUMMARY["train"],
        description=(
            "Synchronous data-parallel mini-batch SGD ([slides]): each of P workers computes "
            "gradients on its share of the global batch B, an all-reduce sums them, the model "
            "steps. Records when each target is first reached (epochs, iterations, seconds). "
            "Flags override a --config TOML file; unset flags keep TrainConfig's defaults."
        ),
    )
    parser.add_argument("--config", help="a TOML file with TrainConfig fields")
    groups = {name: parser.add_argument_group(title) for name, title in GROUPS.items()}
    add_data_arguments(groups["data"])
    parser.set_defaults(dataset=None)  # unset: the --config file's, else TrainConfig's digits
    add_config_flags(groups)
    stop = groups["stopping"]
    for metric in TARGET_METRICS:
        stop.add_argument(
            f"--target-{metric.replace('_', '-')}",
            dest=f"target_{metric}",
            type=float,
            nargs="+",
            action="extend",
            metavar="X",
            help=f"stop once {metric} reaches X (several allowed"
            + (": 0.9 0.95 0.99)" if metric.endswith("acc") else ")"),
        )
    stop.add_argument(
        "--no-stop-at-targets",
        action="store_true",
        help="keep training after every target is reached",
    )
    run = parser.add_argument_group("output")
    run.add_argument("--checkpoint", type=creatable_file,
                     help="checkpoint file (written periodically and on SIGTERM)")
    run.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    run.add_argument("--output", "-o", type=result_file,
                     help="write the full RunResult (curves, timings) as JSON; a file there "
                     "is replaced only when it holds an earlier result")
    run.add_argument("--tensorboard", metavar="DIR",
                     help="write every curve as TensorBoard scalars into DIR")
    run.add_argument(
        "--json",
        action="store_true",
        help="print a JSON summary on stdout: status, targets, final, config_hash",
    )
    run.add_argument("--no-progress", action="store_true",
                     help="no progress bar (in a log: no progress lines every 30 s)")
    run.add_argument("--stall-timeout", type=_seconds, default=DEFAULT_STALL_TIMEOUT,
                     metavar="SECONDS",
                     help="with several workers: end the run, naming the silent rank, when a "
                     "collective waits this long for it (stopped, swapped out, hung or gone); "
                     f"default {DEFAULT_STALL_TIMEOUT:g}")
    parser.set_defaults(func=run_command)


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def build_config(args: argparse.Namespace) -> TrainConfig:
    values: dict[str, Any] = load_toml(args.config, "config file") if args.config else {}
    if args.model is None:  # the file's model is used: a file never makes batchbound import
        from batchbound.models.user import refuse_module

        refuse_module(values.get("model"), f"config file {args.config}")
    for f in dataclasses.fields(TrainConfig):
        value = getattr(args, f.name, None)
        if value is not None:
            values[f.name] = value
    targets = target_list(**{m: getattr(args, f"target_{m}") for m in TARGET_METRICS})
    if targets:
        values["targets"] = targets
    if args.no_stop_at_targets:
        values["stop_at_targets"] = False
    from batchbound.train.distributed import env_world_size

    world = env_world_size()  # checked: a malformed or leftover torchrun setting is one line
    if world > 1 and args.workers is None:
        values["workers"] = world
    return TrainConfig.from_dict(values)


def run_command(args: argparse.Namespace) -> int:
    config = build_config(args)
    if args.resume and not args.checkpoint:
        raise BatchboundError("--resume needs --checkpoint PATH")
    if args.tensorboard:  # a bad directory fails now, not after the training
        check_logdir(args.tensorboard)
        check_replaceable(args.tensorboard, config.config_hash())
    from batchbound.train.distributed import env_rank

    main = env_rank() == 0  # under torchrun, rank 0 writes
    outputs = (args.checkpoint, args.output, args.tensorboard) if main else ()
    with claim_outputs(outputs):  # a second run given the same paths is refused now
        result = train(  # over an existing checkpoint without --resume: refused (train)
            config,
            checkpoint_path=args.checkpoint,
            resume=args.resume,
            keep_checkpoint=True,
            progress=not args.no_progress and not args.json,
            stall_timeout=args.stall_timeout,
        )
    if not main:
        return EXIT_STOPPED if result.status == "stopped" else 0
    # the result first: an output that cannot be written now (its folder removed during the
    # run, a full disk) must not take the printed result with it
    if args.json:
        print(json.dumps(result.summary(), allow_nan=False), flush=True)
    else:
        print_human(result)
        sys.stdout.flush()
    if args.output:
        save_output(result, args.output)
    if args.tensorboard:
        try:
            write_run(result, args.tensorboard)
        except OSError as exc:
            raise FaultError(f"cannot write the TensorBoard run into {args.tensorboard}: "
                             f"{exc.strerror or exc}; the result is printed above") from None
    if result.status == "stopped":
        print(f"stopped: {resume_hint(args.checkpoint)}", file=sys.stderr)
        return EXIT_STOPPED
    return 1 if result.status == "failed" else 0


def result_file(text: str) -> Path:
    """``--output``'s path: writable (``writable_file``), and a file already there replaced
    only when it holds an earlier run's result, not the user's own data (a study spec, a
    data file: an outside review's were overwritten with JSON)."""
    path = writable_file(text)
    if path.is_file() and path.stat().st_size and not _holds_a_result(path):
        raise argparse.ArgumentTypeError(
            f"{text} exists and holds no batchbound result; give a new path (only an "
            "earlier result is replaced)")
    return path


def _holds_a_result(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            held = json.loads(f.read(1 << 26))
    except (OSError, ValueError):
        return False
    return isinstance(held, dict) and {"config", "config_hash", "status"} <= held.keys()


def save_output(result: RunResult, path: str | Path) -> None:
    """Write ``--output`` whole or not at all (batchbound/files.py: a failed write keeps the file
    that was there); when that fails after the run, keep the result in a file of its own
    (the working directory, else the temporary folder) and say where, as a fault."""
    text = result.to_json(indent=1)
    try:
        write_whole(path, text)
        return
    except OSError as exc:
        reason = exc.strerror or str(exc)
    kept = "it was not kept anywhere else"
    for folder in (Path.cwd(), Path(tempfile.gettempdir())):
        try:
            name = write_new(folder, f"batchbound-result-{result.config_hash}-", ".json", text)
        except OSError:
            continue
        kept = f"the whole result is kept in {name}"
        break
    raise FaultError(f"cannot write {path} after the run: {reason}; the result is printed "
                     f"above and {kept}")


def print_human(result: RunResult, file: Any = None) -> None:
    out = file or sys.stdout
    final = result.final
    missed = [t.name for t in result.targets if not t.reached]
    if missed and result.status == "complete":  # it ran to its limit without them
        print(f"status: target{'s' if len(missed) > 1 else ''} missed: {', '.join(missed)} "
              f"(the run completed: {result.message})", file=out)
    else:
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
    online = result.curve("online_batch_bound")
    if online:
        print(f"online n·Δ estimate (smoothed, last iteration): {online[-1][3]:.4g}", file=out)
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
