"""Everything named in a plan is checked before the first run (issue 39): a study's trainer
entry point, and a user's model factory, imported and run on one example of the data (an
import that exits is an error; a shape that does not fit is named). Each is one line, exit 2,
before any work."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from bad_input import BAD_INPUT, refused
from study_processes import TRAINER

pytestmark = BAD_INPUT

MODELS = {
    "exits": "import sys\nsys.exit(0)\n\ndef make():\n    pass\n",
    "wrong_input": "from torch import nn\n\ndef make():\n"
                   "    return nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 10))\n",
    "wrong_output": "from torch import nn\n\ndef make(input_shape):\n"
                    "    return nn.Linear(input_shape[0], 3)\n",
    "exits_when_called": "import sys\n\ndef make():\n    sys.exit(3)\n",
    "fits": "from torch import nn\n\ndef make(input_shape, num_outputs):\n"
            "    return nn.Linear(input_shape[0], num_outputs)\n",
}
SPEC = """
[study]
name = "checks"
[data]
datasets = ["digits"]
[models]
specs = ["{model}"]
[batches]
sizes = [64]
[lr]
grid = [0.1]
tuning = "none"
[train]
targets = {{ train_acc = 0.5 }}
max_epochs = 1
repeats = 1
"""


@pytest.fixture
def models(tmp_path, monkeypatch):
    folder = tmp_path / "user"
    folder.mkdir()
    for name, text in MODELS.items():
        (folder / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    for name in MODELS:
        sys.modules.pop(name, None)


def _spec(tmp_path: Path, model: str = "fc(depth=1,width=8)") -> Path:
    path = tmp_path / "spec.toml"
    path.write_text(SPEC.format(model=model))
    return path


@pytest.mark.parametrize("trainer, match", [
    ("batchbound.study.adaptr:execute", r"cannot import batchbound\.study\.adaptr: "
                                        r"ModuleNotFoundError"),
    ("batchbound.study.adapter:exeucte", r"module batchbound\.study\.adapter has no 'exeucte'"),
    ("batchbound.study.adapter", r"give it as module:function"),
    ("batchbound.study.adapter:DEFAULT_TRAINER", r"DEFAULT_TRAINER is not callable"),
])
def test_a_trainer_typo_is_refused_before_any_run(tmp_path, capsys, trainer, match):
    """Every run was executed and recorded failed, the ModuleNotFoundError only in the
    store's error column."""
    store = tmp_path / "s.sqlite"
    refused(["study", "run", str(_spec(tmp_path)), "--store", str(store), "--jobs", "0",
             "--trainer", trainer, "--no-progress"], match, capsys)
    assert not store.exists()  # refused before the store is made


def test_a_known_trainer_passes_the_check():
    from batchbound.study.adapter import check_trainer

    check_trainer(TRAINER)
    check_trainer("batchbound.study.adapter:execute")


CASES = {
    "exits": r"model exits:make: importing exits called sys\.exit\(0\); a model's module must "
             r"not exit when imported",
    "exits_when_called": r"model exits_when_called:make: calling it with nothing raised "
                         r"SystemExit: 3",
    "wrong_input": r"model wrong_input:make does not take this data's examples: one example of "
                   r"shape \(64,\) \(float32\) raised RuntimeError: mat1 and mat2 shapes",
    "wrong_output": r"model wrong_output:make returns \(1, 3\) for one example of shape "
                    r"\(64,\); this classification data needs \(batch, 10\)",
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("command", ["advise", "train"])
def test_a_user_model_is_probed_before_any_work(tmp_path, capsys, models, case, command):
    spec = f"{case}:make"
    argv = {"advise": ["advise", "--model", spec, "--planned-epochs", "2"],
            "train": ["train", "--model", spec, "--max-iterations", "2", "--no-progress"]
            }[command]
    refused(argv, CASES[case], capsys)


def test_a_fitting_user_model_passes_the_probe(tmp_path, capsys, models):
    from batchbound.cli import main

    assert main(["train", "--model", "fits:make", "--max-iterations", "2", "--no-progress",
                 "--json"]) == 0
    capsys.readouterr()
