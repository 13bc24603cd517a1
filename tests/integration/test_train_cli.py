"""``batchbound train``: --json parses, human output names epochs/iterations/seconds, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from batchbound.cli import main

ARGS = [
    "train",
    "--dataset",
    "digits",
    "--model",
    "fc(depth=1,params=800)",
    "--batch-size",
    "32",
    "--lr",
    "0.2",
    "--max-epochs",
    "3",
    "--no-progress",
]


def test_json_summary(capsys) -> None:
    code = main([*ARGS, "--target-train-acc", "0.5", "0.999", "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["status"] == "complete" and len(summary["config_hash"]) == 16
    reached, missed = summary["targets"]
    assert reached["reached"] and reached["iteration"] > 0 and reached["epoch"] > 0
    assert reached["seconds"] > 0 and not missed["reached"]
    assert summary["final"]["epochs"] == pytest.approx(3, abs=0.05)


def test_human_output_and_full_result(tmp_path, capsys) -> None:
    out = tmp_path / "run.json"
    assert main([*ARGS, "--target-test-acc", "0.5", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "test_acc>=0.5: reached after" in text and "epochs" in text and "iterations" in text
    full = json.loads(out.read_text())
    assert full["curves"]["columns"] == ["iteration", "epoch", "seconds", "metric", "value"]


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--lr", "0"], "lr must be a positive"),
        (["--strategy", "fast"], "unknown learning-rate strategy"),
        (["--batch-size", "100000"], "larger than the training set"),
        (["--workers", "64"], "more workers (64)"),
    ],
)
def test_bad_input_exits_2_without_traceback(capsys, extra: list, words: str) -> None:
    assert main([*ARGS, *extra]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


@pytest.mark.slow
def test_done_when_command_two_workers() -> None:
    command = [
        sys.executable,
        "-m",
        "batchbound",
        "train",
        "--dataset",
        "digits",
        "--model",
        "fc(depth=2,params=4000)",
        "--batch-size",
        "64",
        "--lr",
        "0.1",
        "--target-train-acc",
        "0.95",
        "--workers",
        "2",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    assert "train_acc>=0.95: reached after" in done.stdout
