"""A model whose trainable parameters are of two precisions (a float32 layer beside float64
ones) computes that layer's gradients in float32, whichever engine measures it. The loop and
vmap engines stated the first parameter's float64 where nothing requiring grad was cast (the
float32 layer fed from the data), and vmap's check against the loop then held float32's
rounding to float64's tolerance: engine='vmap' refused the model as one torch.func cannot see."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from batchbound.diversity import measure


class MixedBranches(nn.Module):
    """A float64 layer, and a float32 one on the same inputs cast from the data."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wide = nn.Linear(6, 3).double()
        self.narrow = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide(x) + self.narrow(x.float()).double()


def _data(b: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(b, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (b,),
                                                                              generator=g)


@pytest.mark.parametrize("engine", ["hooks", "loop", "vmap", "auto"])
def test_every_engine_states_the_lowest_parameter_precision(engine: str) -> None:
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = measure(MixedBranches(), (x, y), "cross_entropy", chunk_size=3,
                         engine=engine)
    assert report.dtype == "float32"
    reference = measure(MixedBranches(), (x, y), "cross_entropy", chunk_size=3,
                        engine="loop")
    assert report.diversity == pytest.approx(reference.diversity, rel=1e-5)
