"""``batchbound models list|describe|family``: the model families, what a spec builds, and the
width/depth table a fixed-parameter sweep ([width]) trains."""

from __future__ import annotations

import argparse
import inspect
import json
from typing import Any

from batchbound.cli.commands import SUMMARY
from batchbound.cli.common import add_data_arguments, count
from batchbound.errors import BatchboundError
from batchbound.models import (
    block_sweep,
    budget_counts_weights_only,
    describe_model,
    family_names,
    family_sweep,
    get_family,
    parse_depths,
    sweepable_families,
)
from batchbound.spec import parse_spec


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help=SUMMARY["models"],
        description="Model families addressed by spec strings such as "
        "'fc(depth=4,params=16000)' or 'resnet(blocks=[2,2,2,2],params=2e6)'. The input shape "
        "and output count come from --dataset (or --input-shape/--outputs).",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    listing = actions.add_parser("list", help="every family and its options")
    listing.add_argument("--json", action="store_true", help="print JSON on stdout")
    listing.set_defaults(func=run_list)

    describe = actions.add_parser(
        "describe", help="layers, output shapes, depth, width and parameter count of a spec")
    describe.add_argument("spec", help="model spec, e.g. 'fc(depth=3,params=16000)'")
    _add_shape_arguments(describe)
    describe.set_defaults(func=run_describe)

    family = actions.add_parser(
        "family",
        help="the width for each depth at a fixed parameter budget ([width]'s sweep)",
        description="For fc/linear, depth is the number of hidden layers and the width solves "
        "d_in·K + (L−1)·K² + K·d_out = P. For lenet/resnet the convolutional part stays fixed "
        "and the fully connected head varies (depth = hidden head layers); with --blocks, "
        "resnet instead varies blocks per chunk and solves the filter count. For cnn1d, depth "
        "is the number of convolutions.",
    )
    family.add_argument("family", help=f"one of {', '.join(sweepable_families())}")
    family.add_argument("--params", required=True, type=float,
                        help="the parameter budget P, e.g. 16000 or 2e6")
    family.add_argument("--depths", default="1-10",
                        help="depths to tabulate: a range 1-10 or a list 1,2,4,8 (default 1-10)")
    family.add_argument("--blocks", nargs="+", default=None, metavar="S1,S2,S3,S4",
                        help="resnet only: block configurations to compare, e.g. "
                        "1,1,1,1 2,2,2,2 3,3,3,3 (replaces --depths)")
    family.add_argument("--options", default="",
                        help="fixed options of the family, as in a spec, e.g. 'act=tanh' or "
                        "'width=16,norm=group'")
    family.add_argument("--count-biases", action="store_true",
                        help="fc: the budget counts biases as well as weights")
    _add_shape_arguments(family)
    family.set_defaults(func=run_family)


def _add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    add_data_arguments(parser)
    parser.add_argument("--input-shape", default=None,
                        help="input shape instead of a data set, e.g. 1,28,28 (needs --outputs)")
    parser.add_argument("--outputs", type=count(1), default=None,
                        help="number of outputs (classes) when --input-shape is given")
    parser.add_argument("--json", action="store_true", help="print JSON on stdout")


def data_shape(args: argparse.Namespace) -> tuple[tuple[int, ...], int, str]:
    """(input shape, outputs, where they came from). Registry facts are used when the data set
    is named without options; otherwise the set is loaded."""
    if args.input_shape is not None:
        if args.outputs is None:
            raise BatchboundError("--input-shape needs --outputs (the number of classes)")
        try:
            shape = tuple(int(s) for s in args.input_shape.split(","))
        except ValueError:
            shape = ()
        if not shape or min(shape) < 1:  # a zero or negative size is no input at all
            raise BatchboundError(f"bad --input-shape {args.input_shape!r}: sizes >= 1, e.g. "
                                  "1,28,28")
        return shape, args.outputs, f"input {args.input_shape}"
    from batchbound.data import get_entry, load_dataset

    parsed = parse_spec(args.dataset)
    entry = get_entry(parsed.name)
    if not parsed.kwargs and entry.input_shape is not None and entry.classes is not None:
        return tuple(entry.input_shape), int(entry.classes), args.dataset
    dataset = load_dataset(args.dataset, args.data_dir)
    return dataset.input_shape, dataset.num_outputs, args.dataset


def run_list(args: argparse.Namespace) -> int:
    rows = []
    for name in family_names():
        builder = get_family(name)
        options = [p for p in inspect.signature(builder).parameters
                   if p not in ("input_shape", "num_outputs")]
        doc = (inspect.getdoc(builder) or "").split("\n")[0]
        rows.append({"family": name, "options": options, "summary": doc})
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        print(f"{row['family']}({', '.join(row['options'])})\n    {row['summary']}")
    return 0


def run_describe(args: argparse.Namespace) -> int:
    shape, outputs, source = data_shape(args)
    description = describe_model(args.spec, shape, outputs)
    if args.json:
        print(json.dumps({**description.to_dict(), "dataset": source}, indent=2))
        return 0
    print(description.table())
    return 0


def run_family(args: argparse.Namespace) -> int:
    if not args.params.is_integer() or args.params < 1:
        raise BatchboundError(f"--params must be a positive whole number, got {args.params}")
    budget = int(args.params)
    options: dict[str, Any] = parse_spec(f"x({args.options})").kwargs if args.options else {}
    shape, outputs, source = data_shape(args)
    if args.blocks is not None:
        if args.family != "resnet":
            raise BatchboundError("--blocks compares ResNet block configurations; use it "
                                  "with the resnet family")
        configs = [parse_spec(f"x(b=[{text}])").kwargs["b"] for text in args.blocks]
        rows = block_sweep(budget, configs, shape, outputs, options=options)
    else:
        rows = family_sweep(args.family, budget, parse_depths(args.depths), shape, outputs,
                            options=options, count_biases=args.count_biases)
    if args.json:
        print(json.dumps({"family": args.family, "budget": budget, "dataset": source,
                          "input_shape": list(shape), "outputs": outputs,
                          "count_biases": args.count_biases,
                          "rows": [row.to_dict() for row in rows]}, indent=2))
        return 0
    counted = "weights + biases" if args.count_biases else (
        "weights" if budget_counts_weights_only(args.family) else "all parameters")
    print(f"{args.family} at {budget:,} parameters ({counted}); {source}: input "
          f"{'×'.join(map(str, shape))}, {outputs} outputs")
    header = f"{'depth':>5}  {'width':>7}  {'params':>12}  {'rel. error':>10}  spec"
    print(header)
    for row in rows:
        width = "-" if row.width is None else str(row.width)
        print(f"{row.depth:>5}  {width:>7}  {row.params:>12,}  {row.relative_error:>+10.2%}  "
              f"{row.spec}")
    return 0
