"""benchmarks/gpu.py runs every path on CPU (--device cpu --smoke): the table a GPU run
prints comes from the same code; benchmarks/host.py (the host-time proxy) runs every step;
benchmarks/budget.py holds measure() under its memory budget."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_benchmark_smoke_on_cpu() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--smoke",
         "--cases", "mlp,gpt2-tiny", "--no-callbacks", "--json"],
        capture_output=True, text=True, timeout=600, check=True)
    rows = json.loads(done.stdout)["tools"]
    assert [r["case"] for r in rows] == ["MLP 784-512³-10", "HF GPT-2 2×64, context 32"]
    for row in rows:
        assert row["errors"] == {} and row["plain_ms"] > 0 and row["measure_ratio"] > 0
        assert row["watch_extra"] is not None and row["every_extra"] is not None
    assert rows[1]["norms_extra"] is not None  # GPT-2 has LayerNorms: the cheap mode ran


def test_host_benchmark_runs_every_step() -> None:
    """benchmarks/host.py (the host-time proxy) times each step on the real code path."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "host.py"), "--layers", "1", "--repeats",
         "1", "--json"], capture_output=True, text=True, timeout=300, check=True)
    rows = json.loads(done.stdout)
    assert [r["step"] for r in rows] == ["plain", "watch", "watch:norms", "empty mode", "measure",
                                         "plain, bf16", "watch, bf16", "watch:norms, bf16",
                                         "watch every 10th"]
    assert all(r["ms"] > 0 and r["mean ms"] > 0 for r in rows)


@pytest.mark.slow
def test_budget_benchmark_row_is_within_its_budget() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "budget.py"), "--cases", "lenet",
         "--precisions", "bf16"], capture_output=True, text=True, timeout=300, check=True)
    row = done.stdout.strip().splitlines()[-1].strip("|").split("|")
    assert row[0].strip() == "LeNet-5" and 0.5 < float(row[-1]) <= 1.0
