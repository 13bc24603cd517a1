"""Checking a model once before trusting its layer rules: where each call keeps its
examples, and whether the rules agree with the per-example loop.

Which axis of a module's input holds the examples cannot be read off one batch: 256
sequences of 256 tokens, sequence-first, look like (n, T, d). So the model runs on two batch
sizes, 2 and 3 (repeating examples when there are fewer): the example axis of a call is the
one dimension whose size follows the batch while every other stays put, and a call whose
input does not change at all has no example axis (a position embedding of ``arange(T)``).
No constant dimension is 2 in one run and 3 in the other, and a flattened (n·T, d) input
follows n·T, not n, so neither a coincidence nor flattening passes.

Then the rules' results for a few examples are compared with the per-example loop's: on
the first chunk itself when the model is in eval mode (as ``measure`` runs it), else on 3
examples run in eval mode (dropout draws no masks). A parameter whose norms (or gradient
sum) disagree is left to the exact fallback. This safety net under the structural checks
also catches models whose examples interact within a batch (f_i then depends on the
others).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from batchbound.diversity.calls import Inputs, call_model, flatten, split_failure
from batchbound.diversity.engines import loop_sq_norms
from batchbound.diversity.hooks import (
    CallLayout,
    HookPlan,
    HooksPass,
    Layout,
    OutputKinds,
    ProbeShapes,
    hooks_stats,
    output_sum,
)
from batchbound.diversity.losses import PerExampleLoss
from batchbound.diversity.pairing import Op, OpShapes, joining, storage, written_in_place
from batchbound.diversity.precision import autocast_dtypes, lowest
from batchbound.diversity.stats import eval_mode, gradients
from batchbound.errors import BatchboundError

PROBE_SIZES = (2, 3)
INTERACTING = (
    "the examples interact within a batch (an example's loss changes with the other examples "
    "in its batch)"
)
COUPLED = (
    INTERACTING + ": a statistic of the batch in the forward pass (h - h.mean(0), batch "
    "normalisation in train mode), routing with a capacity shared by the batch (experts "
    "choosing their tokens) or a loss over the whole batch (a contrastive InfoNCE or CLIP "
    "loss) couples them, so per-example gradients g_i = ∇f_i, and with them S, T and "
    "Δ = S/T, are not defined (a forward that changes from call to call reads the same: a "
    "buffer it updates in every mode, random numbers from outside torch's generator). "
    "Ways out: for a statistic in the forward, running statistics "
    "(measure in eval mode, as for BatchNorm); for a loss over the batch, the noise scale "
    "without per-example gradients, from the gradients of separate batches "
    "(OnlineDiversity.update_from_gradients, DiversityCallback, gns_hook)"
)


RANDOM_IN_EVAL = (
    "the model gives other outputs on each call even in eval mode (random numbers drawn "
    "outside dropout: patches masked at random, as ViT-MAE's, or noise added to its "
    "inputs; or state it changes on each call, a counter of its calls), so an example run "
    "alone runs otherwise than in its batch, and its per-example gradients cannot be "
    "checked against the per-example loop; pass the random numbers in as an input "
    "(ViT-MAE's noise=) or turn them off (a masking ratio of 0), and keep a count of steps "
    "outside the forward"
)


def call_failure(model: nn.Module, x: Inputs, exc: Exception, where: str) -> str:
    """Why the model raised on a few examples split from a call of several arguments: the
    split (``split_failure``), or the model itself where it raises on ``where`` (the chunk,
    the batch) as given too (a kernel that takes float32 alone, in measure's float64
    copy)."""
    try:
        with torch.no_grad(), buffers_kept(model), rng_kept(dict(model.named_parameters())):
            call_model(model, x)
    except Exception as whole:  # any: the user's model, on the user's own examples
        said = " ".join(str(whole).split())
        return (f"the model raised on {where} as given, before any split "
                f"({type(whole).__name__}: {said})")
    return split_failure(x, exc)


def why_coupled(model: nn.Module, x: Tensor) -> str:
    """Why the check's batch and its examples alone differ: random numbers the model draws
    even in eval mode (``RANDOM_IN_EVAL``), else examples that interact or a buffer its
    forward updates (``COUPLED``)."""
    with rng_kept(dict(model.named_parameters())), eval_mode(model):
        return COUPLED if deterministic(model, x, random_only=True) else RANDOM_IN_EVAL


def examples(t: Tensor, count: int) -> Tensor:
    """The first ``count`` examples of ``t``, repeating them when it has fewer."""
    return t[torch.arange(count, device=t.device) % t.shape[0]]


@contextmanager
def rng_kept(params: dict[str, nn.Parameter]) -> Iterator[None]:
    """The random state as it was: a probe must not shift a seeded run's dropout masks."""
    devices = sorted({p.device.index or 0 for p in params.values() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        yield


class _OfParameters(TorchDispatchMode):
    """Follows one forward pass's data flow through its ATen operations: a tensor is of the
    parameters alone when its storage is a parameter's or a buffer's, or an operation wrote
    it from such tensors only (a factory, ``arange``, from none). Anything else (the examples,
    a tensor made where no operation shows, as ``from_numpy``) is not, nor is what an
    operation writes from it. A value read on the host from such a tensor (``.item()``, a
    branch on it) could reach any later tensor unseen, so then nothing is (``host``)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.clean = {storage(t) for t in (*model.parameters(), *model.buffers())}
        self.host = False
        self._alive: list[Tensor] = []  # no freed memory's address taken for a new tensor's

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in flatten((args, kwargs)) if isinstance(t, Tensor)]
        leaves = flatten(out)
        written = [t for t in leaves if isinstance(t, Tensor)]
        if not self.host and all(storage(t) in self.clean for t in inputs):
            self.clean.update(storage(t) for t in written)
            self._alive += written
        else:
            self.host |= any(not isinstance(t, Tensor) and t is not None for t in leaves)
            written += written_in_place(func, args, kwargs or {})
            self.clean.difference_update(storage(t) for t in written)
        return out

    def alone(self, t: Tensor) -> bool:
        return not self.host and storage(t) in self.clean


def output_kinds(model: nn.Module, x: Tensor, params: dict[str, nn.Parameter]) -> OutputKinds:
    """Which outputs hold no dimension of the examples: those whose shape is the same at two
    batch sizes, whatever their size (a load per expert of n experts, a statistic per head
    of n heads, at a batch of n), so a loss that reads them reads the batch's quantity; and
    of those, the ones of the parameters alone (a learned temperature): computed from the
    parameters and buffers only (``_OfParameters``), and the same at both sizes (not
    ``temperature * n``). Two small forward passes at 2 and 3 examples, or at n and n + 1
    (the batch's own size and one more) for a model that cannot run on so few (BatchNorm
    that needs four); in the caller's grad mode (a user's forward may read its outputs'
    ``grad_fn``), the random state and the buffers kept."""
    n = x.shape[0]
    tried = [PROBE_SIZES] + ([(n, n + 1)] if n > PROBE_SIZES[1] else [])
    for sizes in tried[:-1]:
        try:
            return _kinds_at(model, x, params, sizes)
        except BatchboundError:
            pass  # the next sizes
    return _kinds_at(model, x, params, tried[-1])


def _kinds_at(model: nn.Module, x: Tensor, params: dict[str, nn.Parameter],
              sizes: tuple[int, int]) -> OutputKinds:
    shapes, alone, ops = [], [], []
    with rng_kept(params), buffers_kept(model):
        for count in sizes:
            flow = _OfParameters(model)
            part = examples(x, count)
            ops.append(OpShapes(_arguments(part), count, replay_rows=True))
            try:
                with flow, ops[-1]:
                    outputs = [t.detach() for t in flatten(call_model(model, part))
                               if isinstance(t, Tensor)]
            except Exception as exc:  # any: the user's model, named in one line
                said = " ".join(str(exc).split())
                raise BatchboundError(
                    f"the model raised on {count} examples ({type(exc).__name__}: {said}); "
                    "which of its outputs hold the examples is read by running it at two batch "
                    "sizes: let it run on any number of examples") from exc
            shapes.append([tuple(t.shape) for t in outputs])
            alone.append([t if flow.alone(t) else None for t in outputs])
        third = _ops_at(model, x, sizes[1] + 1)
    small, large = shapes
    if len(small) != len(large):
        raise BatchboundError(f"the model returns {len(small)} tensors at {sizes[0]} "
                              f"examples and {len(large)} at {sizes[1]}: which of its "
                              "outputs hold the examples cannot be read; return the same "
                              "outputs whatever the number of examples")
    fixed = frozenset(k for k, (s, t) in enumerate(zip(small, large, strict=True)) if s == t)
    parameters = frozenset(k for k in fixed if alone[0][k] is not None
                           and alone[1][k] is not None
                           and torch.equal(alone[0][k], alone[1][k]))  # type: ignore[arg-type]
    return OutputKinds(fixed, parameters, *joining(ops[0].ops, ops[1].ops, sizes,
                                                   third=third))


def _arguments(part: Tensor | Inputs) -> Any:
    return (part.args, part.kwargs) if isinstance(part, Inputs) else part


def _ops_at(model: nn.Module, x: Tensor, count: int) -> list[Op] | None:
    """The forward's operations at a third batch size (``pairing.joining``); None where
    the model does not run there."""
    part = examples(x, count)
    recorded = OpShapes(_arguments(part), count, replay_rows=True)
    try:
        with recorded:
            call_model(model, part)
    except Exception:  # any: the two sizes above decide alone
        return None
    return recorded.ops


def probe_layout(
    model: nn.Module, x: Tensor, plan: HookPlan, params: dict[str, nn.Parameter]
) -> Layout:
    """Run the model at 2 and at 3 examples and read each call's example axis. The backward
    passes, which show where a batch-less output is broadcast, run only if a call needs it."""
    runs, roots = [], []
    with rng_kept(params), buffers_kept(model):
        try:
            for count in PROBE_SIZES:
                run = HooksPass(plan, params, None, count)
                runs.append(run)
                root = output_sum(run.forward(model, examples(x, count)))
                if root is not None:
                    run.attach([root.grad_fn])
                roots.append(root)
            layout = _layout(runs[0].shapes, runs[1].shapes)
            if any(c.axis is None and c.reason for c in layout.values()) and all(
                    r is not None for r in roots):
                for root in roots:
                    gradients(root, list(params.values()))
                layout = _layout(runs[0].shapes, runs[1].shapes)
        finally:
            for run in runs:
                run.close()
    return layout


def _layout(small: dict, large: dict) -> Layout:
    layout = {key: _derive(shapes, large.get(key)) for key, shapes in small.items()}
    for key in large.keys() - small.keys():
        layout[key] = CallLayout(reason=f"it ran at {PROBE_SIZES[1]} examples but not at "
                                        f"{PROBE_SIZES[0]}")
    return layout


def _follows(s: tuple[int, ...], t: tuple[int, ...], d: int) -> bool:
    lo, hi = PROBE_SIZES
    return s[d] == lo and t[d] == hi and all(s[j] == t[j] for j in range(len(s)) if j != d)


def _derive(a: ProbeShapes, b: ProbeShapes | None) -> CallLayout:
    lo, hi = PROBE_SIZES
    if b is None:
        return CallLayout(reason=f"it ran at {lo} examples but not at {hi}")
    entry, s, t = a.entry, a.main, b.main
    if s is None or t is None:
        kind = a.kind if s is None else b.kind
        return CallLayout(reason=f"its argument {entry.main or 'input'!r} is a {kind}, not a "
                                 "tensor")
    s, t = tuple(s), tuple(t)
    seen = f"(shape {s} at {lo} examples, {t} at {hi})"
    if len(s) != len(t):
        return CallLayout(reason=f"its input changes its number of dimensions {seen}")
    if entry.example_axis is not None:
        axis = entry.example_axis(a.module)
        if axis < len(s) and _follows(s, t, axis):
            return CallLayout(axis=axis)
        return CallLayout(reason=f"its input does not hold the examples along dimension {axis} "
                                 f"{seen}")
    lead = len(s) - entry.feature_dims(a.module)
    axes = [d for d in range(max(lead, 0)) if _follows(s, t, d)]
    if len(axes) == 1:
        return CallLayout(axis=axes[0])
    if s == t:
        g, h = a.broadcast, b.broadcast
        if g is not None and h is not None and len(g) == len(h):
            found = [d for d in range(len(g)) if _follows(tuple(g), tuple(h), d)]
            if len(found) == 1:
                return CallLayout(axis=None, consumer_axis=found[0])
        return CallLayout(reason=f"its input {s} has no example axis, and its output is not "
                                 "broadcast over the examples by an addition")
    return CallLayout(reason=f"no single dimension of its input holds the examples {seen}: "
                             "flattened with another axis, or mixed")


def tolerance(dtype: torch.dtype) -> float:
    """Relative agreement asked of the rules against the loop, by the precision the forward
    actually computed in (``hooks.HooksPass.precision``: autocast's bfloat16 for a float32
    model under autocast): a bfloat16 batch of one rounds differently from a batch of 8."""
    if dtype == torch.float64:
        return 1e-8
    if dtype == torch.float32:
        return 1e-3
    return 5e-2


def losses_differ(together: Tensor, alone: Tensor, dtype: torch.dtype) -> bool:
    """Whether the examples' losses in a batch differ from their losses each run alone by
    more than ``dtype``'s rounding allows: the examples interact."""
    scale = float(alone.abs().max()) + 1e-30
    return float((together - alone).abs().max()) > tolerance(dtype) * scale


def disagreements(
    fast_sq: dict[str, Tensor],
    fast_losses: Tensor,
    slow_sq: dict[str, Tensor],
    slow_losses: Tensor,
    dtype: torch.dtype,
    fast_sum: dict[str, Tensor] | None = None,
    slow_sum: dict[str, Tensor] | None = None,
) -> dict[str, str]:
    """Parameter -> reason, for each parameter whose per-example norms from the rules
    (``fast_*``, rows matching the loop's examples) disagree with the per-example loop's
    (``slow_*``); every parameter when the examples' losses differ (they interact)."""
    rtol = tolerance(dtype)
    count = int(slow_losses.shape[0])
    if losses_differ(fast_losses, slow_losses, dtype):
        return dict.fromkeys(slow_sq, INTERACTING)
    per_example = torch.stack(list(slow_sq.values())).sum(dim=0)
    floor = float(per_example.max()) * rtol + 1e-300
    norm = math.sqrt(float(per_example.sum())) + 1e-300
    # A parameter's own norms off by half where they stand well above rounding: a rule gone
    # wrong on a parameter too small for the tolerance above, taken on the whole example
    # (zeros for a layer holding under 1e-3 of S passed it in float32)
    visible = per_example * (torch.finfo(dtype).eps * 1e3)
    reasons = {}
    for name, sq in fast_sq.items():
        slow = slow_sq[name]
        gross = bool((((sq - slow).abs() > 0.5 * slow) & (slow > visible)).any())
        worst = 1.0 if gross else float(((sq - slow).abs() / (per_example + floor)).max())
        if fast_sum is not None and slow_sum is not None:
            gap = torch.linalg.vector_norm(fast_sum[name] - slow_sum[name])
            worst = max(worst, float(gap) / norm)
        if worst > rtol:
            reasons[name] = ("its layer rule disagreed with the per-example loop on a check of "
                             f"{count} examples (relative error {worst:.1e})")
    return reasons


def self_check(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss_fn: PerExampleLoss,
    plan: HookPlan,
    params: dict[str, nn.Parameter],
    layout: Layout,
    excluded: dict[str, str],
    kinds: OutputKinds | None = None,
) -> dict[str, str]:
    """For a model in train mode: the rules on a batch of up to 8 of the chunk's examples,
    spread over it, beside the per-example loop on each (see ``disagreements``). In train
    mode when the model is deterministic there (so a layer that mixes the batch in training
    shows), else in eval mode (dropout masks cannot be replayed one example at a time). The model's
    buffers are restored after."""
    rows, size = spread_rows(x.shape[0])
    xs, ys = examples(x[rows], size), examples(y[rows], size)
    with buffers_kept(model), rng_kept(params):
        mode = nullcontext() if deterministic(model, xs) else eval_mode(model)
        with mode:
            fast = hooks_stats(model, xs, ys, loss_fn, plan, params, layout, excluded=excluded,
                               kinds=kinds)
            slow_sq, _, slow_losses = loop_sq_norms(model, xs, ys, loss_fn, list(params),
                                                    sums=False)
    # The tolerance of the precision the forward actually ran in (autocast: bfloat16), and
    # under autocast at least autocast's: an operation that lowers its own inside is unseen.
    precision = lowest(fast.precision, *autocast_dtypes())
    return disagreements(fast.sq_norms, fast.losses, slow_sq, slow_losses, precision)


LOSS_SCALE = 0.5  # exact in every float format, and the least underflow in float16


def not_linear(model: nn.Module, x: Tensor | Inputs, y: Tensor, loss_fn: PerExampleLoss,
               params: dict[str, nn.Parameter]) -> str | None:
    """Why the model's backward is not linear in the loss, or None: its parameters'
    gradients at ``LOSS_SCALE`` times the stand-in loss are not that times the gradients
    (each parameter's difference against its gradient's norm plus the precision's tolerance
    of the whole gradient's: float16's underflow and a sum's order on a GPU round below it,
    where a parameter's gradient is near zero), on up to 8 of the examples. Every
    operation's vector-Jacobian product is linear, so only what rewrites a gradient in the
    backward shows: a hook that clamps, normalises or adds to it
    (``h.register_hook(lambda g: g.clamp(..))``), an ``autograd.Function`` whose backward
    does. Under a mean loss ``watch`` reads each example's gradient at 1/b and scales it by
    b, which such a rewrite does not commute with: the per-example gradients would depend on
    the batch's size (25 % off on a clamp). Two forward passes from the same buffers and
    random state (a backward may free what its function saved)."""
    rows, size = spread_rows(x.shape[0])
    xs, ys = examples(x[rows], size), examples(y[rows], size)
    # a parameter's own gradient hook (p.register_hook) is named later, by the step's check
    names = [k for k, p in params.items() if p.requires_grad and not p._backward_hooks]
    if not names:
        return None
    with buffers_kept(model), rng_kept(params):
        mode = nullcontext if deterministic(model, xs) else functools.partial(eval_mode, model)

    def grads(scale: float) -> tuple[Tensor | None, ...] | None:
        with buffers_kept(model), rng_kept(params), mode():
            total = loss_fn(call_model(model, xs), ys).sum()
            return gradients(total * scale, [params[k] for k in names]) \
                if total.requires_grad else None

    whole, part = grads(1.0), grads(LOSS_SCALE)
    if whole is None or part is None:
        return None
    pairs = [(name, a.to_dense().double(), b.to_dense().double() / LOSS_SCALE)  # sparse too
             for name, a, b in zip(names, whole, part, strict=True)
             if a is not None and b is not None]
    # the precision the forward ran in: autocast's where it is on (float16 rounds at 5e-2)
    tol = tolerance(lowest(*(g.dtype for g in whole if g is not None), *autocast_dtypes()))
    norms = [float(torch.linalg.vector_norm(a)) for _, a, _ in pairs]
    floor = tol * math.sqrt(sum(n * n for n in norms))  # rounding below it is no rewrite
    worst, where = 0.0, ""
    for (name, a, b), norm in zip(pairs, norms, strict=True):
        gap = float(torch.linalg.vector_norm(a - b)) / (norm + floor + 1e-300)
        if gap > worst:
            worst, where = gap, name
    if worst <= tol:
        return None
    return (f"the model's backward is not linear in the loss: {where}'s gradient at half the "
            f"loss is not half of it (relative difference {worst:.1e}), so something in the "
            "backward rewrites gradients (a hook that clamps, normalises or adds to them, "
            "h.register_hook(lambda g: g.clamp(...)), or an autograd.Function whose backward "
            "does); under a mean loss each example's gradient would then depend on the "
            "batch's size, and its per-example gradients are not defined: remove it while "
            "watching")


def spread_rows(n: int) -> tuple[Tensor, int]:
    """The checks' rows: up to 8 spread over the ``n`` examples, and the checks' batch size
    (at least 3: ``examples`` repeats them)."""
    rows = torch.linspace(0, n - 1, min(8, n)).round().long().unique()
    return rows, max(3, rows.numel())


def padded_output(model: nn.Module, x: Tensor, fixed: frozenset[int] = frozenset()
                  ) -> str | None:
    """Why the check's batch and its examples alone differ, where an output holding the
    examples along dimension 0 has other dimensions on the batch than on an example alone:
    padded to the batch's longest example (``pad_packed_sequence`` without
    ``total_length``), its padding then holds values that no example alone has. None when
    every such output keeps its other dimensions."""
    rows, size = spread_rows(x.shape[0])
    xs = examples(x[rows], size)

    def shapes(inputs: Tensor) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in _leaves(model, inputs)]

    with buffers_kept(model), torch.random.fork_rng(devices=[]):
        mode = nullcontext() if deterministic(model, xs) else eval_mode(model)
        with mode:
            whole = shapes(xs)
            alone = [shapes(xs[i : i + 1]) for i in range(size)]
    for k, s in enumerate(whole):
        if k in fixed or not s or s[0] != size:
            continue
        for a in alone:
            if k < len(a) and len(a[k]) == len(s) and a[k][1:] != s[1:]:
                dims = [d for d in range(1, len(s)) if a[k][d] != s[d]]
                if s[dims[0]] == size and a[k][dims[0]] == 1:
                    return (f"output {k} of the model has shape {s} on {size} examples but "
                            f"{a[k]} on one of them alone: its dimension {dims[0]} is the "
                            "batch's examples again, a quantity of every pair of examples (the "
                            "similarities a contrastive loss such as CLIP's reads), so the "
                            "examples interact through it, and watch, whose check cannot tell "
                            "which outputs the loss will read, refuses the model; a loss of "
                            "the examples' own outputs alone (CLIP's embeddings) is measured "
                            "by measure(), whose check reads the loss itself")
                return (f"output {k} of the model has shape {s} on {size} examples but {a[k]} "
                        f"on one of them alone: its dimension {dims[0]} follows the batch (a "
                        "padding to the batch's longest example, as pad_packed_sequence "
                        "without total_length pads), so watch cannot compare an example alone "
                        "with the batch; pad to a length that does not depend on the batch "
                        "(pad_packed_sequence(..., total_length=...)), or use measure(), whose "
                        "check reads the loss itself")
    return None


