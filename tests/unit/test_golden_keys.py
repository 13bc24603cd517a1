"""Golden keys: the store's run keys and the checkpoints' config hashes, recorded before the
study's training fields and the config's validation were reorganised (issue 42). A change
here orphans every stored study and checkpoint: if one is intended, say so and migrate."""

from __future__ import annotations

import hashlib

import pytest

from batchbound.errors import BatchboundError
from batchbound.study.plan import make_plan
from batchbound.study.spec import load_study, preset_names
from batchbound.train import TrainConfig

# TrainConfig.config_hash(): a run's key in the store and the hash a checkpoint is bound to
CONFIGS = {
    "default": ({}, "956d8208960ae2e5"),
    "targets": ({"dataset": "mnist5k", "model": "lenet", "batch_size": 128, "lr": 0.05,
                 "targets": [{"metric": "train_acc", "threshold": 0.95}], "max_epochs": 7.5,
                 "strategy": "lsr(base_batch=32,warmup_epochs=2)", "momentum": 0.9,
                 "weight_decay": 1e-4, "seed": 3, "diversity_every_epochs": 0.5},
                "602e847dc1a82c0d"),
    "records": ({"snapshot_every_epochs": 1.0, "final_probes": ["osg"],
                 "micro_batch": 16, "eval_growth": 1.05}, "68756a5c341cf233"),
    "warmup": ({"batch_size": 16, "batch_policy": "warmup(every=25,fraction=0.25)"},
               "99e5ce1fac2fefc4"),
    "mechanism": ({"mechanism": "dropconnect(p=0.5)", "mechanism_granularity": "example",
                   "workers": 2, "convention": "sum", "sampling": "replacement"},
                  "8546f6cc6656f863"),
}
# every packaged preset's planned keys (tuning runs, then finals at each cell's first η),
# hashed together (skipped where the preset's data is not on this machine; the Fashion-MNIST
# and full-fortunes ones take half a minute each to plan, so they are slow tests)
PRESETS: dict[str, str] = {
    "architectures-digits": "09c2461f25d24175",
    "architectures-fashion": "c78f5b371126e4e5",
    "dropconnect-timing-digits": "d4c039c1ff93dc7a",
    "dropconnect-timing-fashion": "a60c4e4cfcacbc0e",
    "generalization-digits": "21b1ce63cfe66450",
    "generalization-fashion": "1b28b9d13d59f0b0",
    "linear-width-depth-synthetic": "4b2c9747a898edec",
    "lm-speedup-fortunes": "de7a1b7de87c5603",
    "lm-speedup-text": "aeafb0479c9d2492",
    "replication-digits": "c72b529b3edbc5da",
    "replication-fashion": "8dc62ac303ae6013",
    "stability-digits": "c5e26b45d1488ecf",
    "stability-fashion": "11338e0677a5b1af",
    "strategies-digits": "2b7d8c2e35fc11f7",
    "strategies-fashion": "aa0d8fbbb5c8c2d1",
    "width-depth-digits": "ff61663e1be11368",
    "width-depth-fashion": "443add50072bf8a1",
}


@pytest.mark.parametrize("name", CONFIGS)
def test_config_hashes_are_unchanged(name):
    fields, expected = CONFIGS[name]
    assert TrainConfig.from_dict(fields).config_hash() == expected


def plan_digest(name: str) -> str:
    plan = make_plan(load_study(name))
    tuning = plan.tuning_runs()
    chosen = {run.group(): run.lr for run in reversed(tuning)}
    runs = tuning + plan.final_runs(chosen)
    return hashlib.sha256("\n".join(map(key_without_files, runs)).encode()).hexdigest()[:16]


def key_without_files(run) -> str:
    """The run's key without the fingerprint of the files its data set read: that part is
    the content of files on this machine (a Debian package's version), so it cannot be
    pinned here; tests/integration/test_data_identity.py checks it enters the key. Data read
    from no file has none, and its key is the stored one."""
    if run.fields.get("data_files") is None:
        return run.key
    return TrainConfig.from_dict({**run.fields, "data_files": None}).config_hash()


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n.endswith(("-fashion", "-fortunes")) else n
    for n in preset_names()])
def test_preset_run_keys_are_unchanged(name):
    try:
        digest = plan_digest(name)
    except BatchboundError as exc:
        pytest.skip(f"{name}: {exc}")
    assert digest == PRESETS[name]
