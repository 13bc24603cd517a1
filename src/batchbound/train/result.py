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

``snapshots`` (with ``snapshot_every_epochs``) is a list of ``(epoch, weights)``: the flat
trainable parameters in ``model.parameters()`` order, float32 numpy arrays on the CPU. In
``to_dict()`` they are ``{"epochs": [...], "dtype": "float32", "data": [base64 of each
array's little-endian bytes]}`` under the key ``snapshots``, present only when there are any.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchbound.errors import BatchboundError
from batchbound.train.config import TrainConfig

STATUSES = ("complete", "diverged", "failed", "stopped")
CURVE_COLUMNS = ("iteration", "epoch", "seconds", "metric", "value")
SNAPSHOT_DTYPE = "<f4"  # float32, little-endian: the bytes behind the base64 and the store's BLOBs


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
    snapshots: list[tuple[float, Any]] = field(default_factory=list)  # (epoch, flat weights)

    def curve(self, metric: str) -> list[tuple[int, float, float, float]]:
        """Rows ``(iteration, epoch, seconds, value)`` of one metric, in order."""
        return [(i, e, s, v) for i, e, s, m, v in self.curves if m == metric]

    def start_refusal(self) -> str | None:
        """Why a diverged run says nothing about its rate: its loss is not finite at the
        initial weights, before any step (the first evaluation's train loss, or the first
        step's batch loss, which is taken there too); None for any other run. The model or
        the loss is at fault there, which no rate changes; a run that diverges after a step
        is a result."""
        if self.status != "diverged":
            return None
        start = next((v for i, _, _, v in self.curve("train_loss") if i == 0), None)
        if start is not None and not math.isfinite(start):
            where = "the training loss"
        elif self.final.get("iterations", 0) <= 1 and not math.isfinite(
                self.final.get("batch_loss", math.nan)):  # diverged on its first batch
            where, start = "the first batch's loss", self.final.get("batch_loss", math.nan)
        else:
            return None
        return (f"{where} is {start} at the initial weights, before any step: the model or "
                "the loss gives a non-finite value there, which no learning rate changes")

    def frame(self):  # type: ignore[no-untyped-def]
        """The curves as a pandas DataFrame with columns CURVE_COLUMNS."""
        import pandas as pd

        return pd.DataFrame(self.curves, columns=list(CURVE_COLUMNS))

    def snapshot_matrix(self) -> tuple[np.ndarray, np.ndarray]:
        """(epochs, shape (k,); weights, shape (k, d) float32): the snapshots stacked."""
        epochs = np.array([e for e, _ in self.snapshots], dtype=np.float64)
        if not self.snapshots:
            return epochs, np.zeros((0, 0), dtype=np.float32)
        return epochs, np.stack([_weights(w) for _, w in self.snapshots])

    def to_dict(self) -> dict[str, Any]:
        out = {
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
        if self.snapshots:
            out["snapshots"] = encode_snapshots(self.snapshots)
        return out

    def summary(self) -> dict[str, Any]:
        """What ``batchbound train --json`` prints: status, targets, final metrics, hash, and
        the kernels and torch threads it computed with."""
        return {
            "status": self.status,
            "config_hash": self.config_hash,
            "targets": [t.to_dict() for t in self.targets],
            "final": {k: _json_float(v) for k, v in self.final.items()},
            "message": self.message,
            "kernels": self.environment.get("kernels"),
            "threads": self.environment.get("threads"),
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
            snapshots=decode_snapshots(data["snapshots"]) if data.get("snapshots") else [],
        )

    @classmethod
    def from_json(cls, text: str) -> RunResult:
        return cls.from_dict(json.loads(text))


def _weights(value: Any) -> np.ndarray:
    """A snapshot as a flat float32 numpy array (from a tensor or an array)."""
    if hasattr(value, "detach"):
        value = value.detach().to("cpu").float().numpy()
    return np.asarray(value, dtype=np.float32).reshape(-1)


def encode_snapshots(snapshots: list[tuple[float, Any]]) -> dict[str, Any]:
    """``{"epochs": [...], "dtype": "float32", "data": [base64, ...]}``: compact JSON."""
    return {
        "epochs": [float(e) for e, _ in snapshots],
        "dtype": "float32",
        "data": [
            base64.b64encode(_weights(w).astype(SNAPSHOT_DTYPE).tobytes()).decode("ascii")
            for _, w in snapshots
        ],
    }


def decode_snapshots(data: dict[str, Any]) -> list[tuple[float, np.ndarray]]:
    """The inverse of ``encode_snapshots``: (epoch, float32 array) pairs."""
    if data.get("dtype", "float32") != "float32":
        raise BatchboundError(f"snapshots of dtype {data.get('dtype')!r}; expected float32")
    return [
        (float(e), np.frombuffer(base64.b64decode(b), dtype=SNAPSHOT_DTYPE).astype(np.float32))
        for e, b in zip(data["epochs"], data["data"], strict=True)
    ]


def _json_float(value: Any) -> Any:
    """NaN and infinities as strings: a diverged run's loss must survive strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _from_json_float(value: Any) -> Any:
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return value
