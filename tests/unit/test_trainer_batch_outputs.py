"""The trainer's batch-output check and parameters no loss reaches: ordinary models and runs
keep training, with the same numbers whichever way the batch is split (micro-batches)."""

from __future__ import annotations

import warnings

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


def tempered_loss(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[0] / out[1], y, reduction="none")


def test_a_learned_temperature_output_trains_alike_with_and_without_micro_batches() -> None:
    """It was refused as a batch quantity (by its shape, (), with no dimension of the
    examples). No data flows into it, so it couples no examples: the objective is the same
    however the batch is split, and the temperature trains."""
    def run(**changes: object) -> torch.Tensor:
        config = TrainConfig(**{**SMALL, "momentum": 0.9, **changes})
        trainer = Trainer(config, DistContext(), parts=Parts(model=Tempered().double(),
                                                             loss=tempered_loss))
        assert trainer.run().status == "complete"
        return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])

    whole = run()
    assert float(whole[-1]) != 0.0  # log_t moved
    assert torch.allclose(whole, run(micro_batch=4), rtol=1e-11, atol=1e-13)
    assert torch.allclose(whole, run(micro_batch=2, online_diversity="two_batch"), rtol=1e-11,
                          atol=1e-13)


def test_a_learned_temperature_is_measured_as_the_float64_loop() -> None:
    from batchbound.diversity import OnlineDiversity, measure, monitored_step, watch

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 64, generator=g, dtype=torch.float64), torch.randint(0, 10, (6,),
                                                                                 generator=g)
    model = Tempered().double()
    with torch.no_grad():
        model.log_t.fill_(0.3)
    params = list(model.parameters())
    losses = tempered_loss(model(x), y)
    total, S = [torch.zeros_like(p) for p in params], 0.0
    for i in range(6):
        for t, grad in zip(total, torch.autograd.grad(losses[i], params, retain_graph=True),
                           strict=True):
            t += grad
            S += float(grad.square().sum())
    T = float(sum(t.square().sum() for t in total))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's cost, for log_t
        report = measure(model, (x, y), tempered_loss, chunk_size=6)
        got_s, got_t = report.S, report.T
        assert got_s == pytest.approx(S, rel=1e-10)
        assert got_t == pytest.approx(T, rel=1e-10)
        monitor, want = OnlineDiversity(1000, decay=0.0), OnlineDiversity(1000, decay=0.0)
        monitored_step(model, x, y, tempered_loss, monitor, reduction="sum")
        want.update_from_norms(S, T, 6)
        assert monitor.m2 == pytest.approx(want.m2, rel=1e-10)
        assert monitor.cross == pytest.approx(want.cross, rel=1e-9)
        model.zero_grad()
        # watch reads per-example gradients off the outputs' rows, and this one has none
        with pytest.raises(BatchboundError) as info, watch(model, OnlineDiversity(10)):
            tempered_loss(model(x), y).mean().backward()
    said = str(info.value)
    assert "output of the parameters alone, a learned temperature" in said
    assert "Use monitored_step()" in said and "\n" not in said


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


class NotAlone(nn.Module):
    """Outputs that look like a temperature but are not of the parameters alone."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.how = nn.Linear(64, 10), how
        self.log_t = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.log_t.exp()
        if self.how == "data":  # the same value at any batch, but the examples flow in
            t = t + 0.0 * x.sum()
        elif self.how == "size":  # no data, but the batch's size
            t = t * x.shape[0]
        else:  # a value read on the host
            t = t + 0.0 * float(x.sum())
        return self.lin(x), t


@pytest.mark.parametrize("how", ["data", "size", "host"])
def test_an_output_of_the_batch_that_looks_like_a_temperature_is_refused(how: str) -> None:
    from batchbound.diversity import measure

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 64, generator=g), torch.randint(0, 10, (6,), generator=g)
    with pytest.raises(BatchboundError) as info:
        measure(NotAlone(how), (x, y), tempered_loss, chunk_size=6)
    assert "reads output 1 of the model, shape ()" in str(info.value)
