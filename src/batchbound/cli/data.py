"""``batchbound data list|show``: which data sets exist, their sizes and shapes, and whether
their files are where batchbound looks for them."""

from __future__ import annotations

import argparse
import json
from typing import Any

from batchbound.cli.commands import SUMMARY
from batchbound.data import dataset_names, get_entry, load_dataset, resolve_data_dir
from batchbound.data.registry import options_of
from batchbound.spec import parse_spec


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "data",
        help=SUMMARY["data"],
        description="The data sets batchbound knows: embedded ones work offline; the others "
        "read files you have from --data-dir, else $BATCHBOUND_DATA, else "
        "~/.cache/batchbound/data (each set in DIR/<name>/ or DIR itself).",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    listing = actions.add_parser("list", help="every data set, with sizes and availability")
    show = actions.add_parser("show", help="one data set: facts, options and availability")
    show.add_argument(
        "spec", help="data set name or spec, e.g. mnist1d or 'synthetic-linear(n=500,d=20)'"
    )
    show.add_argument(
        "--load",
        action="store_true",
        help="load the set and report the actual tensors (spec options apply)",
    )
    for sub in (listing, show):
        sub.add_argument(
            "--data-dir",
            default=None,
            help="directory holding your data files; default $BATCHBOUND_DATA, "
            "else ~/.cache/batchbound/data",
        )
        sub.add_argument("--json", action="store_true", help="print JSON on stdout")
    listing.set_defaults(func=run_list)
    show.set_defaults(func=run_show)


def _shape(shape: Any) -> str:
    return "?" if shape is None else "x".join(str(s) for s in shape)


def _cell(value: Any) -> str:
    return "?" if value is None else str(value)


def _status(row: dict[str, Any]) -> str:
    if not row["available"]:
        return "missing"
    if row["embedded"]:
        return "available (embedded)"
    return "available" if row["n_train"] is not None else "give path=FILE"


def run_list(args: argparse.Namespace) -> int:
    rows = [get_entry(name).describe(args.data_dir) for name in dataset_names()]
    if args.json:
        print(
            json.dumps(
                {"data_dir": str(resolve_data_dir(args.data_dir)), "datasets": rows}, indent=2
            )
        )
        return 0
    header = ["name", "train", "test", "shape", "classes", "task", "status", "source"]
    table = [[r["name"], _cell(r["n_train"]), _cell(r["n_test"]), _shape(r["input_shape"]),
              "-" if r["task"] == "regression" else _cell(r["classes"]), _cell(r["task"]),
              _status(r),
              r["source"]] for r in rows]  # fmt: skip
    widths = [max(len(line[i]) for line in [header, *table]) for i in range(len(header) - 1)]
    for line in [header, *table]:
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False))
            + "  "
            + line[-1]
        )
    print(f"\ndata dir: {resolve_data_dir(args.data_dir)}   (? = depends on your file)")
    for r in rows:
        if not r["available"]:
            print(f"- {r['name']}: {r['reason']}")
    return 0


def run_show(args: argparse.Namespace) -> int:
    entry = get_entry(parse_spec(args.spec).name)
    info = entry.describe(args.data_dir)
    info["options"] = options_of(entry)
    if args.load:
        info["loaded"] = load_dataset(args.spec, args.data_dir).describe()
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if key == "loaded":
            print("loaded:")
            for sub_key, sub_value in value.items():
                print(f"  {sub_key}: {sub_value}")
        elif value is not None:
            print(f"{key}: {', '.join(value) if key == 'options' else value}")
    return 0
