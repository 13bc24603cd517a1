"""Checking an engine against the float64 per-example loop, the obviously correct reference:
one forward and one backward per example."""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from batchbound.diversity import PerExampleStats, per_example_stats

RTOL = 1e-9


def feature_loss(out: Tensor, y: Tensor) -> Tensor:
    """A non-linear per-example loss for any output shape: Σ_j tanh(out_j)·y_j."""
    return (torch.tanh(out).reshape(out.shape[0], -1) * y).sum(dim=1)


def feature_targets(model: nn.Module, x: Tensor) -> Tensor:
    with torch.no_grad():
        width = model(x).reshape(x.shape[0], -1).shape[1]
    return torch.randn(x.shape[0], width, dtype=torch.float64)


def assert_exact(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss: Any,
    *,
    engine: str = "auto",
    fallback: bool = False,
    warns: str | None = None,
) -> PerExampleStats:
    """``engine``'s per-example norms and gradient sums equal the float64 loop's, to RTOL
    relative. ``fallback``: whether some parameter went to an exact fallback engine (with a
    batchbound warning, which must match the regex ``warns`` when given) or none did (and
    nothing was warned but what matches ``warns``)."""
    model = model.double()
    x = x.double() if isinstance(x, Tensor) and x.is_floating_point() else x
    reference = per_example_stats(model, x, y, loss, engine="loop")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = per_example_stats(model, x, y, loss, engine=engine)
    ours = [w for w in caught if "batchbound" in str(w.message)]
    messages = [str(w.message) for w in ours]
    if fallback:
        assert got.fallback and messages
        assert warns is None or any(re.search(warns, m, re.S) for m in messages), messages
    else:
        assert not got.fallback, messages
        assert all(warns is not None and re.search(warns, m, re.S) for m in messages), messages
    assert got.sq_norms.keys() == reference.sq_norms.keys()
    scale = float(reference.total_sq_norms.max())
    for name in reference.sq_norms:
        torch.testing.assert_close(got.sq_norms[name], reference.sq_norms[name],
                                   rtol=RTOL, atol=RTOL * scale, msg=lambda m, k=name: f"{k}: {m}")
        torch.testing.assert_close(got.grad_sum[name], reference.grad_sum[name],
                                   rtol=RTOL, atol=RTOL * scale**0.5,
                                   msg=lambda m, k=name: f"{k}: {m}")
    torch.testing.assert_close(got.losses, reference.losses, rtol=RTOL, atol=1e-12)
    assert abs(got.S - reference.S) <= RTOL * reference.S
    assert abs(got.T - reference.T) <= RTOL * max(reference.T, reference.S)
    return got


def loop_gradients(model: nn.Module, x: Tensor, y: Tensor, loss: Any) -> Tensor:
    """(n, d) per-example gradients of a float64 copy of ``model`` (left as it is), one
    backward per example: the reference the engines are checked against."""
    model = copy.deepcopy(model).double()
    rows = []
    for i in range(x.shape[0]):
        model.zero_grad()
        loss(model(x[i : i + 1].double()), y[i : i + 1]).sum().backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return torch.stack(rows)
