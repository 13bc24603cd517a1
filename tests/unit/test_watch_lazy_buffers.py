"""A buffer the model's forward builds on its first call (a lazily made cache of positions,
as some attention implementations keep one) is a buffer when the watched forward runs: on
the first step the model's check runs the forward before it, and watch() reads the buffers
after that check, so indexing by the cache is not taken for rows moved by the data."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from batchbound.diversity import OnlineDiversity, watch


class LazyCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.register_buffer("cache", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            self.cache = torch.arange(x.shape[1] - 1, -1, -1).float()  # a registered name
        return self.head(torch.tanh(self.a(x[:, self.cache.long()])))


def test_a_buffer_built_by_the_first_forward_is_read_as_one() -> None:
    model = LazyCache().eval()
    x, y = torch.randn(8, 5, 6), torch.randint(0, 3, (8, 5))
    monitor = OnlineDiversity(100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn its cost
        with watch(model, monitor):
            out = model(x)
            nn.functional.cross_entropy(out.transpose(1, 2), y).backward()
    assert monitor.steps == 1
