"""The prediction model's own error, as measured on jobs it was not fitted on.

The iterations' interval from the pilot (``trajectory.py``, ``critical.py``) covers the
estimator's sampling error and the extrapolation past the pilot; it takes McCandlish et al.'s
relation and the rate rules as exact. They are not: on the benchmark's jobs
(benchmarks/advise.py) the measured iterations at B = B0·2^d differ from the central
prediction by a factor that grows with d (×0.4–×1.5 at d = 2–6). ``model_error.json`` holds
those measured rows: per row the job (data, model, optimiser, B0, rate), the batch, the central
prediction and the measured iterations.

Per row the error per doubling is u = ln(measured / predicted) / log2(B / B0). For a job, the
band is the 10th to the 90th percentile of u over every recorded row of *other* jobs (a row of
the same job is left out, so no job is checked against its own errors), widened to contain 0,
and a row at d = |log2(B / B0)| doublings gets [k·e^(u_lo·d), k·e^(u_hi·d)] around its central
k. The iterations' interval is the union of the pilot's interval and this band. Below B0 no
error was measured: the band there is symmetric, ± the larger of |u_lo| and |u_hi|.

``benchmarks/advise.py --record FILE`` writes the file from a run's rows.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchbound.errors import BatchboundError
from batchbound.spec import parse_spec

RECORDED = Path(__file__).with_name("model_error.json")
QUANTILE = 0.1  # the band holds the middle 80 % of the other jobs' errors


@dataclass(frozen=True)
class ModelError:
    """The error band per doubling of B over B0, and what it was measured on."""

    low: float  # u_lo <= 0
    high: float  # u_hi >= 0
    rows: int  # recorded rows it rests on
    jobs: int  # distinct jobs among them
    left_out: int  # rows of this same job, not used

    def widen(self, central: float, interval: tuple[float, float], batch: int,
              b0: int) -> tuple[float, float]:
        """The union of ``interval`` and the band around ``central`` at ``batch``."""
        if not math.isfinite(central) or batch == b0:
            return interval
        doublings = abs(math.log2(batch / b0))
        low, high = (self.low, self.high) if batch > b0 else \
            (-max(-self.low, self.high), max(-self.low, self.high))
        return (min(interval[0], central * math.exp(low * doublings)),
                max(interval[1], central * math.exp(high * doublings)))

    def to_dict(self) -> dict[str, Any]:
        return {"per_doubling": [self.low, self.high], "quantiles": [QUANTILE, 1 - QUANTILE],
                "rows": self.rows, "jobs": self.jobs, "left_out": self.left_out}

    def text(self) -> str:
        return (f"the model's own error, measured on {self.rows} runs of {self.jobs} other "
                f"jobs (benchmarks/advise.py): ×e^({self.low:.3f}·d) to ×e^({self.high:.3f}·d) "
                "at d doublings of B over B0 (their middle 80 %), joined to the interval")


def job_key(dataset: str, model: str, optimizer: str, momentum: float, batch_size: int,
            lr: float) -> tuple[Any, ...]:
    """What makes two runs the same job. A data file is named by its file name, not the
    directory it was read from (the benchmark's held-out text lives in each user's home)."""
    return (_named(dataset), _named(model), optimizer, float(momentum), int(batch_size),
            float(lr))


def _named(text: str) -> Any:
    """A spec by its parts (a path by its file name); other names (a user's
    ``module:function``) as written, without spaces."""
    try:
        spec = parse_spec(text)
    except BatchboundError:
        return "".join(text.split())
    return (spec.name, tuple(sorted((k, Path(str(v)).name if k == "path" else str(v))
                                    for k, v in spec.kwargs.items())))


def _key_of(row: dict[str, Any]) -> tuple[Any, ...]:
    return job_key(row["dataset"], row["model"], row["optimizer"], row.get("momentum", 0.0),
                   row["b0"], row["lr"])


def load(path: Path = RECORDED) -> list[dict[str, Any]]:
    try:
        rows = json.loads(path.read_text())["rows"]
        return [r for r in rows if r["batch"] != r["b0"] and r["predicted"] > 0
                and 0 < r["measured"] < math.inf]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BatchboundError(f"cannot read the model's recorded errors {path}: {exc}") from exc


def error_for(key: tuple[Any, ...], rows: list[dict[str, Any]] | None = None) -> ModelError:
    """The band for the job ``key`` (``job_key``) from the recorded rows of other jobs."""
    rows = load() if rows is None else rows
    others = [r for r in rows if _key_of(r) != key]
    if not others:
        raise BatchboundError("no recorded run of another job to measure the model's error on")
    errors = sorted(math.log(r["measured"] / r["predicted"]) / abs(math.log2(r["batch"] /
                                                                              r["b0"]))
                    for r in others)
    return ModelError(min(_quantile(errors, QUANTILE), 0.0),
                      max(_quantile(errors, 1 - QUANTILE), 0.0), len(others),
                      len({_key_of(r) for r in others}), len(rows) - len(others))


def _quantile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    at = q * (len(values) - 1)
    lo, hi = math.floor(at), math.ceil(at)
    return values[lo] + (values[hi] - values[lo]) * (at - lo)


__all__ = ["QUANTILE", "RECORDED", "ModelError", "error_for", "job_key", "load"]
