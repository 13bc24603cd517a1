"""Gradient diversity under seed 001's diversity-inducing mechanisms (DIMs).

A DIM replaces each example's gradient g_i by a random surrogate M(g_i), drawn independently
per example. Seed 001 (§4.4) defines the diversity under a DIM as a ratio of *expectations*
over the mechanism:

    Δ^DIM = Σ_i E‖M(g_i)‖² / E‖Σ_i M(g_i)‖²,        B^DIM = n·Δ^DIM.

With S = Σ‖g_i‖², T = ‖Σg_i‖², d parameters and q = 1 − p, independence across examples
gives E‖ΣM(g_i)‖² = Σ_i E‖M(g_i)‖² + Σ_{i≠j} ⟨E M(g_i), E M(g_j)⟩, hence:

- ``dropconnect(p)``, M(g) = D g with D a diagonal mask keeping each coordinate with
  probability q: E‖Dg‖² = q‖g‖², E Dg = q g, so Δ = qS / (qS + q²(T−S)) = S / (S + q(T−S)).
  The rescaled mask D/q used in training gives S/q over S/q + (T−S): the same Δ, because
  Δ is a ratio and the scale cancels.
- ``sgld(sigma)``, M(g) = g + ξ, ξ ~ N(0, σ²I_d): Δ = (S + ndσ²) / (T + ndσ²).
- ``quantization`` (alias ``quantize``), [Q(v)]_l = ‖v‖₂ sign(v_l) η_l with
  P(η_l = 1) = |v_l|/‖v‖₂: Q is unbiased and E‖Q(v)‖² = ‖v‖₂‖v‖₁, so with
  R = Σ_i ‖g_i‖₂‖g_i‖₁, Δ = R / (T − S + R).
  By default v is the whole flattened gradient; ``quantization(per_tensor=true)`` quantizes
  each parameter tensor on its own, and R sums ‖g_ip‖₂‖g_ip‖₁ over tensors p.

Theorem 7 (seed 001): each of these is ≥ Δ whenever B = nΔ ≤ n, i.e. T ≥ S.

This module holds the mechanisms themselves (vectorised samplers the trainer reuses), the
closed forms as pure functions of (S, T, n, d, R), the exact measurement on a model and data,
and a Monte Carlo estimator that samples the mechanism to check the closed forms.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from batchbound.diversity.distributed import all_reduce_sum
from batchbound.diversity.losses import resolve_loss
from batchbound.diversity.measure import data_chunks, measure, measuring
from batchbound.diversity.prepared import per_example_gradients
from batchbound.diversity.stats import trainable_parameters
from batchbound.errors import BatchboundError
from batchbound.spec import Spec, parse_spec

MECHANISM_NAMES = ("none", "dropconnect", "sgld", "quantization")
_ALIASES = {"quantize": "quantization", "quantise": "quantization"}


# ----------------------------------------------------------------------------- the spec


@dataclass(frozen=True)
class Mechanism:
    """A parsed mechanism spec: ``none``, ``dropconnect(p=0.5)``, ``sgld(sigma=0.01)``,
    ``quantization`` or ``quantization(per_tensor=true)`` (``quantize`` is an alias)."""

    name: str
    p: float = 0.0
    sigma: float = 0.0
    per_tensor: bool = False

    def __post_init__(self) -> None:
        if self.name not in MECHANISM_NAMES:
            raise BatchboundError(
                f"unknown mechanism {self.name!r}; choose from {', '.join(MECHANISM_NAMES)}"
            )
        if not (0.0 <= self.p < 1.0):
            raise BatchboundError(f"dropconnect needs a drop probability p in [0, 1), got {self.p}")
        if not (self.sigma >= 0.0 and math.isfinite(self.sigma)):
            raise BatchboundError(f"sgld needs a noise level sigma ≥ 0, got {self.sigma}")

    def __str__(self) -> str:
        options = {
            "dropconnect": {"p": self.p},
            "sgld": {"sigma": self.sigma},
            "quantization": {"per_tensor": True} if self.per_tensor else {},
        }.get(self.name, {})
        return str(Spec(self.name, options))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "p": self.p, "sigma": self.sigma, "per_tensor": self.per_tensor}


_OPTIONS = {"none": (), "dropconnect": ("p",), "sgld": ("sigma",), "quantization": ("per_tensor",)}


def parse_mechanism(spec: str | Mechanism) -> Mechanism:
    """``"dropconnect(p=0.5)"`` → Mechanism; unknown names and options are errors that list the
    valid choices."""
    if isinstance(spec, Mechanism):
        return spec
    parsed = parse_spec(spec)
    name = _ALIASES.get(parsed.name.lower(), parsed.name.lower())
    if name not in _OPTIONS:
        raise BatchboundError(
            f"unknown mechanism {parsed.name!r}; choose from {', '.join(MECHANISM_NAMES)}"
        )
    allowed = _OPTIONS[name]
    unknown = sorted(set(parsed.kwargs) - set(allowed))
    if unknown:
        valid = ", ".join(allowed) if allowed else "none"
        raise BatchboundError(f"mechanism {name!r} has no option {unknown[0]!r}; options: {valid}")
    if name == "dropconnect" and "p" not in parsed.kwargs:
        raise BatchboundError("dropconnect needs a drop probability, e.g. dropconnect(p=0.5)")
    if name == "sgld" and "sigma" not in parsed.kwargs:
        raise BatchboundError("sgld needs a noise level, e.g. sgld(sigma=0.01)")
    kwargs = dict(parsed.kwargs)
    for key in ("p", "sigma"):
        value = kwargs.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BatchboundError(f"{name}: {key} must be a number, got {kwargs[key]!r}")
    if "per_tensor" in kwargs and not isinstance(kwargs["per_tensor"], bool):
        raise BatchboundError(
            f"quantization: per_tensor must be true or false, got {kwargs['per_tensor']!r}"
        )
    return Mechanism(name, **{k: v if isinstance(v, bool) else float(v) for k, v in kwargs.items()})


# ------------------------------------------------------------------ closed forms (pure)


def dropconnect_diversity(S: float, T: float, p: float) -> float:
    """Δ under DropConnect with drop probability p: S / (S + (1−p)(T−S)).

    The same for the unscaled mask D g (seed 001) and the rescaled D g/(1−p) of training."""
    Mechanism("dropconnect", p=p)  # validates p
    return _ratio(S, S + (1.0 - p) * (T - S))


def sgld_diversity(S: float, T: float, n: int, d: int, sigma: float) -> float:
    """Δ under SGLD with isotropic N(0, σ²I_d) noise per example: (S + ndσ²) / (T + ndσ²)."""
    Mechanism("sgld", sigma=sigma)  # validates sigma
    noise = n * d * sigma**2
    return _ratio(S + noise, T + noise)


def quantization_diversity(S: float, T: float, R: float) -> float:
    """Δ under stochastic quantization: R / (T − S + R), with R = Σ_i ‖g_i‖₂‖g_i‖₁."""
    return _ratio(R, T - S + R)


def diversity_under(
    mechanism: str | Mechanism, *, S: float, T: float, n: int, d: int, R: float | None = None
) -> float:
    """Δ^DIM from the sufficient statistics; R is needed for quantization only."""
    mech = parse_mechanism(mechanism)
    if mech.name == "none":
        return _ratio(S, T)
    if mech.name == "dropconnect":
        return dropconnect_diversity(S, T, mech.p)
    if mech.name == "sgld":
        return sgld_diversity(S, T, n, d, mech.sigma)
    if R is None:
        raise BatchboundError("quantization needs R = Σ‖g_i‖₂‖g_i‖₁ (per-example L1 norms)")
    return quantization_diversity(S, T, R)


def _ratio(num: float, den: float) -> float:
    num, den = float(num), float(den)
    if den == 0.0:
        return math.nan if num == 0.0 else math.inf
    return num / den


# ------------------------------------------------------------- samplers (vectorised)
# A ``generator`` must live on the device of the tensors it samples for (torch's rule).


def dropconnect_mask(
    shape: torch.Size | tuple[int, ...],
    p: float,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    rescale: bool = False,
) -> Tensor:
    """A mask of independent entries: 0 with probability p, else 1 (or 1/(1−p) with
    ``rescale``, which keeps the masked gradient unbiased)."""
    if not 0.0 <= p < 1.0:
        raise BatchboundError(f"dropconnect needs a drop probability p in [0, 1), got {p}")
    keep = torch.rand(shape, generator=generator, device=device, dtype=dtype) >= p
    return keep.to(dtype) / (1.0 - p) if rescale else keep.to(dtype)


def sgld_noise(
    like: Tensor, sigma: float, *, generator: torch.Generator | None = None
) -> Tensor:
    """N(0, σ²) noise shaped like ``like``; the SGLD surrogate is g + sgld_noise(g, σ)."""
    return sigma * torch.randn(
        like.shape, generator=generator, device=like.device, dtype=like.dtype
    )


def quantize(v: Tensor, generator: torch.Generator | None = None, *, batch_dims: int = 0) -> Tensor:
    """Seed 001's stochastic quantizer: [Q(v)]_l = ‖v‖₂ sign(v_l) η_l, η_l ~ Bernoulli(|v_l|/‖v‖₂).

    Unbiased (E Q(v) = v), with E‖Q(v)‖² = ‖v‖₂‖v‖₁. The first ``batch_dims`` dimensions index
    independent vectors (``batch_dims=1`` on per-example gradients (n, ...) quantizes each
    example's gradient); the remaining dimensions form one vector. A zero vector maps to zero.
    """
    return quantize_group([v], generator, batch_dims=batch_dims)[0]


def quantize_group(
    tensors: list[Tensor], generator: torch.Generator | None = None, *, batch_dims: int = 0
) -> list[Tensor]:
    """Quantize several tensors as one concatenated vector (the norm is over all of them),
    e.g. all of a model's gradient tensors; shapes are kept."""
    if not tensors:
        return []
    lead = tensors[0].shape[:batch_dims]
    sq = sum(t.reshape(*lead, -1).square().sum(-1) for t in tensors)
    norm = torch.as_tensor(sq).sqrt()
    out = []
    for t in tensors:
        scale = norm.reshape(*lead, *([1] * (t.dim() - batch_dims)))
        prob = torch.where(scale > 0, t.abs() / scale.clamp_min(torch.finfo(t.dtype).tiny), 0.0)
        eta = torch.rand(t.shape, generator=generator, device=t.device, dtype=t.dtype) < prob
        out.append(scale * torch.sign(t) * eta.to(t.dtype))
    return out


def apply_mechanism(
    mechanism: str | Mechanism,
    grads: Tensor | Mapping[str, Tensor],
    generator: torch.Generator | None = None,
    *,
    batch_dims: int = 1,
    rescale: bool = False,
) -> Tensor | dict[str, Tensor]:
    """Draw M(g) independently for each of the vectors indexed by the first ``batch_dims``
    dimensions (default: per-example gradients of shape (n, ...)). ``grads`` is one tensor or
    a dict of per-parameter tensors that together form the vector. ``rescale`` applies
    DropConnect's 1/(1−p) (ignored by the other mechanisms)."""
    mech = parse_mechanism(mechanism)
    named = dict(grads) if isinstance(grads, Mapping) else {"": grads}
    if mech.name == "none":
        out = {k: v.clone() for k, v in named.items()}
    elif mech.name == "dropconnect":
        out = {
            k: v * dropconnect_mask(v.shape, mech.p, generator=generator, device=v.device,
                                    dtype=v.dtype, rescale=rescale)
            for k, v in named.items()
        }
    elif mech.name == "sgld":
        out = {k: v + sgld_noise(v, mech.sigma, generator=generator) for k, v in named.items()}
    elif mech.per_tensor:
        out = {k: quantize(v, generator, batch_dims=batch_dims) for k, v in named.items()}
    else:
        drawn = quantize_group(list(named.values()), generator, batch_dims=batch_dims)
        out = dict(zip(named, drawn, strict=True))
    return out if isinstance(grads, Mapping) else out[""]


# ----------------------------------------------------------------------- Monte Carlo


@dataclass(frozen=True)
class MonteCarloEstimate:
    """Δ^DIM estimated by sampling: the numerator Σ_i E‖M(g_i)‖² and denominator
    E‖Σ_i M(g_i)‖² are averaged separately over ``samples`` draws (Δ^DIM is a ratio of
    expectations, not an expected ratio). Standard errors are of the two means; the ratio's
    comes from the delta method."""

    samples: int
    numerator: float
    denominator: float
    numerator_se: float
    denominator_se: float
    diversity: float
    diversity_se: float


def monte_carlo_diversity(
    mechanism: str | Mechanism,
    grads: Tensor,
    *,
    samples: int = 1000,
    generator: torch.Generator | None = None,
    block: int = 64,
    parameter_slices: list[slice] | None = None,
) -> MonteCarloEstimate:
    """Sample the mechanism on an (n, d) matrix of per-example gradients.

    ``parameter_slices`` splits the d columns into parameter tensors, which matters only for
    ``quantization(per_tensor=true)``.
    """
    mech = parse_mechanism(mechanism)
    if grads.dim() != 2 or grads.shape[0] == 0:
        raise BatchboundError(f"grads must be an (n, d) matrix, got shape {tuple(grads.shape)}")
    if samples < 2:
        raise BatchboundError(f"samples must be ≥ 2, got {samples}")
    g = grads.detach().double()
    nums, dens = [], []
    for start in range(0, samples, block):
        count = min(block, samples - start)
        tiled = g.expand(count, *g.shape)  # (count, n, d): count independent draws
        if mech.name == "quantization" and mech.per_tensor and parameter_slices:
            pieces = {str(i): tiled[..., s] for i, s in enumerate(parameter_slices)}
            parts = apply_mechanism(mech, pieces, generator, batch_dims=2)
            drawn = torch.cat(list(parts.values()), -1)
        else:
            drawn = apply_mechanism(mech, tiled, generator, batch_dims=2)
        nums.append(drawn.square().sum(dim=(1, 2)))
        dens.append(drawn.sum(dim=1).square().sum(dim=1))
    num, den = torch.cat(nums), torch.cat(dens)
    m_num, m_den = float(num.mean()), float(den.mean())
    se_num = float(num.std() / math.sqrt(samples))
    se_den = float(den.std() / math.sqrt(samples))
    cov = float(((num - m_num) * (den - m_den)).sum() / (samples - 1) / samples)
    ratio = _ratio(m_num, m_den)
    var = (se_num**2 / m_den**2 + m_num**2 * se_den**2 / m_den**4
           - 2 * m_num * cov / m_den**3) if m_den else math.nan
    se = math.sqrt(max(var, 0.0))
    return MonteCarloEstimate(samples, m_num, m_den, se_num, se_den, ratio, se)


# -------------------------------------------------------------- exact, on a model


@dataclass
class MechanismReport:
    """Exact Δ^DIM of a model on a data set, beside the plain Δ it changes."""

    mechanism: str
    n: int
    d: int
    S: float
    T: float
    R: float | None
    diversity: float
    batch_bound: float
    base_diversity: float
    base_batch_bound: float
    seconds: float
    engine: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "mechanism": self.mechanism, "n": self.n, "d": self.d, "S": self.S, "T": self.T,
            "R": self.R, "diversity": self.diversity, "batch_bound": self.batch_bound,
            "base_diversity": self.base_diversity, "base_batch_bound": self.base_batch_bound,
            "seconds": self.seconds, "engine": self.engine,
        }


