"""``batchbound report STUDY``: the HTML page and Markdown summary of a study."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from batchbound.errors import BatchboundError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "report", help="write a study's HTML report and Markdown summary",
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
    """A study name, or the name inside a spec file / preset."""
    from batchbound.study.spec import load_study

    try:
        return load_study(text).name
    except BatchboundError:
        return text


def cmd_report(args: argparse.Namespace) -> int:
    from batchbound.cli.study import DEFAULT_ROOT, default_store
    from batchbound.study.report import write_report

    name = study_name(args.study)
    store = args.store or default_store(name)
    if not store.exists():
        raise BatchboundError(f"no store at {store}; run `batchbound study run` first or pass "
                              "--store")
    paths = write_report(store, name, args.out or DEFAULT_ROOT / name / "report")
    print(paths.html)
    print(paths.markdown)
    if paths.failed:  # the report says so at the top; the exit status says so to scripts
        print(f"report: {paths.failed} runs of {name} failed and are left out; rerun "
              "`batchbound study run` to retry them", file=sys.stderr)
        return 1
    return 0
