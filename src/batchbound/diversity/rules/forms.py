"""The forms a rule gives one call's per-example gradients in, and their inner products.

A parameter used by one module call needs only the squared norms ‖g_i‖² of that call's
gradients. A parameter used by several calls (a module run twice, or a weight tied between
modules: nanoGPT's token embedding and output head) has per-example gradient
g_i = Σ_c g_i^(c), and ‖g_i‖² = Σ_c ‖g_i^(c)‖² + 2 Σ_{c<d} ⟨g_i^(c), g_i^(d)⟩ needs the
cross terms, so every form also gives per-example inner products with any other form.

- ``Dense``: the gradients themselves, (n, *shape).
- ``Outer``: Σ_t u_t v_tᵀ per example: a weight (p × q) applied at T positions (Linear on
  sequences, Embedding, recurrent weights). u is (n, T, p), or (n, T) integer row indices
  (an embedding's one-hot u, with ``rows`` = p); v is (n, T, q). Its squared norm and inner
  products take the Gram form Σ_ts (u_t·u'_s)(v_t·v'_s) or the materialised p × q product,
  whichever costs fewer flops.
- ``Lazy``: a rule's own fast squared norms, materialised only for cross terms (conv).

``batch_sum_exact`` is False where autograd's batch gradient is not the sum of the
per-example gradients (an embedding with ``scale_grad_by_freq`` counts over the batch, but
example i alone has its own counts); the engine then takes ``total()`` for Σ_i g_i.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from batchbound.diversity.stats import LOW_PRECISION

# Numbers a materialised block of per-example gradients may hold in ``inner``.
MATERIALISE_BUDGET = 2**24
# Dense per-example gradients up to this many numbers may wait for the end of the backward
# pass, to be normed together with others of their shape (hooks.grouped_row_sq_norms).
DEFER_NUMEL = 2**20
# An ``Outer`` this small is materialised (2 operations) and normed with its like, rather
# than normed by its Gram form (6): small steps are bound by operations, not flops, so it
# may cost up to this factor more flops than the Gram form.
SMALL_FLOPS_FACTOR = 2


@functools.lru_cache(maxsize=32)
def _offsets(n: int, p: int, device: torch.device) -> Tensor:
    """(n, 1): p·example, the same tensor for every call of these sizes (never written)."""
    return torch.arange(0, n * p, p, device=device).unsqueeze(1)


@functools.lru_cache(maxsize=32)
def ones(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """(n,) ones, the same tensor for every call of these sizes (never written): Σ_i of n
    rows as one matrix-vector product added into a running sum (``addmv_``)."""
    return torch.ones(n, dtype=dtype, device=device)


def add_row_sum(out: Tensor, rows: Tensor) -> None:
    """``out += Σ_i rows[i]`` for ``rows`` (n, ...) with ``out``'s entries per row: one
    ``addmv_`` (β = 1), no temporary sum and no separate addition; else those two."""
    n = rows.shape[0]
    if rows.dtype != out.dtype or not out.is_contiguous() or rows.numel() != n * out.numel():
        out.add_(rows.sum(dim=0).reshape(out.shape))
        return
    flat = out if out.dim() == 1 else out.view(-1)  # no view op where none is needed
    matrix = rows if rows.dim() == 2 else rows.reshape(n, -1)
    flat.addmv_(matrix.t(), ones(n, rows.dtype, rows.device))


def segments(keys: Tensor) -> Tensor:
    """For each entry of the 1-D ``keys``, the index of its value among the distinct values
    (equal keys, equal index; indices 0..distinct-1), as ``torch.unique``'s ``inverse`` gives
    it, but in fixed-size operations: a sort and a running count. ``unique``'s output size
    waits for the device, a host synchronisation inside the backward pass on a GPU."""
    ordered, order = torch.sort(keys)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    return torch.empty_like(order).scatter_(0, order, torch.cumsum(starts, 0) - 1)


def _long(t: Tensor) -> Tensor:
    """Integer indices as int64 (no operation when they are already)."""
    return t if t.dtype == torch.int64 else t.long()


def products(x: Tensor, y: Tensor) -> Tensor:
    """``x @ y`` in float32 for float32 or lower-precision operands: bfloat16 or float16
    operands on CUDA multiplied as they are, with float32 results (``out_dtype``: tensor-core
    speed; a product of two such numbers is exact in float32 and the sums accumulate in
    float32, as they would widened), elsewhere widened first (exactly)."""
    if x.dtype in LOW_PRECISION and x.dtype == y.dtype and x.is_cuda:
        mm = torch.bmm if x.dim() == 3 else torch.mm
        return mm(x, y, out_dtype=torch.float32)
    return _float32(x) @ _float32(y)


def _float32(t: Tensor) -> Tensor:
    """A bfloat16 or float16 tensor as float32 (exact); any other as it is."""
    return t.float() if t.dtype in LOW_PRECISION else t


def _row_sq(t: Tensor) -> Tensor:
    if t.dim() == 1:
        return t.square()
    return torch.linalg.vector_norm(t, dim=tuple(range(1, t.dim()))).square()


class PerExampleGrad:
    """One call's per-example gradients of one parameter, for n examples."""

    batch_sum_exact: bool = True

    @property
    def n(self) -> int:
        raise NotImplementedError

    def sq_norms(self) -> Tensor:
        """‖g_i‖², shape (n,)."""
        raise NotImplementedError

    def dense(self) -> Tensor:
        """The gradients, (n, ...) with the parameter's number of entries per example."""
        raise NotImplementedError

    def flat_dense(self) -> Tensor:
        """The gradients as (n, numel)."""
        return self.dense().reshape(self.n, -1)

    def total(self) -> Tensor:
        """Σ_i g_i, flattened."""
        return self.dense().sum(dim=0).reshape(-1)

    def add_total_to(self, out: Tensor) -> None:
        """``out += Σ_i g_i``, ``out`` a contiguous tensor of the parameter's shape (a running
        sum over chunks)."""
        out.add_(self.total().reshape(out.shape))

    def part(self, rows: slice) -> PerExampleGrad:
        """The same gradients for the examples ``rows``."""
        raise NotImplementedError


