"""batchbound.diversity: exact gradient diversity Δ = S/T and the batch-size bound B = n·Δ.

>>> from batchbound.diversity import measure
>>> report = measure(model, dataset)          # doctest: +SKIP
>>> report.diversity, report.batch_bound      # doctest: +SKIP

``per_example_stats`` (one chunk: per-example losses, squared norms per parameter and the
gradient sum, from one backward pass) and ``per_example_gradients`` (materialised, via
torch.func) are the building blocks for mechanisms, online estimators and the trainer.
"""

from batchbound.diversity.losses import LOSS_NAMES, cross_entropy, mse, resolve_loss
from batchbound.diversity.measure import measure
from batchbound.diversity.report import DiversityReport
from batchbound.diversity.stats import (
    ENGINES,
    PerExampleStats,
    per_example_gradients,
    per_example_l1_l2,
    per_example_stats,
)

__all__ = [
    "ENGINES",
    "LOSS_NAMES",
    "DiversityReport",
    "PerExampleStats",
    "cross_entropy",
    "measure",
    "mse",
    "per_example_gradients",
    "per_example_l1_l2",
    "per_example_stats",
    "resolve_loss",
]
