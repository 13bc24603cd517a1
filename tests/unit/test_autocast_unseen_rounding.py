"""An operation that autocast lowers inside itself and that returns float32 (``nn.Bilinear``
on CPU: its ``_trilinear`` rounds in bfloat16) is unseen by the dispatch mode that observes the
precision, and a dispatch mode even stops the lowering. The per-example loop and the exact
fallback run without that mode, so they round where the observed pass did not. Held-out round
of issue 35: under bfloat16 autocast such a model was refused by watch() as "examples
interact" (the self-check's float32 tolerance), then as "not a sum over examples" (the
fallback's), and measure() stated float32 for numbers that carried bfloat16 rounding."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from training_models import loop_S_T

from batchbound.diversity import OnlineDiversity, measure, per_example_stats, watch


class BilinearNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bilinear = nn.Bilinear(6, 6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.bilinear(x, torch.tanh(x))


def _setup() -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(1)
    return BilinearNet(), torch.randn(8, 6), torch.randint(0, 3, (8,))


def test_bilinear_under_bf16_autocast_in_watch_is_measured_and_stated() -> None:
    model, x, y = _setup()
    S, _ = loop_S_T(copy.deepcopy(model).double(), (x.double(),), {},
                    lambda out, i: F.cross_entropy(out, y[i : i + 1], reduction="sum"), 8)
    monitor = OnlineDiversity(1000, decay=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with watch(model, monitor, reduction="sum"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            F.cross_entropy(out, y, reduction="sum").backward()
    assert monitor.m2 * 8 == pytest.approx(S, rel=0.02)
    assert monitor.precision.startswith("bfloat16")
    assert any("computes in bfloat16" in str(w.message) for w in caught)


def test_measure_under_autocast_states_the_fallbacks_precision() -> None:
    model, x, y = _setup()
    exact = per_example_stats(copy.deepcopy(model).double(), x.double(), y, "cross_entropy",
                              engine="loop")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            report = measure(model, (x, y), "cross_entropy")
    measured = report.S
    assert measured == pytest.approx(exact.S, rel=0.02)
    assert report.dtype == "bfloat16"
