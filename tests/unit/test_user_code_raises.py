"""An exception the user's model, loss or data raise while batchbound runs them (in eval
mode for measure(), on parts of a batch for the check of the layer rules) is one
BatchboundError that says how they were run, chained to the original; one raised in
batchbound's own code passes as it is. Before, measure() on Hugging Face's Reformer (whose
backward asserts train mode) and a model that needs three examples ended in their own
AssertionError and ValueError."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from batchbound.diversity import (
    OnlineDiversity,
    PreparedStats,
    measure,
    per_example_stats,
    prepared,
    watch,
)
from batchbound.errors import BatchboundError

X, Y = torch.randn(6, 4), torch.randint(0, 3, (6,))


def loss(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, y, reduction="none")


class TrainsOnly(torch.autograd.Function):
    """The identity, whose backward asserts train mode (as Reformer's reversible layers)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, training: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.training = training
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        if not ctx.training:
            raise AssertionError("backward needs train mode")
        return grad, None


class BackwardInTrainMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(TrainsOnly.apply(self.a(x), self.training))


class AtLeastThree(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < 3:
            raise ValueError("needs three examples")
        return self.a(x)


def test_measure_names_a_backward_that_needs_train_mode() -> None:
    with pytest.raises(BatchboundError, match=r"^AssertionError: backward needs train mode "
                                              r"\(raised as .* in eval mode") as raised:
        measure(BackwardInTrainMode().train(), (X, Y), loss)
    assert isinstance(raised.value.__cause__, AssertionError)  # its traceback, chained
    per_example_stats(BackwardInTrainMode().train(), X, Y, loss)  # in its own mode: measured


@pytest.mark.parametrize("api", ["per_example_stats", "measure", "prepared", "watch"])
def test_a_model_that_needs_three_examples(api: str) -> None:
    model = AtLeastThree()
    with pytest.raises(BatchboundError, match=r"^ValueError: needs three examples \(raised "
                                              r"as .* any number of examples"):
        if api == "per_example_stats":
            per_example_stats(model, X, Y, loss)
        elif api == "measure":
            measure(model, (X, Y), loss)
        elif api == "prepared":
            PreparedStats(model, loss)(X, Y)
        else:
            with watch(model, OnlineDiversity()):
                F.cross_entropy(model(X), Y).backward()


def test_a_loss_and_a_data_set_that_raise() -> None:
    def missing(outputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return {"logits": outputs}["labels"]

    with pytest.raises(BatchboundError, match=r"^KeyError: 'labels' \(raised as"):
        measure(nn.Linear(4, 3), (X, Y), missing)

    class Broken(Dataset):
        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            if i == 4:
                raise OSError("file 4 unreadable")
            return X[i], Y[i]

    with pytest.raises(BatchboundError, match=r"^OSError: file 4 unreadable \(raised as "
                                              r"measure\(\) read the data"):
        measure(nn.Linear(4, 3), Broken(), loss, chunk_size=2)


def test_an_exception_in_batchbounds_own_code_passes_as_it_is(monkeypatch) -> None:
    """A bug of ours is not laid on the user's model: here a call in prepared.py with
    arguments the callee does not take (a builtin: no frame of its own)."""
    monkeypatch.setattr(prepared.PreparedStats, "_hooks", len)
    with pytest.raises(TypeError, match="len"):
        per_example_stats(nn.Linear(4, 3), X, Y, loss)


def test_running_out_of_memory_passes_as_it_is() -> None:
    """A caller retries with a smaller chunk on torch.OutOfMemoryError: it stays one."""

    class Hungry(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 4:
                raise torch.OutOfMemoryError("out of memory (simulated)")
            return self.a(x)

    with pytest.raises(torch.OutOfMemoryError):
        measure(Hungry(), (X, Y), loss)


def test_the_trainer_records_a_crash_in_its_measurement_as_a_failed_run() -> None:
    """A model that crashes mid-run is the run's result ('failed'), also where the step's
    norms run through batchbound's own passes; not a refusal of bad input."""
    from batchbound.train.config import TrainConfig
    from batchbound.train.distributed import DistContext
    from batchbound.train.loop import Parts, Trainer

    class Flaky(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.calls = nn.Linear(64, 10), 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training and x.shape[0] >= 8:
                self.calls += 1
                if self.calls == 5:
                    raise RuntimeError("a failure in my kernel")
            return self.a(x)

    config = TrainConfig(dataset="digits", batch_size=32, lr=0.1, max_iterations=8,
                         eval_every_iterations=8, online_diversity="norms")
    result = Trainer(config, DistContext(), parts=Parts(model=Flaky(), loss=loss)).run()
    assert result.status == "failed" and "a failure in my kernel" in result.message


def test_a_loss_raising_inside_torch_under_batchbounds_modes() -> None:
    """The loss runs under batchbound's own function mode (the precision it reads): a bad
    target raised below that mode's frame, which hands each operation on."""
    with pytest.raises(BatchboundError, match=r"^IndexError: Target \d is out of bounds"):
        measure(nn.Linear(4, 3), (X, Y + 5), loss, chunk_size=3)
