"""Online estimates of gradient diversity during training, from what each step already has.

``OnlineDiversity`` turns numbers a step already has into smoothed estimates
(``update_*``); ``steps.py`` feeds it from a user's own step (``watch``, ``monitored_step``).

The full-data quantities are n, M2 = S/n (the mean squared per-example gradient norm) and
‖G‖² = T/n² (the squared norm of the mean gradient); then n·Δ = M2/‖G‖² = 1 + B_simple, with
B_simple = tr(Σ)/‖G‖² McCandlish et al.'s (2018) simple noise scale and tr(Σ) = M2 − ‖G‖².

**Why not S_B/T_B of the batch.** For a batch of b examples, S_B = Σ_{i∈B}‖g_i‖² and
T_B = ‖Σ_{i∈B} g_i‖². With examples drawn uniformly *with* replacement,
E[S_B] = b·M2 and E[T_B] = b²‖G‖² + b·tr(Σ) = b(b−1)‖G‖² + b·M2, so T_B carries a noise term
and b·S_B/T_B is a biased estimate of n·Δ (it is ≤ b, whatever n·Δ is). Unbiased estimates
of the two population quantities are

    M2 ≈ S_B / b,        C ≈ (T_B − S_B) / (b(b − 1))    (the mean of ⟨g_i, g_j⟩ over pairs i ≠ j).

Under replacement sampling E[C] = ‖G‖². Under sampling *without* replacement (a shuffled
epoch: each batch holds distinct examples) E[C] = (T − S)/(n(n − 1)), and the exact
‖G‖² = T/n² = (1 − 1/n)·C + M2/n; ``sampling=`` picks the conversion (with n unknown both
reduce to ‖G‖² ≈ C).

**Without per-example norms** (per-worker or per-micro-batch gradients): the mean gradient
G_b of b examples has E‖G_b‖² = C + (M2 − C)/b in both sampling schemes, so two batch sizes
b_small < b_big give McCandlish et al.'s (Appendix A.1) unbiased pair

    C ≈ (b_big‖G_big‖² − b_small‖G_small‖²) / (b_big − b_small),
    M2 − C ≈ (‖G_small‖² − ‖G_big‖²) / (1/b_small − 1/b_big).

Typically the small batches are the workers' (or micro-batches') local gradients and the big
one their average, which every data-parallel step computes anyway.

**The ratio's bias.** Each step's estimates are unbiased, but their ratio is not, and a
single step's C can even be negative. As McCandlish et al. do, the numerator M2 and the
denominator C are smoothed *separately* by an exponential moving average (or, with
``decay=None``, a running mean over all steps), and the ratio is taken of the smoothed values:
a ratio of averages, whose bias shrinks as the averaging window grows. While the smoothed
‖G‖² is ≤ 0 the noise dominates and the batch bound reads +inf.

**How long a window.** One step's C is noisy when n·Δ ≫ b (the batch sees the mean gradient
through noise of size tr(Σ)/b), so ``batch_bound_se`` reports the standard error from the
spread of the per-step estimates; widen the window (``decay`` closer to 1, ≈ 1/(1 − decay)
steps) until it is small. On digits with fc(depth=2, params=4000) at initialisation
(n·Δ = 65), batches of 64 gave estimates within 10 % after 20 steps and 3 % after 200. During
training the exact Δ(w) itself can jump between consecutive iterates when the full gradient
is small; the smoothed value is then the ratio of the window's averages over recent iterates
(what McCandlish et al.'s B_simple is in practice), not Δ at the current w.

**Its lag.** While n·Δ moves, the smoothed value trails it by about decay/(1 − decay) steps
of its trend (19 at 0.95), which ``batch_bound_se`` (sampling noise at a fixed w) does not
contain. ``batch_bound_lag`` estimates that distance from a second, faster EMA (decay²): for a
steady trend the slow EMA trails by (1 + decay) times the gap between the two, so
lag = (1 + decay)·(fast − slow), positive while n·Δ rises. ``batch_bound_interval`` is the
smoothed value ± 2 SE, widened to reach smoothed + lag. With ``decay=None`` (a running mean)
the lag is not estimated (NaN) and the interval says nothing of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from batchbound.diversity.stats import PerExampleStats
from batchbound.errors import BatchboundError, warn

SAMPLINGS = ("without_replacement", "with_replacement")
GradientLike = Tensor | Mapping[str, Tensor] | Sequence[Tensor]
_SUMS = ("w", "w2", "m", "c", "mm", "cc", "mc")
MAX_DEFERRED = 64  # steps kept on the device before they are folded (bounds their memory)
_FAST = ("w", "m", "c")  # the faster EMA's sums, for the lag


class OnlineDiversity:
    """Smoothed estimates of M2, ‖G‖², the noise scale, n·Δ and Δ from training steps.

    ``n`` is the training-set size (needed for ``diversity`` and for the exact finite-n
    correction; without it the population is treated as infinite). ``decay`` is the EMA
    factor per update (0.95 ≈ the last 20 steps), or None for a plain running mean. The EMA
    is bias-corrected as in Adam, so the first updates are not pulled towards zero.

    Data parallel, with every rank's monitor in agreement: feed global quantities, which one
    scalar all-reduce gives next to the gradient all-reduce the step does anyway.
    Per-example: ``update_from_norms(Σ_ranks S_local, ‖Σ_ranks grad_sum‖², Σ_ranks b_local)``.
    Two-batch: ``update_two_batch(mean_ranks ‖G_local‖², b_local, ‖G_global‖², b_global)``,
    with ‖G_local‖² taken before the all-reduce.
    """

    def __init__(
        self, n: int | None = None, *, decay: float | None = 0.95,
        sampling: str = "without_replacement",
    ) -> None:
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise BatchboundError(f"n must be a positive integer or None, got {n!r}")
        if decay is not None and not 0.0 <= decay < 1.0:
            raise BatchboundError(f"decay must be in [0, 1) or None (running mean), got {decay}")
        if sampling not in SAMPLINGS:
            raise BatchboundError(
                f"unknown sampling {sampling!r}; choose from {', '.join(SAMPLINGS)}"
            )
        self.n, self.decay, self.sampling = n, decay, sampling
        self.precision: str | None = None  # what the last step computed in (watch sets it)
        self._steps = 0
        self._last: tuple[float, float] | None = None
        # Device numbers of steps not yet folded in (``defer_from_norms``): one host sync
        # for all of them when an estimate is read, none inside the training step.
        self._deferred: list[tuple[Tensor, int, Tensor | None]] = []
        # Steps ``watch`` left out: their T_B held fewer digits than their precision
        # (``defer_from_norms``'s ``inexact``).
        self.left_out = 0
        # Weighted sums over steps (EMA or equal weights): Σw, Σw², and Σw·x for
        # x in M2, C, M2², C², M2·C; the second moments give the standard error.
        self._sums = dict.fromkeys(_SUMS, 0.0)
        self._fast = dict.fromkeys(_FAST, 0.0)

    # ------------------------------------------------------------------ updates

    @property
    def steps(self) -> int:
        """Steps folded in (deferred ones included)."""
        self.fold()
        return self._steps

    @property
    def last(self) -> tuple[float, float] | None:
        """The last step's raw (M2, C), for callers that keep their own windows."""
        self.fold()
        return self._last

    def update(self, m2: float, cross: float) -> None:
        """Fold in one step's unbiased estimates of M2 and C (see the module docstring)."""
        self.fold()
        self._update(m2, cross)

    def _update(self, m2: float, cross: float) -> None:
        m2, cross = float(m2), float(cross)
        if not (math.isfinite(m2) and math.isfinite(cross)):
            raise BatchboundError(f"non-finite diversity estimates: M2={m2}, C={cross}")
        self._steps += 1
        self._last = (m2, cross)
        keep = 1.0 - 1.0 / self._steps if self.decay is None else self.decay
        new = {"w": 1.0, "m": m2, "c": cross, "mm": m2 * m2, "cc": cross * cross,
               "mc": m2 * cross}
        for key, value in new.items():
            self._sums[key] = keep * self._sums[key] + (1.0 - keep) * value
        self._sums["w2"] = keep**2 * self._sums["w2"] + (1.0 - keep) ** 2
        fast = keep * keep
        for key in _FAST:
            self._fast[key] = fast * self._fast[key] + (1.0 - fast) * new[key]

    def update_from_norms(self, S_B: float, T_B: float, batch_size: int) -> None:
        """From a batch's Σ‖g_i‖² and ‖Σg_i‖² (per-example losses, summed)."""
        self.fold()
        self._from_norms(S_B, T_B, batch_size)

    def _from_norms(self, S_B: float, T_B: float, batch_size: int) -> None:
        if batch_size < 2:
            raise BatchboundError(f"per-example estimates need a batch of ≥ 2, got {batch_size}")
        b = batch_size
        self._update(S_B / b, (T_B - S_B) / (b * (b - 1)))

    def defer_from_norms(self, S_B: Tensor, T_B: Tensor, batch_size: int, *,
                         scale: float = 1.0, inexact: Tensor | None = None) -> None:
        """``update_from_norms`` with S_B and T_B (both times ``scale``) as 0-dim tensors on
        the device: kept there and folded in, in order, when any estimate (or ``steps``) is
        next read, so a training step never waits for the device. Past ``MAX_DEFERRED``
        steps they are folded. ``inexact``, a 0-dim boolean tensor: where true the step is
        left out when folded (``left_out``, and a warning the first time)."""
        if batch_size < 2:
            raise BatchboundError(f"per-example estimates need a batch of ≥ 2, got {batch_size}")
        f64 = torch.float64
        row = torch.stack([t if t.dim() == 0 else t.reshape(()) for t in (S_B, T_B)])
        row = row if row.dtype == f64 else row.to(f64)
        row = row * scale if scale != 1.0 else row
        self._deferred.append((row, batch_size, inexact))
        if len(self._deferred) >= MAX_DEFERRED:
            self.fold()

    def fold(self) -> None:
        """Fold deferred steps in (one host sync); a no-op when there are none. A non-finite
        step is refused (BatchboundError) after the others are folded in, as each would be
        had it been refused in its own step."""
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        rows = [row for row, _, _ in deferred]
        flags = [flag.reshape(1).to(row.dtype) for row, _, flag in deferred if flag is not None]
        if len({row.device for row in rows}) > 1:
            rows, flags = [row.cpu() for row in rows], [flag.cpu() for flag in flags]
        # one copy to the host for all of them
        values = torch.cat([torch.stack(rows).reshape(-1), *flags]).tolist()
        inexact = iter(values[2 * len(rows):])
        refused, left_out = [], 0
        for j, (_, b, flag) in enumerate(deferred):
            S_B, T_B = values[2 * j], values[2 * j + 1]
            if flag is not None and next(inexact):
                left_out += 1
                continue
            try:
                self._from_norms(S_B, T_B, b)
            except BatchboundError as exc:
                refused.append(str(exc))
        if left_out and not self.left_out:
            warn(f"batchbound: watch(): {left_out} step(s) left out of the monitor: .grad held "
                 "a sum so much larger than the step's gradient (never cleared, many "
                 "micro-batches accumulated, or several into a bfloat16 .grad) that its change "
                 "keeps fewer digits than the step's precision; clear .grad before the block "
                 "(optimizer.zero_grad()), or watch only each step's first micro-batches. "
                 "monitor.left_out counts them")
        self.left_out += left_out
        if refused:
            raise BatchboundError(f"{len(refused)} of the {len(deferred)} steps read since the "
                                  f"last estimate were refused, the others folded in: "
                                  f"{refused[0]}")

    def update_from_stats(self, stats: PerExampleStats) -> None:
        """From ``per_example_stats`` of the current mini-batch."""
        self.update_from_norms(stats.S, stats.T, stats.n)

    def update_two_batch(
        self, small_sq_norm: float, small_size: float, big_sq_norm: float, big_size: float
    ) -> None:
        """From ‖G_small‖² and ‖G_big‖², the squared norms of *mean* gradients over
        ``small_size`` < ``big_size`` examples (McCandlish et al., Appendix A.1)."""
        if not 0 < small_size < big_size:
            raise BatchboundError(
                f"the two-batch estimator needs 0 < small_size < big_size, got {small_size} "
                f"and {big_size}"
            )
        cross = (big_size * big_sq_norm - small_size * small_sq_norm) / (big_size - small_size)
        spread = (small_sq_norm - big_sq_norm) / (1.0 / small_size - 1.0 / big_size)
        self.update(cross + spread, cross)

    def update_from_gradients(
        self,
        small_grads: Sequence[GradientLike],
        small_size: int | Sequence[int],
        big_grad: GradientLike | None = None,
        big_size: int | None = None,
    ) -> None:
        """From per-worker / per-micro-batch *mean* gradients over disjoint example sets.

        ``small_grads[k]`` is one gradient (a tensor, a list of tensors, or a name → tensor
        dict) averaged over ``small_size[k]`` examples; None entries (``[p.grad for p in
        model.parameters()]`` with frozen layers) are parameters with no gradient, and must
        be the same in every gradient. ``big_grad`` defaults to their size-weighted average
        (what an all-reduce of the workers' gradients gives, here summed in float64), over
        the sum of the sizes. The small side uses the mean of ‖G_k‖² over k, whose
        expectation is C + (M2 − C)·mean_k(1/b_k).
        """
        sizes = _sizes(small_size, len(small_grads))
        if big_grad is None and len(small_grads) < 2:
            raise BatchboundError(
                f"need at least 2 small gradients without big_grad, got {len(small_grads)}: "
                "their average is the big one, equal to a single small one")
        flats = _flats([*small_grads, *([] if big_grad is None else [big_grad])])
        if big_grad is None:
            total = sum(sizes)
            big = sum(b * f.double() for b, f in zip(sizes, flats, strict=True)) / total
            big_size = total
        else:
            if big_size is None:
                raise BatchboundError("big_size is needed with big_grad")
            big = flats.pop()
        small_sq = sum(float(f.double().square().sum()) for f in flats) / len(flats)
        harmonic = len(sizes) / sum(1.0 / b for b in sizes)
        self.update_two_batch(small_sq, harmonic, float(big.double().square().sum()), big_size)

    # ---------------------------------------------------------------- estimates

    @property
    def m2(self) -> float:
        """Smoothed M2 = S/n, the mean squared per-example gradient norm."""
        return self._mean("m")

    @property
    def cross(self) -> float:
        """Smoothed mean inner product ⟨g_i, g_j⟩ over pairs of distinct draws."""
        return self._mean("c")

    @property
    def gradient_sq_norm(self) -> float:
        """Smoothed ‖G‖² = T/n², the squared norm of the full-data mean gradient."""
        if self.n is not None and self.sampling == "without_replacement":
            return (1.0 - 1.0 / self.n) * self.cross + self.m2 / self.n
        return self.cross

    @property
    def trace_cov(self) -> float:
        """tr(Σ) = M2 − ‖G‖², the per-example gradient variance."""
        return self.m2 - self.gradient_sq_norm

    @property
    def batch_bound(self) -> float:
        """n·Δ = M2/‖G‖² = 1 + noise_scale; +inf while the smoothed ‖G‖² is ≤ 0."""
        g2 = self.gradient_sq_norm
        if math.isnan(g2):
            return math.nan
        return self.m2 / g2 if g2 > 0 else math.inf

    @property
    def noise_scale(self) -> float:
        """B_simple = tr(Σ)/‖G‖² (McCandlish et al.)."""
        return self.batch_bound - 1.0

    @property
    def diversity(self) -> float:
        """Δ = batch_bound / n; NaN when n was not given."""
        return self.batch_bound / self.n if self.n is not None else math.nan

    @property
    def batch_bound_se(self) -> float:
        """Standard error of ``batch_bound`` from the spread of the per-step estimates (delta
        method, steps treated as independent, effective count (Σw)²/Σw² for the EMA).

        It measures sampling noise at a fixed w only; during training Δ(w) itself moves (and
        can jump when the full gradient is small), which this does not capture: see
        ``batch_bound_lag`` and ``batch_bound_interval``, which do."""
        if self.steps < 2:
            return math.nan
        shrink = self._sums["w2"] / self._sums["w"] ** 2  # 1 / effective number of steps
        m, c = self.m2, self.cross
        var_m = max(self._mean("mm") - m * m, 0.0) * shrink
        var_c = max(self._mean("cc") - c * c, 0.0) * shrink
        cov = (self._mean("mc") - m * c) * shrink
        a, b = (1.0, 0.0)
        if self.n is not None and self.sampling == "without_replacement":
            a, b = 1.0 - 1.0 / self.n, 1.0 / self.n
        g = self.gradient_sq_norm  # = a·C + b·M2
        if g <= 0:
            return math.inf
        var_g = a * a * var_c + b * b * var_m + 2 * a * b * cov
        cov_mg = a * cov + b * var_m
        ratio = m / g
        var = ratio**2 * (var_m / m**2 + var_g / g**2 - 2 * cov_mg / (m * g))
        return math.sqrt(max(var, 0.0))

    @property
    def batch_bound_lag(self) -> float:
        """How far the smoothed n·Δ trails the current one, (1 + decay)·(fast − slow) from a
        second EMA at decay² (see the module docstring); NaN for a running mean or before 2
        steps, 0 when either value is infinite."""
        if self.decay is None or self.steps < 2:
            return math.nan
        w = self._fast["w"]
        m, c = self._fast["m"] / w, self._fast["c"] / w
        g = (1.0 - 1.0 / self.n) * c + m / self.n if (
            self.n is not None and self.sampling == "without_replacement") else c
        fast, slow = (m / g if g > 0 else math.inf), self.batch_bound
        if not (math.isfinite(fast) and math.isfinite(slow)):
            return 0.0
        return (1.0 + self.decay) * (fast - slow)

    @property
    def batch_bound_interval(self) -> tuple[float, float]:
        """The smoothed n·Δ ± 2 standard errors, widened to reach it plus its estimated lag;
        without a lag estimate (a running mean) the ± 2 SE alone."""
        bound, se, lag = self.batch_bound, self.batch_bound_se, self.batch_bound_lag
        lag = 0.0 if math.isnan(lag) else lag
        return min(bound, bound + lag) - 2 * se, max(bound, bound + lag) + 2 * se

    def _mean(self, key: str) -> float:
        return self._sums[key] / self._sums["w"] if self.steps else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps, "n": self.n, "m2": self.m2, "cross": self.cross,
            "gradient_sq_norm": self.gradient_sq_norm, "trace_cov": self.trace_cov,
            "noise_scale": self.noise_scale, "batch_bound": self.batch_bound,
            "batch_bound_se": self.batch_bound_se, "batch_bound_lag": self.batch_bound_lag,
            "diversity": self.diversity,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "decay": self.decay, "sampling": self.sampling, "steps": self.steps,
                "sums": dict(self._sums), "fast": dict(self._fast), "left_out": self.left_out}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        fresh = OnlineDiversity(state["n"], decay=state["decay"], sampling=state["sampling"])
        self.n, self.decay, self.sampling = fresh.n, fresh.decay, fresh.sampling
        self._deferred = []
        self._steps = int(state["steps"])
        self.left_out = int(state.get("left_out", 0))
        self._sums = {key: float(state["sums"][key]) for key in _SUMS}
        # a state saved before the lag was estimated: the fast EMA starts from the slow one
        fast = state.get("fast") or {key: self._sums[key] for key in _FAST}
        self._fast = {key: float(fast[key]) for key in _FAST}


