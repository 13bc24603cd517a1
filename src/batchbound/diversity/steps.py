"""Diversity from a user's own training step: ``watch`` around their forward and backward,
unchanged, or ``monitored_step`` in place of those two lines.

Both give ``measure``'s guarantee for the model: the per-example norms they feed the monitor
are exact, or the step raises BatchboundError naming the parameter and the reason. ``watch``
does not see the loss as a function of each example: it reads whether the loss couples the
batch's examples (InfoNCE, in-batch negatives) off the loss's own graph at
``loss.backward()`` (``loss_coupling.py``), where ``monitored_step`` and ``measure`` call the
loss on examples apart.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from batchbound.diversity.calls import CHECKING, CopiedInert, Inputs, flatten
from batchbound.diversity.collector import collector_paused
from batchbound.diversity.graph import Node, parameter_users
from batchbound.diversity.hooks import (
    HookPlan,
    HooksPass,
    Layout,
    batch_output,
    draw_fingerprint_vectors,
    fingerprint_of,
    plan_hooks,
)
from batchbound.diversity.loss_coupling import Coupling, loss_coupling, loss_graph
from batchbound.diversity.loss_scale import check_loss_scale, loss_scale_of
from batchbound.diversity.losses import resolve_loss
from batchbound.diversity.online import OnlineDiversity, dense_gradient
from batchbound.diversity.outputs import (
    OutputGrads,
    RandomState,
    autocast_as,
    autocast_state,
    fallback_from_outputs,
    replayed_from_outputs,
)
from batchbound.diversity.precision import LOW_PRECISION, RANK, GradientPrecision, lowest, statement
from batchbound.diversity.precision import name as dtype_name
from batchbound.diversity.prepared import PreparedStats, describe
from batchbound.diversity.rows import (
    UNTRACKED_CHANGE,
    RowChecks,
    RowTracker,
    operations,
)
from batchbound.diversity.rule_check import (
    INTERACTING,
    buffers_kept,
    call_failure,
    coupling_outputs,
    deterministic,
    not_linear,
    output_kinds,
    padded_output,
    probe_layout,
    rng_kept,
    self_check,
    tolerance,
    why_coupled,
)
from batchbound.diversity.stats import (
    batch_norm_modules,
    check_model_mode,
    trainable_parameters,
)
from batchbound.diversity.subsets import monitored_parameters
from batchbound.errors import BatchboundError, raised_by_user_code, warn

# Checked once per model (the probe runs the model at two batch sizes): model -> state.
_PREPARED: weakref.WeakKeyDictionary[nn.Module, dict[tuple, PreparedStats]] = (
    weakref.WeakKeyDictionary()
)


def monitored_step(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss: str | Callable[[Tensor, Tensor], Tensor],
    monitor: OnlineDiversity,
    *,
    reduction: str = "mean",
    engine: str = "auto",
) -> Tensor:
    """Forward and backward of a per-example ``loss`` on (x, y), as a training step does, and
    a ``monitor`` update from the same backward pass.

    Accumulates into each trainable parameter's ``.grad`` exactly what
    ``loss(model(x), y).mean().backward()`` (``reduction="mean"``) or ``.sum().backward()``
    would, and returns that reduced loss (detached). Replace the forward/backward lines of an
    existing step with it; the optimizer step and ``zero_grad`` stay the user's. The model runs
    in its current mode; BatchNorm in train mode has no per-example gradients and is refused.
    The model is checked on the first step and the plan kept for later steps with the same
    ``loss`` object, ``engine`` and trainable parameters. Under DDP pass the inner module and
    all-reduce ``.grad`` as usual. Each rank's monitor then holds an unbiased estimate from
    its local batch; ranks that must agree (an adaptive batch size) should feed global numbers
    instead, see ``OnlineDiversity``.
    """
    if reduction not in ("mean", "sum"):
        raise BatchboundError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    prepared = _PREPARED.setdefault(model, {})
    # which parameters train is part of the plan: a loop that freezes or unfreezes some
    # between steps (gradual unfreezing) gets a new one
    trained = tuple((name, id(p)) for name, p in trainable_parameters(model).items())
    key = (engine, loss, trained)
    if key not in prepared:
        prepared.clear()  # one live plan per model
        prepared[key] = PreparedStats(model, resolve_loss(loss), engine)
    stats = prepared[key](x, y)
    scale = 1.0 / stats.n if reduction == "mean" else 1.0
    for name, param in trainable_parameters(model).items():
        grad = (stats.grad_sum[name] * scale).to(param.dtype).reshape(param.shape)
        if param.grad is None:
            param.grad = grad.clone()
        else:
            param.grad.add_(grad)
    monitor.update_from_stats(stats)
    used = lowest(prepared[key].precision, next(iter(prepared[key].params.values())).dtype)
    monitor.precision = dtype_name(used)
    total = stats.losses.sum()
    return (total / stats.n if reduction == "mean" else total).detach()


@contextmanager
def watch(model: nn.Module, monitor: OnlineDiversity, *, reduction: str = "mean",
          subset: str = "all", loss_scale: object = None) -> Iterator[None]:
    """Update ``monitor`` from the user's own forward and backward pass, unchanged:

        with watch(model, monitor):
            loss = F.cross_entropy(model(x), y)   # mean over the batch
            loss.backward()
        optimizer.step()

    The layer rules read per-example squared norms off the same backward pass (as
    ``per_example_stats`` does) and T_B comes from the change in ``.grad``, so the step costs
    about what it did and its gradients are untouched. ``reduction`` says how the loss
    combines the examples' losses: ``"mean"`` (norms rescaled by b²) or ``"sum"``. Call the
    model once per block, with any positional and keyword arguments (every tensor whose
    first dimension holds the batch is split by example), and run one backward. Inside the
    model the autograd graph shows which uses a layer rule covers; a parameter no rule can
    take is computed in the same step by the exact fallback (``outputs.py``: vmap or the
    per-example loop on the gradients the loss left on the model's outputs), with its cost
    warned once. A use in the loss itself (a regulariser written into it) is refused: seen on
    the loss's graph at ``loss.backward()``, or, for a backward started another way, by
    comparing the gradient sums with the change in ``.grad`` (put regularisers outside the
    block, or in the optimizer's weight decay). A loss that couples the examples (InfoNCE,
    in-batch negatives) is refused at ``loss.backward()``, before it runs
    (``loss_coupling.py``), and so is a model whose backward rewrites gradients other than
    linearly (a hook that clamps them), on its first step (``rule_check.not_linear``). A step
    whose ``.grad`` held so large a sum that its change lost digits is left out of the
    monitor (``monitor.left_out``), with a warning. Under
    autocast the precision the forward actually ran in sets the self-check's tolerance
    and is stated (``monitor.precision``, a warning); see docs/precision.md. The model is
    planned once and the plan kept while its structure stays the same. BatchNorm must be in
    eval mode.

    ``loss_scale``: a ``torch.amp.GradScaler`` (or a number) whose scale the loss was
    multiplied by (``scaler.scale(loss).backward()`` in the block): its current scale is
    divided out, so M2 and C are the loss's own and steps at different scales fold alike.
    Without it they carry s², and a scale change reweights the running estimate. A number
    also undoes a fixed factor: ``loss_scale=1 / k`` for ``(loss / k).backward()``, gradient
    accumulation over k micro-batches.

    ``subset="norms"``: the cheap mode. Only the LayerNorm and RMSNorm parameters are read
    (diversity/subsets.py), exactly, and ``monitor`` then holds *their* n·Δ, an estimate of
    the model's whose agreement is measured in docs/benchmarks.md; the other layers run
    untouched.
    """
    if reduction not in ("mean", "sum"):
        raise BatchboundError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    check_loss_scale(loss_scale)
    with collector_paused():  # the step's bookkeeping, freed at its end (collector.py)
        yield from _watched_step(model, monitor, reduction, subset, loss_scale)


def _watched_step(model: nn.Module, monitor: OnlineDiversity, reduction: str,
                  subset: str, loss_scale: object) -> Iterator[None]:
    with _Watched(model, subset, loss_scale) as watched:
        yield
    planned = watched.planned
    if watched.single:  # a loader's last, short batch: the training goes on
        assert planned is not None  # planned as the model was called
        if "single" not in planned.warned:
            planned.warned.add("single")
            warn("batchbound: watch(): a batch of one example leaves the monitor as it was "
                 "(per-example estimates need two); its step is the optimizer's as usual")
        return
    run = watched.finish()
    if (run is None or watched.delta is None or watched.before is None
            or not (run.backward_seen or (watched.outputs and watched.outputs.grads))):
        through = ("the model" if watched.subset == "all" else
                   f"the parameters subset={watched.subset!r} reads (the model's LayerNorm "
                   "and RMSNorm layers)")
        raise BatchboundError(f"watch() saw no backward pass through {through}; call the "
                              "model and loss.backward() inside the block")
    assert planned is not None
    if not watched.loss_seen and "backward" not in planned.warned:
        planned.warned.add("backward")
        warn("batchbound: watch(): the backward was not started by loss.backward() (by "
             "torch.autograd.backward?), so whether the loss couples the batch's examples "
             "(InfoNCE, in-batch negatives) was not checked; call loss.backward()")
    params = planned.params
    refused = {k: why for k, why in run.reasons.items() if why in REFUSED}
    if refused:
        _refuse(refused)
    coupling = watched.form.coupling if watched.form is not None else {}
    reached = [k for k in coupling if watched.outputs and k in watched.outputs.grads]
    if reached:
        k = reached[0]
        raise BatchboundError("watch(): " + batch_output(
            k, coupling[k], run.n, "backpropagate it after the block (a second "
            "backward adds its gradient to .grad, outside what watch reads)"))
    # the backward's own change, from its start to its end: what the block does to .grad
    # before it (zero_grad) or after it (clipping, GradScaler.unscale_) is not Δ's
    delta, before = watched.delta, watched.before
    if run.precision == torch.float16 and not _finite(delta, run.sq_norms):
        # float16 overflow: a GradScaler skips this step's update too, and lowers its scale
        _state_precision(monitor, planned, run.precision)
        warn("batchbound: watch(): this float16 step's gradients overflowed (inf or "
             "NaN); the monitor skips it, as a GradScaler skips the optimizer step")
        return
    # the forward's lowest precision on the gradient's path, and the loss's written after it
    precision = watched.loss_precision(run.precision)
    unseen = _unseen_uses(run, delta, before, precision)
    unseen.update({k: UNACCOUNTED for k in run.unused if bool(delta[k].any())})
    if unseen:
        _refuse(_hooks_named(params, unseen))
    sq_norms, held = run.sq_parts()  # S_B needs no per-example norms of the held gradients
    if run.reasons:  # no layer rule can take these: the exact fallback, in this step
        try:
            sq_norms = {**sq_norms, **watched.fallback(run.reasons, delta, precision)}
        except BatchboundError as exc:
            if set(run.reasons.values()) != {UNTRACKED_CHANGE}:
                raise
            # the first step of a program new since the row tracker stopped: the next step
            # that runs it is tracked and measured; this one the fallback cannot read (a loss
            # computed inside the model), so it is left out, as a batch of one is
            if "untracked" not in planned.warned:
                planned.warned.add("untracked")
                warn("batchbound: watch(): a step ran operations not seen on the steps the "
                     "row tracker followed (padding appearing after unpadded batches?) and the "
                     f"exact fallback cannot read it ({str(exc).split(': ', 1)[-1][:160]}…); "
                     "the monitor leaves it out, and the next step that runs them is checked "
                     "and measured; its step is the optimizer's as usual")
            return
        precision = watched.fallback_precision(precision)
    # The rules saw the user's loss, so their norms and sums carry its scale: a mean over b
    # examples divides every per-example gradient by b.
    b = run.n
    scale = float(b) if reduction == "mean" else 1.0
    S_B, T_B = batch_sums(sq_norms, [run.totals.get(k, delta[k]) for k in params], held)
    inexact = _rounded_away(watched.held_norms, delta, run.totals, T_B, precision,
                            watched.held_sparse)
    if loss_scale is not None:  # the scale this step's gradients carry, on the device
        carried = watched.scale * watched.scale
        S_B, T_B = S_B / carried, T_B / carried
    _state_precision(monitor, planned, precision)
    # no host sync in the step
    monitor.defer_from_norms(S_B, T_B, b, scale=scale**2, inexact=inexact)


def batch_sums(sq_norms: dict[str, Tensor], sums: list[Tensor],
               held: Sequence[Tensor] = ()) -> tuple[Tensor, Tensor]:
    """S_B = Σ over parameters and examples of ‖g_i‖² and T_B = ‖Σ_i g_i‖², as float64 device
    tensors, in a few fused operations: one concatenation and one sum of the per-example
    squared norms, one multi-tensor norm of the per-example gradients ``held`` un-normed
    (``HooksPass.sq_parts``: all their entries' squares count in S_B), one for T_B
    (tests/unit/test_watch_fused.py checks them against a loop)."""
    f64 = torch.float64
    terms = []
    if sq_norms:  # mixed dtypes: cat widens to the widest, exactly
        terms.append(torch.cat(list(sq_norms.values())).sum(dtype=f64))
    if held:
        norms_of_held = torch.stack(torch._foreach_norm(list(held), 2, dtype=f64))
        terms.append(torch.dot(norms_of_held, norms_of_held))
    norms_of_sums = torch.stack(torch._foreach_norm(sums, 2, dtype=f64))
    S_B = terms[0] if len(terms) == 1 else terms[0] + terms[1]
    return S_B, torch.dot(norms_of_sums, norms_of_sums)


def _rounded_away(held_norms: dict[str, Tensor], delta: dict[str, Tensor],
                  exact: dict[str, Tensor], T_B: Tensor, precision: torch.dtype,
                  sparse: bool = False) -> Tensor | None:
    """Whether accumulation's rounding can move T_B by more than the step's precision allows
    (a 0-dim boolean tensor; None where no ``.grad`` held a sum). ``.grad += g`` rounds each
    entry by ≤ u|after| (u the unit roundoff, ε/2) and reading the change after − before by
    ≤ u|Δ|, so ‖Δ − g‖ ≤ e = u(‖after‖ + ‖Δ‖) per parameter (4u where a ``.grad`` is
    ``sparse``: its entries are summed as it is made dense, as ``_accumulated_sparse``
    allows) and |T̂ − T| ≤ Σ e(2‖Δ‖ + e): about 2ku of T after k micro-batches, but where
    ``.grad`` held a sum ~10⁴ times the step's in float32 (a loop that never clears it), or
    about 6 micro-batches' in bfloat16, T_B keeps fewer digits than its precision and the
    monitor leaves the step out (tests/unit/test_watch_accumulated_digits.py: T_B off by 1 %
    at 10⁷, and C, a difference, by more)."""
    held = [k for k in held_norms if k not in exact]
    if not held:
        return None
    change = torch.stack(torch._foreach_norm([delta[k] for k in held], 2, dtype=torch.float64))
    unit = max(torch.finfo(delta[k].dtype).eps for k in held) * (2 if sparse else 0.5)
    e = torch.stack([held_norms[k] for k in held]).add_(change).mul_(unit)
    error = torch.dot(e, change.mul_(2).add_(e))
    return error > tolerance(precision) * T_B


def _grad_copies(params: dict[str, nn.Parameter]) -> dict[str, Tensor | None]:
    """What each ``.grad`` holds before the block (None: no gradient yet), copied by one
    multi-tensor operation."""
    held = [k for k, p in params.items() if p.grad is not None]
    copies = dict.fromkeys(params)
    if held:
        with torch.no_grad():
            copied = torch._foreach_mul([dense_gradient(params[k].grad) for k in held], 1.0)
        copies.update(zip(held, copied, strict=True))
    return copies


def _grad_changes(params: dict[str, nn.Parameter],
                  before: dict[str, Tensor | None]) -> dict[str, Tensor]:
    """The change in each ``.grad`` over the block (zeros where there is none)."""
    delta: dict[str, Tensor] = {}
    both = [k for k, p in params.items() if p.grad is not None and before[k] is not None]
    for name, p in params.items():
        if p.grad is None:
            delta[name] = torch.zeros_like(p)
        elif before[name] is None:
            delta[name] = dense_gradient(p.grad)
    if both:
        with torch.no_grad():
            changes = torch._foreach_sub([dense_gradient(params[k].grad) for k in both],
                                         [before[k] for k in both])
        delta.update(zip(both, changes, strict=True))
    return {k: delta[k] for k in params}


def _finite(*groups: dict[str, Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for group in groups for t in group.values())


def _state_precision(monitor: OnlineDiversity, planned: _Planned, used: torch.dtype) -> None:
    """The precision the step computed in, on the monitor (``monitor.precision``), and a
    warning once per model when it is below the parameters' (autocast) or low itself."""
    parameters = next(iter(planned.params.values())).dtype
    monitor.precision = dtype_name(used) if used == parameters else (
        f"{dtype_name(used)} (autocast or casts in the forward; {dtype_name(parameters)} "
        "parameters)")
    if used in LOW_PRECISION and used not in planned.warned:
        planned.warned.add(used)
        warn(f"batchbound: watch(): {statement(used, parameters)}")


def _hooks_named(params: dict[str, nn.Parameter], reasons: dict[str, str]) -> dict[str, str]:
    """``reasons``, with a hook on a parameter's gradient named as the likely cause where the
    parameter has one (``register_hook``: a clamp changes .grad after the examples' gradients
    were read, which no rule sees)."""
    return {k: (HOOKED if getattr(params[k], "_backward_hooks", None) else why)
            for k, why in reasons.items()}


HOOKED = ("a hook on its gradient (register_hook) changes .grad after the examples' gradients "
          "are read, so .grad is not their sum: change .grad after the block instead (clamp or "
          "clip it there)")


def _refuse(reasons: dict[str, str]) -> None:
    raise BatchboundError(f"watch() cannot compute these parameters' per-example gradients "
                          f"exactly: {describe(reasons)}. Use monitored_step(), which "
                          "computes them by an exact fallback")


def _unseen_uses(run: HooksPass, delta: dict[str, Tensor], before: dict[str, Tensor | None],
                 precision: torch.dtype) -> dict[str, str]:
    """Parameters whose ``.grad`` change disagrees with the rules' gradient sum (projected on
    fixed random vectors): a use the model's graph does not show, a regulariser in the loss.
    One comparison for all parameters; the projections and norms are small tensor products.

    The tolerance: rtol × the norms (‖Δ.grad‖ + √S), which bound rounding's effect on any
    projection; or, where the rules' forms bound their terms (``forms.project_bound``), the
    rounding that bound allows, at the projection's own scale (~1/√numel of the norms'), at
    which a regulariser on a layer's weights shows (tests/unit/test_watch_rounding_floor.py).
    Where ``.grad`` held a sum already (accumulation), its addition and the subtraction
    that reads the change round by ≤ ε(|a|ᵀ|before||b| + |a|ᵀ|Δ||b|) more (``_accumulated``),
    an embedding's (a sparse ``.grad``) by ≤ ε(‖before‖ + ‖after‖)."""
    names = [k for k in run.fingerprints if k not in run.totals]
    if not names:
        return {}
    rtol = tolerance(precision)
    ours = torch.stack([torch.as_tensor(run.fingerprints[k]) for k in names])
    seen = torch.stack([fingerprint_of(delta[k], run.fingerprint_vectors[k]) for k in names])
    scale = torch.stack([torch.linalg.vector_norm(delta[k]) for k in names]) + torch.stack(
        [run.sq_norms[k].sum() for k in names]).sqrt()
    floor = rtol * step_norm(delta)
    allowed = (rtol * scale + floor * (scale <= floor)).unsqueeze(1).expand_as(ours).clone()
    bounded = [i for i, k in enumerate(names) if run.fingerprint_bounds.get(k) is not None]
    if bounded:
        keys = [names[i] for i in bounded]
        terms, chains = (torch.stack([torch.as_tensor(run.fingerprint_bounds[k][j])  # type: ignore[index]
                                      for k in keys]).double() for j in (0, 1))
        held_round = torch.stack([
            _accumulated(before.get(k), delta[k], run.fingerprint_vectors[k])
            if k not in run.fingerprint_indexed
            else _accumulated_sparse(before.get(k), delta[k], scale[i]).expand(terms.shape[1])
            for i, k in zip(bounded, keys, strict=True)])
        tight = _rounding(precision, terms, chains) + held_round
        allowed[bounded] = torch.minimum(allowed[bounded], tight.to(allowed.dtype))
    bad = ((ours - seen).abs() > allowed + 1e-30).any(dim=1).tolist()
    return {k: "its gradient includes uses outside the model's layers (a regulariser in the loss?)"
            for k, wrong in zip(names, bad, strict=True) if wrong}


def _accumulated(before: Tensor | None, delta: Tensor, vectors: tuple[Tensor, Tensor]) -> Tensor:
    """What accumulation can move a dense ``.grad``'s fingerprints by: ``.grad += g`` and
    Δ = after − before round each entry by ≤ 1 unit of |before + g| and of |Δ|, so the
    projections on a, b by ≤ ε(|a|ᵀ|before||b| + |a|ᵀ|Δ||b|) with a margin (ε = 2 units;
    a ``.grad`` that was None takes g as it is): on the fingerprints' own scale, where
    ε·‖before‖ is √numel times larger and let a regulariser through once many micro-batches
    had accumulated. Not for an embedding's (``HooksPass.fingerprint_indexed``): a sparse
    gradient's entries are added one at a time onto before, or reordered when a sparse
    ``.grad`` is made dense."""
    absolute = (vectors[0].abs(), vectors[1].abs())
    held = fingerprint_of(delta.abs(), absolute)
    if before is not None:
        held = held + fingerprint_of(before.abs(), absolute)
    return 2 * torch.finfo(delta.dtype).eps * held.double()


def _accumulated_sparse(before: Tensor | None, delta: Tensor, scale: Tensor) -> Tensor:
    """An embedding's allowance for accumulation (``_accumulated``'s exception): its entries
    added onto ``before`` one at a time, or reordered when a sparse ``.grad`` is made dense,
    round by ≤ 2ε(‖before‖ + ‖after‖), with ‖after‖ ≤ ‖before‖ + ‖Δ‖ ≤ ‖before‖ + ``scale``."""
    held = 0.0 if before is None else float(torch.linalg.vector_norm(before, dtype=torch.float64))
    return 4 * torch.finfo(delta.dtype).eps * (2 * held + scale.double())


def _rounding(precision: torch.dtype, terms: Tensor, chains: Tensor) -> Tensor:
    """What rounding can move a projection by, from its terms in absolute value and their
    chains of roundings (``forms.project_bound``): 2 units of float32 or float64 per link,
    at most the precision's rtol (longer sums round far below the worst case). bfloat16 and
    float16, or float32 products run in TensorFloat-32 or bfloat16 passes
    (``torch.set_float32_matmul_precision``), round each operand to 10 bits or fewer: their
    rtol."""
    rtol = tolerance(precision)
    if precision == torch.float32 and _float32_products_lowered():
        return tolerance(torch.bfloat16) * terms
    if precision not in (torch.float32, torch.float64):
        return rtol * terms
    unit = torch.finfo(precision).eps  # 2 units of rounding
    return torch.minimum(unit * chains, rtol * terms)


def _float32_products_lowered() -> bool:
    """Whether float32 matrix products may round their operands to TensorFloat-32 or
    bfloat16: ``torch.set_float32_matmul_precision``, or the per-backend settings of
    torch ≥ 2.9 (``torch.backends.{cuda,mkldnn}.matmul.fp32_precision``, and the generic
    ``torch.backends.fp32_precision`` they inherit), after which the legacy read raises
    (tests/unit/test_watch_fingerprints.py: oneDNN's "bf16" rounds a CPU's float32 Linear
    at 3e-3)."""
    try:
        if torch.get_float32_matmul_precision() != "highest":
            return True
    except RuntimeError:  # "a mix of the legacy and new APIs": the backends' own say
        pass
    backends = [getattr(getattr(torch.backends, name, None), "matmul", None)
                for name in ("cuda", "mkldnn")]
    return any(getattr(b, "fp32_precision", "ieee") in ("tf32", "bf16") for b in backends)


def step_norm(delta: dict[str, Tensor]) -> Tensor:
    """‖the step's whole gradient‖: the scale of the checks' rounding floor, rtol × this. A
    parameter whose exact gradient is 0 (an attention key's bias: softmax ignores a shift)
    holds rounding of the terms that cancelled, not of its own norm. The floor applies only
    to a parameter whose gradient and examples' gradients (the check's own scale) lie below
    it: a use the outputs do not show can then be no larger than that, and moves the step's
    Δ by no more than its precision does. Elsewhere it would hide one: the fingerprints are
    projections, about 1/√numel of a mismatch's norm, so a regulariser of 0.03 × the step's
    gradient on a small layer passed under it (tests/unit/test_watch_rounding_floor.py)."""
    if not delta:
        return torch.zeros((), dtype=torch.float64)
    norms = torch._foreach_norm(list(delta.values()), 2, dtype=torch.float64)
    return torch.linalg.vector_norm(torch.stack(norms))


# Shapes of call whose programs a form keeps (sequence lengths, with dynamic padding): past
# them the oldest's are checked again when they come back (a check on a few examples split
# off; ~10 kB a program on a 12-layer GPT-2)
PROGRAM_SHAPES = 256


@dataclass
class _Programs:
    """The programs (``HooksPass.program``: the layers' calls with their outputs' shapes, and
    the autograd graph's nodes with their saved arguments) that one form's steps ran since
    their checks: in full per shape of call (``rows.chunk_key``), and apart from their sizes
    (``rows.operations``), as a new batch size or sequence length leaves them. A program is
    known in full at its shape, or apart from its sizes where no program of that shape has
    its operations: the same operations with other arguments at the same sizes
    (``h.mean(0)`` for ``h.mean(1)``) are checked. Oldest forgotten first."""

    full: dict[Hashable, dict[Hashable, _Form]] = field(default_factory=dict)
    free: dict[Hashable, _Form] = field(default_factory=dict)
    free_at: dict[Hashable, set[Hashable]] = field(default_factory=dict)  # per shape

    def find(self, key: Hashable, program: Hashable) -> _Form | None:
        """The check that holds for this program at this shape of call, or None."""
        checked = self.full.get(key, {}).get(program)
        if checked is not None:
            return checked
        free = operations(*program)  # type: ignore[misc]
        return None if free in self.free_at.get(key, ()) else self.free.get(free)

    def add(self, key: Hashable, program: Hashable, checked: _Form) -> None:
        if self.full.get(key, {}).get(program) is checked:
            return  # known already, as on most steps: no second pass over its nodes
        free = operations(*program)  # type: ignore[misc]
        self.free_at.setdefault(key, set()).add(free)
        for held, item in ((self.full.setdefault(key, {}), program), (self.free, free)):
            held[item] = checked
            if len(held) > KNOWN_FORMS:
                del held[next(iter(held))]
        while len(self.full) > PROGRAM_SHAPES:
            oldest = next(iter(self.full))
            del self.full[oldest], self.free_at[oldest]


@dataclass
class _Planned:
    """What watch() needs of a model, planned once while its structure stays the same."""

    structure: tuple
    params: dict[str, nn.Parameter]
    plan: HookPlan
    fingerprint_vectors: dict[str, tuple[Tensor, Tensor]]
    batch_norms: list[tuple[str, nn.Module]]
    # per way the model is called (``call_form``): its first such call's check
    forms: dict[Hashable, _Form] = field(default_factory=dict)
    # per way the model is called: the programs its steps ran after a check of that form
    programs: dict[Hashable, _Programs] = field(default_factory=dict)
    warned: set[object] = field(default_factory=set)  # precisions and fallbacks stated
    # Per train/eval mode of the modules: whether two forward passes agree (no dropout).
    deterministic: dict[tuple[bool, ...], bool] = field(default_factory=dict)
    row_checks: RowChecks = field(default_factory=RowChecks)  # the steps the tracker sees
    # the ways of writing the loss (``loss_coupling.loss_graph``): steps seen, the next
    # one whose coupling is checked (0: none, it cannot be read)
    losses: dict[Hashable, list[int]] = field(default_factory=dict)


@dataclass
class _Form:
    """What the first watched call of one form showed (the probe, the self-check): the
    outputs are indexed as that form returns them (with ``labels=`` a Hugging Face model's
    output 0 is its loss, without them its logits)."""

    layout: Layout
    checked: dict[str, str]  # disagreed with the loop: the fallback
    # Outputs without the examples' axis that are no sum or mean of the examples' own
    coupling: dict[int, tuple[int, ...]]
    fixed: frozenset[int]  # outputs with no examples' axis (``output_kinds``)


KNOWN_FORMS = 16  # checks of forms of call kept per model; past them the oldest's is redone


def call_form(model: nn.Module, args: tuple, kwargs: dict) -> Hashable:
    """How the model is called, apart from its tensors' sizes: its modules' train flags (a
    model may return other outputs in train mode) and the user's hooks on them (by their
    code: a hook added between steps may mix the examples, in its output or in a gradient,
    with no operation of the graph to show it), and each argument's name and kind (a
    tensor's dimensions and dtype; any other value itself: ``return_dict=False``, a mixing
    weight that switches on a statistic of the batch)."""
    def kind(value: Any) -> Hashable:
        if isinstance(value, Tensor):
            return ("tensor", value.dim(), value.dtype)
        if isinstance(value, (tuple, list)):
            return tuple(kind(v) for v in value)
        if isinstance(value, dict):
            return tuple((k, kind(v)) for k, v in value.items())
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        return type(value)
    modules = tuple(_hooked(m) if m._forward_pre_hooks or m._forward_hooks
                    or m._backward_pre_hooks or m._backward_hooks else m.training
                    for m in model.modules())
    return modules, kind(args), kind(kwargs)


def _hooked(module: nn.Module) -> Hashable:
    return (module.training, *(_code(h) for hooks in (
        module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks,
        module._backward_hooks) for h in hooks.values() if not isinstance(h, CopiedInert)))


def _code(hook: Callable) -> Hashable:
    """What a hook runs: a closure made anew on every step is the same hook."""
    function = getattr(hook, "__func__", hook)  # a bound method's
    return getattr(function, "__code__", type(hook))


# One plan per model and subset: a loop that alternates watch(subset="all") and
# watch(subset="norms") on one model keeps both, instead of re-checking the model (the probe
# and the per-example loop) on every step.
_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[str, _Planned]] = weakref.WeakKeyDictionary()


def _planned(model: nn.Module, subset: str = "all") -> tuple[_Planned, list[Tensor]]:
    """The model's plan, made again where its structure changed, and its buffers now."""
    structure, buffers = _walk(model)
    plans = _PLANS.setdefault(model, {})
    planned = plans.get(subset)
    if planned is None or planned.structure != structure:
        params = monitored_parameters(model, subset)
        plan = plan_hooks(model, params)
        planned = plans[subset] = _Planned(structure, params, plan,
                                           draw_fingerprint_vectors(params),
                                           batch_norm_modules(model))
    return planned, buffers


def _walk(model: nn.Module) -> tuple[tuple, list[Tensor]]:
    """One pass over the modules, on every step: what a plan holds for (each module's name,
    identity and type; each parameter's name, identity, shape, dtype, device and whether it
    trains, in ``named_parameters`` order, tied ones once) and the buffers (for the row
    tracker and a replay). Four passes (``named_parameters``, ``named_modules`` and
    ``buffers`` twice) were a fifth of the Python calls ``watch`` adds to a step, and a GPU
    waits on the host's Python (docs/benchmarks.md)."""
    modules, tensors, buffers = [], [], []
    seen: set[int] = set()
    for name, module in model.named_modules():
        modules.append((name, id(module), type(module)))
        for key, p in module._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                tensors.append((f"{name}.{key}" if name else key, id(p), p.shape, p.dtype,
                                p.device, p.requires_grad))
        for b in module._buffers.values():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                buffers.append(b)
    return (tuple(modules), tuple(tensors)), buffers


class _Watched:
    """Root-module hooks: on the model's call, check it (first time only), record its layer
    calls, and before the backward pass read the graph from its outputs."""

    def __init__(self, model: nn.Module, subset: str, loss_scale: object = None) -> None:
        self.model, self.subset = model, subset
        # a GradScaler's scale as the backward ends: the one its gradients carry, also where
        # the block goes on to scaler.update()
        self.loss_scale = loss_scale
        self.scale: float | Tensor = 1.0
        # planned as the model is called: a layer unfrozen or a parameter replaced inside
        # the block, before the forward, is the step's
        self.planned: _Planned | None = None
        self.plan: HookPlan | None = None
        self.params: dict[str, nn.Parameter] = {}
        self.buffers: list[Tensor] = []
        # .grad as the backward begins (a zero_grad() inside the block is before it), and
        # its change at the backward's end
        self.before: dict[str, Tensor | None] | None = None
        self.delta: dict[str, Tensor] | None = None
        self.held_norms: dict[str, Tensor] = {}
        self.held_sparse = False
        self.versions: dict[str, int] = {}  # the parameters' versions at the backward's end
        self._queued = False
        self.run: HooksPass | None = None
        self.form: _Form | None = None  # the check of this call's form (``call_form``)
        self._form_key: Hashable = None
        self._checked_now = False  # the form was checked as this step began
        self.calls = 0
        self.inputs: Tensor | Inputs | None = None  # the examples of the watched call
        self.single = False  # a batch of one: nothing to read (``_watched_step``)
        self.outputs: OutputGrads | None = None  # for the fallback, when it is needed
        self.autocast: list[tuple[str, torch.dtype]] = []  # active at the model's call
        self.random: RandomState | None = None  # torch's random state as the forward began
        self._rows: RowTracker | None = None  # active during the model's forward
        self._loss: _LossWatch | None = None  # active from the forward's end to the backward
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> _Watched:
        self._handles = [
            self.model.register_forward_pre_hook(CopiedInert(self._before), with_kwargs=True),
            self.model.register_forward_hook(CopiedInert(self._after)),
        ]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._stop_rows()  # the model's forward raised before its end
        self._stop_loss()
        if self.outputs is not None:
            self.outputs.close()
        if self.run is not None:
            self.run.recorder.__exit__(None, None, None)
            if exc_type is not None:
                self.run.close()

    def _before(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        if CHECKING.get() is not None:  # a watcher's own pass: not the user's call
            return
        self.calls += 1
        if self.calls > 1:
            raise BatchboundError("the model ran more than once inside watch(); per-example "
                                  "norms need one forward and one backward per block")
        self.planned, self.buffers = _planned(model, self.subset)
        self.plan, self.params = self.planned.plan, self.planned.params
        check_model_mode(model, self.planned.batch_norms)
        x = Inputs.of(args, kwargs)
        if x is None:
            raise BatchboundError("watch() needs a tensor of examples among the model's "
                                  "arguments (the examples along its first dimension)")
        if x.shape[0] < 2:
            self.single = True
            return
        self.inputs, self.autocast = x, autocast_state()
        form = self._form_key = call_form(model, args, kwargs)
        self.form = self.planned.forms.get(form)
        if self.form is None:
            self.form = self._checked(x)
            self._checked_now = True
            forms = self.planned.forms
            if len(forms) >= KNOWN_FORMS:  # the oldest's check, for this one's
                del forms[next(iter(forms))]
                self._warn_forms()
            forms[form] = self.form
            # the probe ran the model: a buffer its forward builds lazily exists now
            self.buffers = list(model.buffers())
        excluded = {**self.plan.static_reasons(), **self.form.checked}
        self.run = HooksPass(self.plan, self.params, self.form.layout, int(x.shape[0]), excluded,
                             fingerprint_vectors=self.planned.fingerprint_vectors)
        self.run.recorder.__enter__()
        self.run.recorder.start()
        # the probe above kept the random state: this is the one the user's forward draws from
        self.random = RandomState(sorted({p.device.index or 0 for p in self.params.values()
                                          if p.device.type == "cuda"}), self.buffers)
        self.run.row_checks = self.planned.row_checks
        self.run.on_program = self._check_program
        self._rows = self.run.start_rows(model, (args, kwargs), lambda: self.buffers)
        if self._rows is not None:
            self._rows.__enter__()

    def _checked(self, x: Tensor | Inputs, layout: Layout | None = None) -> _Form:
        """The model checked on examples split off ``x`` (the probe of its layers' axes
        first, where no ``layout`` is given), by passes no watcher records (``CHECKING``)."""
        assert self.plan is not None
        checking = CHECKING.set(object())
        try:
            with torch.enable_grad():
                try:
                    if layout is None:
                        layout = probe_layout(self.model, x, self.plan, self.params)
                    return self._check(x, layout)
                except BatchboundError:
                    raise
                except Exception as exc:  # any: named in the refusal
                    if isinstance(x, Inputs):
                        raise BatchboundError(call_failure(self.model, x, exc, "the batch")
                                              ) from exc
                    with raised_by_user_code(lambda: (
                            "watch() ran the model on parts of a batch, down to one example, "
                            "to check its layer rules: a model must run on any number of "
                            "examples")):
                        raise
        finally:
            CHECKING.reset(checking)

    def _warn_forms(self) -> None:
        if "forms" not in self.planned.warned:
            self.planned.warned.add("forms")
            warn(f"batchbound: watch(): the model was called in more than {KNOWN_FORMS} ways "
                 "(its arguments' values or its modules' train flags differ from step to "
                 "step: a count passed as a Python number?); each new way is checked again, "
                 "at the cost of a few forward passes (pass a count as a tensor)")

    def _check(self, x: Tensor | Inputs, layout: Layout) -> _Form:
        """Once per model and form of call: the rules beside the per-example loop on a few
        examples, with a fixed random projection of the outputs standing in for the user's
        loss (the rules do not depend on the loss; the check shows examples that interact or
        are reordered).
        Parameters whose rules disagree go to the exact fallback."""
        y = torch.zeros(x.shape[0], device=x.device)
        # n experts' loads at a batch of n: no output of the examples, whatever its size
        kinds = output_kinds(self.model, x, self.params)
        fixed = kinds.fixed
        stand_in = functools.partial(_stand_in_loss, fixed=fixed)
        reasons = self_check(self.model, x, y, stand_in, self.plan, self.params, layout,
                             self.plan.static_reasons(), kinds)
        if INTERACTING in reasons.values():  # or a padding that follows the batch, named
            why = padded_output(self.model, x, fixed) or why_coupled(self.model, x)
            raise BatchboundError(f"watch(): {why}")
        why = not_linear(self.model, x, y, stand_in, self.params)
        if why:  # the rules and the fallback alike read the examples' gradients at 1/b
            raise BatchboundError(f"watch(): {why}")
        if kinds.unchecked:  # measure() runs each chunk apart instead (pairing.py)
            raise BatchboundError(
                f"watch(): {kinds.joins}: whether they interact depends on each step's data, "
                "which watch cannot check without running the model again on parts of every "
                "batch; measure() checks each chunk")
        # the stand-in reads the outputs with the examples' axis only: the others apart
        return _Form(layout, reasons, coupling_outputs(self.model, x, fixed), fixed)

    def _after(self, model: nn.Module, args: tuple, output: Any) -> Any:
        if CHECKING.get() is not None or self.run is None:
            return
        self._stop_rows()
        self.run.recorder.stop()
        roots = [t.grad_fn for t in flatten(output) if isinstance(t, Tensor) and t.grad_fn]
        # before the rules' own hooks, so that a second backward is refused ahead of them
        self._handles += [root.register_prehook(self._backward_reached) for root in roots]
        self.run.attach(roots)  # it calls _check_program before it hooks the rules
        # each output's node as the forward leaves it: an in-place edit after it is the loss's
        tensors = [(t.grad_fn, t.output_nr, t) for t in flatten(output) if isinstance(t, Tensor)]
        if self.run.reasons or self.form.coupling:  # the outputs' gradients are needed
            self.outputs = OutputGrads(output, self.run.n, self.form.fixed)
        # entered after our own hooks on the outputs: the user's on the loss's tensors it sees
        self._loss = _LossWatch(self.run, roots, (tensors, self.form.fixed),
                                self.planned.losses)
        self._loss.__enter__()
        return self.outputs.output if self.outputs is not None else None

    def _check_program(self) -> None:
        """A check holds for the operations the step it ran on ran (its program): a step of
        a program not seen since (a flag or a hook that no argument shows switching on a
        statistic of the batch, a mask a library skips without padding) is checked now, on
        its own examples, before its backward; refused where they interact. Each program
        is checked once, and its check read on every step that runs it."""
        assert self.run is not None and self.planned is not None and self.form is not None
        programs = self.planned.programs.setdefault(self._form_key, _Programs())
        key, program = self.run.row_key, self.run.program
        checked = self.form if self._checked_now else programs.find(key, program)
        if checked is None:
            assert self.inputs is not None
            checked = self._checked(self.inputs, self.form.layout)
        programs.add(key, program, checked)
        for name, why in checked.checked.items():  # this program's own fallback
            self.run.reasons.setdefault(name, why)
        self.form = checked  # its outputs' marks, for this step

    def _backward_reached(self, grad_outputs: tuple) -> None:
        """A backward pass reached the model's outputs: read .grad's change when it ends."""
        if self.delta is not None:
            raise BatchboundError("watch(): a second backward pass through the model's outputs "
                                  "in one block (retain_graph, or torch.autograd.grad inside "
                                  "the step, as a gradient penalty takes it with "
                                  "create_graph=True); the rules read one backward per "
                                  "forward: backpropagate the sum of the losses once")
        if not self._queued:
            self._queued = True
            # before any .grad of the model's parameters changes: each is written after a
            # node of the model, and the backward reaches the model's outputs first
            self.before = _grad_copies(self.params)
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._queued = False
        assert self.before is not None  # copied as the backward reached the outputs
        stepped = [k for k, p in self.params.items() if p._post_accumulate_grad_hooks]
        if stepped:  # read at the backward's end, .grad is no longer the step's gradient
            raise BatchboundError(
                f"watch(): {', '.join(stepped[:3])}{' …' if len(stepped) > 3 else ''} "
                "have hooks on their accumulated gradient (register_post_accumulate_grad_hook:"
                " an optimizer step in the backward), which change .grad before watch reads "
                "the step's gradient at the backward's end; step the optimizer after the block")
        delta = _grad_changes(self.params, self.before)
        if self.loss_scale is not None:
            self.scale = loss_scale_of(self.loss_scale, next(iter(delta.values())).device)
        # a .grad that was None before is read as itself: copy it, or clipping scales it here
        fresh = [k for k, v in self.before.items() if v is None and self.params[k].grad is not None]
        if fresh:
            with torch.no_grad():
                delta.update(zip(fresh, torch._foreach_mul([delta[k] for k in fresh], 1.0),
                                 strict=True))
        self.delta = delta
        # ‖.grad‖ where it held a sum before: its rounding (``_rounded_away``)
        held = [k for k, v in self.before.items() if v is not None]
        self.held_norms = dict(zip(held, torch._foreach_norm(
            [dense_gradient(self.params[k].grad) for k in held], 2, dtype=torch.float64),
            strict=True)) if held else {}
        self.held_sparse = any(self.params[k].grad.is_sparse for k in held)
        # the weights the step's gradients were taken at: the fallback reads them after the
        # block, so a change before then (an optimizer step inside it) is refused there
        self.versions = {k: p._version for k, p in self.params.items()}

    def _stop_rows(self) -> None:
        if self._rows is not None:
            self._rows.__exit__(None, None, None)
            self._rows = None

    @property
    def loss_seen(self) -> bool:
        """Whether the block's backward was a ``loss.backward()`` (its loss read)."""
        return self._loss is not None and self._loss.called

    def _stop_loss(self) -> None:
        if self._loss is not None:
            self._loss.__exit__(None, None, None)

    def loss_precision(self, forward: torch.dtype) -> torch.dtype:
        """The lower of the forward's precision and the loss's: a float64 model's logits cast
        to float32 in the loss round the gradients that reach the model in float32."""
        return lowest(forward, self._loss.seen.dtype if self._loss is not None else None)

    def fallback_precision(self, observed: torch.dtype) -> torch.dtype:
        """The fallback reruns the forward under the call's autocast without the dispatch mode
        that observed it, so an operation that lowers its own inside (``nn.Bilinear`` on CPU)
        computes there in autocast's dtype: the fallback's numbers carry at least its rounding."""
        return lowest(observed, *(dtype for _, dtype in self.autocast))

    def finish(self) -> HooksPass | None:
        if self.run is not None:
            self.run.finish()
        return self.run

    def fallback(self, reasons: dict[str, str], delta: dict[str, Tensor],
                 precision: torch.dtype) -> dict[str, Tensor]:
        checking = CHECKING.set(object())  # its runs of the model: no other watcher's calls
        try:
            return self._fallback(reasons, delta, precision)
        finally:
            CHECKING.reset(checking)

    def _fallback(self, reasons: dict[str, str], delta: dict[str, Tensor],
                  precision: torch.dtype) -> dict[str, Tensor]:
        """Squared norms of the parameters no rule took, by the exact fallback on the
        outputs' gradients (``outputs.py``); a warning once per set of reasons with the cost.
        A model that draws random numbers (dropout) has its batch's forward replayed from
        the random state its call began with, so the masks are the step's own. The gradient
        sum must match the step's own (the change in ``.grad``): a mismatch is a use the
        outputs do not show (a regulariser through ``torch.autograd.backward``), a loss that
        is not a sum over examples, or masks the replay did not draw again."""
        assert self.outputs is not None and self.inputs is not None
        moved = [k for k, p in self.params.items() if p._version != self.versions.get(k)]
        if moved:
            raise BatchboundError(
                f"watch(): {', '.join(moved[:3])}{' …' if len(moved) > 3 else ''} changed "
                "inside the block after the backward (an optimizer step inside it?), and the "
                "exact fallback, which runs at the block's end, would read the examples' "
                "gradients at the new weights; step the optimizer after the block")
        names = [k for k in self.params if k in reasons]
        modes = tuple(m.training for m in self.model.modules())
        if modes not in self.planned.deterministic:  # once per mode: two forward passes
            with autocast_as(self.autocast), buffers_kept(self.model), rng_kept(self.params):
                self.planned.deterministic[modes] = deterministic(self.model, self.inputs)
        rtol = tolerance(self.fallback_precision(precision))
        try:
            if self.planned.deterministic[modes]:
                sq, sums, method, seconds = fallback_from_outputs(
                    self.model, self.inputs, self.outputs, names, self.autocast)
            else:
                assert self.random is not None  # set as the watched call began
                sq, sums, method, seconds = replayed_from_outputs(
                    self.model, self.inputs, self.outputs, names, self.autocast, self.random,
                    rtol)
        except BatchboundError as exc:
            _refuse({k: str(exc) for k in names})
        floor = rtol * float(step_norm(delta))
        scale = {k: float(torch.linalg.vector_norm(delta[k])) + float(sq[k].sum()) ** 0.5
                 for k in names}  # the floor only below it (step_norm)
        wrong = {k: "its gradient in this step is not the sum of the per-example gradients "
                    "read off the model's outputs (a regulariser in the loss, a loss that "
                    "is not a sum over the examples, or examples that interact in this "
                    "step: a statistic of the batch switched on after the first step, "
                    "which the per-example loop checked?)"
                 for k in names
                 if float(torch.linalg.vector_norm(sums[k].to(delta[k].dtype) - delta[k]))
                 > rtol * scale[k] + (floor if scale[k] <= floor else 0.0) + 1e-30}
        if wrong and self.planned.deterministic[modes]:  # dropout raised since it was read?
            with autocast_as(self.autocast), buffers_kept(self.model), rng_kept(self.params):
                if not deterministic(self.model, self.inputs):
                    self.planned.deterministic[modes] = False
                    return self.fallback(reasons, delta, precision)  # replayed, once
        if wrong:
            _refuse(_hooks_named(self.params, wrong))
        key = describe({k: reasons[k] for k in names})
        if key not in self.planned.warned:
            self.planned.warned.add(key)
            warn(f"batchbound: watch(): computing exact per-example gradients by "
                 f"{method} ({seconds:.2g} s on this step) for the parameters no layer "
                 f"rule can take: {key}")
        return sq


class _LossWatch(TorchFunctionMode):
    """Between the model's forward and ``loss.backward()``: at that call, the loss's own
    graph is read from its root to the model's outputs, and every parameter it uses (a
    regulariser written into the loss) is named, by construction, with no fingerprint of the
    gradients needed, and whether the loss couples the examples (``loss_coupling.py``) is
    checked on the 1st, 2nd, 4th, … step of each way it is written. The backward itself runs
    outside the mode. A backward started some other way (``torch.autograd.backward``) is not
    seen: the fingerprints then decide on a use in the loss, and its coupling is not checked
    (``_watched_step`` warns once)."""

    def __init__(self, run: HooksPass, outputs: list[Node],
                 tensors: tuple[list[tuple[Node | None, int, Tensor]], frozenset[int]],
                 checked: dict[Hashable, list[int]]) -> None:
        super().__init__()
        self.run, self.outputs = run, outputs
        self.tensors = tensors  # the model's outputs, and which hold no examples
        self.called = False  # a loss.backward() was called: its coupling read
        # a hook on a tensor of the loss or on an output (its gradient read by the check)
        self.hooked = any(t._backward_hooks or t.retains_grad for _, _, t in tensors[0])
        self.checked = checked  # the ways of writing the loss checked on this model
        # the loss's precision: ``logits.float()`` in a float64 model rounds in float32
        self.seen = GradientPrecision()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func is not Tensor.backward:
            if getattr(func, "__name__", None) in _HOOKING:
                self.hooked = True  # the check's derivatives would run the user's hook
            out = func(*args, **(kwargs or {}))
            for t in flatten(out):
                if isinstance(t, Tensor) and RANK.get(t.dtype, 3) < 2:
                    self.seen.see(t, flatten((args, kwargs)))
            self.seen.arm()  # above autograd: the results have their nodes already
            return out
        given = (kwargs or {}).get("inputs", args[4] if len(args) > 4 else None)
        if given is not None:
            raise BatchboundError(
                "watch(): backward(inputs=...) leaves the model's other parameters without a "
                "gradient in this step, so its S and T would be those of part of the model; "
                "call backward() without inputs=, and freeze what should not train")
        if func is Tensor.backward and self.run.layout is not None and isinstance(args[0], Tensor):
            root = args[0].grad_fn
            if root is not None:
                self.called = True
                ids = {id(p): name for name, p in self.run.params.items()}
                nodes, written = loss_graph(root, self.outputs)
                for name in parameter_users(nodes, ids):
                    self.run.reasons[name] = LOSS_USE_IN_WATCH  # also over 'no rule'
                self.run.fingerprint_vectors = {}  # the graph answered: no fingerprints
                # steps of this way of writing the loss, and the next one checked: the 1st,
                # 2nd, 4th, 8th, … (a coupling the data switches on: pairs of one label)
                state = self.checked.setdefault(written, [0, 1])
                if len(self.checked) > KNOWN_FORMS:
                    del self.checked[next(iter(self.checked))]
                state[0] += 1
                if state[0] == state[1]:
                    gradient = (kwargs or {}).get("gradient", args[1] if len(args) > 1 else None)
                    try:
                        looked = self._check_coupling(args[0], gradient, nodes, state[0])
                    except BatchboundError:
                        self.checked.pop(written, None)  # refused again on its next step
                        raise
                    state[1] = 2 * state[1] if looked else 0
        return func(*args, **(kwargs or {}))

    def _check_coupling(self, loss: Tensor, gradient: Tensor | None, nodes: list[Node],
                        step: int) -> bool:
        """Refuse a loss that couples the examples before its backward runs (.grad as it
        was), on the ``step``-th step written so; warn where it cannot be read (then not
        again: the reason is the loss's graph). Whether it was read."""
        coupling = (Coupling(False, "a hook on a tensor of the loss or on the model's outputs "
                             "(register_hook, retain_grad) would run in it")
                    if self.hooked else
                    loss_coupling(loss, gradient, nodes, *self.tensors, self.run.n))
        if coupling is None:
            return True
        if coupling.checked:
            earlier = (f" (seen on step {step} of this loss, not on its earlier ones: the "
                       "monitor's estimate from them is no more exact)" if step > 1 else "")
            raise BatchboundError(f"watch(): {coupling.why}{earlier}")
        warn(f"batchbound: watch(): whether the loss couples the batch's examples (InfoNCE, "
             f"in-batch negatives) was not checked: {coupling.why}; with such a loss the "
             "per-example norms are no example's own")
        return False


_HOOKING = ("register_hook", "retain_grad")  # Tensor methods whose hooks a backward runs

LOSS_USE_IN_WATCH = ("used by the loss outside the model's layers (a regulariser written "
                     "into the loss?)")


UNACCOUNTED = ("it gets a gradient that no operation in the autograd graph accounts for (a "
               "custom autograd.Function writing it unseen, or its layer's output written in "
               "place after the call, as h[mask] = v on a view, which takes the output's node "
               "out of the graph?)")
# Reasons the fallback on the outputs' gradients cannot remedy (it sees the model only).
REFUSED = (LOSS_USE_IN_WATCH,)


# An output entry this large stands for a masked one (``masked_fill(~mask, finfo.min)``):
# the stand-in loss leaves it out, as its square would overflow float32
_MASKED = 1e15


def _stand_in_loss(outputs: Any, targets: Tensor, fixed: frozenset[int] = frozenset()
                   ) -> Tensor:
    """Per example: Σ_k ⟨output_k,i, r_k⟩ + ‖output_k,i‖²/2 over the outputs that hold the
    examples along dim 0, for fixed random r_k (the same on every call); not the ``fixed``
    outputs, whose shape does not follow the number of examples (``output_kinds``).

    Computed in float32 at least (outputs of a few hundred square past float16's 65504), and
    without the entries that are infinite or lie beyond ``_MASKED`` (logits masked with
    ``finfo.min`` or ``-inf``, whose square overflows): they get no gradient from it."""
    n, total = targets.shape[0], None
    generator = torch.Generator().manual_seed(0)
    tensors = [t for t in flatten(outputs) if isinstance(t, Tensor)]
    for k, out in enumerate(tensors):
        if not (out.is_floating_point() and out.dim() > 0 and out.shape[0] == n
                and out.requires_grad and k not in fixed):
            continue
        wide = out.to(torch.promote_types(out.dtype, torch.float32))
        r = torch.randn(out.shape[1:], generator=generator, dtype=wide.dtype)
        value = wide.detach()
        # NaN stays: the model's own NaN (attention over padding alone) is refused as such
        wide = torch.where(value.isnan() | (value.abs() < _MASKED), wide, 0)
        # ⟨out, r⟩ + ‖out‖²/2: each example's output gradient is r + its own output, not r
        # alone, so that a backward hook mixing the examples' gradients (g + g.mean(0))
        # does not leave them as they were alone
        term = (wide * (r.to(out.device) + 0.5 * wide)).reshape(n, -1).sum(dim=1)
        total = term if total is None else total + term
    if total is None:
        raise BatchboundError(f"watch(): none of the model's outputs holds the {n} examples "
                              "along its first dimension")
    return total