def coupling_outputs(model: nn.Module, x: Tensor, fixed: frozenset[int] = frozenset()
                     ) -> dict[int, tuple[int, ...]]:
    """The model's floating outputs with no dimension of the examples (``fixed``, see
    ``output_kinds``, and those without the check's count) whose value on a few
    examples is neither the sum nor the mean of its values on each example alone (output
    position in ``flatten``'s order -> shape): a quantity of the batch, as a mixture of
    experts' load-balancing loss, that couples the examples when a loss backpropagates
    through it. A sum or mean of the examples' own (a Hugging Face model's mean loss over
    equally long sequences) is not one. Deterministic forward passes (eval mode where
    dropout draws), the buffers and the random state kept."""
    rows, size = spread_rows(x.shape[0])
    xs = examples(x[rows], size)

    with buffers_kept(model), torch.random.fork_rng(devices=[]):
        mode = nullcontext() if deterministic(model, xs) else eval_mode(model)
        with mode:
            whole = _leaves(model, xs)
            batchless = {k: t for k, t in enumerate(whole) if t.is_floating_point()
                         and (size not in t.shape or k in fixed)}  # (T, n, V) holds them
            if not batchless:
                return {}
            alone = [_leaves(model, xs[i : i + 1]) for i in range(size)]
    found = {}
    for k, value in batchless.items():
        each = [a[k] if k < len(a) and a[k].shape == value.shape else None for a in alone]
        if any(e is None for e in each):
            found[k] = tuple(value.shape)
            continue
        total = torch.stack(each).double().sum(dim=0)
        # float32 inside a float64 model rounds; autocast rounds at its own precision
        rtol = max(tolerance(lowest(value.dtype, *autocast_dtypes())), 1e-5)
        if not any(torch.allclose(value.double(), t, rtol=rtol, atol=0.0)
                   for t in (total, total / size)):
            found[k] = tuple(value.shape)
    return found


