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
from collections.abc import Collection, Sequence
from typing import Any, NoReturn

from batchbound import __version__, kernels
from batchbound.cli.commands import COMMANDS, SUMMARY
from batchbound.errors import BatchboundError


class BadArguments(SystemExit):
    """argparse's error, already printed: SystemExit(2) to any caller but ``main``, which
    returns 2 as for every other error."""


class Parser(argparse.ArgumentParser):
    """Every batchbound parser (subcommands inherit the class): argparse's own errors, a bad
    number or a missing argument, are one line like every other error, not the usage.
    ``unrecognized_hints`` says, for a flag another command takes, why this one does not."""

    unrecognized_hints: dict[str, str] = {}  # noqa: RUF012 (read only; a command sets its own)

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
            why = [f"{flag} is {self.unrecognized_hints[flag]}" for flag in
                   dict.fromkeys(e.split("=")[0] for e in extras)
                   if flag in self.unrecognized_hints]
            self.error(f"unrecognized arguments: {' '.join(extras)}"
                       + (f" ({'; '.join(why)})" if why else ""))
        return parsed, extras


def build_parser(commands: Collection[str] = COMMANDS) -> argparse.ArgumentParser:
    """The parser, with ``commands`` fully registered (their modules imported, which imports
    torch) and the others as a name and a line, enough for ``batchbound --help``."""
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
        if name in commands:
            importlib.import_module(f"batchbound.cli.{name}").register(subparsers)
        else:
            subparsers.add_parser(name, help=SUMMARY[name], add_help=False)
    return parser


def command_in(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (the top-level
    parser has only --help and --version), None for ``batchbound --help``."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = command_in(argv)
    try:
        # only the command asked for is imported: `batchbound --help` stays free of torch
        args = build_parser([command] if command else []).parse_args(argv)
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
