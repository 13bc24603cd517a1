"""Closed-form bounds on the batch-size bound B = n·Δ, to show beside measured values.

Pure functions of shapes and data, no torch models. Sources:

- [width] (width vs depth), Theorems 1 and 3: linear networks with Gaussian data and weights;
- [diversity] (gradient diversity), Remarks 1 and 2: generalized linear models and sparse conflicts;
- [inefficiency]: the speedup ratio s(m; m0) = k(m0)/k(m).

Critical-batch-size fits (McCandlish et al.) belong to the study's analysis, not here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from batchbound.errors import BatchboundError

ArrayLike = np.ndarray | torch.Tensor | Sequence[Sequence[float]]


def two_layer_linear_bound(n: int, width: int, input_dim: int) -> float:
    """[width], Theorem 1: a 2-layer linear network (one hidden layer of ``width`` K, input
    dimension d, one output) has B_S ≳ nKd / (Kn + dn + Kd) with constant probability.

    The theorem is stated up to constants (Θ(nKd)/Θ(Kn+dn+Kd)); this returns the expression
    with all constants 1, so it gives the order of magnitude, not a guaranteed lower bound.
    For large n it tends to Kd/(K+d), increasing in the width and never above d.
    """
    _positive(n=n, width=width, input_dim=input_dim)
    n, k, d = float(n), float(width), float(input_dim)
    return n * k * d / (k * n + d * n + k * d)


def linear_network_rho_bound(input_dim: int, hidden_widths: Sequence[int]) -> float:
    """[width], Theorem 3: for an L-layer linear network with N(0,1) weights and inputs,
    ρ = E[n Σ‖∇f_i‖²] / E[‖Σ∇f_i‖²] ≥ L / (Σ_{φ=1}^{L−1} (L−φ)/(K_φ − 1) + 2L/(d − 1)).

    [width]'s L counts *weight matrices*: ``hidden_widths`` = (K_1, ..., K_{L−1}) are the
    hidden layer widths and L = len(hidden_widths) + 1. batchbound's ``fc(depth=...)`` counts
    hidden layers, so an ``fc(depth=D, width=K)`` network has L = D + 1 here
    (``hidden_widths=[K] * D``). The output is a single unit (K_L = 1) in the theorem.
    With equal widths K this is 1 / ((L−1)/(2(K−1)) + 2/(d−1)) = Θ(dK/(dL + K)).

    ρ is a ratio of expectations, the seed's stand-in for the expected batch-size bound.
    Needs d ≥ 2 and every K_φ ≥ 2.
    """
    widths = [int(k) for k in hidden_widths]
    if input_dim < 2 or any(k < 2 for k in widths):
        raise BatchboundError(
            f"the depth bound needs input_dim ≥ 2 and every hidden width ≥ 2, got "
            f"input_dim={input_dim}, hidden_widths={widths}"
        )
    layers = len(widths) + 1
    hidden = sum((layers - phi) / (k - 1) for phi, k in enumerate(widths, start=1))
    return layers / (hidden + 2 * layers / (input_dim - 1))


def glm_batch_bound(features: ArrayLike) -> float:
    """[diversity], Remark 1: for a generalized linear loss f_i(w) = ℓ_i(x_iᵀw),
    B_S(w) ≥ n · min_i ‖x_i‖² / σ_max(X)² for every w, where X is the (n, d) feature matrix.

    It holds for any ℓ_i (convex or not) and also for multi-output linear models
    (per-example gradients a_i x_iᵀ). A model with a bias is a GLM in the features with a
    constant 1 appended: pass that augmented matrix.
    """
    x = _matrix(features, "features")
    n = x.shape[0]
    sigma_max = float(np.linalg.norm(x, ord=2))
    if sigma_max == 0.0:
        raise BatchboundError("the feature matrix is all zeros; the GLM bound is undefined")
    return n * float((x**2).sum(axis=1).min()) / sigma_max**2


def conflict_graph_max_degree(supports: ArrayLike) -> int:
    """The maximum degree ρ of [diversity]'s conflict graph: examples i ≠ j are adjacent when the
    supports of their gradients overlap. ``supports`` is an (n, d) matrix whose nonzero
    entries mark the coordinates each example's gradient may touch (e.g. the feature matrix of
    a sparse linear model, or the gradients themselves)."""
    mask = (_matrix(supports, "supports") != 0).astype(np.int64)
    overlaps = (mask @ mask.T) > 0
    np.fill_diagonal(overlaps, False)
    return int(overlaps.sum(axis=1).max()) if len(overlaps) else 0


def sparse_conflict_batch_bound(n: int, max_degree: int) -> float:
    """[diversity], Remark 2: with sparse conflicts of maximum degree ρ, B_S(w) ≥ n / (ρ + 1)."""
    _positive(n=n)
    if max_degree < 0:
        raise BatchboundError(f"max_degree must be ≥ 0, got {max_degree}")
    return n / (max_degree + 1)


def batch_bound_from_noise_scale(noise_scale: float) -> float:
    """n·Δ = 1 + B_simple, where B_simple = tr(Σ)/‖G‖² (McCandlish et al. 2018)."""
    return 1.0 + noise_scale


def speedup_ratio(iterations: float, base_iterations: float) -> float:
    """[inefficiency]: s(m; m0) = k(m0) / k(m), the number of iterations to reach the target with
    the base batch size m0 over that with batch size m. Linear scaling gives s = m/m0."""
    _positive(iterations=iterations, base_iterations=base_iterations)
    return base_iterations / iterations


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise BatchboundError(f"{name} must be > 0, got {value}")


def _matrix(data: ArrayLike, name: str) -> np.ndarray:
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu().double().numpy()
    x = np.asarray(data, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0:
        raise BatchboundError(f"{name} must be a non-empty (n, d) matrix, got shape {x.shape}")
    return x
