"""Language models end to end on a small text file: measure, train (one process and two gloo
workers), advise, a tiny study with its report; the lm-speedup-text preset plans; and the
same commands on Debian's fortunes where that package is installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchbound.cli import main
from batchbound.data import load_dataset
from batchbound.data.text import DEBIAN_FORTUNES, DEFAULT_FILES
from batchbound.diversity import measure
from batchbound.errors import BatchboundError
from batchbound.models import build_model
from batchbound.study.plan import make_plan
from batchbound.study.report import write_report
from batchbound.study.runner import run_study
from batchbound.study.spec import load_study, preset_names, study_from_dict
from batchbound.study.store import Store

LINES = [
    "The sea is calm tonight. The tide is full, the moon lies fair upon the straits.",
    "A cloud does not know why it moves in just such a direction and at such a speed.",
    "Every program has at least one bug and can be shortened by at least one instruction.",
    "Whenever you find yourself on the side of the majority, it is time to pause.",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    paragraphs = [f"{LINES[i % 4]} ({i})\n" for i in range(60)]
    path.write_text("\n".join(paragraphs), encoding="utf-8")
    return f"text(path={path},context=16)"


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("spec", ["gpt(width=16,heads=2)", "lstm(hidden=16)"])
def test_measure_json_equals_the_library(capsys: pytest.CaptureFixture[str], corpus: str,
                                         spec: str) -> None:
    code, out, _ = cli(capsys, "measure", "--dataset", corpus, "--model", spec, "--json",
                       "--dtype", "float64")
    assert code == 0
    got = json.loads(out)
    ds = load_dataset(corpus)
    model = build_model(spec, ds.input_shape, ds.num_outputs, seed=0)
    ref = measure(model, ds, dtype=torch.float64)  # exact against the loop: unit tests
    assert got["n"] == ds.n_train and got["loss_name"] == "sequence_cross_entropy"
    assert got["fallback_parameters"] == []
    for key in ("S", "T", "diversity"):
        assert got[key] == pytest.approx(getattr(ref, key), rel=1e-12), key
    code, out, _ = cli(capsys, "measure", "--dataset", corpus, "--model", spec)
    assert code == 0 and f"n={ds.n_train} (text), loss sequence_cross_entropy" in out


def test_models_and_data_of_different_kinds_are_refused(capsys: pytest.CaptureFixture[str],
                                                       corpus: str) -> None:
    code, _, err = cli(capsys, "measure", "--dataset", "digits", "--model", "lstm")
    assert code == 2 and "lstm reads token ids, but digits is a classification set" in err
    code, _, err = cli(capsys, "train", "--dataset", corpus, "--max-iterations", "2")
    assert code == 2 and "fc reads float features" in err and "gpt or lstm" in err
    assert "Traceback" not in err


def test_train_reports_next_token_accuracy(capsys: pytest.CaptureFixture[str],
                                           corpus: str) -> None:
    code, out, _ = cli(capsys, "train", "--dataset", corpus, "--model", "lstm(hidden=16)",
                       "--max-iterations", "20", "--batch-size", "8", "--lr", "0.3",
                       "--eval-every-iterations", "10", "--target-train-acc", "0.2",
                       "--no-progress", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["status"] in ("complete", "reached")
    final = result["final"]
    assert 0 <= final["train_acc"] <= 1 and 0 <= final["test_acc"] <= 1
    assert final["train_loss"] < 16 * 4.59  # below a uniform guess over 98 symbols
    assert result["targets"][0]["name"] == "train_acc>=0.2"


def test_train_on_two_gloo_workers(capsys: pytest.CaptureFixture[str], corpus: str) -> None:
    args = ["train", "--dataset", corpus, "--model", "gpt(width=16,heads=2)",
            "--max-iterations", "6", "--batch-size", "8", "--lr", "0.01",
            "--eval-every-iterations", "3", "--no-progress", "--json"]
    code, out, _ = cli(capsys, *args, "--workers", "2")
    assert code == 0
    two = json.loads(out)
    code, out, _ = cli(capsys, *args)
    one = json.loads(out)
    # the same global batches, summed across ranks: the same run up to float32 rounding
    assert two["final"]["train_loss"] == pytest.approx(one["final"]["train_loss"], rel=1e-4)
    assert two["final"]["test_acc"] == pytest.approx(one["final"]["test_acc"], abs=1e-3)


def test_advise_on_text(capsys: pytest.CaptureFixture[str], corpus: str) -> None:
    code, out, err = cli(capsys, "advise", "--dataset", corpus, "--model", "lstm(hidden=16)",
                         "--lr", "0.3", "--batch-size", "8", "--target-train-loss", "45",
                         "--max-workers", "1", "--max-epochs", "10", "--diversity-every", "1",
                         "--json")
    assert code == 0, err
    advice = json.loads(out)
    assert advice["batch_bound"] >= 1 and advice["rows"][0]["workers"] == 1
    assert advice["pilot"]["target"] == "train_loss<=45"


def test_tiny_study_on_text_runs_and_reports(corpus: str, tmp_path: Path) -> None:
    spec = study_from_dict({
        "study": {"name": "tiny-text"},
        "data": {"datasets": [corpus]},
        "models": {"specs": ["lstm(hidden=16)", "gpt(depth=1,width=16,heads=2)"]},
        "batches": {"sizes": [4, 8, 16]},
        "lr": {"strategy": ["blr", "lsr(base_batch=4)"], "grid": [0.01, 0.1],
               "tune_epochs": 0.5, "tune_at": "base_batch"},
        "train": {"targets": {"train_loss": 50, "train_acc": 0.2}, "max_epochs": 4,
                  "eval_every_epochs": 0.5, "diversity_every_epochs": 2, "repeats": 1},
    })
    outcome = run_study(spec, tmp_path / "s.sqlite", jobs=0, progress=False)
    assert outcome.failed == 0 and outcome.executed == outcome.total
    with Store(tmp_path / "s.sqlite") as store:
        frames = store.frames("tiny-text")
    assert set(frames["curves"]["metric"]) >= {"train_acc", "test_acc", "train_loss"}
    assert set(frames["diversity"]["metric"]) >= {"diversity"}
    paths = write_report(tmp_path / "s.sqlite", "tiny-text", tmp_path / "report",
                         max_workers=1)
    summary = paths.markdown.read_text()
    assert "lstm L=1 K=16" in summary and "gpt L=1 K=16" in summary
    speedups = paths.analysis.speedups
    assert len(speedups) and set(speedups["batch_size"]) <= {4, 8, 16}
    assert (tmp_path / "report" / "figures" / "speedup.png").stat().st_size > 1000


def test_a_feature_model_on_text_fails_the_plan(corpus: str) -> None:
    spec = study_from_dict({
        "study": {"name": "wrong-kind"}, "data": {"datasets": [corpus]},
        "models": {"family": "fc", "params": 2000, "depths": [1]},
        "batches": {"sizes": [4]}, "train": {"targets": {"train_loss": 40}},
    })
    with pytest.raises(BatchboundError, match="fc reads float features"):
        make_plan(spec)


def test_preset_is_listed_and_loads(capsys: pytest.CaptureFixture[str]) -> None:
    assert "lm-speedup-text" in preset_names()
    spec = load_study("lm-speedup-text")
    assert spec.data[0].dataset == "fortunes(context=32)"
    assert [parse.split("(")[0] for parse in spec.lr.strategies] == ["blr", "lsr"]
    assert spec.train.targets == (("train_loss", 75.0),)
    with pytest.raises(SystemExit):
        main(["study", "--help"])
    assert "lm-speedup-text" in capsys.readouterr().out


needs_fortunes = pytest.mark.skipif(
    not all((DEBIAN_FORTUNES / name).is_file() for name in DEFAULT_FILES),
    reason="Debian's fortunes not installed: sudo apt-get install fortunes "
    "(Debian package fortunes)",
)


@needs_fortunes
def test_preset_plans_on_fortunes() -> None:
    plan = make_plan(load_study("lm-speedup-text"))
    finals = plan.final_runs({r.group(): r.lr for r in plan.tuning_runs()})
    assert {r.n_train for r in finals} == {2779}
    assert sorted({r.batch_size for r in finals}) == [2, 4, 8, 16, 32, 64, 128]
    assert len(plan.tuning_runs()) == 6 and len(finals) == 28


@needs_fortunes
@pytest.mark.parametrize("model", ["gpt", "lstm"])
def test_measure_fortunes_with_defaults(capsys: pytest.CaptureFixture[str], model: str) -> None:
    code, out, _ = cli(capsys, "measure", "--dataset", "fortunes", "--model", model, "--json")
    assert code == 0
    got = json.loads(out)
    assert got["n"] == 1389 and got["fallback_parameters"] == [] and got["batch_bound"] >= 1


@needs_fortunes
def test_data_list_shows_the_text_task(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(capsys, "data", "list", "--json")
    rows = {r["name"]: r for r in json.loads(out)["datasets"]}
    assert code == 0 and rows["fortunes"]["task"] == rows["text"]["task"] == "text"
    assert rows["fortunes"]["available"] and rows["fortunes"]["classes"] == 98


@needs_fortunes
@pytest.mark.parametrize("extra", [["--model", "lstm"], ["--model", "gpt", "--lr", "0.003"]])
def test_train_fortunes_twenty_iterations(capsys: pytest.CaptureFixture[str],
                                          extra: list[str]) -> None:
    code, out, _ = cli(capsys, "train", "--dataset", "fortunes", *extra, "--max-iterations",
                       "20", "--eval-every-iterations", "20", "--no-progress", "--json")
    result = json.loads(out)
    assert code == 0 and result["status"] == "complete"
    assert result["final"]["train_loss"] < 64 * 4.585  # below the uniform guess, ln 98 a token
    assert result["final"]["test_acc"] > 0.05
