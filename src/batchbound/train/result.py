"""RunResult: what one training run leaves behind, serialisable to JSON.

``curves`` is one long table of rows ``(iteration, epoch, seconds, metric, value)``, the shape
the study store keeps. Metrics written by the trainer:

- ``batch_loss`` (every iteration: the global batch's mean loss), ``lr`` and ``batch_size``
  (at iteration 0 and at every change);
- ``train_loss``, ``train_acc``, ``test_loss``, ``test_acc`` at each evaluation (accuracies
  only on classification; train metrics on ``eval_subset`` when set);
- ``diversity`` and ``batch_bound`` (exact Δ and n·Δ, every ``diversity_every_epochs``);
- ``online_diversity`` and ``online_batch_bound`` (the online estimate, every iteration).

``seconds`` is training wall time: evaluation, exact diversity and checkpoints are excluded,
so time-to-target compares training alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from batchbound.train.config import TrainConfig

STATUSES = ("complete", "diverged", "failed", "stopped")
CURVE_COLUMNS = ("iteration", "epoch", "seconds", "metric", "value")


@dataclass
class TargetResult:
    name: str
    metric: str
    threshold: float
    reached: bool = False
    iteration: int | None = None
    epoch: float | None = None
    seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class RunResult:
    config: TrainConfig
    config_hash: str
    status: str = "complete"
    targets: list[TargetResult] = field(default_factory=list)
    curves: list[tuple[int, float, float, str, float]] = field(default_factory=list)
    timings: dict[str, Any] = field(default_factory=dict)
    final: dict[str, Any] = field(default_factory=dict)
    message: str = ""  # why the run ended (diverged at ..., error text, signal)
    environment: dict[str, Any] = field(default_factory=dict)  # world size, device, versions

    def curve(self, metric: str) -> list[tuple[int, float, float, float]]:
        """Rows ``(iteration, epoch, seconds, value)`` of one metric, in order."""
        return [(i, e, s, v) for i, e, s, m, v in self.curves if m == metric]

    def frame(self):  # type: ignore[no-untyped-def]
        """The curves as a pandas DataFrame with columns CURVE_COLUMNS."""
        import pandas as pd

        return pd.DataFrame(self.curves, columns=list(CURVE_COLUMNS))

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "config_hash": self.config_hash,
            "status": self.status,
            "targets": [t.to_dict() for t in self.targets],
            "curves": {
                "columns": list(CURVE_COLUMNS),
                "rows": [[i, e, s, m, _json_float(v)] for i, e, s, m, v in self.curves],
            },
            "timings": self.timings,
            "final": {k: _json_float(v) for k, v in self.final.items()},
            "message": self.message,
            "environment": self.environment,
        }

    def summary(self) -> dict[str, Any]:
        """What ``batchbound train --json`` prints: status, targets, final metrics, hash."""
        return {
            "status": self.status,
            "config_hash": self.config_hash,
            "targets": [t.to_dict() for t in self.targets],
            "final": {k: _json_float(v) for k, v in self.final.items()},
            "message": self.message,
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        rows = data.get("curves", {}).get("rows", [])
        return cls(
            config=TrainConfig.from_dict(data["config"]),
            config_hash=data["config_hash"],
            status=data["status"],
            targets=[TargetResult(**t) for t in data.get("targets", [])],
            curves=[
                (int(i), float(e), float(s), str(m), _from_json_float(v)) for i, e, s, m, v in rows
            ],
            timings=dict(data.get("timings", {})),
            final={k: _from_json_float(v) for k, v in data.get("final", {}).items()},
            message=data.get("message", ""),
            environment=dict(data.get("environment", {})),
        )

    @classmethod
    def from_json(cls, text: str) -> RunResult:
        return cls.from_dict(json.loads(text))


def _json_float(value: Any) -> Any:
    """NaN and infinities as strings: a diverged run's loss must survive strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _from_json_float(value: Any) -> Any:
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return value