def mechanism_diversity(
    model: nn.Module,
    data: Any,
    loss: Any = None,
    mechanism: str | Mechanism = "dropconnect(p=0.5)",
    *,
    chunk_size: int = 256,
    engine: str = "auto",
    dtype: torch.dtype | None = None,
) -> MechanismReport:
    """Exact Δ^DIM over the whole data set from the closed forms.

    ``data``, ``loss``, ``chunk_size``, ``engine`` and ``dtype`` are as for ``measure``.
    DropConnect and SGLD need only S and T, which come from ``measure`` (the fast per-example
    norm engines). Quantization needs per-example L1 norms, so it materialises per-example
    gradients chunk by chunk (memory: chunk_size × parameters; ``engine`` does not apply).
    """
    return mechanism_diversities(model, data, loss, [mechanism], chunk_size=chunk_size,
                                 engine=engine, dtype=dtype)[0]


def mechanism_diversities(
    model: nn.Module,
    data: Any,
    loss: Any = None,
    mechanisms: Sequence[str | Mechanism] = ("dropconnect(p=0.5)",),
    *,
    chunk_size: int = 256,
    engine: str = "auto",
    dtype: torch.dtype | None = None,
) -> list[MechanismReport]:
    """Several mechanisms from one pass over the data (one report each, in order)."""
    mechs = [parse_mechanism(m) for m in mechanisms]
    if not mechs:
        raise BatchboundError("no mechanism given; choose from " + ", ".join(MECHANISM_NAMES))
    start = time.perf_counter()
    d = sum(p.numel() for p in trainable_parameters(model).values())
    R: dict[bool, float] = {}
    if any(m.name == "quantization" for m in mechs):
        n, S, T, R[False], R[True] = _quantization_sums(model, data, loss, chunk_size, dtype)
        used = "materialise"
    else:
        report = measure(model, data, loss, chunk_size=chunk_size, engine=engine, dtype=dtype)
        n, S, T, used = report.n, report.S, report.T, report.engine
    seconds = time.perf_counter() - start
    base = _ratio(S, T)
    reports = []
    for mech in mechs:
        r = R[mech.per_tensor] if mech.name == "quantization" else None
        diversity = diversity_under(mech, S=S, T=T, n=n, d=d, R=r)
        reports.append(MechanismReport(
            mechanism=str(mech), n=n, d=d, S=S, T=T, R=r, diversity=diversity,
            batch_bound=n * diversity, base_diversity=base, base_batch_bound=n * base,
            seconds=seconds, engine=used,
        ))
    return reports


