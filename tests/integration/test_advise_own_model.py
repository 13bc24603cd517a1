"""advise for a user's own model: from Python (a module, a DataLoader, a per-example loss and an
optimizer factory) and from the command line (``--model mymodels:small_cnn``), with a pilot
far shorter than the plan."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from batchbound.advise import advise
from batchbound.cli import main
from batchbound.data import load_dataset
from batchbound.errors import BatchboundError


class TwoTower(nn.Module):
    """Not a family batchbound ships: two branches over halves of the input, summed."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Sequential(nn.Linear(32, 24), nn.GELU())
        self.right = nn.Sequential(nn.Linear(32, 24), nn.Tanh())
        self.head = nn.Linear(24, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.left(x[:, :32]) + self.right(x[:, 32:]))


def per_example_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def test_advise_takes_a_module_a_dataloader_a_loss_and_an_optimizer():
    digits = load_dataset("digits")
    loader = DataLoader(TensorDataset(digits.x_train, digits.y_train), batch_size=100)
    model = TwoTower()
    before = [p.detach().clone() for p in model.parameters()]
    made = []

    def optimizer(params):
        made.append(1)
        return torch.optim.SGD(params, lr=0.1, momentum=0.5)

    advice = advise(model, loader, per_example_loss, optimizer=optimizer, batch_size=16,
                    lr=0.1, planned_epochs=3, pilot_fraction=0.2, max_workers=2)
    planned = math.ceil(3 * digits.n_train / 16)
    pilot = advice.pilot
    assert pilot["planned_iterations"] == planned
    assert pilot["iterations"] == math.ceil(0.2 * planned)
    assert made  # the user's optimizer trained the pilot
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    rows = advice.to_dict()["rows"]
    assert {r["workers"] for r in rows} == {1, 2}
    for r in rows:
        low, high = r["iterations_interval"]
        assert low <= r["iterations"] <= high
    at_b0 = next(r for r in rows if r["workers"] == 1 and r["batch_size"] == 16)
    assert at_b0["iterations"] == pytest.approx(planned)  # the plan itself, by construction
    two = next(r for r in rows if r["workers"] == 2 and r["best"])
    if advice.on_seconds:
        assert two["communication_seconds"] > 0  # the all-reduce timed on 2 gloo processes
    else:  # a busy machine: no seconds at all, rather than untrustworthy ones
        assert two["communication_seconds"] is None and advice.extra["timing_warning"]


def test_advise_refuses_a_plan_and_a_target_together_and_no_plan_at_all():
    digits = load_dataset("digits")
    with pytest.raises(BatchboundError, match="not both"):
        advise(TwoTower(), digits, planned_epochs=2,
               targets=({"metric": "train_acc", "threshold": 0.9},))
    with pytest.raises(BatchboundError, match="state the plan"):
        advise(TwoTower(), digits)
    with pytest.raises(BatchboundError, match="pilot fraction"):
        advise(TwoTower(), digits, planned_epochs=2, pilot_fraction=0)


MYMODELS = '''
import torch
from torch import nn


def small_cnn(input_shape, num_outputs, seed):
    torch.manual_seed(seed)  # as a user's factory does: advise must pass an int, not None
    side = int(round(input_shape[0] ** 0.5))
    return nn.Sequential(nn.Unflatten(1, (1, side, side)), nn.Conv2d(1, 6, 3, padding=1),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(6 * (side // 2) ** 2, num_outputs))
'''


def test_advise_cli_with_a_users_model_file(tmp_path: Path, monkeypatch, capsys):
    """The command line in this process, from the model file's folder as a user runs it
    (its timing ranks are fresh interpreters there); sys.path and ``mymodels`` put back."""
    (tmp_path / "mymodels.py").write_text(MYMODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "mymodels", raising=False)
    try:
        code = main(["advise", "--dataset", "digits", "--model", "mymodels:small_cnn", "--lr",
                     "0.1", "--target-train-acc", "0.95", "--max-workers", "2", "--json"])
    finally:
        sys.modules.pop("mymodels", None)
    out, err = capsys.readouterr()
    assert code == 0, err
    advice = json.loads(out)
    assert advice["recommended"]["workers"] in (1, 2)
    assert advice["pilot"]["iterations"] > 0
    assert "pilot:" in err and "about" in err  # the cost, said first
