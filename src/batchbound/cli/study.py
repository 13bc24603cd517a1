"""``batchbound study plan|run|export``: batch-size studies from a TOML spec."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from batchbound.cli.commands import SUMMARY
from batchbound.cli.common import EXIT_STOPPED, count, output_dir, output_file
from batchbound.errors import BatchboundError
from batchbound.study.executor import EXECUTORS
from batchbound.study.spec import preset_names

DEFAULT_ROOT = Path("runs")


def default_store(study: str) -> Path:
    return DEFAULT_ROOT / study / "study.sqlite"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "study", help=SUMMARY["study"],
        description="Batch-size studies: a TOML spec names data sets, model shapes (or a family "
        "sweep at fixed parameter count), batch sizes, the learning-rate strategy, grid and "
        "tuning rule, targets, epochs and seeds. FILE is a path or a packaged preset name "
        f"({', '.join(preset_names())}). See docs/study.md.")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    plan = sub.add_parser("plan", help="print the runs a spec implies, with a cost estimate")
    plan.add_argument("file", help="study TOML file or preset name")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON on stdout")
    _add_data_dir(plan)
    plan.set_defaults(func=cmd_plan)

    run = sub.add_parser("run", help="run (or resume) a study into its SQLite store",
                         description="Runs every planned run not yet finished in the store, "
                         "with a pool of local processes or on Ray. Safe to rerun and to kill: "
                         "finished runs are skipped, interrupted and stopped runs resume from "
                         "their checkpoints, and the workers stop with the runner. One runner "
                         "per store: a second one on the same store is refused.")
    run.add_argument("file", help="study TOML file or preset name")
    run.add_argument("--store", type=Path, help="SQLite store; default runs/<study>/study.sqlite")
    run.add_argument("--jobs", type=count(0), default=None,
                     help="parallel runs (default: one per core; 0: inline in this process)")
    run.add_argument("--trainer", default=None,
                     help="module:function executing one run; default: batchbound's trainer")
    run.add_argument("--executor", choices=[k for k in EXECUTORS if k != "inline"],
                     default="local",
                     help="where runs execute: a pool of local processes (default), or Ray "
                     "tasks on a local Ray instance or the cluster at --address "
                     "(pip install 'batchbound[ray]')")
    run.add_argument("--address", default=None, metavar="ADDR",
                     help="with --executor ray: the cluster to join ('auto', or HOST:PORT of "
                     "the head node); default: start a local Ray instance with --jobs CPUs")
    run.add_argument("--checkpoint-dir", type=Path, default=None, metavar="DIR",
                     help="where runs keep their checkpoints; default <store>-checkpoints "
                     "beside the store. On a Ray cluster of several machines, a folder every "
                     "node mounts at the same path")
    run.add_argument("--no-progress", action="store_true",
                     help="no progress bar (in a log: no progress lines)")
    run.add_argument("--tensorboard", type=Path, metavar="DIR", default=None,
                     help="write each finished run as TensorBoard scalars into DIR/<run>/ "
                     "(runs finished earlier too); view with `tensorboard --logdir DIR`")
    _add_data_dir(run)
    run.set_defaults(func=cmd_run)

    export = sub.add_parser("export", help="write a store's tables as CSV or Parquet")
    export.add_argument("store", type=Path, help="SQLite store (runs/<study>/study.sqlite)")
    export.add_argument("--format", choices=("csv", "parquet"), default="csv",
                        help="csv (default) or parquet (pip install 'batchbound[parquet]')")
    export.add_argument("--study", default=None, help="only this study's rows")
    export.add_argument("--out", type=Path, default=None,
                        help="output directory; default <store dir>/export")
    export.set_defaults(func=cmd_export)


def _add_data_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", default=None,
                        help="directory holding your data files (sets $BATCHBOUND_DATA for "
                        "planning and every worker); default $BATCHBOUND_DATA, else "
                        "~/.cache/batchbound/data")


def _use_data_dir(args: argparse.Namespace) -> None:
    # workers inherit the environment, so one setting reaches planning and every run
    if args.data_dir is not None:
        os.environ["BATCHBOUND_DATA"] = str(Path(args.data_dir).expanduser().resolve())


def cmd_plan(args: argparse.Namespace) -> int:
    from batchbound.study.plan import estimate_seconds, make_plan
    from batchbound.study.spec import load_study

    _use_data_dir(args)
    spec = load_study(args.file)
    plan = make_plan(spec)
    tuning = plan.tuning_runs()
    # finals need tuned step sizes; plan them at the first grid value for the estimate
    first = {r.group(): r.lr for r in tuning}
    finals = plan.final_runs({c: spec.lr.grid[0] for c in first}) if tuning \
        else plan.final_runs({})
    rows = [{**r.labels(), "role": r.role, "epochs": r.epochs, "key": r.key,
             "estimate_s": round(estimate_seconds(r), 2)} for r in [*tuning, *finals]]
    total = sum(r["estimate_s"] for r in rows)
    if args.json:
        print(json.dumps({"study": spec.name, "runs": rows, "estimate_seconds": total}))
        return 0
    print(f"study {spec.name}: {len(tuning)} tuning runs + {len(finals)} final runs "
          f"(tuning rule {spec.lr.tuning}; final η chosen after tuning)")
    # columns as wide as their longest label: a cut one hid which replicate(r=..) a run used
    wd = max([4, *(len(r["data"]) for r in rows)])
    wm = max([5, *(len(r["model"]) for r in rows)])
    print(f"{'role':6} {'data':{wd}} {'model':{wm}} {'B':>5} {'η':>8} {'seed':>4} {'epochs':>6}")
    for r in rows:
        eta = f"{r['lr']:g}" if r["role"] == "tune" or not tuning else "tuned"
        print(f"{r['role']:6} {r['data']:{wd}} {r['model']:{wm}} {r['batch_size']:>5} "
              f"{eta:>8} {r['seed']:>4} {r['epochs']:>6g}")
    print(f"estimated cost: at most {total / 60:.1f} CPU-minutes (final runs stop at their "
          "targets, so usually far less)")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from batchbound.study.adapter import DEFAULT_TRAINER
    from batchbound.study.executor import make_executor
    from batchbound.study.runner import run_study
    from batchbound.study.spec import load_study

    if args.tensorboard is not None:  # before planning: no run starts into a bad DIR
        from batchbound.train.tensorboard import check_logdir

        check_logdir(args.tensorboard)
    _use_data_dir(args)
    spec = load_study(args.file)
    # the outputs before any run: a result is never lost for want of a place to write it
    store = output_file(args.store or default_store(spec.name), make_folders=True)
    if args.checkpoint_dir is not None:
        output_dir(args.checkpoint_dir)
    if args.address is not None and args.executor != "ray":
        raise BatchboundError("--address is for --executor ray")
    executor = make_executor(args.jobs, args.executor,
                             **({"address": args.address} if args.executor == "ray" else {}))
    try:
        with _stopped_by_sigterm():
            outcome = run_study(spec, store, args.jobs, trainer=args.trainer or DEFAULT_TRAINER,
                                progress=not args.no_progress, tensorboard=args.tensorboard,
                                executor=executor, checkpoints=args.checkpoint_dir)
    except _Stopped as stopped:  # the runner closed its executor: runs stopped at checkpoints
        print(f"study {spec.name}: stopped by {stopped}; the runs in progress stopped at their "
              f"checkpoints, and `study run` again resumes them; store {store}",
              file=sys.stderr)
        return EXIT_STOPPED
    stopped = f", {outcome.stopped} stopped (a rerun resumes them)" if outcome.stopped else ""
    print(f"study {spec.name}: {outcome.executed} runs executed, {outcome.skipped} already "
          f"done, {outcome.failed} failed{stopped}; store {store}", file=sys.stderr)
    if args.tensorboard is not None:
        print(f"TensorBoard: tensorboard --logdir {args.tensorboard}", file=sys.stderr)
    return 1 if outcome.failed else EXIT_STOPPED if outcome.stopped else 0


class _Stopped(Exception):
    """SIGTERM or SIGINT reached the runner (raised where it was, as Ctrl-C's
    KeyboardInterrupt is); its text is the signal's name."""


@contextmanager
def _stopped_by_sigterm() -> Iterator[None]:
    """SIGTERM and SIGINT (Ctrl-C to the group, or to one pool worker, which passes it on)
    stop the study once: further ones, from the workers being stopped, are ignored."""
    signals = (signal.SIGTERM, signal.SIGINT)

    def stop(signum: int, frame: object) -> None:
        for sig in signals:  # once: the workers are being stopped
            signal.signal(sig, signal.SIG_IGN)
        raise _Stopped(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, stop) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def cmd_export(args: argparse.Namespace) -> int:
    from batchbound.study.store import Store, export

    if not args.store.exists():
        raise BatchboundError(f"no store at {args.store}")
    own = args.store.parent / "export"
    out = output_dir(args.out or own)
    with Store(args.store, readonly=True) as store:
        paths = export(store, out, args.format, args.study, ours=out.resolve() == own.resolve())
    for path in paths:
        print(path)
    return 0
