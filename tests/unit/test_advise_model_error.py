"""advise's interval includes the model's own error, measured on other jobs' runs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from batchbound.advise import model_error
from batchbound.advise.model_error import ModelError, error_for, job_key
from batchbound.errors import BatchboundError


def row(dataset: str, batch: int, predicted: float, measured: float, **job) -> dict:
    return {"case": dataset, "dataset": dataset, "model": job.get("model", "fc"),
            "optimizer": job.get("optimizer", "sgd"), "momentum": 0.0, "b0": 16, "lr": 0.1,
            "batch": batch, "predicted": predicted, "measured": measured,
            "pilot_interval": [predicted, predicted]}


def test_the_band_is_the_other_jobs_middle_80_percent_per_doubling() -> None:
    rows = [row("a", 64, 100, 50), row("a", 32, 100, 90)]  # the job asked about
    rows += [row(f"o{i}", 16 * 2 ** (1 + i % 3), 100, 100 * math.exp(u * (1 + i % 3)))
             for i, u in enumerate(np.linspace(-0.5, 0.1, 11))]
    band = error_for(job_key("a", "fc", "sgd", 0.0, 16, 0.1), rows)
    others = np.linspace(-0.5, 0.1, 11)  # the per-doubling errors of the other rows
    assert band.low == pytest.approx(np.percentile(others, 10))
    assert band.high == pytest.approx(np.percentile(others, 90))
    assert (band.rows, band.jobs, band.left_out) == (11, 11, 2)


def test_the_band_always_holds_the_central_prediction() -> None:
    rows = [row(f"o{i}", 64, 100, 200 + i) for i in range(5)]  # all under-predicted
    band = error_for(("nobody",), rows)
    assert band.low == 0.0 and band.high > 0


def test_widen_joins_the_band_to_the_interval() -> None:
    band = ModelError(low=-0.2, high=0.05, rows=10, jobs=3, left_out=0)
    assert band.widen(100, (90, 130), 16, 16) == (90, 130)  # at B0: nothing to widen
    low, high = band.widen(100, (90, 130), 64, 16)  # two doublings
    assert low == pytest.approx(100 * math.exp(-0.4)) and high == 130
    low, high = band.widen(100, (99, 101), 4, 16)  # below B0: symmetric, the larger side
    assert (low, high) == (pytest.approx(100 * math.exp(-0.4)),
                           pytest.approx(100 * math.exp(0.4)))
    assert band.widen(math.inf, (1, math.inf), 64, 16) == (1, math.inf)


def test_a_job_is_its_data_model_optimiser_b0_and_rate() -> None:
    key = job_key("text(path=/home/x/.cache/common-licenses.txt)", "gpt(depth=2, width=64)",
                  "adamw", 0.0, 16, 0.003)
    assert key == job_key("text(path=common-licenses.txt)", "gpt(depth=2,width=64)", "adamw",
                          0, 16, 0.003)
    for other in (job_key("fortunes", "gpt(depth=2,width=64)", "adamw", 0.0, 16, 0.003),
                  job_key("text(path=common-licenses.txt)", "gpt(depth=2,width=64)", "sgd",
                          0.0, 16, 0.003),
                  job_key("text(path=common-licenses.txt)", "gpt(depth=2,width=64)", "adamw",
                          0.0, 32, 0.003)):
        assert other != key


def test_the_shipped_record_leaves_each_benchmark_job_out() -> None:
    rows = model_error.load()
    keys = [model_error._key_of(r) for r in rows]
    assert len(rows) >= 20 and len(set(keys)) >= 8
    for key in set(keys):  # two cases that differ only in betas are one job: both left out
        band = error_for(key, rows)
        assert band.left_out == keys.count(key) >= 2
        assert band.low < 0 <= band.high


def test_an_unreadable_record_is_refused(tmp_path) -> None:
    bad = tmp_path / "errors.json"
    bad.write_text(json.dumps({"rows": "nope"}))
    with pytest.raises(BatchboundError, match="recorded errors"):
        model_error.load(bad)
    bad.write_text("{")
    with pytest.raises(BatchboundError, match="recorded errors"):
        model_error.load(bad)


def test_a_users_model_name_is_a_job_too() -> None:
    assert job_key("digits", "mymodels:small_cnn", "sgd", 0.0, 16, 0.1) == \
        job_key("digits", " mymodels:small_cnn", "sgd", 0.0, 16, 0.1)