def dense_gradient(grad: Tensor) -> Tensor:
    """A ``.grad`` as a dense tensor (``nn.Embedding(sparse=True)`` leaves a sparse one)."""
    if grad.requires_grad:  # only under create_graph: a .grad is normally a plain tensor
        grad = grad.detach()
    return grad.to_dense() if grad.is_sparse else grad


def _flat(grad: GradientLike) -> tuple[Tensor, tuple[int, ...]]:
    """One vector of a gradient's entries, None ones left out, and the positions of those."""
    if isinstance(grad, Tensor):
        return dense_gradient(grad).reshape(-1), ()
    values = list(grad.values()) if isinstance(grad, Mapping) else list(grad)
    kept = [v for v in values if v is not None]
    if not kept:
        raise BatchboundError("an empty gradient was given (no entry, or every entry None)")
    if not all(isinstance(v, Tensor) for v in kept):
        raise BatchboundError("a gradient's entries must be tensors (or None)")
    return (torch.cat([dense_gradient(v).reshape(-1) for v in kept]),
            tuple(k for k, v in enumerate(values) if v is None))


def _flats(grads: Sequence[GradientLike]) -> list[Tensor]:
    """The gradients flattened, all of one length and with None at the same entries."""
    flats = [_flat(g) for g in grads]
    sizes = sorted({f.numel() for f, _ in flats})
    if len(sizes) > 1:
        raise BatchboundError(f"the gradients have different lengths: {sizes}")
    if any(nones != flats[0][1] for _, nones in flats):
        raise BatchboundError("the gradients have None at different entries (a parameter "
                              "with no gradient in some and not in others)")
    return [f for f, _ in flats]


def _sizes(small_size: int | Sequence[int], count: int) -> list[float]:
    """One positive size per small gradient."""
    # a list, a numpy array or a tensor of sizes; a 0-dim one is one size for every gradient
    many = isinstance(small_size, Sequence) or getattr(small_size, "ndim", 0) > 0
    given = list(small_size) if many else [small_size] * count  # type: ignore[arg-type]
    if count == 0 or len(given) != count:
        raise BatchboundError(
            f"need one size per small gradient, got {count} gradients and {len(given)} sizes")
    try:  # a Python, numpy or 0-dim tensor number
        sizes = [float(b) for b in given]
    except (TypeError, ValueError):
        raise BatchboundError(f"small sizes must be numbers, got {given!r}") from None
    if not all(math.isfinite(b) and b > 0 for b in sizes):
        raise BatchboundError(f"small sizes must be positive, got {sizes}")
    return sizes
