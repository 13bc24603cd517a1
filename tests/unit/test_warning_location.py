"""A warning names the user's line (the call of measure, the ``with watch(...)`` block), not
a line inside batchbound, whatever the depth it is raised at."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from batchbound.diversity import OnlineDiversity, measure, watch


class Scaled(nn.Module):
    """A parameter used outside any layer's call: the exact fallback takes it, with a warning."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) * self.scale


def ce(out: Tensor, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(out, y, reduction="none")


def data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)


def test_measure_warns_at_its_callers_line() -> None:
    x, y = data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        measure(Scaled(), (x, y), ce, chunk_size=8)
    said = [w for w in caught if "batchbound:" in str(w.message)]
    assert said and all(w.filename == __file__ for w in said), [(w.filename, w.lineno)
                                                                  for w in said]


def test_watch_warns_at_the_blocks_line() -> None:
    x, y = data()
    model, monitor = Scaled(), OnlineDiversity()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch(model, monitor):
            ce(model(x), y).mean().backward()
    said = [w for w in caught if "batchbound:" in str(w.message)]
    assert said and all(w.filename == __file__ for w in said), [(w.filename, w.lineno)
                                                                  for w in said]
