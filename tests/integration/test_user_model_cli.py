"""A user's own model on the command line: ``--model MODULE:CALLABLE`` for measure, train,
models describe and advise, imported from the current directory as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from batchbound.cli import main

MODELS = '''
import torch
from torch import nn


class SmallCNN(nn.Module):
    """Written the way a user writes one: 8x8 digits as flat vectors, a conv, a head."""

    def __init__(self, classes):
        super().__init__()
        self.conv = nn.Conv2d(1, 6, 3, padding=1)
        self.head = nn.Linear(6 * 4 * 4, classes)

    def forward(self, x):
        h = torch.relu(self.conv(x.view(-1, 1, 8, 8)))
        return self.head(torch.max_pool2d(h, 2).flatten(1))


def small_cnn(num_outputs):
    return SmallCNN(num_outputs)


def seeded(input_shape, num_outputs, seed):
    torch.manual_seed(1000 + seed)
    return nn.Sequential(nn.Linear(input_shape[0], 16), nn.Tanh(), nn.Linear(16, num_outputs))


def no_arguments():
    return nn.Sequential(nn.Linear(64, 10))


def not_a_module():
    return 3


def raises():
    raise ValueError("no GPU here")


class NaNHead(nn.Linear):
    def forward(self, x):
        return super().forward(x) * float("nan")


def nan_at_start(num_outputs):
    return NaNHead(64, num_outputs)


def batch_norm_mlp(input_shape, num_outputs):
    return nn.Sequential(nn.Linear(input_shape[0], 16), nn.BatchNorm1d(16), nn.ReLU(),
                         nn.Linear(16, num_outputs))


class LogitsAndLoss(nn.Module):
    """nanoGPT's forward: (logits, loss), the loss None without targets."""

    def __init__(self, classes):
        super().__init__()
        self.head = nn.Linear(64, classes)

    def forward(self, x, targets=None):
        return self.head(x), None


def logits_and_loss(num_outputs):
    return LogitsAndLoss(num_outputs)


def wrong_width(num_outputs):
    return nn.Sequential(nn.Linear(7, num_outputs))
'''


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchbound", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture()
def home(tmp_path: Path) -> Path:
    (tmp_path / "mymodels.py").write_text(MODELS)
    return tmp_path


@pytest.fixture()
def in_home(home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``home`` as this process's current directory, for the CLI called in this process
    (``batchbound.cli.main``: no interpreter start per call); sys.path and the imported
    ``mymodels`` are put back afterwards. ``test_train_takes_a_factory_...`` and
    ``test_a_bad_factory_run_as_a_process...`` keep the real process and its exit code."""
    monkeypatch.chdir(home)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "mymodels", raising=False)
    yield home
    sys.modules.pop("mymodels", None)


def test_measure_and_describe_take_a_factory_from_the_current_directory(in_home, capsys):
    assert main(["measure", "--dataset", "digits", "--model", "mymodels:small_cnn",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["params"] == 6 * 9 + 6 + 96 * 10 + 10 and report["depth"] == 1
    assert report["batch_bound"] > 1 and report["fallback_parameters"] == []
    assert main(["models", "describe", "mymodels:no_arguments", "--dataset", "digits"]) == 0
    assert "Linear" in capsys.readouterr().out


def test_train_takes_a_factory_from_the_current_directory(home):
    """As its own process, as a user runs it (``python -m`` puts the folder on the path),
    and on 2 workers, whose ranks import the factory too."""
    done = run(["train", "--dataset", "digits", "--model", "mymodels:seeded", "-B", "32",
                "--lr", "0.1", "--max-epochs", "1", "--workers", "2", "--json"], home)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "complete"


def test_the_seed_reaches_the_factory_and_fixes_the_initialisation(in_home, capsys):
    # in this process: the second seed-0 call also sees the global RNG the first one left
    outs = []
    for s in ("0", "0", "1"):
        assert main(["measure", "--dataset", "digits", "--model", "mymodels:seeded", "--seed",
                     s, "--json"]) == 0
        outs.append(capsys.readouterr().out)
    values = [json.loads(o)["S"] for o in outs]
    assert values[0] == values[1] != values[2]


BAD_FACTORIES = [
    ("nomodule:f", "no module 'nomodule'"),
    ("mymodels:missing", "has no callable 'missing'"),
    ("mymodels:not_a_module", "returned a int, not a torch.nn.Module"),
    ("mymodels:raises", "raised ValueError: no GPU here"),
    # was a traceback from the named loss (AttributeError: 'tuple' object has no 'dim')
    ("mymodels:logits_and_loss", "returns tuple for one example of shape (64,)"),
    # was torch's traceback from the first chunk, exit 1: one example is tried first, as
    # train does
    ("mymodels:wrong_width", "does not take this data's examples: one example of shape (64,)"),
]


@pytest.mark.parametrize("spec, words", BAD_FACTORIES)
def test_a_bad_factory_is_one_line_and_exit_2(in_home, capsys, spec, words):
    assert main(["measure", "--dataset", "digits", "--model", spec]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_a_bad_factory_run_as_a_process_is_one_line_and_exit_2(home):
    """The exit code and stderr of a real process, for one case (the others in-process)."""
    spec, words = BAD_FACTORIES[-1]
    done = run(["measure", "--dataset", "digits", "--model", spec], home)
    assert done.returncode == 2
    assert words in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_train_refuses_a_loss_not_finite_at_the_initial_weights(in_home, capsys):
    """As advise does: exit 2, one line naming the cause, not 'diverged' and exit 0."""
    code = main(["train", "--dataset", "digits", "--model", "mymodels:nan_at_start", "-B", "32",
                 "--lr", "0.1", "--max-iterations", "5", "--json"])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert "at the initial weights, before any step" in err
    assert len(err.strip().splitlines()) == 1 and out == ""


def test_advise_takes_a_batch_norm_mlp_that_cannot_step_on_one_example(in_home, capsys):
    """BatchNorm1d in train mode cannot take a batch of one: the model check refused the
    model as one that 'does not take this data's examples' (it ran one example in train
    mode), and the step timers (here and on 2 processes) failed at micro-batch 1.
    The check runs in eval mode; the timers start at the first size the step runs at, and
    no row asks for a micro-batch below it."""
    code = main(["advise", "--dataset", "digits", "--model", "mymodels:batch_norm_mlp",
                 "--lr", "0.1", "--planned-epochs", "3", "--critical-batch", "noise",
                 "--max-workers", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    answer = json.loads(out)
    ones = [r for r in answer["rows"] if r["batch_size"] // r["workers"] < 2]
    assert ones and all(r["seconds_to_target"] is None for r in ones)  # never timed: no time
    assert answer["recommended"]["batch_size"] // answer["recommended"]["workers"] >= 2