class Dense(PerExampleGrad):
    def __init__(self, grads: Tensor, sq_norms: Tensor | None = None) -> None:
        self.grads, self._sq = grads, sq_norms  # sq_norms: when the rule has them already

    @property
    def n(self) -> int:
        return int(self.grads.shape[0])

    def sq_norms(self) -> Tensor:
        return _row_sq(self.grads) if self._sq is None else self._sq

    @property
    def deferrable(self) -> bool:
        """Small, with no norms of its own yet: cheaper normed beside others of its shape."""
        return self._sq is None and self.grads.dim() >= 1 and self.grads.numel() <= DEFER_NUMEL

    def dense(self) -> Tensor:
        return self.grads

    def add_total_to(self, out: Tensor) -> None:
        add_row_sum(out, self.grads)

    def part(self, rows: slice) -> Dense:
        return Dense(self.grads[rows])


class Lazy(PerExampleGrad):
    """Squared norms by a rule's fast method; ``materialise`` gives the gradients and
    ``total`` their sum (without materialising them)."""

    def __init__(self, n: int, sq_norms: Callable[[], Tensor], materialise: Callable[[], Tensor],
                 part: Callable[[slice], Lazy], total: Callable[[], Tensor],
                 add_total_to: Callable[[Tensor], None] | None = None) -> None:
        self._n, self._sq, self._dense, self._part = n, sq_norms, materialise, part
        self._total, self._add_total_to = total, add_total_to

    @property
    def n(self) -> int:
        return self._n

    def sq_norms(self) -> Tensor:
        return self._sq()

    def dense(self) -> Tensor:
        return self._dense()

    def part(self, rows: slice) -> Lazy:
        return self._part(rows)

    def total(self) -> Tensor:
        return self._total().reshape(-1)

    def add_total_to(self, out: Tensor) -> None:
        if self._add_total_to is None:
            super().add_total_to(out)
        else:
            self._add_total_to(out)


