"""A user's optimizer factory ``params -> Optimizer`` (advise and the trainer from Python), as
outside users write them: checked where it is called, so that what it does wrong is one
``BatchboundError`` naming the cause, never a traceback from inside torch and never a run
that silently trains something else (a factory over the caller's own model, which the
trainer never steps because it trains a copy; groups whose rates the trainer would flatten)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from batchbound.advise import advise
from batchbound.advise.inputs import from_objects
from batchbound.errors import BatchboundError
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Trainer


class LoRAMLP(nn.Module):
    """A frozen base Linear with a trainable low-rank A, B beside it, and a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(8, 16).requires_grad_(False)
        self.A = nn.Parameter(torch.randn(2, 8) / 8 ** 0.5)
        self.B = nn.Parameter(torch.randn(16, 2) * 0.1)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(x) + x @ self.A.t() @ self.B.t()))


def data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def trainer(model: nn.Module, optimizer, lr: float | None = None) -> Trainer:
    config, dataset, parts = from_objects(model, data(), "cross_entropy", optimizer,
                                          batch_size=8, lr=lr, seed=0, device="cpu")
    config = config.replace(max_epochs=None, max_iterations=3)
    return Trainer(config, DistContext(device=torch.device("cpu")), dataset=dataset,
                   parts=parts)


def decay_groups(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """nanoGPT's groups: weight decay on matrices only, one rate."""
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2],
                               "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2],
                               "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95))


def test_weight_decay_groups_with_one_rate_train_the_copy() -> None:
    model = LoRAMLP()
    run = trainer(model, decay_groups)
    held = [p for g in run.optimizer.param_groups for p in g["params"]]
    assert {id(p) for p in held} == {id(p) for p in run.params}
    assert len(held) == 4  # A, B, head's weight and bias; the frozen base is not given
    result = run.run()
    assert result.status == "complete"
    assert not torch.equal(run.model.head.weight, model.head.weight)  # the copy moved


def test_a_factory_over_the_callers_own_model_is_refused() -> None:
    """The trainer steps a copy: an optimizer over the caller's model would never move the
    copy, and the pilot would read an untrained model as a measured one."""
    model = LoRAMLP()
    own = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(BatchboundError, match="not given to it") as info:
        trainer(model, lambda params: torch.optim.AdamW(own, lr=1e-3))
    assert "copy" in str(info.value)


def test_a_factory_that_leaves_trainable_parameters_out_is_refused() -> None:
    with pytest.raises(BatchboundError, match="leaves 2 of the 4") as info:
        trainer(LoRAMLP(), lambda params: torch.optim.AdamW(params[:2], lr=1e-3))
    assert "requires_grad=False" in str(info.value)


def test_groups_with_different_rates_are_refused() -> None:
    """The trainer sets every group's rate from η0 and the rate rule: a group's own rate
    would be silently replaced."""
    def two_rates(params):
        return torch.optim.AdamW([{"params": params[:2], "lr": 1e-2},
                                  {"params": params[2:]}], lr=1e-3)

    with pytest.raises(BatchboundError, match="different rates") as info:
        trainer(LoRAMLP(), two_rates)
    assert "0.01" in str(info.value) and "0.001" in str(info.value)


@pytest.mark.parametrize(("factory", "words"), [
    (lambda params: torch.optim.AdamW(params, lr=1e-3, betas=(1.2, 0.9)),
     "the optimizer factory raised ValueError: Invalid beta parameter at index 0: 1.2"),
    (lambda params: 1 / 0, "the optimizer factory raised ZeroDivisionError"),
    (lambda params: None, "the optimizer factory returned a NoneType, not a "
                          "torch.optim.Optimizer"),
])
def test_a_bad_factory_is_one_line(factory, words: str) -> None:
    with pytest.raises(BatchboundError) as info:
        trainer(LoRAMLP(), factory, lr=1e-3)
    assert words in str(info.value) and "\n" not in str(info.value)
    # advise reads the factory's rate before anything else, and says the same
    with pytest.raises(BatchboundError) as info:
        advise(LoRAMLP(), data(), "cross_entropy", optimizer=factory, planned_epochs=2,
               critical_batch="noise", max_workers=1)
    assert words in str(info.value)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", None])
def test_a_model_with_nothing_to_train_is_refused(optimizer) -> None:
    frozen = nn.Linear(8, 3).requires_grad_(False)
    factory = None if optimizer is None else optimizer
    if optimizer is None:
        def factory(params):
            return torch.optim.AdamW(params, lr=1e-3)
    with pytest.raises(BatchboundError, match="no trainable parameters"):
        advise(frozen, data(), "cross_entropy", optimizer=factory, lr=1e-3, planned_epochs=2,
               critical_batch="noise", max_workers=1)


class NaNModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * math.nan


def test_a_loss_not_finite_at_the_initial_weights_is_not_blamed_on_the_rate() -> None:
    x, y = data(1024)
    with pytest.raises(BatchboundError) as info:
        advise(NaNModel(), (x, y), "cross_entropy", optimizer="adamw", lr=1e-3,
               planned_epochs=4, critical_batch="noise", max_workers=1)
    said = str(info.value)
    assert "initial weights" in said and "lower --lr" not in said


def test_an_adam_pilot_on_per_example_norms_says_its_noise_scale_is_euclidean() -> None:
    """Only the two-batch estimate can be weighted by Adam's 1/(√v̂ + ε); the norms the layer
    rules read cannot. The answer must not pass the Euclidean noise scale off as the one the
    steps take (the refusal for a pilot whose signal is below its noise suggests norms)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 8, generator=g)
    y = x[:, :3].argmax(1)
    advice = advise(LoRAMLP(), (x, y), "cross_entropy", optimizer="adamw", lr=3e-3,
                    batch_size=8, planned_epochs=2, critical_batch="noise", max_workers=1,
                    estimator="norms")
    assert advice.pilot["metric"] == "euclidean"
    assert "Euclidean metric" in advice.assumptions
    two_batch = advise(LoRAMLP(), (x, y), "cross_entropy", optimizer="adamw", lr=3e-3,
                       batch_size=8, planned_epochs=2, critical_batch="noise", max_workers=1)
    assert two_batch.pilot["metric"] == "adam"
    assert "Euclidean metric" not in two_batch.assumptions


@pytest.mark.parametrize(("make", "adaptive"), [
    (lambda p: torch.optim.AdamW(p, lr=1e-3), True),
    (lambda p: torch.optim.RMSprop(p, lr=1e-3), True),  # no betas, yet per-coordinate
    (lambda p: torch.optim.Adagrad(p, lr=1e-2), True),
    (lambda p: torch.optim.SGD(p, lr=0.1), False),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1),
     False),
])
def test_an_optimiser_that_scales_each_coordinate_is_adam_type(make, adaptive: bool) -> None:
    """Adam-type (the √ rate rule; the noise scale said to be Euclidean where it cannot be
    Adam's) is what the optimiser does, read off its steps, not whether it names betas."""
    from batchbound.advise.advice import _adaptive
    from batchbound.train import TrainConfig
    from batchbound.train.loop import Parts

    assert _adaptive(TrainConfig(), Parts(optimizer=make)) is adaptive
