"""The papers' experiments beyond the batch-size sweep, one module each, gathered in one
registry (``registry.py``): the imports below are the complete list, so a new experiment is
one module and one line here."""

from batchbound.study.experiments import (
    architectures,
    generalization,
    replication,
    stability,
    theory,
    timing,
)
from batchbound.study.experiments.registry import (
    EXPERIMENTS,
    Section,
    register_experiment,
    sections,
)

__all__ = ["EXPERIMENTS", "Section", "architectures", "generalization", "register_experiment",
           "replication", "sections", "stability", "theory", "timing"]