class Outer(PerExampleGrad):
    """Σ_t u_t v_tᵀ per example (see the module docstring)."""

    def __init__(self, u: Tensor, v: Tensor, rows: int | None = None,
                 batch_sum_exact: bool = True, sq_norms: Tensor | None = None,
                 autograd_terms: bool = True) -> None:
        # u and v as the rule gave them: bfloat16 or float16 where the call computed in it
        # (``products`` multiplies them so); ``u`` and ``v`` widen them for everything else.
        # One position (T = 1) may come as (n, p) and (n, q): the batch sum is then added
        # from them as they are (no reshape or unsqueeze: host time on every step), and
        # whatever reads them by position gets them with their T axis (``__getattr__``)
        self._given, self.rows = (u, v), rows
        self._one = v.dim() == 2
        if not self._one:
            self._u, self._v = u, v
        self._wide: tuple[Tensor, Tensor] | None = None
        self.batch_sum_exact = batch_sum_exact
        self._sq = sq_norms  # when the rule has them already
        # u and v are the tensors autograd's batch gradient multiplies (the call's recorded
        # input and output gradient), so the two sums differ by the summation's rounding
        # alone (``project_bound``); False where the rule computed them itself
        self.autograd_terms = autograd_terms

    def __getattr__(self, name: str) -> Tensor:
        """``_u`` and ``_v`` of a one-position pair, (n, 1, ·), made when first read (only
        what ``__init__`` left unset reaches here: no lookup cost on the others)."""
        if name in ("_u", "_v") and self.__dict__.get("_one"):
            u, v = self._given
            self._u, self._v = u.unsqueeze(1), v.unsqueeze(1)
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def u(self) -> Tensor:
        return self._widened()[0]

    @property
    def v(self) -> Tensor:
        return self._widened()[1]

    def _widened(self) -> tuple[Tensor, Tensor]:
        if self._wide is None:  # an index tensor u stays as it is
            u = self._u if self.indexed else _float32(self._u)
            self._wide = (u, _float32(self._v))
        return self._wide

    @property
    def n(self) -> int:
        return int(self._given[1].shape[0])

    @property
    def steps(self) -> int:
        return 1 if self._one else int(self._given[1].shape[1])

    @property
    def p(self) -> int:
        return self.rows if self.rows is not None else int(self._given[0].shape[-1])

    @property
    def q(self) -> int:
        return int(self._given[1].shape[-1])

    @property
    def indexed(self) -> bool:
        return self.rows is not None

    def part(self, rows: slice) -> Outer:
        sq = None if self._sq is None else self._sq[rows]
        return Outer(self._u[rows], self._v[rows], self.rows, self.batch_sum_exact, sq,
                     self.autograd_terms)

    def _keys(self) -> Tensor:
        """Row index + p·example, flattened: one key per (example, row) pair."""
        return (_long(self.u) + _offsets(self.u.shape[0], self.p, self.u.device)).reshape(-1)

    def small_dense(self) -> Dense | None:
        """The materialised gradients, (n, p, q), when they are small enough to be normed
        with others of their shape (``DEFER_NUMEL``) and the product is not much more work
        than the Gram form (``SMALL_FLOPS_FACTOR``); else None."""
        if self._sq is not None or self.steps == 1:
            return None
        steps, p, q = self.steps, self.p, self.q
        if self.indexed:  # scattered by index_add (no unique, which waits for the device)
            return Dense(self.dense()) if self.n * p * q <= DEFER_NUMEL else None
        if self.n * p * q > DEFER_NUMEL or p * q > SMALL_FLOPS_FACTOR * steps * (p + q + 1):
            return None
        return Dense(products(self._u.transpose(1, 2), self._v))

    def sq_norms(self) -> Tensor:
        if self._sq is not None:
            return self._sq
        if self.indexed:  # sum v over positions sharing (example, row); no n·p·q tensor
            keys = self._keys()
            segment = segments(keys)
            sums = self.v.new_zeros(keys.numel(), self.q)  # rows past the last segment: 0
            sums.index_add_(0, segment, self.v.reshape(-1, self.q))
            owner = torch.zeros_like(segment).scatter_(
                0, segment, torch.div(keys, self.p, rounding_mode="floor"))
            return self.v.new_zeros(self.n).index_add_(0, owner, sums.square().sum(dim=1))
        if self.steps == 1:  # one outer product: ‖u‖²‖v‖²
            return _row_sq(self.u[:, 0]) * _row_sq(self.v[:, 0])
        steps, p, q, u, v = self.steps, self.p, self.q, self._u, self._v
        if steps * steps * (p + q + 1) < steps * p * q:
            gram_u = products(u, u.transpose(1, 2))
            gram_v = products(v, v.transpose(1, 2))
            return (gram_u * gram_v).sum(dim=(1, 2))
        return _row_sq(products(u.transpose(1, 2), v))

    def dense(self) -> Tensor:
        if self.indexed:
            return self.flat_dense().view(self.n, self.p, self.q)
        return products(self._u.transpose(1, 2), self._v)

    def flat_dense(self) -> Tensor:
        if self.indexed:  # scattered straight into (n, p·q)
            out = self.v.new_zeros(self.n * self.p, self.q)
            out.index_add_(0, self._keys(), self.v.reshape(-1, self.q))
            return out.view(self.n, -1)
        return super().flat_dense()

    def total(self) -> Tensor:
        v = self.v.reshape(-1, self.q)
        if self.indexed:
            out = v.new_zeros(self.p, self.q)
            return out.index_add_(0, _long(self.u).reshape(-1), v).reshape(-1)
        return (self.u.reshape(-1, self.p).transpose(0, 1) @ v).reshape(-1)

    def add_total_to(self, out: Tensor) -> None:
        """The product added by the matrix kernel itself (``addmm_``, β = 1): no (p × q)
        temporary and no separate addition, for a running sum."""
        if self._one:  # (n, p) and (n, q) as given: no reshape
            u, v = (_float32(t) for t in self._given)
        else:
            u, v = self.u, self.v
        if v.dtype != out.dtype or not out.is_contiguous():
            super().add_total_to(out)
            return
        p, q = self.p, self.q
        v = v if v.dim() == 2 else v.reshape(-1, q)
        into = out if out.shape == (p, q) else out.view(p, q)  # a weight's sum: as it is
        if self.indexed:
            into.index_add_(0, _long(u).reshape(-1), v)
        else:
            into.addmm_((u if u.dim() == 2 else u.reshape(-1, p)).transpose(0, 1), v)


