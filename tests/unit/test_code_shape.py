"""Shape rules the issue tracker asked to keep: the config schema's functions stay short
(validation lives in small named checks and in preflight.py), and every field's declared
choices are enforced by the schema itself."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig

SRC = Path(__file__).resolve().parents[2] / "src" / "batchbound"
LONGEST = 60  # lines per function


@pytest.mark.parametrize("module", ["train/config.py", "train/preflight.py"])
def test_no_long_functions(module):
    tree = ast.parse((SRC / module).read_text())
    long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > LONGEST]
    assert long == []


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(TrainConfig)
                                  if "choices" in f.metadata])
def test_every_declared_choice_is_enforced(name):
    with pytest.raises(BatchboundError, match=f"unknown {name} 'nonsense'; choose from"):
        TrainConfig(**{name: "nonsense"})
