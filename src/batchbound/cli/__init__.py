"""The ``batchbound`` command line: a thin layer that parses arguments into configs and calls
the library. Each subcommand lives in its own module with a ``register(subparsers)`` function
that adds its parser and sets ``func`` (args -> exit code).

Exit codes, the same for every command: 0 done; 1 a run failed, or a fault in the middle of
work (a full disk, a dead or silent rank: one line, what was saved is kept); 2 bad input,
refused before any work; 75 (EX_TEMPFAIL) stopped by SIGTERM or SIGINT at a checkpoint, so a
rerun (``train --resume``, ``study run``) continues; 130 interrupted outside a run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from batchbound import __version__, kernels
from batchbound.errors import BatchboundError

# Subcommand modules, in the order `batchbound --help` lists them.
COMMANDS = ["measure", "data", "models", "train", "advise", "study", "report", "demo"]


class BadArguments(SystemExit):
    """argparse's error, already printed: SystemExit(2) to any caller but ``main``, which
    returns 2 as for every other error."""


class Parser(argparse.ArgumentParser):
    """Every batchbound parser (subcommands inherit the class): argparse's own errors, a bad
    number or a missing argument, are one line like every other error, not the usage."""

    def error(self, message: str) -> NoReturn:
        command = " ".join(self.prog.split()[:2])  # "batchbound study", as BatchboundErrors
        print(f"{command}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise BadArguments(2)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras and self.get_default("func") is not None:
            # a subcommand's leftovers are its own: name it, not the top-level parser
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="batchbound",
        description=(
            "Measure gradient diversity Δ(w) and the batch-size bound B = n·Δ(w), train "
            "data-parallel at or under it, and run batch-size studies."
        ),
        epilog=(
            "Every command computes on portable CPU kernels, so the same command gives the "
            "same numbers on any x86-64 processor; set BATCHBOUND_KERNELS=native for the "
            "processor's fastest kernels (numbers may then differ between machines). Every "
            "process computes on one torch thread whatever OMP_NUM_THREADS says; set "
            "BATCHBOUND_THREADS=N for N (numbers may then differ from one thread's)."
        ),
    )
    parser.add_argument("--version", action="version", version=f"batchbound {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"batchbound.cli.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except BadArguments:
        return 2
    try:
        kernels.use()  # before the first tensor: the same numbers on every x86-64 processor
        with kernels.computing_threads():  # 1 thread (or $BATCHBOUND_THREADS), not the cores
            return int(args.func(args) or 0)
    except BatchboundError as exc:  # bad input (2), or a fault mid-work (FaultError, 1)
        print(f"batchbound {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `batchbound study plan ... | head`: the reader has had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 141  # as a shell reports a process ended by SIGPIPE
