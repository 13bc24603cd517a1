"""``batchbound demo``: the packaged width-vs-depth study, end to end, in a few minutes."""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import time
from pathlib import Path

from batchbound.cli.commands import SUMMARY
from batchbound.cli.common import count, output_dir, output_file

PRESET = "width-depth-digits"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help=SUMMARY["demo"],
        description="Runs the packaged preset study width-depth-digits (fully connected ReLU "
        "nets of ~4000 weights at depths 1, 2, 3, 4 and 6 on the embedded digits, batch sizes "
        "16-1024, η tuned per (shape, B), three seeds, each run to 95 % training accuracy "
        "within 30 epochs: 245 runs, a few minutes on 2 cores), writes its report, and prints "
        "per shape: depth, width, Δ, B = nΔ, the threshold B*, the largest B within E "
        "epochs (15 here), and the study's critical batch size. Resumable: rerunning reuses "
        "finished runs.")
    parser.add_argument("--preset", default=PRESET, help=f"study preset or file; default {PRESET}")
    parser.add_argument("--store", type=Path, default=None,
                        help="SQLite store; default runs/<study>/study.sqlite")
    parser.add_argument("--out", type=Path, default=None,
                        help="report directory; default runs/<study>/report")
    parser.add_argument("--jobs", type=count(0), default=None,
                        help="parallel runs; default one per core")
    parser.add_argument("--fresh", action="store_true", help="delete the store first")
    parser.add_argument("--trainer", default=None, help=argparse.SUPPRESS)
    parser.set_defaults(func=cmd_demo)


def _cell(value: object, digits: str = ".3g") -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "–"
        if math.isinf(value):
            return "∞"
        return format(value, digits)
    return str(value)


def cmd_demo(args: argparse.Namespace) -> int:
    from batchbound.advise.workers import workers_table
    from batchbound.cli.study import DEFAULT_ROOT, default_store
    from batchbound.study import analysis as A
    from batchbound.study.adapter import DEFAULT_TRAINER
    from batchbound.study.report import critical_text, write_report
    from batchbound.study.runner import checkpoint_root, run_study
    from batchbound.study.spec import load_study

    start = time.perf_counter()
    spec = load_study(args.preset)
    # the outputs first: a bad one fails before the store is deleted or a run starts
    store = output_file(args.store or default_store(spec.name), make_folders=True)
    out = output_dir(args.out or DEFAULT_ROOT / spec.name / "report")
    if args.fresh:
        for path in (store, Path(f"{store}-wal"), Path(f"{store}-shm")):
            path.unlink(missing_ok=True)
        shutil.rmtree(checkpoint_root(store), ignore_errors=True)
    print(f"demo: study {spec.name} → {store}", file=sys.stderr)
    outcome = run_study(spec, store, args.jobs, trainer=args.trainer or DEFAULT_TRAINER)
    trained = time.perf_counter()
    paths = write_report(store, spec.name, out, workers=workers_table)
    a = paths.analysis
    # stdout is the summary alone (the README shows it verbatim); paths and timing: stderr
    print(f"report: {paths.html}\nsummary: {paths.markdown}", file=sys.stderr)
    linear = {}
    if len(a.regimes):
        linear = dict(zip(a.regimes["model_label"], a.regimes["linear_until"], strict=False))
    reference = float(a.diversity["batch_size"].iloc[0]) if len(a.diversity) else math.nan
    matched = float(a.shapes.get("matched_loss", [math.nan])[0])
    print(f"target {a.targets[0] if a.targets else '-'}; Δ {A.delta_label(a.diversity)} at "
          f"B = {_cell(reference, '.0f')} | at matched training loss {_cell(matched)}")
    print(f"{'depth':>5} {'width':>5} {'Δ avg':>9} {'nΔ avg':>8} {'Δ match':>9} "
          f"{'nΔ match':>8} {'B*':>6} {'largest B ≤ ' + format(a.budget, 'g') + ' ep':>18} "
          f"{'linear ≤':>8} {'B_crit':>7}")
    grid = sorted(float(b) for b in a.per_run["batch_size"].unique()) if len(a.per_run) else []
    marked = False

    def edge(value: object, ends: tuple[str, ...]) -> str:
        nonlocal marked
        number = float(value) if isinstance(value, (int, float)) else math.nan
        cell = _cell(number, ".0f")
        if A.grid_edge(number, grid) in ends:
            marked = True
            return cell + "†"
        return cell

    for _, row in a.shapes.iterrows():
        value = row.get("b_crit", math.nan)
        crit = ("degen." if row.get("degenerate") and math.isfinite(float(value)) else
                _cell(value, ".0f"))
        print(f"{_cell(row.get('depth')):>5} {_cell(row.get('width')):>5} "
              f"{_cell(row.get('delta_mean', math.nan)):>9} "
              f"{_cell(row.get('bound_mean', math.nan), '.0f'):>8} "
              f"{_cell(row.get('delta_matched', math.nan)):>9} "
              f"{_cell(row.get('bound_matched', math.nan), '.0f'):>8} "
              f"{edge(row.get('threshold_batch', math.nan), ('smallest', 'largest')):>6} "
              f"{edge(row.get('largest_batch', math.nan), ('largest',)):>18} "
              f"{edge(linear.get(row['model_label'], math.nan), ('smallest', 'largest')):>8} "
              f"{crit:>7}")
    if marked:
        print(f"† at the grid edge (B = {_cell(grid[0], '.0f')}…{_cell(grid[-1], '.0f')}): "
              "the value may lie beyond the grid")
    print(f"\ncritical batch size (one fit for all shapes): {critical_text(a)}")
    print(f"runs: {outcome.executed} executed, {outcome.skipped} reused, {outcome.failed} failed;"
          f" training {trained - start:.0f} s, report {time.perf_counter() - trained:.0f} s",
          file=sys.stderr)
    return 1 if outcome.failed else 0
