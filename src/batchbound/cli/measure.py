"""``batchbound measure``: exact gradient diversity Δ and batch-size bound B of one or more
models on a data set's training split."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from batchbound.cli.commands import SUMMARY
from batchbound.cli.common import add_data_arguments, add_model_argument, int64
from batchbound.data import load_dataset
from batchbound.diversity import ENGINES, LOSS_NAMES, measure
from batchbound.errors import BatchboundError
from batchbound.models import build_model, count_parameters, model_shape
from batchbound.models.layers import check_task
from batchbound.models.user import is_user_spec, probe_user_model, untagged_shape
from batchbound.train.config import DEVICE, DEVICES
from batchbound.train.distributed import resolve_device

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "measure",
        help=SUMMARY["measure"],
        description=(
            "Compute S = Σ‖g_i‖², T = ‖Σg_i‖², Δ = S/T and B = n·Δ exactly over the training "
            "split, for each --model at its initialisation (set by --seed). With several "
            "models, prints one row per model."
        ),
    )
    add_data_arguments(parser)
    add_model_argument(parser, repeatable=True)
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="auto",
        help="per-example norm engine: hooks (layer rules), vmap (torch.func), loop "
        "(reference), auto (hooks, vmap for layers without a rule); default auto",
    )
    parser.add_argument(
        "--chunk-size", type=int64, default=256, help="examples per backward pass; default 256"
    )
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="float32", help="precision; default float32"
    )
    parser.add_argument("--seed", type=int64, default=0,
                        help="model initialisation seed; default 0")
    parser.add_argument("--device", default="auto",
                        help="auto (cuda when available) | cpu | cuda[:i]; default auto")
    parser.add_argument(
        "--loss",
        choices=LOSS_NAMES,
        default=None,
        help="per-example loss; default cross_entropy for classification, mse for regression, "
        "sequence_cross_entropy (a sequence's summed token losses) for text",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print JSON: one object per model (a list when several models are given)",
    )
    parser.set_defaults(func=run)


def measure_one(spec: str, dataset: Any, args: argparse.Namespace) -> dict[str, Any]:
    model = build_model(spec, dataset.input_shape, dataset.num_outputs, seed=args.seed)
    check_task(model_shape(model), dataset.task, args.dataset)
    if is_user_spec(spec):  # one example before any work: shapes named in one line
        probe_user_model(spec, model, dataset.x_train[:1], dataset.num_outputs, dataset.task)
    model.to(resolve_device(args.device))  # the data follow the model's device
    report = measure(
        model,
        dataset,
        loss=args.loss,
        chunk_size=args.chunk_size,
        engine=args.engine,
        dtype=DTYPES[args.dtype],
        progress=sys.stderr.isatty(),
    )
    shape = model_shape(model)
    depth, width = (shape.depth, shape.width) if shape else untagged_shape(model)
    return {
        "model": spec,
        "dataset": args.dataset,
        "seed": args.seed,
        "device": str(next(model.parameters()).device),
        "params": count_parameters(model),
        "depth": depth,
        "width": width,
        **report.to_dict(),
    }


def _fmt(value: float | None, digits: int = 4) -> str:
    return "inf" if value is None else f"{value:.{digits}g}"


def print_table(rows: list[dict[str, Any]], dataset: Any, args: argparse.Namespace) -> None:
    first = rows[0]
    print(
        f"data set {args.dataset}: n={first['n']} ({dataset.task}), loss {first['loss_name']}, "
        f"engine {args.engine}, {args.dtype}, seed {args.seed}"
    )
    name_width = max(5, *(len(r["model"]) for r in rows))
    header = f"{'model':<{name_width}}  {'depth':>5}  {'width':>5}  {'params':>8}  "
    print(header + f"{'Δ':>10}  {'B':>10}  {'seconds':>8}")
    for r in rows:
        print(
            f"{r['model']:<{name_width}}  {r['depth']:>5}  {r['width']:>5}  {r['params']:>8}  "
            f"{_fmt(r['diversity']):>10}  {_fmt(r['batch_bound']):>10}  {r['seconds']:>8.3f}"
        )


def run(args: argparse.Namespace) -> int:
    if not DEVICE.fullmatch(args.device):  # as train's: before the data are read
        raise BatchboundError(f"unknown device {args.device!r}; choose from "
                              f"{', '.join(DEVICES)} or cuda:i (a GPU's index)")
    dataset = load_dataset(args.dataset, args.data_dir)
    rows = [measure_one(spec, dataset, args) for spec in args.model]
    if args.json:
        print(json.dumps(rows[0] if len(rows) == 1 else rows, indent=2, allow_nan=False))
    else:
        print_table(rows, dataset, args)
    return 0
