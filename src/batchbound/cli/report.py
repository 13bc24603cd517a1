"""``batchbound report STUDY``: the HTML page and Markdown summary of a study."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from batchbound.cli.commands import SUMMARY
from batchbound.cli.common import output_dir
from batchbound.errors import BatchboundError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help=SUMMARY["report"],
        description="Analyses a study in its store (epochs to target, B*, largest B within E "
        "epochs, speedup and regimes, critical batch size, Δ along training) and writes "
        "report.html (self-contained), summary.md and figures/*.png|svg.")
    parser.add_argument("study", help="study name, spec file or preset name")
    parser.add_argument("--store", type=Path, default=None,
                        help="SQLite store; default runs/<study>/study.sqlite")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory; default runs/<study>/report")
    parser.set_defaults(func=cmd_report)


def study_name(text: str) -> str:
    """The name inside a spec file or preset, else ``text`` itself as a study's name: it
    names the folder runs/<name>/, so '..' or 'a/b' is refused, never joined into a path."""
    from batchbound.study.spec import check_study_name, load_study, resolve_study_path

    try:
        path = resolve_study_path(text)
    except BatchboundError:  # not a file or preset: a name, unless it reads as a file's path
        if "/" in text or text.endswith(".toml"):  # "not a valid name" would hide the typo
            raise
        return check_study_name(text)
    return load_study(path).name  # a file that is there: its errors are the answer


def cmd_report(args: argparse.Namespace) -> int:
    from batchbound.advise.workers import workers_table
    from batchbound.cli.study import DEFAULT_ROOT, default_store
    from batchbound.study.report import unfinished, write_report

    name = study_name(args.study)
    store = args.store or default_store(name)
    if not store.exists():
        raise BatchboundError(f"no store at {store}; run `batchbound study run` first or pass "
                              "--store")
    out = output_dir(args.out or DEFAULT_ROOT / name / "report")
    paths = write_report(store, name, out, workers=workers_table)
    print(paths.html)
    print(paths.markdown)
    warning = unfinished(paths.analysis)
    if warning:  # rendered, and says so at the top; a script sees no result
        print(f"report: {warning}", file=sys.stderr)
        return 1
    if paths.failed:  # the report says so at the top; the exit status says so to scripts
        print(f"report: {paths.failed} runs of {name} failed and are left out; rerun "
              "`batchbound study run` to retry them", file=sys.stderr)
        return 1
    return 0
