"""Weight snapshots (snapshot_every_epochs): when they are taken, what they hold, that they
survive a stop and resume exactly, and their JSON and store round trips."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch

from batchbound.data import load_dataset
from batchbound.models import build_model
from batchbound.study.store import Store
from batchbound.train import RunResult, TrainConfig
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Trainer

N = 1438  # digits' training examples
SMALL = dict(
    dataset="digits",
    model="fc(depth=1,params=800)",
    batch_size=32,
    lr=0.1,
    max_iterations=20,
    eval_every_iterations=6,
    snapshot_every_epochs=0.1,
)


def flat(model: torch.nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()]).numpy()


def test_taken_at_zero_on_cadence_and_at_the_end() -> None:
    trainer = Trainer(TrainConfig(**SMALL), DistContext())
    result = trainer.run()
    # 32/1438 epochs per iteration: 0.1, 0.2, 0.3, 0.4 are first reached at 5, 9, 14, 18
    iterations = [0, 5, 9, 14, 18, 20]
    assert [e for e, _ in result.snapshots] == pytest.approx([i * 32 / N for i in iterations])
    epochs, weights = result.snapshot_matrix()
    assert epochs.dtype == np.float64 and epochs[0] == 0.0
    assert weights.dtype == np.float32 and weights.shape == (6, flat(trainer.model).size)
    assert np.array_equal(weights[-1], flat(trainer.model))  # the final parameters
    digits = load_dataset("digits")
    initial = build_model(SMALL["model"], digits.input_shape, digits.num_outputs, seed=0)
    assert np.array_equal(weights[0], flat(initial))
    assert not np.array_equal(weights[1], weights[0])
    assert not result.curve("snapshot")  # nothing added to the curves


def test_last_point_is_not_repeated_and_nothing_without_the_option() -> None:
    result = Trainer(TrainConfig(**{**SMALL, "max_iterations": 18}), DistContext()).run()
    assert len(result.snapshots) == 5  # 18 is on the cadence and the end: kept once
    plain = Trainer(TrainConfig(**{**SMALL, "snapshot_every_epochs": None}), DistContext()).run()
    assert plain.snapshots == [] and "snapshots" not in plain.to_dict()


def test_resume_gives_the_same_snapshots(tmp_path) -> None:
    config = TrainConfig(**{**SMALL, "max_iterations": 30, "checkpoint_every": 7,
                            "momentum": 0.9})
    expected = Trainer(config, DistContext()).run()

    path = tmp_path / "run.ckpt"
    first = Trainer(config, DistContext(), checkpoint_path=path)
    step = first.train_step

    def interrupted(*args: object) -> dict:
        if first.iteration == 11:  # SIGTERM arrives during iteration 12
            os.kill(os.getpid(), signal.SIGTERM)
        return step(*args)

    first.train_step = interrupted  # type: ignore[method-assign]
    stopped = first.run()
    assert stopped.status == "stopped" and stopped.final["iterations"] == 13
    # the stopped result ends with its own last point (iteration 13, off the cadence)
    assert stopped.snapshots[-1][0] == pytest.approx(13 * 32 / N)
    resumed = Trainer(config, DistContext(), checkpoint_path=path).run(resume=True)
    assert resumed.status == "complete"
    assert [e for e, _ in resumed.snapshots] == [e for e, _ in expected.snapshots]
    for (_, mine), (_, theirs) in zip(resumed.snapshots, expected.snapshots, strict=True):
        assert np.array_equal(mine, theirs)
    assert len(expected.snapshots) == 8  # 0, 5, 9, 14, 18, 23, 27 and the end, 30


def test_json_round_trip_is_exact_and_compact() -> None:
    result = Trainer(TrainConfig(**SMALL), DistContext()).run()
    data = result.to_dict()
    assert set(data["snapshots"]) == {"epochs", "dtype", "data"}
    assert data["snapshots"]["dtype"] == "float32"
    assert all(isinstance(b, str) for b in data["snapshots"]["data"])
    back = RunResult.from_json(json.dumps(data))
    assert [e for e, _ in back.snapshots] == [e for e, _ in result.snapshots]
    assert all(np.array_equal(a, b) and b.dtype == np.float32
               for (_, a), (_, b) in zip(result.snapshots, back.snapshots, strict=True))


def test_store_round_trip(tmp_path) -> None:
    result = Trainer(TrainConfig(**SMALL), DistContext()).run()
    plain = Trainer(TrainConfig(**{**SMALL, "snapshot_every_epochs": None}), DistContext()).run()
    labels = {"data": "digits", "batch_size": 32, "seed": 0}
    with Store(tmp_path / "s.sqlite") as store:
        store.register_study("demo", {"name": "demo"})
        store.register_runs("demo", [("a", "final", {}, labels), ("b", "final", {}, labels)])
        store.record_result("a", result.to_dict(), 1.0)
        store.record_result("a", result.to_dict(), 1.0)  # a rerun replaces, never duplicates
        store.record_result("b", plain.to_dict(), 1.0)  # no snapshots: no rows
        got = store.snapshots(["a", "b", "missing"])
        assert list(got) == ["a"]
        epochs, weights = got["a"]
        want_epochs, want_weights = result.snapshot_matrix()
        assert np.array_equal(epochs, want_epochs) and epochs.dtype == np.float64
        assert weights.dtype == np.float32 and np.array_equal(weights, want_weights)
        index = store.frames("demo")["snapshots"]
        assert list(index.columns) == ["key", "epoch", "numel"]
        assert len(index) == 6 and set(index["numel"]) == {want_weights.shape[1]}
        assert len(store.table("snapshots")) == 6
        store.record_result("a", plain.to_dict(), 1.0)  # recorded again without: rows gone
        assert store.snapshots(["a"]) == {}


def test_an_older_store_gains_the_table(tmp_path) -> None:
    path = tmp_path / "old.sqlite"
    with Store(path) as store:
        store.db.execute("DROP TABLE snapshots")  # as a store written before snapshots existed
    with Store(path) as store:
        assert store.snapshots(["a"]) == {} and store.table("snapshots").empty
