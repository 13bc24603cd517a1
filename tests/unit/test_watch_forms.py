"""What watch learns on a model's first call (its layers' axes, the check against the loop,
the marks on its outputs) holds for calls of the same form only: the same modules' train
flags and the same arguments' names and kinds, any value not a tensor itself. A later step
of another form is checked anew; before, the first form's check spoke for it, and a
statistic of the batch switched on by a mode or a number gave its numbers without a word."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchbound.diversity import OnlineDiversity, watch
from batchbound.errors import BatchboundError

B = 5


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,),
                                                                              generator=g)


class AuxInTraining(nn.Module):
    """In train mode, a load-balancing style loss of the batch beside the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        logits = self.b(torch.tanh(self.a(x)))
        if self.training:
            share = logits.softmax(-1).mean(0)
            return 3 * (share * share).sum(), logits
        return logits


def test_a_mode_that_adds_a_batch_output_is_checked_anew() -> None:
    """Eval first (logits alone), then train with the batch's loss in the loss: S was 14 %
    off the loop's."""
    torch.manual_seed(0)
    model, monitor = AuxInTraining().double().eval(), OnlineDiversity()
    x, y = batch(0)
    with watch(model, monitor):
        F.cross_entropy(model(x), y).backward()
    model.train()
    with pytest.raises(BatchboundError, match="the loss reads output 0 of the model, shape"), \
            watch(model, monitor):
        aux, logits = model(x)
        (F.cross_entropy(logits, y) + aux).backward()


class Mixing(nn.Module):
    """Blends each example's features with the batch's mean by ``mix`` (none at 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, mix: float = 0.0) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if mix:
            h = (1 - mix) * h + mix * h.mean(0, keepdim=True)
        return self.b(h)


def test_a_number_that_switches_on_a_statistic_of_the_batch_is_checked_anew() -> None:
    """mix=0.0 on the first step, 0.3 after: S was 30–35 % off the loop's."""
    torch.manual_seed(0)
    model, monitor = Mixing().double(), OnlineDiversity()
    x, y = batch(0)
    with watch(model, monitor):
        F.cross_entropy(model(x, mix=0.0), y).backward()
    with pytest.raises(BatchboundError, match="the examples interact"), watch(model, monitor):
        F.cross_entropy(model(x, mix=0.3), y).backward()


class FunctionalBatchNorm(nn.Module):
    """Batch normalisation written with F.batch_norm, which check_model_mode cannot see."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(width)), nn.Parameter(torch.zeros(width))
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("var", torch.ones(width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(h, self.mean, self.var, self.weight, self.bias, self.training)


def test_a_model_that_cannot_run_one_example_alone_is_refused_in_one_line() -> None:
    """In train mode its per-example loop raised a bare ValueError from inside batchbound."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), FunctionalBatchNorm(8), nn.Tanh(),
                          nn.Linear(8, 3)).double()
    monitor = OnlineDiversity()
    x, y = batch(0)
    with watch(model.eval(), monitor):
        F.cross_entropy(model(x), y).backward()
    with pytest.raises(BatchboundError, match=r"raised on example \d+ run alone \(ValueError") \
            as info, watch(model.train(), monitor):
        F.cross_entropy(model(x), y).backward()
    assert "\n" not in str(info.value)


class ScaledDropout(nn.Module):
    """A scale no layer rule takes (the exact fallback), after a dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(6, 8), nn.Dropout(0.0), nn.Linear(8, 3)
        self.scale = nn.Parameter(torch.full((8,), 1.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.tanh(self.a(x))) * self.scale)


def test_dropout_raised_after_the_first_step_is_replayed() -> None:
    """A dropout schedule from 0 to 0.4: the fallback took the model for one that draws no
    random numbers (read once per mode) and refused the step as a regulariser in the loss."""
    torch.manual_seed(0)
    model, monitor = ScaledDropout().double().train(), OnlineDiversity()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, p in enumerate([0.0, 0.4, 0.4]):
            model.drop.p = p
            x, y = batch(step)
            with watch(model, monitor):
                F.cross_entropy(model(x), y).backward()
            assert monitor.last is not None
