"""Arguments shared by several subcommands, so they read the same everywhere."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import tempfile
import typing
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from batchbound.errors import BatchboundError
from batchbound.files import names_a_stream


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
        "list`), or your own factory as MODULE:CALLABLE (e.g. mymodels:small_cnn, imported "
        "from the current directory; called with whichever of input_shape, num_outputs and "
        "seed it names)" + ("; repeat for several models" if repeatable else ""),
    )


def output_file(path: str | Path, *, make_folders: bool = False) -> Path:
    """Fail before any work when a file cannot be written at ``path``: a folder there, a
    missing folder (unless ``make_folders``: the writer creates it) or a read-only one, so
    a result is never lost after the work is done. Returns the path."""
    target = _path(path)
    if names_a_stream(target):  # /dev/stdout, /dev/null, a FIFO: written in place, no folder
        return target
    if target.is_dir():
        raise BatchboundError(f"cannot write {path}: it is a directory; give a file path")
    _writable_folder(path, target.parent, make_folders)
    return target


def output_dir(path: str | Path) -> Path:
    """Fail before any work when ``path`` cannot become a folder of outputs (the writer
    creates it and its parents). Returns the path."""
    target = _path(path)
    if target.exists() and not target.is_dir():
        raise BatchboundError(f"cannot write into {path}: it is a file, not a directory")
    _writable_folder(path, target, make_folders=True)
    return target


def _path(path: str | Path) -> Path:
    if "\0" in str(path):
        raise BatchboundError(f"bad path {str(path)!r}: it contains a NUL byte")
    return Path(path).expanduser()


def _writable_folder(path: str | Path, folder: Path, make_folders: bool) -> None:
    """``folder`` exists (or, with ``make_folders``, its nearest existing ancestor does) and
    a file can be created in it. Probed by creating one: permission bits lie to root and
    on read-only mounts."""
    existing = folder.absolute()
    while make_folders and not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        missing = "is not a directory" if existing.exists() else "does not exist"
        raise BatchboundError(f"cannot write {path}: {existing} {missing}")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise BatchboundError(f"cannot write {path}: {existing} is not writable "
                              f"({exc.strerror or exc})") from None


def count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum`` (``--jobs``, ``--outputs``) that fits in
    64 bits."""

    def parse(text: str) -> int:
        value = int64(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def int64(text: str) -> int:
    """An argparse type: an integer that fits in 64 bits, as seeds and sizes must for torch
    and the store (a seed of 10**29 was torch's "Overflow when unpacking long long")."""
    from batchbound.config import INT64_MAX

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise argparse.ArgumentTypeError(f"{value} does not fit in a 64-bit integer (at most "
                                         f"{INT64_MAX})")
    return value


def _argument(check: Callable[[str], Path]) -> Callable[[str], Path]:
    """An argparse type from a path check: the path is checked as it is parsed, before any
    work, and its error is argparse's one line."""

    def parse(text: str) -> Path:
        try:
            return check(text)
        except BatchboundError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


writable_file = _argument(output_file)
# an output file whose writer creates its folders (a checkpoint)
creatable_file = _argument(functools.partial(output_file, make_folders=True))


# `train` and `study run` stopped by SIGTERM or SIGINT at a checkpoint: a rerun continues.
# EX_TEMPFAIL, "try again later", so a batch script tells "preempted" from "done" (0),
# "failed" (1) and "bad input" (2).
EXIT_STOPPED = 75


def add_config_flags(groups: dict[str, Any], only: Collection[str] | None = None,
                     defaults: dict[str, Any] | None = None) -> None:
    """One flag per TrainConfig field (those in ``only``, when given), from the field's
    metadata (group, help, flags, choices, metavar), its type and its default (or the
    command's own, in ``defaults``: set them on the parser too); ``dest`` is the field name
    and the parser's default None (unset: the config's own default)."""
    from batchbound.train.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        meta = f.metadata
        flags = meta.get("flags", (f"--{f.name.replace('_', '-')}",))
        if not flags or (only is not None and f.name not in only):
            continue  # set another way (--dataset, --target-*, --no-stop-at-targets)
        kind, many = (meta["parse"], False) if "parse" in meta else _flag_type(hints[f.name])
        given = (defaults or {}).get(f.name, f.default)
        default = "" if given in (None, ()) else f" (default {given})"
        text = meta["help"]() if callable(meta["help"]) else meta["help"]
        groups[meta["group"]].add_argument(
            *flags,
            dest=f.name,
            type=kind,
            nargs="+" if many else None,
            choices=meta.get("choices"),
            metavar=meta.get("metavar"),
            help=text + default,
        )


def _flag_type(hint: Any) -> tuple[type, bool]:
    """(the argparse type, whether the field is a list) for ``int | None``, ``float``,
    ``str``, ``tuple[str, ...]``."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is tuple:
        return args[0], True
    kind = args[0] if args else hint
    if kind not in (int, float, str):
        raise TypeError(f"no CLI flag type for {hint!r}")
    return kind, False
