"""Per-example statistics of a model, exact or refused: the entry point over the engines.

``PreparedStats(model, loss, engine)`` is called once per chunk. With ``engine="auto"`` (the
default) or ``"hooks"`` it checks the model on its first chunk (``rule_check.py``), then runs
each chunk through the layer rules (``hooks.py``), which report every parameter they cannot
compute exactly, with the reason. ``"hooks"`` refuses those with a BatchboundError;
``"auto"`` computes them by an exact fallback, torch.func vmap or, where vmap cannot run
the model, the per-example loop, and warns once, naming them, the reason and the cost.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from batchbound.diversity.calls import Inputs, call_model
from batchbound.diversity.collector import collector_paused
from batchbound.diversity.engines import (
    VmapUnsupported,
    fallback_sq_norms,
    loop_gradients,
    loop_sq_norms,
    loop_stats,
    vmap_gradients,
    vmap_stats,
)
from batchbound.diversity.hooks import HookPlan, Layout, OutputKinds, hooks_stats, plan_hooks
from batchbound.diversity.losses import (
    DeferredFinite,
    PerExampleLoss,
    bit_halves,
    check_losses,
    resolve_loss,
)
from batchbound.diversity.outputs import RandomState, replayed_rows
from batchbound.diversity.precision import GradientPrecision, autocast_dtypes, lowest
from batchbound.diversity.rows import KNOWN_KEYS, RowChecks, chunk_key
from batchbound.diversity.rule_check import (
    COUPLED,
    INTERACTING,
    buffers_kept,
    call_failure,
    check_rows,
    deterministic,
    disagreements,
    losses_differ,
    output_kinds,
    probe_layout,
    rng_kept,
    self_check,
    tolerance,
    why_coupled,
)
from batchbound.diversity.stats import (
    ENGINES,
    PerExampleStats,
    any_training,
    batch_norm_modules,
    check_chunk,
    check_model_mode,
    gradients,
    norm_dtype,
    trainable_parameters,
)
from batchbound.errors import BatchboundError, raised_by_user_code, warn


@dataclass
class _Seen:
    """What a model's chunks showed, which speaks for the later chunks of every call as it
    does for those of one: a user's loss split on its first chunk (``split_gap``,
    ``loss_joining``: 1.9 ms of a 15 ms chunk of the benchmarks' MLP), and the programs each
    chunk shape ran and was checked in (``_check_program``)."""

    loss_split: bool = False  # a user's loss checked on parts of a chunk (split_gap)
    loss_joins: str = ""  # why it is checked on every chunk (losses.loss_joining)
    programs: dict[Hashable, set[Hashable]] = field(default_factory=dict)  # by chunk_key


@dataclass
class _Checked:
    """The check of a model (its calls' example axes and the rules' agreement with the loop),
    which depends on its structure and the loss, not on its weights: kept per model, so that
    measuring the same model again (every half epoch in a study, each ``measure`` call) does
    not redo it. Kept with it: the outputs' kinds (``output_kinds``: two more forward passes)
    and what its chunks showed (``_Seen``)."""

    structure: tuple
    plan: HookPlan
    layout: Layout
    reasons: dict[str, str]
    kinds: OutputKinds | None
    seen: _Seen


_CHECKS: weakref.WeakKeyDictionary[nn.Module, _Checked] = weakref.WeakKeyDictionary()
KNOWN_PROGRAMS = 16  # programs kept per chunk shape; past them each new one is checked


# Models whose vmap gradients were checked against the loop (per_example_gradients).
_VMAP_CHECKED: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()


def structure_of(model: nn.Module, params: dict[str, nn.Parameter], loss: object,
               engine: str) -> tuple:
    modules = tuple((name, id(m), type(m)) for name, m in model.named_modules())
    tensors = tuple((name, id(p), tuple(p.shape), p.dtype, p.device) for name, p in params.items())
    user_loss = getattr(loss, "__wrapped__", loss)  # resolve_loss wraps it anew on every call
    return modules, tensors, user_loss, engine


def describe(reasons: dict[str, str]) -> str:
    """Parameters grouped by reason: "reason: a, b; other reason: c"."""
    grouped: dict[str, list[str]] = {}
    for name, reason in reasons.items():
        grouped.setdefault(reason, []).append(name)
    return "; ".join(f"{reason}: {', '.join(names)}" for reason, names in grouped.items())


class PreparedStats:
    """``per_example_stats`` for one model called many times (a training loop, ``measure``'s
    chunks): the model is checked and planned once, here, instead of on every call.

    The model's structure (its modules, which parameters train, its control flow) must stay
    as it was on the first call; its weights and its train/eval mode may change (BatchNorm's
    mode is checked on every call). Every call still checks, from the autograd graph, that
    each parameter is used only where its rule looks.
    """

    def __init__(self, model: nn.Module, loss: object = None, engine: str = "auto") -> None:
        if engine not in ENGINES:
            raise BatchboundError(f"unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
        self.model, self.engine = model, engine
        self.loss_fn: PerExampleLoss = resolve_loss(loss)  # type: ignore[arg-type]
        self.params = trainable_parameters(model)
        self.batch_norms = batch_norm_modules(model)
        self.plan: HookPlan | None = None
        self.layout: Layout | None = None
        self.checked: dict[str, str] | None = None  # parameters that failed the check
        self.kinds: OutputKinds | None = None  # outputs with no examples' dimension
        self.fallback = "vmap"  # "loop" once vmap has failed on this model
        self._vmap_checked = False  # vmap's rows checked against the loop's once
        self._warned: set[str] = set()
        self._vmap_error = ""
        self.precision: torch.dtype | None = None  # the lowest a hooks forward ran in
        self._methods = ""
        # per train/eval mode of the modules: whether two forward passes agree (no dropout)
        self._deterministic: dict[tuple[bool, ...], bool] = {}
        self._structure = structure_of(model, self.params, loss, engine)
        self.seen = _Seen()  # the cached check's, where there is one
        # the chunks the row tracker sees: all under engine='hooks', which refuses rather
        # than fall back where an untracked chunk ran differently
        self.row_checks = RowChecks() if engine == "auto" else None
        # where a checked model's losses are checked finite (None: on each chunk, on the host)
        self.finite: DeferredFinite | None = None
        if engine in ("auto", "hooks"):
            cached = _CHECKS.get(model)
            if cached is not None and cached.structure == self._structure:
                self.plan, self.layout = cached.plan, cached.layout
                self.checked, self.kinds = dict(cached.reasons), cached.kinds
                self.seen = cached.seen
            else:
                self.plan = plan_hooks(model, self.params)

    def __call__(self, x: Tensor | Inputs, y: Tensor, offset: int = 0,
                 into: dict[str, Tensor] | None = None) -> PerExampleStats:
        """One chunk: ``x`` a tensor of examples, or ``Inputs`` for a model called with
        several arguments (``inputs(img, cond=c)``).

        ``into``: running sums, one per parameter (its shape, ``norm_dtype``, contiguous):
        the chunk's Σ_i g_i is added to them instead of returned (``grad_sum`` is then
        empty); the layer rules that compute a batch sum themselves add it in their own
        kernel (``Outer.add_total_to``), with no temporary and no separate addition."""
        with collector_paused():  # the chunk's bookkeeping, freed at its end (collector.py)
            stats = self._stats(x, y, offset, into)
        if into is not None and stats.grad_sum:
            names = list(stats.grad_sum)
            torch._foreach_add_([into[k] for k in names], [stats.grad_sum[k] for k in names])
        if into is not None:
            stats.grad_sum = {}
        return stats

    def _checking(self, x: Tensor | Inputs) -> contextlib.AbstractContextManager:
        """The checks' passes, which run the model otherwise than its user does."""
        return raised_by_user_code(lambda: (
            f"batchbound ran the model and the loss on parts of a chunk of {x.shape[0]} "
            "examples, down to one example (in eval mode where the model draws random "
            "numbers), to check the layer rules: a model must run on any number of examples"))

    def _stats(self, x: Tensor | Inputs, y: Tensor, offset: int,
               into: dict[str, Tensor] | None) -> PerExampleStats:
        if isinstance(x, Inputs):  # y: a tensor, or the same dict batch (dict_batch)
            check_chunk(torch.empty(x.n, 0), y if isinstance(y, Tensor) else torch.empty(
                y.shape[0], 0))
        else:
            check_chunk(x, y)
        check_model_mode(self.model, self.batch_norms)
        with torch.enable_grad():  # also when called under torch.no_grad()
            if self.engine == "loop":
                seen = GradientPrecision()  # the casts the hooks engine observes, observed
                stats = loop_stats(self.model, x, y, self.loss_fn, offset=offset, seen=seen)
                self._saw(seen)
                return stats
            if self.engine == "vmap":
                used: set[str] = set()  # read off this call's own graph (no extra forward)
                seen = GradientPrecision()
                try:
                    stats = vmap_stats(self.model, x, y, self.loss_fn, offset=offset,
                                       uses=used, seen=seen)
                    self._saw(seen)
                    if used:
                        raise BatchboundError(
                            f"engine='vmap' cannot see parameters used outside their modules' "
                            f"attributes, by the loss itself or through a closure or plain "
                            f"list ({', '.join(sorted(used))}); use engine='auto' or 'loop'")
                    if not self._vmap_checked:
                        self._check_vmap(x, y, stats.sq_norms, stats.losses)
                    return stats
                except VmapUnsupported as exc:
                    raise BatchboundError(f"{exc}; use engine='auto' or 'loop'") from None
            if x.shape[0] == 1:
                return self._one_example(x, y, offset)
            with self._checking(x):
                if self.layout is None:
                    self._probe(x, y, offset)
                if self.kinds is None:
                    self.kinds = output_kinds(self.model, x, self.params)
                if self.checked is None and any_training(self.model):
                    self._checked(self_check(self.model, x, y, self.loss_fn, self.plan,
                                             self.params, self.layout,
                                             self.plan.static_reasons(), self.kinds), x)
            return self._hooks(x, y, offset, into)

    def _check_apart(self, x: Tensor | Inputs, y: Tensor, losses: Tensor, offset: int,
                     kinds: OutputKinds) -> None:
        """Every chunk of a forward that may join its examples (``pairing.py``): their
        losses with the chunk run in halves, split by each bit of their positions, against
        their losses in the whole chunk; the first chunk's check cannot speak for the
        others, whose data may join them where its did not. A forward that draws other
        random numbers on every call cannot be checked so: refused where it pairs the
        examples or feeds back a quantity of the batch that combines their rows or is laid
        over them (``OutputKinds.unchecked``: a mean of their rows a flag in the data
        switches on), left to the first chunk's check where some examples' rows are put
        back among theirs (packed sequences show it, and are measured in train mode as
        before)."""
        joins = kinds.joins
        if not self._repeats(x):
            if not kinds.unchecked:
                return
            raise BatchboundError(
                f"{joins}, and it gives other outputs on each call in this mode (dropout?): "
                "whether the examples of a chunk interact cannot be checked by running them "
                "apart; measure in eval mode")
        if self._apart_differ(x, y, losses):
            raise BatchboundError(
                f"on the chunk from example {offset}, {INTERACTING}: {joins}, and on this "
                "chunk the data joined them, so per-example gradients, S, T and Δ are not "
                "defined there")

    def _apart_differ(self, x: Tensor | Inputs, y: Tensor, losses: Tensor) -> bool:
        """Whether the examples' losses with the chunk run in halves, split by each bit of
        their positions (any two fall in different halves once), differ from theirs in the
        whole chunk (a deterministic forward: ``_repeats``)."""
        dtype = lowest(self.precision, *autocast_dtypes())
        with torch.no_grad(), buffers_kept(self.model), rng_kept(self.params):
            for rows in bit_halves(x.shape[0], losses.device):
                apart = self.loss_fn(call_model(self.model, x[rows]), y[rows])
                if losses_differ(losses[rows], apart, dtype):
                    return True
        return False

    def _check_program(self, x: Tensor | Inputs, y: Tensor, losses: Tensor, offset: int,
                       program: Hashable) -> None:
        """A chunk that ran other operations than the earlier chunks of its shape (its
        layer calls and its graph's structure, ``HooksPass.program``): control flow on the
        data's values (a Python branch, an offset from ``int(x.max())``) that the first
        chunk's check did not see, and that may join the examples (``cat([h[:1], h[:-1]])``,
        ``h.roll(k, 0)``). Checked by value, apart, where the forward repeats; each program
        once (``KNOWN_PROGRAMS`` a shape, for the last ``KNOWN_KEYS`` shapes seen). The
        first chunk of a shape (or of one forgotten) is that shape's reference: the
        model's first, checked against the loop, or, for a later shape (the last, shorter
        chunk), one unchecked."""
        given = (x.args, x.kwargs) if isinstance(x, Inputs) else (x,)
        key = chunk_key(given, self.model.training)
        programs = self.seen.programs
        known = programs.get(key)
        if known is None:
            if len(programs) >= KNOWN_KEYS:  # the oldest shape's, for this one's
                del programs[next(iter(programs))]
            programs[key] = {program}
            return
        if program in known or not self._repeats(x):
            return
        if self._apart_differ(x, y, losses):
            raise BatchboundError(
                f"on the chunk from example {offset}, {INTERACTING}: its forward ran other "
                "operations than on the earlier chunks of its shape (control flow on the "
                "data's values: a Python branch, or an offset, on a value of the batch?), and "
                "on this chunk its examples' losses with the chunk run in parts differ from "
                "theirs in the whole chunk, so per-example gradients, S, T and Δ are not "
                "defined there")
        if len(known) < KNOWN_PROGRAMS:
            known.add(program)

    def _saw(self, seen: GradientPrecision) -> None:
        """The loop's or vmap's observed precision into ``precision``, as a hooks pass's."""
        # every trainable parameter's dtype: a float32 layer beside float64 ones, fed from
        # the data (no cast of a tensor that requires grad), computes its gradient in float32
        parameters = lowest(*(p.dtype for p in self.params.values()))
        self.precision = lowest(self.precision, seen.dtype, parameters)

    def _probe(self, x: Tensor, y: Tensor, offset: int) -> None:
        assert self.plan is not None
        try:
            self.layout = probe_layout(self.model, x, self.plan, self.params)
        except BatchboundError:
            with torch.no_grad():  # an error of the user's data: say it in their shapes
                check_losses(self.loss_fn(call_model(self.model, x), y), x.shape[0], offset)
            raise
        except Exception as exc:  # any: a tensor the batch shares, split as the examples
            if not isinstance(x, Inputs):
                raise
            where = f"the chunk from example {offset}"
            raise BatchboundError(call_failure(self.model, x, exc, where)) from exc

    def _checked(self, reasons: dict[str, str], x: Tensor | Inputs) -> None:
        if INTERACTING in reasons.values():  # not cached: the model may be fixed and rerun
            raise BatchboundError(why_coupled(self.model, x))
        self.checked = reasons
        assert self.layout is not None
        assert self.plan is not None
        _CHECKS[self.model] = _Checked(self._structure, self.plan, self.layout, dict(reasons),
                                       self.kinds, self.seen)
        if reasons and self.engine == "hooks":
            raise BatchboundError(f"engine='hooks' cannot compute these parameters' per-example "
                                  f"gradients exactly: {describe(reasons)}")

    def _hooks(self, x: Tensor, y: Tensor, offset: int,
               into: dict[str, Tensor] | None = None) -> PerExampleStats:
        """``into`` (see ``__call__``): what the rules add there themselves is left out of
        the result's ``grad_sum``. Not on the first chunk, which may be run again."""
        assert self.plan is not None and self.layout is not None
        start = time.perf_counter()
        excluded = self.checked if self.checked is not None else self.plan.static_reasons()
        # the random state and buffers the forward begins from, for a replay (train mode)
        random = (RandomState(sorted({p.device.index or 0 for p in self.params.values()
                                      if p.device.type == "cuda"}), self.model.buffers())
                  if any_training(self.model) else None)
        # a user's loss, on the first chunk, and on every one where it may join the examples
        # (``losses.loss_joining``): named ones are each example's own by construction
        seen = self.seen
        split_loss = (not seen.loss_split or bool(seen.loss_joins)) and hasattr(
            self.loss_fn, "__wrapped__")
        result = hooks_stats(self.model, x, y, self.loss_fn, self.plan, self.params,
                             self.layout, excluded=excluded, offset=offset,
                             into=into if self.checked is not None else None,
                             kinds=self.kinds, row_checks=self.row_checks,
                             finite=self.finite if self.checked is not None else None,
                             split_loss=split_loss,
                             read_loss=split_loss and not seen.loss_split)
        self.precision = lowest(self.precision, result.precision)
        if (result.loss_gap is not None
                and result.loss_gap > tolerance(lowest(self.precision, *autocast_dtypes()))):
            joins = result.loss_joins or seen.loss_joins
            why = f" ({joins})" if joins else ""
            raise BatchboundError(f"on the chunk from example {offset}, the loss of a part of "
                                  f"its examples is not their loss in the whole chunk{why}: "
                                  f"{COUPLED}")
        if split_loss and x.shape[0] >= 4 and not seen.loss_split:
            seen.loss_split, seen.loss_joins = True, result.loss_joins
        with self._checking(x):
            first = self.checked is None
            if first:  # the first chunk, in eval mode: check it against the loop
                self._checked(check_rows(self.model, x, y, self.loss_fn, self.params,
                                         result.sq_norms, result.losses, result.precision), x)
            if first and self.checked:
                pass  # run again below, parameters sent to the fallback
            elif self.kinds is not None and self.kinds.joins and x.shape[0] > 1:
                self._check_apart(x, y, result.losses, offset, self.kinds)
            elif x.shape[0] > 1 and result.program is not None:
                self._check_program(x, y, result.losses, offset, result.program)
        if first and self.checked:
            return self(x, y, offset)
        if not result.reasons:
            sq_norms = {name: result.sq_norms[name] for name in self.params}
            return PerExampleStats(result.losses, sq_norms, result.grad_sum)
        if self.engine == "hooks":
            raise BatchboundError(
                "engine='hooks' cannot compute these parameters' per-example gradients "
                f"exactly: {describe(result.reasons)}; use engine='auto' (an exact fallback "
                "for them), 'vmap' or 'loop'"
            )
        rules_seconds = time.perf_counter() - start
        names = [name for name in self.params if name in result.reasons]
        start = time.perf_counter()
        if random is not None and not self._repeats(x):
            sq, sums = _replayed(self.model, x, y, self.loss_fn, names, random, result.losses,
                                 tolerance(lowest(self.precision, *autocast_dtypes())))
            self._methods = "replay"
        else:
            sq, sums, alone = self._fallback(x, y, names, offset, result.loss_uses)
            _check_alone(result.losses, alone, lowest(self.precision, *autocast_dtypes()),
                         offset)
        self._warn(result.reasons, time.perf_counter() - start, rules_seconds)
        result.sq_norms.update(sq)
        result.grad_sum.update(sums)
        ordered = {name: result.sq_norms[name] for name in self.params}
        grad_sum = {name: result.grad_sum[name] for name in self.params
                    if name in result.grad_sum}  # without those the rules added to ``into``
        return PerExampleStats(result.losses, ordered, grad_sum, tuple(names))

    def _repeats(self, x: Tensor | Inputs) -> bool:
        """Whether the model's forward gives the same outputs twice in its current modes
        (no dropout, no buffer its forward updates): once per set of modes."""
        modes = tuple(m.training for m in self.model.modules())
        if modes not in self._deterministic:
            with buffers_kept(self.model), rng_kept(self.params):
                self._deterministic[modes] = deterministic(self.model, x)
        return self._deterministic[modes]

    def _fallback(
        self, x: Tensor, y: Tensor, names: list[str], offset: int, loop_only: set[str]
    ) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor]:
        """vmap for ``names``, but the loop for ``loop_only`` (parameters the loss uses) and
        for everything once vmap has failed on this model."""
        sq: dict[str, Tensor] = {}
        sums: dict[str, Tensor] = {}
        by_vmap = [k for k in names if k not in loop_only]
        losses = None
        if self.fallback == "vmap" and by_vmap:
            try:
                sq, sums, losses = fallback_sq_norms(self.model, x, y, self.loss_fn, by_vmap,
                                                     "vmap")
                if not self._vmap_checked:
                    self._check_vmap(x, y, sq, losses)
            except VmapUnsupported as exc:
                self.fallback, self._vmap_error = "loop", str(exc)
                sq = {}
        by_loop = [k for k in names if k not in sq]
        self._methods = ("vmap" if sq else "") + ("+loop" if sq and by_loop else
                                                   "loop" if by_loop else "")
        if by_loop:
            more, more_sums, losses = fallback_sq_norms(self.model, x, y, self.loss_fn, by_loop,
                                                        "loop", offset=offset)
            sq.update(more)
            sums.update(more_sums)
        assert losses is not None
        return sq, sums, losses

    def _check_vmap(self, x: Tensor, y: Tensor, sq: dict[str, Tensor], losses: Tensor) -> None:
        """torch.func sees only parameters reached as module attributes (not through a
        closure or a plain list): its first and last rows, once per model, against the
        loop's. Raises VmapUnsupported on disagreement."""
        rows = sorted({0, x.shape[0] - 1})
        slow_sq, _, slow_losses = loop_sq_norms(self.model, x[rows], y[rows], self.loss_fn,
                                                list(sq), sums=False)
        fast = {name: values[rows] for name, values in sq.items()}
        wrong = disagreements(fast, losses[rows], slow_sq, slow_losses,
                              lowest(self.precision, next(iter(self.params.values())).dtype))
        if wrong:
            raise VmapUnsupported(
                "torch.func vmap disagreed with the per-example loop on "
                f"{', '.join(sorted(wrong))} (a parameter reached outside its module's "
                "attributes, through a closure or a plain list?)")
        self._vmap_checked = True

    def _warn(self, reasons: dict[str, str], seconds: float, others: float | None) -> None:
        """Once per set of reasons: which parameters, why, by what, and at what cost."""
        key = describe(reasons)
        if key in self._warned:
            return
        self._warned.add(key)
        how = {
            "vmap": "torch.func vmap",
            "loop": "the per-example loop, one forward and backward per example",
            "vmap+loop": "torch.func vmap, and the per-example loop (one forward and backward "
                         "per example) for the loss's own parameters",
            "replay": "the chunk's forward replayed with its own random numbers and buffers",
        }[self._methods]
        if self._vmap_error and "loop" in self._methods:
            how += f" ({self._vmap_error})"
        cost = f"{seconds:.2g} s on this chunk"
        if others:
            cost += f", {seconds / others:.1f}× the {others:.2g} s of everything else"
        warn(
            f"batchbound: computing exact per-example gradients by {how} ({cost}) for the "
            f"parameters no layer rule can take: {key}"
        )

    def _one_example(self, x: Tensor, y: Tensor, offset: int) -> PerExampleStats:
        """One example: its gradient is the batch gradient, exact for any model."""
        losses = self.loss_fn(call_model(self.model, x), y)
        check_losses(losses, 1, offset)
        names = list(self.params)
        tensors = [self.params[k] for k in names]
        grads = gradients(losses.sum(), tensors) if losses.requires_grad else [None] * len(names)
        grad_sum, sq_norms = {}, {}
        for name, g in zip(names, grads, strict=True):
            p = self.params[name]
            g = torch.zeros_like(p) if g is None else g.to_dense() if g.is_sparse else g
            grad_sum[name] = g
            norm = torch.linalg.vector_norm(g, dtype=norm_dtype(g.dtype))
            sq_norms[name] = norm.square().reshape(1)
        return PerExampleStats(losses.detach(), sq_norms, grad_sum)