def _quantization_sums(
    model: nn.Module, data: Any, loss: Any, chunk_size: int, dtype: torch.dtype | None
) -> tuple[int, float, float, float, float]:
    """n, S, T, R = Σ_i ‖g_i‖₂‖g_i‖₁ and R per tensor = Σ_i Σ_p ‖g_ip‖₂‖g_ip‖₁ in one pass of
    materialised per-example gradients, chunk by chunk, summed across ranks."""
    acc = torch.float64
    with measuring(model, dtype) as work:
        chunks, loss_fn = chunks_for(work, data, loss, chunk_size)
        params = trainable_parameters(work)
        device = next(iter(params.values())).device
        sums = torch.zeros(4, dtype=acc, device=device)  # n, S, R, R per tensor
        total = {k: torch.zeros(p.shape, dtype=acc, device=device) for k, p in params.items()}
        for x, y in chunks:
            grads = per_example_gradients(work, x, y, loss_fn)
            flat = {k: g.reshape(g.shape[0], -1).to(acc) for k, g in grads.items()}
            sq = {k: g.square().sum(1) for k, g in flat.items()}
            l1 = {k: g.abs().sum(1) for k, g in flat.items()}
            sq_all = torch.stack(list(sq.values())).sum(0)
            l1_all = torch.stack(list(l1.values())).sum(0)
            r_tensor = torch.stack([(sq[k].sqrt() * l1[k]).sum() for k in flat]).sum()
            sums += torch.stack([sums.new_tensor(x.shape[0]), sq_all.sum(),
                                 (sq_all.sqrt() * l1_all).sum(), r_tensor])
            for k, g in flat.items():
                total[k] += g.sum(0).reshape(total[k].shape)
    names = list(total)
    reduced = all_reduce_sum([sums, *total.values()])
    sums, total = reduced[0], dict(zip(names, reduced[1:], strict=True))
    T = float(sum(t.square().sum() for t in total.values()))
    return int(sums[0]), float(sums[1]), T, float(sums[2]), float(sums[3])


# ------------------------------------------------- engine access (chunks, gradients)
# Shared with differential.py: the model prepared as ``measure`` prepares it, and the data
# streamed through the engine's own chunker.


def chunks_for(
    model: nn.Module, data: Any, loss: Any, chunk_size: int
) -> tuple[Iterator[tuple[Tensor, Tensor]], Any]:
    """(chunks already on the model's device and dtype, per-example loss)."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise BatchboundError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    chunks, _, task = data_chunks(data, chunk_size)
    loss_fn = resolve_loss(loss, task)
    first = next(iter(trainable_parameters(model).values()))

    def moved() -> Iterator[tuple[Tensor, Tensor]]:
        for x, y in chunks:
            yield (
                x.to(device=first.device, dtype=first.dtype if x.is_floating_point() else None),
                y.to(device=first.device, dtype=first.dtype if y.is_floating_point() else None),
            )

    return moved(), loss_fn