def _gram_u(a: Outer, b: Outer) -> Tensor:
    """(n, T_a, T_b) inner products u_t·u'_s."""
    if a.indexed and b.indexed:
        return (a.u.unsqueeze(2) == b.u.unsqueeze(1)).to(a.v.dtype)
    if a.indexed:
        return _gram_u(b, a).transpose(1, 2)
    if b.indexed:  # u'_s is one-hot at row b.u[s]: pick that column of u_t
        n, t_a, t_b = a.n, a.steps, b.steps
        return a.u.gather(2, _long(b.u).unsqueeze(1).expand(n, t_a, t_b))
    return products(a._u, b._u.transpose(1, 2))


def _outer_inner(a: Outer, b: Outer) -> Tensor:
    p, q = a.p, a.q
    dense_u = not (a.indexed or b.indexed)
    gram = a.steps * b.steps * ((p if dense_u else 1) + q)
    materialise = (a.steps + b.steps) * p * q + p * q
    if gram <= materialise:
        return (_gram_u(a, b) * products(a._v, b._v.transpose(1, 2))).sum(dim=(1, 2))
    return _dense_inner(a, b)


def _dense_outer_inner(d: Tensor, o: Outer) -> Tensor:
    """⟨D_i, Σ_t u_t v_tᵀ⟩ = Σ_t u_tᵀ D_i v_t for a materialised D (n, p·q)."""
    d = d.reshape(o.n, o.p, o.q)
    if o.indexed:
        picked = d.gather(1, _long(o.u).unsqueeze(2).expand(o.n, o.steps, o.q))
        return (picked * o.v).sum(dim=(1, 2))
    return torch.einsum("ntp,npq,ntq->n", o.u, d, o.v)


