"""batchbound.train: synchronous data-parallel mini-batch SGD on torch.distributed.

>>> from batchbound.train import TrainConfig, Target, train
>>> config = TrainConfig(dataset="digits", model="fc(depth=2,params=4000)", batch_size=64,
...                      lr=0.1, targets=(Target("train_acc", 0.95),), max_epochs=30)
>>> result = train(config)          # doctest: +SKIP
>>> result.status, result.targets[0].epoch   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from batchbound.train.config import TARGET_METRICS, Target, TrainConfig, target_list
from batchbound.train.result import RunResult, TargetResult

__all__ = [
    "TARGET_METRICS",
    "RunResult",
    "Target",
    "TargetResult",
    "TrainConfig",
    "run",
    "target_list",
    "train",
]


def train(config: TrainConfig, **kwargs: Any) -> RunResult:
    """Train per ``config`` (see batchbound.train.launch.train for the keyword options), on
    ``batchbound.kernels.threads()`` torch threads (1 unless $BATCHBOUND_THREADS is set; the
    caller's count is put back afterwards). A run whose loss is not finite at the initial
    weights is refused (BatchboundError, ``RunResult.start_refusal``): bad input, not a
    divergence; ``run`` returns it as the diverged result it is."""
    from batchbound.errors import BatchboundError

    result = run(config, **kwargs)
    refusal = result.start_refusal()
    if refusal is not None:
        raise BatchboundError(refusal)
    return result


def run(config: TrainConfig, **kwargs: Any) -> RunResult:
    """``train`` that returns every result, a run diverged at its initial weights included
    (a study records it as diverged, as any other run that diverged)."""
    from batchbound import kernels
    from batchbound.train.launch import train as _train

    with kernels.computing_threads():
        return _train(config, **kwargs)
