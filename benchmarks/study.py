"""Benchmark the study machinery on a preset: runs per minute, and the share of wall time
spent outside training (planning, the store, tuning decisions, the report). Goal ≤ 5%.

    python benchmarks/study.py [--preset width-depth-digits] [--jobs 0] [--json]

With ``--jobs 0`` (the default) every run executes inline, so the time outside training is
exactly the wall time minus the sum of the runs' own wall times. With a pool, the runs'
time is divided by the number of jobs, which is an approximation (pool start-up and
idle workers count as outside training).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from batchbound.study.report import write_report
from batchbound.study.runner import run_study
from batchbound.study.spec import load_study
from batchbound.study.store import Store


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="width-depth-digits")
    parser.add_argument("--jobs", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    spec = load_study(args.preset)
    with tempfile.TemporaryDirectory() as tmp:
        store_path = Path(tmp) / "study.sqlite"
        start = time.perf_counter()
        outcome = run_study(spec, store_path, args.jobs, progress=False)
        ran = time.perf_counter()
        write_report(store_path, spec.name, Path(tmp) / "report")
        end = time.perf_counter()
        with Store(store_path) as store:
            run_seconds = store.db.execute("SELECT SUM(wall_seconds) FROM runs").fetchone()[0]
    parallel = max(args.jobs, 1)
    training = run_seconds / parallel
    total = end - start
    result = {
        "preset": spec.name, "jobs": args.jobs, "runs": outcome.executed,
        "runs_per_minute": outcome.executed / ((ran - start) / 60),
        "wall_seconds": total, "training_seconds": training,
        "plan_seconds": outcome.seconds["plan"], "store_seconds": outcome.seconds["store"],
        "report_seconds": end - ran,
        "outside_training_share": (total - training) / total,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:24} {value:.3f}" if isinstance(value, float) else f"{key:24} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
