"""batchbound.diversity: exact gradient diversity Δ = S/T and the batch-size bound B = n·Δ.

>>> from batchbound.diversity import measure
>>> report = measure(model, dataset)          # doctest: +SKIP
>>> report.diversity, report.batch_bound      # doctest: +SKIP

``per_example_stats`` (one chunk: per-example losses, squared norms per parameter and the
gradient sum, from one backward pass) and ``per_example_gradients`` (materialised, via
torch.func) are the building blocks for mechanisms, online estimators and the trainer.
"""

from batchbound.diversity.calls import Inputs, inputs
from batchbound.diversity.differential import DifferentialReport, differential_diversity
from batchbound.diversity.losses import (
    LOSS_NAMES,
    cross_entropy,
    mse,
    resolve_loss,
    sequence_cross_entropy,
)
from batchbound.diversity.measure import measure
from batchbound.diversity.mechanisms import (
    MechanismReport,
    apply_mechanism,
    dropconnect_mask,
    mechanism_diversities,
    mechanism_diversity,
    monte_carlo_diversity,
    parse_mechanism,
    quantize,
    quantize_group,
    sgld_noise,
)
from batchbound.diversity.online import OnlineDiversity
from batchbound.diversity.prepared import (
    PreparedStats,
    per_example_gradients,
    per_example_l1_l2,
    per_example_stats,
)
from batchbound.diversity.report import DiversityReport
from batchbound.diversity.stats import ENGINES, PerExampleStats
from batchbound.diversity.steps import monitored_step, watch

__all__ = [
    "ENGINES",
    "LOSS_NAMES",
    "DifferentialReport",
    "DiversityReport",
    "Inputs",
    "MechanismReport",
    "OnlineDiversity",
    "PerExampleStats",
    "PreparedStats",
    "apply_mechanism",
    "cross_entropy",
    "differential_diversity",
    "dropconnect_mask",
    "inputs",
    "measure",
    "mechanism_diversities",
    "mechanism_diversity",
    "monitored_step",
    "monte_carlo_diversity",
    "mse",
    "parse_mechanism",
    "per_example_gradients",
    "per_example_l1_l2",
    "per_example_stats",
    "quantize",
    "quantize_group",
    "resolve_loss",
    "sequence_cross_entropy",
    "sgld_noise",
    "watch",
]
