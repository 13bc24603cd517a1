"""The Python API's functions put the caller's torch thread count back when they fail too
(kernels.computing_threads / on_threads), not only when they return."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from batchbound.advise import advise
from batchbound.diversity import measure
from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig


class Failing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert torch.get_num_threads() == 1  # inside: batchbound's one thread
        raise RuntimeError("the user's forward fails")


def test_the_callers_thread_count_is_back_after_an_error() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        config = TrainConfig(dataset="digits", model="fc(depth=1,params=800)", batch_size=16)
        with pytest.raises(BatchboundError, match="unknown critical batch source"):
            advise(config, planned_epochs=1, critical_batch="guess")
        assert torch.get_num_threads() == 3
        with pytest.raises(BatchboundError, match="RuntimeError: the user's forward fails"):
            measure(Failing(), (torch.randn(4, 3), torch.randint(0, 2, (4,))),
                    loss="cross_entropy")
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
