"""Arguments shared by several subcommands, so they read the same everywhere."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from batchbound.errors import BatchboundError


def add_data_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                       default: str | None = "digits") -> None:
    parser.add_argument(
        "--dataset",
        default=default,
        required=default is None,
        help="data set spec, e.g. digits or 'synthetic-linear(n=2000,d=50)' "
        "(see `batchbound data list`)" + (f"; default {default}" if default else ""),
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="directory holding a user's data files; default $BATCHBOUND_DATA, "
        "else ~/.cache/batchbound/data",
    )


def add_model_argument(
    parser: argparse.ArgumentParser, default: str | None = None, repeatable: bool = False
) -> None:
    """``--model SPEC``; with ``repeatable`` it may be given several times (a list)."""
    parser.add_argument(
        "--model",
        default=default,
        required=default is None,
        action="append" if repeatable else "store",
        metavar="SPEC",
        help="model spec, e.g. 'fc(depth=3,params=16000,act=relu)' (see `batchbound models "
        "list`)" + ("; repeat for several models" if repeatable else ""),
    )


def check_writable(path: str) -> None:
    """Fail before any work when an output file cannot be written (its folder missing or
    read-only)."""
    folder = Path(path).expanduser().resolve().parent
    if not folder.is_dir():
        raise BatchboundError(f"cannot write {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise BatchboundError(f"cannot write {path}: folder {folder} is not writable")
