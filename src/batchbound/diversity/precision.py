"""Which precision a forward pass actually computed in, and what that means for the numbers.

A float32 model under ``torch.autocast`` (around the step or inside its forward) runs its
matrix products in bfloat16 or float16, and a model may hold low-precision parameters. Its
gradients then carry that rounding. The per-example norms are read from the activations and
output gradients the model actually used and accumulated in float32 and float64; what the
precision decides is how closely they can agree with a per-example loop, which rounds its
own batches of one differently, so the self-check's tolerance is set from it
(``rule_check.tolerance``), and every report states it.

The precision is observed, not assumed: ``rows.RowTracker`` sees every ATen operation of the
forward (after autocast's casts) and notes the lowest floating dtype any of them produced.
"""

from __future__ import annotations

import math

import torch

from batchbound.diversity.stats import LOW_PRECISION

__all__ = ["LOW_PRECISION", "autocast_dtypes", "digits", "lowest", "name", "statement"]
_RANK = {torch.float16: 0, torch.bfloat16: 0, torch.float32: 1, torch.float64: 2}


def lowest(*dtypes: torch.dtype | None) -> torch.dtype:
    """The least precise of the floating ``dtypes`` (None entries ignored; float32 if none)."""
    best, rank = torch.float32, 3  # one pass, no list: called per tensor of every call
    for d in dtypes:
        r = _RANK.get(d, 3)  # type: ignore[arg-type]
        if r < rank:
            best, rank = d, r
    return best  # type: ignore[return-value]


def autocast_dtypes() -> list[torch.dtype]:
    """The dtypes of the autocast contexts active now. An operation may compute inside itself
    in autocast's dtype and return float32 (``nn.Bilinear`` on CPU), which no dispatch mode
    sees, and a dispatch mode changes that: the per-example loop, run without one, can then
    round where the observed pass did not."""
    return [torch.get_autocast_dtype(d) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]


def name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def digits(dtype: torch.dtype) -> int:
    """Significant decimal digits of a floating dtype's mantissa (bfloat16: 2, float16: 3)."""
    return int(-math.log10(torch.finfo(dtype).eps))


def statement(used: torch.dtype, parameters: torch.dtype) -> str:
    """One sentence for a report: the precision used, where it came from, what it costs."""
    where = "" if used == parameters else (
        f" (autocast or casts in the forward; its parameters are {name(parameters)})")
    return (f"{name(used)} gradients: the model computes in {name(used)}{where}, so its "
            f"per-example gradients carry {name(used)} rounding (unit roundoff "
            f"{torch.finfo(used).eps / 2:.1e}) and S, T and Δ hold about {digits(used)} "
            "significant digits (norms and sums accumulated in float32 and float64)")