def _check_alone(together: Tensor, alone: Tensor, dtype: torch.dtype, offset: int) -> None:
    """The fallback's per-example losses, each example run alone, against the chunk's own:
    examples that interact on this chunk (a flag or counter that switched a statistic of
    the batch on after the first chunk, which the per-example loop checked) are refused,
    not measured alone."""
    if losses_differ(together, alone, dtype):
        raise BatchboundError(f"on the chunk from example {offset}, {COUPLED}")


def _replayed(model: nn.Module, x: Tensor | Inputs, y: Tensor, loss_fn: PerExampleLoss,
              names: list[str], random: RandomState, seen: Tensor, rtol: float
              ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The fallback for a model whose forward draws random numbers or updates buffers
    (dropout, spectral norm's power iteration in train mode): a forward per example, or
    under vmap, would draw masks of its own, so its norms would be of other gradients than
    the chunk's. The chunk's forward is replayed from the random state and buffers it began
    with, its losses must equal the chunk's (else refused), and each example's loss is
    differentiated on that one graph, a few rows per batched backward (the examples do not
    interact: the check saw to it)."""
    params = dict(model.named_parameters())
    tensors = [params[k] for k in names]
    with buffers_kept(model), random.replaying(), torch.enable_grad():
        losses = loss_fn(call_model(model, x), y)
        if not (losses.shape == seen.shape
                and torch.allclose(losses.detach(), seen, rtol=rtol, atol=0.0)):
            raise BatchboundError(
                "the model draws random numbers (dropout) and its forward, replayed from the "
                "random state and buffers its chunk began with, gave other losses (random "
                "numbers from outside torch's generator?), so the per-example gradients of "
                "this chunk cannot be read; put the model in eval mode")
        sq, sums = replayed_rows(losses, names, tensors)
    return sq, sums


def per_example_stats(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss: object = None,
    *,
    engine: str = "auto",
    offset: int = 0,
) -> PerExampleStats:
    """Per-example losses, squared gradient norms per parameter, and the gradient sum, for one
    chunk, from one forward and one backward pass (``engine="hooks"``/``"auto"``).

    ``loss`` is a name (``"cross_entropy"``, ``"mse"``) or a callable returning one loss per
    example (see ``resolve_loss``). The model is used in its current mode (BatchNorm must be
    in eval mode; dropout in train mode gives the gradients under the masks drawn in this
    pass, the fallback's parameters too: the pass is replayed from its random state and
    buffers), and its
    ``.grad`` fields are left untouched. ``offset`` is the index of the chunk's first example,
    used to name an example whose loss is not finite. For many calls on one model,
    ``PreparedStats`` checks and plans the model once.

    Engines: ``"hooks"`` (layer rules; a BatchboundError naming each parameter they cannot
    compute exactly, and why), ``"auto"`` (layer rules, and an exact fallback with a warning
    for such parameters), ``"vmap"`` (torch.func for everything), ``"loop"`` (one backward
    per example: the slow reference).
    """
    return PreparedStats(model, loss, engine)(x, y, offset)


def per_example_gradients(
    model: nn.Module, x: Tensor, y: Tensor, loss: object = None
) -> dict[str, Tensor]:
    """Materialised per-example gradients, name -> (n, *param.shape): torch.func vmap, or the
    per-example loop (with a warning) where vmap cannot run the model.

    Memory is n × (number of parameters): use it on chunks (mechanisms, Monte Carlo checks).
    """
    loss_fn = resolve_loss(loss)  # type: ignore[arg-type]
    check_chunk(x, y)
    params = trainable_parameters(model)
    names = list(params)
    check_model_mode(model)
    with torch.enable_grad():
        try:
            # the loss's own uses of parameters (torch.func cannot see them) are read off
            # this call's graph, not checked by a forward of their own (a training step calls
            # this every step)
            grads, outside = vmap_gradients(model, x, y, loss_fn, names)
            if outside:
                warn(
                    "batchbound: torch.func cannot see parameters used outside their modules' "
                    f"attributes, by the loss itself or through a closure or plain list "
                    f"({', '.join(sorted(outside))}); materialising per-example gradients with "
                    "the per-example loop instead (exact, slower)")
                return loop_gradients(model, x, y, loss_fn, names)
            key = structure_of(model, params, loss_fn, "vmap")
            if _VMAP_CHECKED.get(model) != key:  # once per model: a training step calls this
                _check_first_row(model, x, y, loss_fn, grads)
                _VMAP_CHECKED[model] = key
            return grads
        except VmapUnsupported as exc:
            warn(f"batchbound: {exc}; materialising per-example gradients with the "
                 "per-example loop instead (exact, slower)")
            return loop_gradients(model, x, y, loss_fn, names)


def _check_first_row(model: nn.Module, x: Tensor, y: Tensor, loss_fn: PerExampleLoss,
                     grads: dict[str, Tensor]) -> None:
    """torch.func sees only parameters reached as module attributes: its first example's
    gradients against autograd's on that example alone."""
    slow = loop_gradients(model, x[:1], y[:1], loss_fn, list(grads))
    rtol = tolerance(next(iter(grads.values())).dtype)
    scale = math.sqrt(sum(float(g.double().square().sum()) for g in slow.values())) + 1e-30
    gap = math.sqrt(sum(float((grads[k][:1].double() - g.double()).square().sum())
                        for k, g in slow.items()))
    if gap > rtol * scale:
        raise VmapUnsupported(f"torch.func vmap disagreed with the per-example loop (relative "
                              f"error {gap / scale:.1e}; a parameter reached outside its "
                              "module's attributes, through a closure or a plain list?)")


def per_example_l1_l2(
    model: nn.Module, x: Tensor, y: Tensor, loss: object = None
) -> tuple[Tensor, Tensor]:
    """(‖g_i‖₁, ‖g_i‖₂) over all parameters, each shape (n,); from materialised gradients.

    Stochastic quantization's diversity needs R = Σ_i ‖g_i‖₂‖g_i‖₁.
    """
    grads = per_example_gradients(model, x, y, loss)
    n = x.shape[0]
    l1 = sum(g.reshape(n, -1).abs().sum(dim=1) for g in grads.values())
    sq = sum(g.reshape(n, -1).square().sum(dim=1) for g in grads.values())
    return l1, sq.sqrt()  # type: ignore[union-attr]
