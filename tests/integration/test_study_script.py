"""The README's Python study API pasted into a script without a ``__main__`` guard: the
pool's spawned workers must not re-run it. And a study's numbers must not depend on how
many threads the machine offers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = """
from batchbound.advise.workers import workers_table
from batchbound.study import run_study, study_from_dict
from batchbound.study.report import write_report

spec = study_from_dict({
    "study": {"name": "pasted"},
    "data": {"datasets": ["digits"]},
    "models": {"family": "fc", "params": 2000, "depths": [1, 2]},
    "batches": {"sizes": [32, 64, 128]},
    "lr": {"grid": [0.3], "tuning": "none"},
    "train": {"targets": {"train_acc": 0.6}, "max_epochs": 4, "repeats": 1},
})
outcome = run_study(spec, "s.sqlite", jobs=2, progress=False,
                    trainer="simulated_trainer:execute")
print("FAILED", outcome.failed, "EXECUTED", outcome.executed)
paths = write_report("s.sqlite", spec.name, "report", max_workers=1, workers=workers_table)
print("REPORT", paths.failed)
"""


def test_unguarded_script_runs_its_study_once(tmp_path):
    (tmp_path / "study.py").write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run([sys.executable, "study.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # printed once: the workers did not run the script again
    assert done.stdout.count("FAILED") == 1 and "FAILED 0 EXECUTED 6" in done.stdout
    assert "REPORT 0" in done.stdout


def test_run_results_do_not_depend_on_thread_count(tmp_path):
    """The same real run, inline, from processes started with 1 and with 2 threads."""
    code = textwrap.dedent("""
        import json, sys, torch
        from pathlib import Path
        from batchbound.study.executor import Job, run_job
        fields = {"dataset": "digits", "transform": None,
                  "model": "fc(depth=2,params=4000)", "batch_size": 64, "lr": 0.3,
                  "strategy": "blr", "momentum": 0.0, "weight_decay": 0.0,
                  "convention": "mean", "sampling": "epoch", "seed": 0, "workers": 1,
                  "targets": [], "max_epochs": 1.0, "eval_every_epochs": 0.5,
                  "diversity_every_epochs": 0.5, "mechanism": "none",
                  "checkpoint_every": None}
        out = run_job(Job("k", fields, Path(sys.argv[1]), False,
                          "batchbound.study.adapter:execute"))
        assert out.error is None, out.error
        print(json.dumps(out.result["curves"]["rows"]))
        print(torch.get_num_threads())
    """)
    results = []
    for threads in ("1", "2"):
        env = {**os.environ, "OMP_NUM_THREADS": threads}
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / threads)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        rows, after = done.stdout.strip().splitlines()
        assert after == threads  # restored after the run
        results.append([r for r in __import__("json").loads(rows) if r[3] != "seconds"])
    strip = [[(r[0], r[3], r[4]) for r in res] for res in results]
    assert strip[0] == strip[1] and len(strip[0]) > 5