def deterministic(model: nn.Module, x: Tensor, random_only: bool = False) -> bool:
    """Whether two forward passes under different random seeds give the same outputs, and
    draw no numbers from torch's generators that the seed decides; ``random_only``: from
    the same buffers (one its forward updates differs not). A layer dropped with
    probability 0.05 (M2M100's LayerDrop) is dropped in neither of two passes most times,
    and was then taken as deterministic, its examples' losses alone then said to differ
    because they interact. Draws the seed does not decide are left to the outputs: a
    forward that seeds the generator itself, with a fixed seed or from the system's entropy
    (Reformer's hash seed, its reversible layers' ``default_generator.seed()``)."""

    def run(seed: int) -> tuple[list[Tensor], bool, list[Tensor]]:
        with buffers_kept(model) if random_only else nullcontext():
            torch.manual_seed(seed)
            before = _generator_states()
            outputs = _leaves(model, x)
            after = _generator_states()
        return outputs, not _same(before, after), after

    (one, drew_one, after_one), (two, drew_two, after_two) = run(1), run(2)
    if not all(torch.equal(a, b) for a, b in zip(one, two, strict=True)):
        return False
    if not (drew_one and drew_two) or _same(after_one, after_two):
        return True
    return not _same(after_one, run(1)[2])  # the same seed, the same draws: the seed's


