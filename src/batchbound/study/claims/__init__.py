"""The papers' claims a study can test, gathered in one registry.

Each paper's claims live in their own module and register with ``@register_claim``; the
imports below are the complete list, so adding a claim means one function in one module (a
new paper: one module and one line here). ``registry.py`` holds the verdict rules.
"""

from batchbound.study.claims import diversity, inefficiency, noise_scale, slides, width
from batchbound.study.claims.registry import (
    CLAIMS,
    CONTRADICTED,
    INCONCLUSIVE,
    SUPPORTED,
    UNTESTABLE,
    ClaimEntry,
    Context,
    Finding,
    evaluate,
    register_claim,
)

__all__ = [
    "CLAIMS",
    "CONTRADICTED",
    "INCONCLUSIVE",
    "SUPPORTED",
    "UNTESTABLE",
    "ClaimEntry",
    "Context",
    "Finding",
    "diversity",
    "evaluate",
    "inefficiency",
    "noise_scale",
    "register_claim",
    "slides",
    "width",
]
