"""`batchbound data list|show`: every embedded set available, file sets explained."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from batchbound.cli import data as data_cli
from batchbound.data import dataset_names, get_entry
from batchbound.data.formats import write_idx

EMBEDDED = {"digits", "mnist5k", "mnist1d", "synthetic-linear", "synthetic-logistic"}


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="batchbound")
    data_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_list_json_marks_embedded_available_and_missing_files_explained(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mnist = tmp_path / "mnist"
    mnist.mkdir()
    for name, shape in (("train-images-idx3-ubyte.gz", (2, 28, 28)),
                        ("train-labels-idx1-ubyte.gz", (2,)),
                        ("t10k-images-idx3-ubyte", (1, 28, 28)),
                        ("t10k-labels-idx1-ubyte", (1,))):  # fmt: skip
        write_idx(mnist / name, np.zeros(shape, np.uint8))
    assert run(["data", "list", "--data-dir", str(tmp_path), "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    rows = {row["name"]: row for row in listing["datasets"]}
    assert set(rows) == set(dataset_names()) and listing["data_dir"] == str(tmp_path)
    for name in EMBEDDED:
        assert rows[name]["available"] and rows[name]["embedded"]
        assert rows[name]["n_train"] == get_entry(name).n_train
    assert rows["mnist"]["available"] and rows["mnist"]["reason"] is None
    assert not rows["kmnist"]["available"]
    assert "train-images-idx3-ubyte" in rows["kmnist"]["reason"]
    assert str(tmp_path / "kmnist") in rows["kmnist"]["reason"]
    assert not rows["cifar10"]["available"] and "data_batch_1" in rows["cifar10"]["reason"]


def test_list_table_and_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["data", "list", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("name")
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "available (embedded)" in lines["mnist5k"] and "1x28x28" in lines["mnist5k"]
    assert "missing" in lines["cifar100"]
    assert "- gisette: needs gisette_scale" in out
    assert run(["data", "show", "synthetic-linear(n=40,d=3)", "--load", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["options"][:2] == ["n", "d"] and shown["loaded"]["n_train"] == 40
    assert shown["loaded"]["input_shape"] == [3]