def _dense_inner(a: PerExampleGrad, b: PerExampleGrad) -> Tensor:
    n = a.n
    return (a.dense().reshape(n, -1) * b.dense().reshape(n, -1)).sum(dim=1)


def _inner_block(a: PerExampleGrad, b: PerExampleGrad) -> Tensor:
    if isinstance(a, Outer) and isinstance(b, Outer):
        return _outer_inner(a, b)
    if isinstance(b, Outer) and not isinstance(a, Outer):
        a, b = b, a
    if isinstance(a, Outer):
        return _dense_outer_inner(b.dense(), a)
    return _dense_inner(a, b)


def inner(a: PerExampleGrad, b: PerExampleGrad, numel: int) -> Tensor:
    """Per-example ⟨g_i^a, g_i^b⟩, shape (n,), for gradients of one parameter with ``numel``
    entries; anything materialised is built a block of examples at a time."""
    n = a.n
    step = max(1, MATERIALISE_BUDGET // max(1, 2 * numel))
    if step >= n:
        return _inner_block(a, b)
    parts = [_inner_block(a.part(slice(i, i + step)), b.part(slice(i, i + step)))
             for i in range(0, n, step)]
    return torch.cat(parts)


def project(form: PerExampleGrad, a: Tensor, b: Tensor) -> Tensor:
    """⟨Σ_i g_i, a_k b_kᵀ⟩ for each column k of ``a`` and ``b`` (the parameter viewed as a
    (len(a) × len(b)) matrix): a cheap fingerprint of the gradient sum, compared with
    autograd's to catch unseen uses."""
    if isinstance(form, Outer):
        left = a[_long(form.u)] if form.indexed else form.u @ a
        return (left * (form.v @ b)).reshape(-1, a.shape[1]).sum(dim=0)
    total = form.total().reshape(a.shape[0], b.shape[0])
    return ((a.T @ total) * b.T).sum(dim=1)


def project_bound(form: PerExampleGrad, a: Tensor, b: Tensor) -> tuple[Tensor, int] | None:
    """How far rounding can move the fingerprint ``project(form, a, b)`` from autograd's
    batch gradient projected alike: the terms' projection in absolute value, Σ over the
    form's terms u_t v_tᵀ of |a_k|ᵀ|u_t||v_t|ᵀ|b_k| per column k, with the longest chain of
    roundings in either computation (the n·T terms summed, the products of length len(a)
    and len(b)). A sum of k terms rounds by at most k·unit of the sum of their absolute
    values, so a use that moves the projection by more is not rounding. It scales with the
    projection itself (~1/√numel of the gradient's norm), where a regulariser of the layer
    shows as it would not against the norms. None for a materialised form (its terms were
    summed over positions already) or one whose terms the rule computed itself."""
    if not isinstance(form, Outer) or not form.autograd_terms:
        return None
    a, b = a.abs(), b.abs()
    left = a[_long(form.u)] if form.indexed else form.u.abs() @ a
    chain = form.n * form.steps + a.shape[0] + b.shape[0] + 8  # + the loss's scaling, margin
    return (left * (form.v.abs() @ b)).reshape(-1, a.shape[1]).sum(dim=0), chain


def sum_dense(forms: list[PerExampleGrad]) -> Tensor:
    """Σ_c g_i^(c) materialised, (n, numel): for small parameters used by several calls."""
    summed = forms[0].flat_dense()
    for form in forms[1:]:
        summed = summed + form.flat_dense()
    return summed


def combined_sq_norms(forms: list[PerExampleGrad], numel: int) -> Tensor:
    """‖Σ_c g_i^(c)‖² for the forms of one parameter's calls: small ones (n·numel up to
    ``DEFER_NUMEL``) summed materialised and normed once (fewer operations than the cross
    terms), others by their norms and inner products, nothing large materialised."""
    if len(forms) > 1 and forms[0].n * numel <= DEFER_NUMEL:
        return _row_sq(sum_dense(forms))
    total = forms[0].sq_norms()
    for i, a in enumerate(forms):
        if i:
            total = total + a.sq_norms()
        for b in forms[i + 1 :]:
            total = total + 2 * inner(a, b, numel)
    return total
