"""``batchbound models describe|family|list``: JSON keys, the [width] table, and errors."""

from __future__ import annotations

import argparse
import json

import pytest

from batchbound.cli import main
from batchbound.cli import models as models_cli


def run(argv: list[str], capsys) -> tuple[int, str]:
    """Run ``batchbound models ...`` through this module's parser only."""
    parser = argparse.ArgumentParser(prog="batchbound")
    models_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["models", *argv])
    code = args.func(args)
    return code, capsys.readouterr().out


def test_describe_json_has_the_documented_keys(capsys):
    code, out = run(["describe", "fc(depth=3,params=4000)", "--dataset", "digits", "--json"],
                    capsys)
    info = json.loads(out)
    assert code == 0
    assert {"params", "depth", "width", "layers", "weights", "resolved", "family"} <= set(info)
    assert info["depth"] == 3 and info["input_shape"] == [64] and info["num_outputs"] == 10
    k = info["width"]
    assert info["weights"] == 64 * k + 2 * k * k + 10 * k
    assert info["params"] == info["weights"] + 3 * k + 10
    assert sum(layer["params"] for layer in info["layers"]) == info["params"]
    linears = [layer for layer in info["layers"] if layer["type"] == "Linear"]
    assert [layer["output_shape"] for layer in linears] == [[k], [k], [k], [10]]


def test_describe_takes_an_explicit_input_shape(capsys):
    code, out = run(["describe", "resnet(width=4)", "--input-shape", "3,32,32", "--outputs",
                     "10"], capsys)
    assert code == 0
    assert "resnet(blocks=[2,2,2,2],width=4" in out and "depth 18" in out


def test_describe_loads_a_data_set_given_with_options(capsys):
    _, out = run(["describe", "linear(depth=2,width=5)", "--dataset",
                     "synthetic-linear(n=40,d=7,outputs=3)", "--json"], capsys)
    info = json.loads(out)
    assert info["input_shape"] == [7] and info["num_outputs"] == 3
    assert info["params"] == 7 * 5 + 5 * 5 + 5 * 3


def test_family_table_is_the_width_papers_sweep(capsys):
    code, out = run(["family", "fc", "--params", "16000", "--depths", "1-10",
                     "--input-shape", "1,28,28", "--outputs", "10", "--json"], capsys)
    table = json.loads(out)
    rows = table["rows"]
    assert code == 0 and [r["depth"] for r in rows] == list(range(1, 11))
    assert rows[-1]["width"] == 17 and rows[-1]["spec"].startswith("fc(depth=10,width=17")
    for r in rows:
        k, depth = r["width"], r["depth"]
        assert r["params"] == 784 * k + (depth - 1) * k * k + 10 * k
        assert r["relative_error"] == pytest.approx((r["params"] - 16000) / 16000)


def test_family_text_and_other_sweeps(capsys):
    code, out = run(["family", "linear", "--params", "2e3", "--depths", "0,2",
                     "--dataset", "digits"], capsys)
    assert code == 0 and "linear(depth=2,width=" in out and "rel. error" in out
    code, out = run(["family", "lenet", "--params", "20000", "--depths", "1-2", "--options",
                     "width_mult=0.2,image=[1,8,8],padding=2", "--dataset", "digits", "--json"],
                    capsys)
    rows = json.loads(out)["rows"]
    assert [r["depth"] for r in rows] == [1, 2]
    assert all(abs(r["relative_error"]) < 0.02 for r in rows)
    code, out = run(["family", "resnet", "--params", "50000", "--blocks", "1,1", "2,2",
                     "--input-shape", "3,16,16", "--outputs", "10", "--json"], capsys)
    rows = json.loads(out)["rows"]
    assert [r["depth"] for r in rows] == [6, 10]
    assert all(abs(r["relative_error"]) < 0.1 for r in rows)


def test_list_names_every_family(capsys):
    _, out = run(["list", "--json"], capsys)
    families = {row["family"] for row in json.loads(out)}
    assert {"fc", "linear", "lenet", "resnet", "vgg", "mobilenetv2", "alexnet", "cnn1d"} <= families


def test_bad_input_exits_2_with_the_message(capsys):
    assert main(["models", "describe", "fc(depth=2,width=4,params=9)", "--dataset", "digits"]) == 2
    assert "give width or params, not both" in capsys.readouterr().err
    assert main(["models", "family", "fc", "--params", "1000", "--depths", "3-1"]) == 2
    assert "bad depths '3-1'" in capsys.readouterr().err
    assert main(["models", "family", "fc", "--params", "1000", "--blocks", "1,1"]) == 2
    assert "use it with the resnet family" in capsys.readouterr().err
