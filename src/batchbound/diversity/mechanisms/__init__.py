"""Gradient diversity under [diversity]'s diversity-inducing mechanisms (DIMs).

A DIM replaces each example's gradient g_i by a random surrogate M(g_i), drawn independently
per example. [diversity] (§4.4) defines the diversity under a DIM as a ratio of *expectations*
over the mechanism:

    Δ^DIM = Σ_i E‖M(g_i)‖² / E‖Σ_i M(g_i)‖²,        B^DIM = n·Δ^DIM.

With S = Σ‖g_i‖², T = ‖Σg_i‖², d parameters, independence across examples gives
E‖ΣM(g_i)‖² = Σ_i E‖M(g_i)‖² + Σ_{i≠j} ⟨E M(g_i), E M(g_j)⟩, hence closed forms in
(S, T, n, d, R) for each mechanism (docs/diversity-extras.md derives them):

- ``none``: M(g) = g, Δ = S/T;
- ``dropconnect(p)``: a Bernoulli(1 − p) keep-mask, Δ = S / (S + (1−p)(T−S));
- ``sgld(sigma)``: g + N(0, σ²I_d), Δ = (S + ndσ²) / (T + ndσ²);
- ``quantization`` (alias ``quantize``; ``per_tensor=true`` for one vector per tensor):
  [diversity]'s unbiased stochastic quantizer, Δ = R / (T − S + R), R = Σ_i ‖g_i‖₂‖g_i‖₁.

Theorem 7 ([diversity]): each of these is ≥ Δ whenever B = nΔ ≤ n, i.e. T ≥ S.

Layout, like the per-layer rules (``batchbound.diversity.rules``): ``registry.py`` holds the
spec (``Mechanism``, ``parse_mechanism``), the table ``MECHANISMS`` and the generic dispatch
(``diversity_under``, ``apply_mechanism``); ``estimate.py`` the Monte Carlo estimator and the
exact measurement on a model and data; one module per mechanism holds everything about it:
its options and their checks, its closed form, its samplers (per-example vectors with batch
dimensions, a worker's scaled gradient, and the summed gradient when per-example gradients
are not needed) and whether it needs R. The trainer (``batchbound.train.mechanisms``)
decides where mechanisms act and calls them through the table.

Adding a mechanism: write ``mechanisms/<name>.py`` with a ``sample`` function decorated by
``@register_mechanism("<name>", closed_form=..., options=..., ...)`` (see registry.py for
each argument; ``sgld.py`` is a small complete example) and add its module to the import
line below. The tests' toy mechanism (tests/unit/test_mechanism_registry.py) is the minimum.
"""

from typing import Any

# the complete list of mechanisms, in the order error messages and to_dict list them
from batchbound.diversity.mechanisms import none, dropconnect, sgld, quantization  # isort: skip
from batchbound.diversity.mechanisms.dropconnect import dropconnect_diversity, dropconnect_mask
from batchbound.diversity.mechanisms.estimate import (
    MechanismReport,
    MonteCarloEstimate,
    chunks_for,
    mechanism_diversities,
    mechanism_diversity,
    monte_carlo_diversity,
)
from batchbound.diversity.mechanisms.quantization import (
    quantization_diversity,
    quantize,
    quantize_group,
)
from batchbound.diversity.mechanisms.registry import (
    MECHANISMS,
    Mechanism,
    MechanismEntry,
    Option,
    Sums,
    apply_mechanism,
    diversity_under,
    mechanism_names,
    parse_mechanism,
    register_mechanism,
)
from batchbound.diversity.mechanisms.sgld import sgld_diversity, sgld_noise


def __getattr__(name: str) -> Any:
    # MECHANISM_NAMES stays importable and follows the table (mechanisms registered later too)
    if name == "MECHANISM_NAMES":
        return mechanism_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MECHANISMS",
    "Mechanism",
    "MechanismEntry",
    "MechanismReport",
    "MonteCarloEstimate",
    "Option",
    "Sums",
    "apply_mechanism",
    "chunks_for",
    "diversity_under",
    "dropconnect",
    "dropconnect_diversity",
    "dropconnect_mask",
    "mechanism_diversities",
    "mechanism_diversity",
    "mechanism_names",
    "monte_carlo_diversity",
    "none",
    "parse_mechanism",
    "quantization",
    "quantization_diversity",
    "quantize",
    "quantize_group",
    "register_mechanism",
    "sgld",
    "sgld_diversity",
    "sgld_noise",
]