def _same(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def _generator_states() -> list[Tensor]:
    """torch's default generators' states: the CPU's, and each started CUDA device's."""
    states = [torch.random.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def _leaves(model: nn.Module, x: Tensor) -> list[Tensor]:
    """The model's tensor outputs on ``x``, detached. The forward runs with gradients on, as
    when the model trains (a user's hook that hooks its outputs' gradients, a gradient
    logger, fails under no_grad); its graph is freed with the outputs it detaches."""
    with torch.enable_grad():
        return [t.detach() for t in flatten(call_model(model, x)) if isinstance(t, Tensor)]


@contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """The model's buffers as they were (a check's forward passes in train mode may update
    running statistics): the same tensors, in their modules, with their values, and their
    sizes where the forward sized them (a quantisation observer's, empty until its first
    call). A buffer no pass wrote (its version counter as it was) is left untouched: a
    write would fail a backward of the user's that saved it (BERT's position ids, checked
    between the user's forward and backward)."""
    saved = [(module, name, b, _version(b), b.detach().clone()) for module in model.modules()
             for name, b in module._buffers.items() if b is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, buffer, version, value in saved:
                if version is None or _version(buffer) != version or (
                        buffer.shape != value.shape):
                    if buffer.shape != value.shape:
                        buffer.resize_(value.shape)
                    buffer.copy_(value)
                module._buffers[name] = buffer


def _version(t: Tensor) -> int | None:
    """The tensor's version counter (None for an inference tensor, which keeps none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def check_rows(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss_fn: PerExampleLoss,
    params: dict[str, nn.Parameter],
    fast_sq: dict[str, Tensor],
    fast_losses: Tensor,
    precision: torch.dtype | None = None,
) -> dict[str, str]:
    """The rules' results for the first, middle and last examples of a chunk just computed
    (a model in eval mode) beside the per-example loop's: see ``disagreements``. Spread
    rows, because a model that reorders its batch (sorting it) may leave the first in place."""
    picked = sorted({0, x.shape[0] // 2, x.shape[0] - 1})
    slow_sq, _, slow_losses = loop_sq_norms(model, x[picked], y[picked], loss_fn, list(params),
                                            sums=False)
    rows = {name: sq[picked] for name, sq in fast_sq.items()}
    dtype = lowest(precision or next(iter(params.values())).dtype, *autocast_dtypes())
    return disagreements(rows, fast_losses[picked], slow_sq, slow_losses, dtype)
