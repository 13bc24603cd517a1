"""The trainer's batch-output check and parameters no loss reaches: ordinary models and runs
keep training, with the same numbers whichever way the batch is split (micro-batches)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.data import Dataset
from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Parts, Trainer

SMALL = dict(dataset="digits", batch_size=8, lr=0.1, max_iterations=4,
             eval_every_iterations=4, dtype="float64")


class Squeezed(nn.Module):
    """A regression head written the common way: ``(n, 1) -> (n,)`` by ``squeeze()``, which
    gives a scalar for a batch of one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).squeeze()


def regression() -> Dataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, generator=g, dtype=torch.float64)
    return Dataset("toy", "regression", x, x[:, 0].clone(), x[:4], x[:4, 0].clone(), None, "t")


def test_a_squeezed_output_trains_with_one_example_a_step() -> None:
    config = TrainConfig(**{**SMALL, "batch_size": 1})
    trainer = Trainer(config, DistContext(), dataset=regression(),
                      parts=Parts(model=Squeezed().double(),
                                  loss=lambda out, y: (out - y) ** 2))
    result = trainer.run()
    assert result.status != "failed" and trainer.iteration == 4


class Tempered(nn.Module):
    """Logits and a learned temperature, a parameter's function and no batch quantity."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(64, 10)
        self.log_t = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), self.log_t.exp()


def test_a_learned_temperature_output_is_refused_saying_how_to_keep_it() -> None:
    """Known limit: an output with no examples' dimension is refused whether or not it
    depends on the batch (the graph does not show the data); the line says so and what to
    do, rather than calling a temperature a batch statistic only."""
    trainer = Trainer(TrainConfig(**SMALL), DistContext(),
                      parts=Parts(model=Tempered(), loss=lambda out, y: F.cross_entropy(
                          out[0] / out[1], y, reduction="none")))
    with pytest.raises(BatchboundError) as info:
        trainer.run()
    said = str(info.value)
    assert "learned temperature, is refused alike: apply it inside the model" in said
    assert "\n" not in said


class Unused(nn.Module):
    """A head the loss never reads (its parameters get no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.spare = nn.Linear(64, 10), nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_unreached_parameters_move_alike_with_and_without_micro_batches() -> None:
    def run(**changes: object) -> torch.Tensor:
        config = TrainConfig(**{**SMALL, "momentum": 0.9, "weight_decay": 0.1, **changes})
        trainer = Trainer(config, DistContext(), parts=Parts(model=Unused().double()))
        trainer.run()
        return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])

    assert torch.allclose(run(), run(micro_batch=4), rtol=1e-11, atol=1e-13)
