"""The layer rules compute in float32 also when the backward runs under autocast
(``measure()`` called inside an autocast block, or ``loss.backward()`` inside it): autocast
used to cast their float32 products back to bfloat16 (two casts each) and round the
per-example gradients and their norms to bfloat16."""

from __future__ import annotations

import torch
from torch import nn

from batchbound.diversity import PreparedStats


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 5)).eval()


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() * y).reshape(out.shape[0], -1).sum(dim=1)


def test_rules_under_autocast_compute_in_float32() -> None:
    model = _model()
    x, y = torch.randn(6, 7, 12), torch.randn(6, 7, 5)  # sequences: products, not ‖a‖‖b‖
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = PreparedStats(model, _loss)(x, y)  # forward and backward under autocast
    assert {t.dtype for t in inside.sq_norms.values()} == {torch.float32}
    exact = PreparedStats(_model().double(), _loss, engine="loop")(x.double(), y.double())
    assert abs(inside.S / exact.S - 1) < 0.02  # bfloat16 forward: about 2 digits
