"""The ``batchbound`` command line: a thin layer that parses arguments into configs and calls
the library. Each subcommand lives in its own module with a ``register(subparsers)`` function
that adds its parser and sets ``func`` (args -> exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from batchbound import __version__
from batchbound.errors import BatchboundError

# Subcommand modules, in the order `batchbound --help` lists them.
COMMANDS = ["measure", "data", "models", "train", "advise", "study", "report", "demo"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchbound",
        description=(
            "Measure gradient diversity Δ(w) and the batch-size bound B = n·Δ(w), train "
            "data-parallel at or under it, and run batch-size studies."
        ),
    )
    parser.add_argument("--version", action="version", version=f"batchbound {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        importlib.import_module(f"batchbound.cli.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BatchboundError as exc:
        print(f"batchbound {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
