"""Same command, same numbers, whatever kernels the processor would pick (batchbound.kernels).

One machine stands in for several: ATEN_CPU_CAPABILITY and MKL's instruction cap make this
process round as an AVX2-only or a baseline x86-64 processor would. Under BATCHBOUND_KERNELS=
native (the old behaviour) those settings give other last bits and, through SGD's chaos, other
decisions; batchbound's own pin must give identical results under every one of them.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

# What the processor would choose, and two stand-ins for other processors.
SETTINGS = {
    "machine": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "baseline": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"},
}

STUDY = """
[study]
name = "kernels"
[data]
datasets = ["digits"]
[models]
specs = ["fc(depth=3,params=4000)"]
[batches]
sizes = [16, 128]
[lr]
grid = [0.3, 1.0]
tune_epochs = 1
[train]
targets = { train_acc = 0.9 }
max_epochs = 6
eval_every_epochs = 0.5
diversity_every_epochs = 2.0
repeats = 2
"""


def _env(setting: str, kernels: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS",
                        "BATCHBOUND_KERNELS")}
    env.update(SETTINGS[setting])
    if kernels is not None:
        env["BATCHBOUND_KERNELS"] = kernels
    return env


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "batchbound", *args], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


TRAIN = ["--dataset", "digits", "--model", "fc(depth=2,params=4000)", "-B", "32", "--lr", "0.3",
         "--max-epochs", "3", "--json"]


def _train_loss(setting: str) -> tuple[float, str]:
    done = _cli(["train", *TRAIN], _env(setting, None))
    result = json.loads(done.stdout)
    return float(result["final"]["train_loss"]), result["kernels"]


# A plain float32 reduction, printed before `batchbound train` runs in the same process: where
# it gives the same bits under every setting, this processor's kernels are the baseline ones.
PROBE = ("import sys, torch; g = torch.Generator().manual_seed(0); "
         "x = torch.randn(4099, generator=g); w = torch.randn(4099, 37, generator=g); "
         "print((x @ w).sum().item().hex(), torch.softmax(w, 0).sum().item().hex()); "
         "from batchbound.cli import main; sys.exit(main(sys.argv[1:]))")


def _native_probe_and_loss(setting: str) -> tuple[str, float]:
    """Under BATCHBOUND_KERNELS=native, in one process: the probe's bits, then train's loss
    (the probe computes first, which native kernels allow)."""
    done = subprocess.run([sys.executable, "-c", PROBE, "train", *TRAIN], capture_output=True,
                          text=True, env=_env(setting, "native"), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    probe, result = done.stdout.split("\n", 1)
    return probe, float(json.loads(result)["final"]["train_loss"])


def test_train_gives_the_same_loss_under_every_processor_setting():
    results = {s: _train_loss(s) for s in SETTINGS}
    assert len({loss for loss, _ in results.values()}) == 1, results
    assert all(k.startswith("portable (ATen DEFAULT") for _, k in results.values()), results


def test_native_kernels_round_differently_here():
    """The control: without the pin, the stand-ins do change the numbers (else the tests
    above and below could not fail on this machine)."""
    native = {s: _native_probe_and_loss(s) for s in SETTINGS}
    if len({probe for probe, _ in native.values()}) == 1:
        pytest.skip("this processor's kernels are the baseline ones")
    losses = {s: loss for s, (_, loss) in native.items()}
    assert len(set(losses.values())) > 1, losses


def _per_run(store: Path) -> dict[tuple, tuple]:
    with sqlite3.connect(store) as db:
        rows = db.execute(
            "select s.role, s.model_label, s.batch_size, s.lr, s.seed, r.status, t.reached, "
            "t.iteration, t.epoch, r.final_json from study_runs s join runs r on r.key = s.key "
            "left join targets t on t.key = s.key").fetchall()
    out = {}
    for role, model, batch, lr, seed, status, reached, iteration, epoch, final in rows:
        loss = json.loads(final).get("train_loss") if final else None
        out[(role, model, batch, lr, seed)] = (status, reached, iteration, epoch, loss)
    return out


def test_a_study_decides_the_same_under_every_processor_setting(tmp_path):
    spec = tmp_path / "kernels.toml"
    spec.write_text(STUDY)
    runs = {}
    for setting in SETTINGS:
        store = tmp_path / f"{setting}.sqlite"
        _cli(["study", "run", str(spec), "--store", str(store), "--jobs", "2",
              "--no-progress"], _env(setting, None))
        runs[setting] = _per_run(store)  # B*, B_crit and the report follow from these
    first = runs["machine"]
    assert first and any(v[0] == "complete" for v in first.values())
    for setting, per_run in runs.items():
        # tuned η, status, reached, iterations and epochs to target, final loss: all identical
        assert per_run == first, setting
