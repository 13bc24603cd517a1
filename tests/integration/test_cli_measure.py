"""`batchbound measure`: --json parses and equals the library call; the table; errors."""

from __future__ import annotations

import json

import pytest
import torch

from batchbound.cli import main
from batchbound.data import load_dataset
from batchbound.diversity import measure
from batchbound.models import build_model

SPEC = "fc(depth=2,params=4000)"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["measure", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_equals_library_call(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--dataset", "digits", "--model", SPEC, "--json", "--seed", "3")
    assert code == 0
    got = json.loads(out)
    ds = load_dataset("digits")
    model = build_model(SPEC, ds.input_shape, ds.num_outputs, seed=3)
    ref = measure(model, ds, dtype=torch.float32).to_dict()
    for key in ("n", "S", "T", "diversity", "batch_bound", "m2", "engine", "per_parameter_S"):
        assert got[key] == ref[key], key
    assert got["model"] == SPEC and got["dataset"] == "digits" and got["seconds"] > 0
    assert got["params"] == sum(p.numel() for p in model.parameters())
    assert got["depth"] == 2


def test_several_models_table_and_json_list(capsys: pytest.CaptureFixture[str]) -> None:
    specs = ["fc(depth=1,params=2000)", "fc(depth=3,params=2000)"]
    args = ["--dataset", "synthetic-linear(n=200,d=10)", "--dtype", "float64"]
    code, out, _ = run(capsys, *args, "--model", specs[0], "--model", specs[1])
    assert code == 0
    lines = out.strip().splitlines()
    assert "n=200 (regression), loss mse" in lines[0]
    assert lines[1].split()[:4] == ["model", "depth", "width", "params"]
    assert lines[2].startswith(specs[0]) and lines[3].startswith(specs[1])
    code, out, _ = run(capsys, *args, "--model", specs[0], "--model", specs[1], "--json")
    rows = json.loads(out)
    assert [r["model"] for r in rows] == specs and all(r["dtype"] == "float64" for r in rows)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", SPEC, "--chunk-size", "0"], "chunk_size must be a positive integer"),
        (["--model", "mlp(depth=2)"], "unknown model family 'mlp'; available:"),
        (["--model", SPEC, "--dataset", "nope"], "unknown data set 'nope'"),
        (["--model", "fc(depth=2,params=4000", "--json"], "fc(depth=2,params=4000"),
        (["--model", SPEC, "--loss", "mse"], "mse needs targets shaped like the outputs"),
    ],
)
def test_errors_are_reported_without_traceback(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("batchbound measure: error:") and message in err


@pytest.mark.parametrize("device", ["tpu", "meta", "cuda:-1", "", "foo:1", "cpu:1"])
def test_an_unknown_device_is_one_line_as_trains(device: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """It was torch's traceback, exit 1 (an outside review); train and advise said it in a
    line."""
    assert main(["measure", "--model", "fc(depth=1,params=100)", "--device", device]) == 2
    said = capsys.readouterr().err.strip()
    assert said == (f"batchbound measure: error: unknown device {device!r}; choose from auto, "
                    "cpu, cuda or cuda:i (a GPU's index)")
