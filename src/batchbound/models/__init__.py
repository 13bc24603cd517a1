"""batchbound.models: model families addressed by spec strings.

>>> from batchbound.models import build_model
>>> model = build_model("fc(depth=3,params=16000)", input_shape=(64,), num_outputs=10, seed=0)
"""

from batchbound.models import fc as _fc  # noqa: F401  (registers the fc family)
from batchbound.models.fc import solve_width, weight_count
from batchbound.models.registry import (
    build_model,
    count_parameters,
    family_names,
    get_family,
    register_family,
)

__all__ = [
    "build_model",
    "count_parameters",
    "family_names",
    "get_family",
    "register_family",
    "solve_width",
    "weight_count",
]
