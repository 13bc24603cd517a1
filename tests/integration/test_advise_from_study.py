"""``advise --from-study``: a study's measured iterations and recorded step times instead of
a pilot, checked on the simulated trainer, whose k(B) and step times are closed forms."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from simulated_trainer import step_seconds

from batchbound.advise import advise_from_study
from batchbound.advise.study import MeasuredIterations
from batchbound.cli import main
from batchbound.errors import BatchboundError
from batchbound.study.measured import load_advice_input
from batchbound.study.runner import run_study
from batchbound.study.spec import study_from_dict

BATCHES = [32, 64, 128, 256, 512]


def spec(depths: list[int]):
    return study_from_dict({
        "study": {"name": "adv", "description": "advise from a study"},
        "data": {"datasets": ["digits"]},
        "models": {"family": "fc", "params": 3000, "depths": depths},
        "batches": {"sizes": BATCHES},
        "lr": {"grid": [0.1, 0.3], "tune_epochs": 0.5},
        "train": {"targets": {"train_acc": 0.6}, "max_epochs": 100, "repeats": 2,
                  "diversity_every_epochs": 1},
    })


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("advise-study")
    out = {}
    for name, depths in (("one", [2]), ("two", [1, 2])):
        out[name] = root / f"{name}.sqlite"
        outcome = run_study(spec(depths), out[name], jobs=0, progress=False,
                            trainer="simulated_trainer:execute")
        assert outcome.failed == 0
    return out


@pytest.fixture()
def cluster(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text("[network]\nbandwidth_gbytes_per_s = 10\nlatency_us = 5\n"
                    "[cluster]\nmax_workers = 64\n")
    return path


def closed_form(b_crit: float = 100.0, s_min: float = 50.0) -> MeasuredIterations:
    batches = (16, 64, 256)
    return MeasuredIterations(batches, tuple(s_min * (1 + b_crit / b) for b in batches),
                              (0.1, 0.2, 0.4), b_crit, s_min)


def test_measured_iterations_interpolate_with_the_fit_and_never_extrapolate() -> None:
    k = closed_form()
    assert k.at(64) == pytest.approx(50 * (1 + 100 / 64))  # a grid point is the measurement
    assert k.at(32) == pytest.approx(50 * (1 + 100 / 32))  # the fit, exact between points
    assert k.at(8) == math.inf and k.at(512) == math.inf  # outside the grid: never advised
    assert k.lr(128) == pytest.approx(math.sqrt(0.2 * 0.4))  # geometric between grid rates
    missed = MeasuredIterations((16, 64, 256), (100.0, math.inf, 30.0), (0.1,) * 3, 100.0, 50.0)
    assert missed.at(32) == math.inf and missed.at(128) == math.inf
    loglog = MeasuredIterations((16, 64), (100.0, 25.0), (0.1, 0.1), math.nan, math.nan)
    assert loglog.at(32) == pytest.approx(50.0)


def test_advice_from_a_study_uses_its_iterations_and_step_times(stores, cluster) -> None:
    advice = advise_from_study(load_advice_input(stores["one"]), cluster=cluster)
    study = advice.study
    assert study is not None and study["grid"] == BATCHES and advice.pilot is None
    measured = dict(zip(study["grid"], study["iterations"], strict=True))
    for row in advice.rows:
        assert BATCHES[0] <= row.batch_size <= BATCHES[-1]
        if row.batch_size in measured:
            assert row.iterations == measured[row.batch_size]
        micro = math.ceil(row.batch_size / row.workers)
        if micro in {math.ceil(b / 1) for b in BATCHES}:  # a micro-batch the runs recorded
            assert row.compute_seconds == pytest.approx(step_seconds(micro))
    assert advice.rows[0].workers == 1 and advice.rows[-1].workers <= BATCHES[-1]
    assert math.isfinite(advice.batch_bound) and advice.batch_bound > 0
    assert "measured by study 'adv'" in advice.assumptions
    data = advice.to_dict()
    assert data["study"]["b_crit"] is not None and "pilot" not in data


def test_a_study_with_several_models_needs_one_named(stores, cluster) -> None:
    with pytest.raises(BatchboundError, match="has models"):
        load_advice_input(stores["two"])
    with pytest.raises(BatchboundError, match="no model 'nope'"):
        load_advice_input(stores["two"], model="nope")
    measured = load_advice_input(stores["two"], model="L=1 K=" + _width(stores["two"], 1))
    assert json.loads(json.dumps(measured))["model"] == measured["model"]  # plain data
    labels = advise_from_study(measured, cluster=cluster).study
    assert labels is not None
    assert labels["model"].startswith("L=1")


def _width(store: Path, depth: int) -> str:
    from batchbound.study.store import Store

    with Store(store) as s:
        runs = s.frames("adv")["runs"]
    return str(int(runs[runs["depth"] == depth]["width"].iloc[0]))


def test_from_study_on_this_machine_times_two_workers(stores, capsys) -> None:
    assert main(["advise", "--from-study", str(stores["one"]), "--max-workers", "2",
                 "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)
    assert [r["workers"] for r in advice["rows"]] == [1, 2]
    assert advice["rows"][1]["communication_seconds"] > 0  # the real step, in lockstep


@pytest.mark.parametrize("args, message", [
    (["--from-study", "/nonexistent.sqlite"], "does not exist"),
    (["--study", "nope"], "no study 'nope'"),
    (["--probe"], "does not apply"),
])
def test_from_study_bad_input_is_one_line(stores, capsys, args, message) -> None:
    base = ["advise", "--from-study", str(stores["one"]), "--max-workers", "1"]
    assert main([*base, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_store_whose_runs_name_a_module_is_refused_and_imports_nothing(
        stores, tmp_path, monkeypatch, capsys) -> None:
    """A store is a file: a run's model edited to ``MODULE:CALLABLE`` was imported and called
    by ``advise --from-study`` (an outside review wrote a file and opened a server that way)."""
    import shutil
    import sqlite3

    store = tmp_path / "edited.sqlite"
    shutil.copy(stores["one"], store)
    marker = tmp_path / "ran"
    (tmp_path / "planted.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                         "def net(): return None\n")
    with sqlite3.connect(store) as db:
        rows = db.execute("SELECT key, config_json FROM runs").fetchall()
        for key, config in rows:
            edited = {**json.loads(config), "model": "planted:net"}
            db.execute("UPDATE runs SET config_json = ? WHERE key = ?", (json.dumps(edited), key))
    monkeypatch.chdir(tmp_path)
    assert main(["advise", "--from-study", str(store), "--max-workers", "2"]) == 2
    said = capsys.readouterr().err.strip()
    assert "model planted:net names a Python module" in said and "\n" not in said
    assert not marker.exists()


def test_a_config_file_that_names_a_module_is_refused_and_imports_nothing(
        tmp_path, monkeypatch, capsys) -> None:
    marker = tmp_path / "ran"
    (tmp_path / "planted.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                         "def net(): return None\n")
    (tmp_path / "config.toml").write_text('model = "planted:net"\n')
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", "config.toml", "--max-iterations", "1", "--no-progress"]) == 2
    said = capsys.readouterr().err.strip()
    assert "config file config.toml: model planted:net names a Python module" in said
    assert "--model planted:net" in said and not marker.exists()
