"""The result of one exact measurement over a data set."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class DiversityReport:
    """S = Σ‖g_i‖², T = ‖Σg_i‖² over n examples; Δ = S/T, B = n·Δ, M2 = S/n.

    ``per_parameter_S`` splits S by parameter name, showing which layers carry the diversity.
    ``loss`` is the mean per-example loss. ``engine`` is the engine asked for, ``dtype`` the
    precision the gradients were computed in, ``world_size`` the number of ranks summed over.
    ``extra`` holds ``loss_name`` and ``fallback_parameters`` (those no layer rule covered,
    computed by torch.func vmap under engine="auto").
    """

    n: int
    S: float
    T: float
    per_parameter_S: dict[str, float]
    loss: float
    seconds: float
    engine: str
    dtype: str
    world_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def diversity(self) -> float:
        """Δ = S/T: 1/n for identical gradients, 1 for pairwise orthogonal ones. With T = 0
        (the full gradient vanishes) it is +inf, or nan when every gradient is zero."""
        if self.T == 0:
            return math.inf if self.S > 0 else math.nan
        return self.S / self.T

    @property
    def batch_bound(self) -> float:
        """B = n·Δ = 1 + B_simple (the simple gradient noise scale of McCandlish et al.)."""
        return self.n * self.diversity

    @property
    def m2(self) -> float:
        """M2 = S/n, the mean squared per-example gradient norm."""
        return self.S / self.n

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict; a non-finite Δ or B (T = 0) becomes None."""
        return {
            "n": self.n,
            "S": self.S,
            "T": self.T,
            "diversity": _finite_or_none(self.diversity),
            "batch_bound": _finite_or_none(self.batch_bound),
            "m2": self.m2,
            "loss": self.loss,
            "per_parameter_S": dict(self.per_parameter_S),
            "seconds": self.seconds,
            "engine": self.engine,
            "dtype": self.dtype,
            "world_size": self.world_size,
            **self.extra,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)
