"""The hooks engine: per-example gradients of one chunk from one forward and one backward.

``HooksPass`` records the calls of modules that have layer rules (``calls.py``), then, before
the backward pass, reads the autograd graph (``graph.py``) and decides for every trainable
parameter whether the rules give its per-example gradients exactly:

1. every operation that uses the parameter lies inside a call of a module whose rule covers
   it (a use anywhere else, a tied head written ``h @ wte.weight.T`` say, is caught);
2. each such call has its examples where the rule reads them: the axis found for that call
   by running two batch sizes (``rule_check.py``), checked again on this chunk, or no example
   axis at all when the call's output is broadcast over the examples by an addition (a
   position embedding ``wpe(arange(T))``, whose per-example gradients are then read off the
   addition's output gradient);
3. the call's rows are not chosen or moved by the data on this chunk (``rows.py``): a
   forward that routes tokens to experts, unpads tokens or puts rows back by an index
   computed from the examples has its affected calls refused, whatever their sizes;
4. the rule does not decline the call's configuration.

Backward pre-hooks on each call's output nodes hand the output gradients to the rule as
soon as autograd computes them; small calls of like layers (a transformer's blocks) wait for
the end of the backward pass and run as one, on their examples stacked (``stacking.py``).
A parameter used by one call gets that call's squared norms; a parameter used by several
(a module run twice, a weight tied between modules) gets ‖Σ_c g_i^(c)‖² with the cross
terms (``rules/forms.py``). Every other parameter comes back with the reason, for the
caller to compute exactly by another engine or to refuse.

The loss is an explicit sum Σ_i f_i; its gradient, taken with ``torch.autograd.grad`` so a
user's ``.grad`` fields are never touched, gives Σ_i g_i and hence T.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge
from torch.utils.hooks import RemovableHandle

from batchbound.diversity import stacking
from batchbound.diversity.calls import CallRecord, CallRecorder, Inputs, call_model, flatten
from batchbound.diversity.graph import (
    Edge,
    Node,
    broadcast_chain,
    broadcast_factor,
    loss_users,
    name_of,
    parameter_users,
    region,
    walk,
)
from batchbound.diversity.losses import (
    DeferredFinite,
    PerExampleLoss,
    check_losses,
    check_shape,
    loss_joining,
    split_gap,
)
from batchbound.diversity.precision import lowest
from batchbound.diversity.rows import (
    UNTRACKED_CHANGE,
    RowChecks,
    RowTracker,
    chunk_key,
    graph_structure,
)
from batchbound.diversity.rules import (
    DEFER_NUMEL,
    Call,
    Dense,
    Outer,
    PerExampleGrad,
    RuleEntry,
    combined_sq_norms,
    project,
    project_bound,
    rule_for,
    sum_dense,
)
from batchbound.diversity.stats import (
    LOW_PRECISION,
    gradients,
    norm_dtype,
    trainable_parameters,
)
from batchbound.errors import BatchboundError

# Numbers of small per-example gradients held until the end of the backward pass, to be
# normed together (2**24: 64 MiB in float32); past it they are normed at once, in groups.
DEFER_BUDGET = 2**24

LOSS_USE = ("used by the loss function itself, outside the model's forward (only the "
            "per-example loop evaluates the loss with the real parameters)")


@dataclass(frozen=True)
class CallLayout:
    """Where one call keeps its examples, from running the model at two batch sizes."""

    axis: int | None = None  # in the main input; None: the input has no example axis
    consumer_axis: int | None = None  # batch-less calls: in the broadcasting addition's output
    reason: str | None = None  # why the call's rule cannot be trusted


Layout = dict[tuple[str, int], CallLayout]


class OutputKinds(NamedTuple):
    """The model's tensor outputs (positions in ``flatten``'s order) whose shape is the same
    at 2 and at 3 examples (``fixed``: no dimension of the examples, whatever their size),
    and of those, the ones computed from the parameters alone (``parameters``: a learned
    temperature), from ``rule_check.output_kinds``; ``joins``: why the forward may join
    the examples where the data says so (``pairing.py``), "" where it does not,
    ``paired``: by a tensor that pairs them (or mixes their rows), and ``reduced``: by a
    quantity of the batch that combines their rows or is laid over them (``pairing.Joined``)."""

    fixed: frozenset[int] = frozenset()
    parameters: frozenset[int] = frozenset()
    joins: str = ""
    paired: bool = False
    reduced: bool = False

    @property
    def unchecked(self) -> bool:
        """Whether the data may join the examples where a chunk's first check cannot speak
        for the rest: every mark but a quantity of the batch made of some examples' rows
        and put back among them (packed sequences' last steps)."""
        return self.paired or self.reduced


@dataclass
class HookPlan:
    """Which modules' rules cover which parameters, decided before any forward pass."""

    covered: dict[str, tuple[nn.Module, RuleEntry]] = field(default_factory=dict)
    claims: dict[str, dict[str, str]] = field(default_factory=dict)  # prefix -> local -> name
    uncovered: dict[str, list[str]] = field(default_factory=dict)  # module label -> params

    def static_reasons(self) -> dict[str, str]:
        return {name: f"no layer rule for {label}" for label, names in self.uncovered.items()
                for name in names}


def plan_hooks(model: nn.Module, params: dict[str, nn.Parameter] | None = None) -> HookPlan:
    params = trainable_parameters(model) if params is None else params
    name_of_param = {id(p): name for name, p in params.items()}
    plan = HookPlan()
    claimed: set[str] = set()
    for prefix, module in model.named_modules():
        entry = rule_for(module)
        if entry is None:
            continue
        claims = {}
        for local in entry.params(module):
            try:
                param = module.get_parameter(local)
            except AttributeError:
                continue  # e.g. bias=False
            if id(param) in name_of_param:
                claims[local] = name_of_param[id(param)]
        if claims:
            plan.covered[prefix] = (module, entry)
            plan.claims[prefix] = claims
            claimed.update(claims.values())
    owner = {}
    for prefix, module in model.named_modules():
        for _, p in module.named_parameters(recurse=False):
            owner.setdefault(id(p), f"{prefix or '<root>'} ({type(module).__name__})")
    for name, p in params.items():
        if name not in claimed:
            plan.uncovered.setdefault(owner.get(id(p), "<unknown>"), []).append(name)
    return plan


# ------------------------------------------------------------------------------ the pass


@dataclass
class _Broadcast:
    """A batch-less call's output reaches the examples through a broadcasting node."""

    edge: Edge
    adjacent: Node  # the node whose output is the broadcast's operand
    grad: Tensor | None = None  # the broadcast output's gradient, (…, n, …)
    operand_shape: torch.Size | None = None


@dataclass
class ProbeShapes:
    """What ``rule_check.py`` compares between two batch sizes, for one call."""

    entry: RuleEntry
    module: nn.Module
    main: torch.Size | None
    broadcast: torch.Size | None = None
    kind: str = "Tensor"  # the main argument's type


class HooksPass:
    """One forward and backward of a chunk (see the module docstring). With ``layout=None``
    it only records shapes for the probe: no rule runs."""

    def __init__(
        self,
        plan: HookPlan,
        params: dict[str, nn.Parameter],
        layout: Layout | None,
        n: int,
        excluded: dict[str, str] | None = None,
        fingerprint_vectors: dict[str, tuple[Tensor, Tensor]] | None = None,
    ) -> None:
        self.plan, self.params, self.layout, self.n = plan, params, layout, n
        # With ``fingerprint_vectors`` (``draw_fingerprint_vectors``): ⟨Σ_i g_i, a bᵀ⟩ per
        # parameter from the rules' forms, for its random a, b, to compare with autograd's
        # gradient sum.
        self.fingerprint_vectors = fingerprint_vectors or {}
        self.backward_seen = False  # an output gradient reached a rule's call
        self.fingerprints: dict[str, Tensor] = {}
        # Per fingerprint, over its forms (``forms.project_bound``): Σ |a|ᵀ|term||b| and the
        # same weighted by each form's chain of roundings; None where a form gave none
        self.fingerprint_bounds: dict[str, tuple[Tensor, Tensor] | None] = {}
        # Parameters with an indexed form (an embedding's): their ``.grad`` may be sparse, or
        # a sparse sum added into a dense one entry by entry (``steps._unseen_uses``)
        self.fingerprint_indexed: set[str] = set()
        self.recorder = CallRecorder(plan.covered)
        self.reasons: dict[str, str] = {**plan.static_reasons(), **(excluded or {})}
        # per-example squared norms computed so far (``sq_norms`` norms the held rest when read)
        self._sq_norms: dict[str, Tensor] = {}
        self.totals: dict[str, Tensor] = {}  # Σ_i g_i where autograd's batch sum differs
        self.shapes: dict[tuple[str, int], ProbeShapes] = {}
        self.unused: set[str] = set()  # parameters no operation in the graph uses
        self.loss_uses: set[str] = set()  # parameters the loss function itself uses
        # Parameters whose batch gradient the rules give (``own_sums``; only where the caller
        # asks autograd itself, ``hooks_stats``: watch reads the user's backward), and the
        # calls whose output gradients autograd is asked for instead (``capture_edges``).
        self.rule_sums: set[str] = set()
        self.own_sums = False
        # With ``into`` (``hooks_stats``): running sums the rules add their batch sums to in
        # their own kernels (``add_total_to``), for the parameters in ``added``.
        self.into: dict[str, Tensor] | None = None
        self.added: set[str] = set()
        self._captures: list[CallRecord] = []
        self._ids = {id(p): name for name, p in params.items()}
        self._first = next(iter(params.values()))  # its dtype and device stand for all
        self._contributions: dict[str, int] = {}
        self._pending: defaultdict[str, list[PerExampleGrad]] = defaultdict(list)
        self._deferred: list[CallRecord] = []
        # small Dense forms (each of one call, or of several stacked), normed together
        self._dense: list[tuple[list[str | None], Tensor]] = []
        self._held = 0  # numbers in ``_dense``, at most ``defer_budget``
        # calls held to run stacked with their like (``stacking.py``), by key
        self._stacks: dict[Hashable, list[CallRecord]] = {}
        self._stacked: set[tuple[str, int]] = set()  # calls put in a stack (run or waiting)
        self._waiting = 0  # numbers of their output gradients, at most ``defer_budget``
        self.defer_budget = DEFER_BUDGET
        self._broadcasts: dict[tuple[str, int], _Broadcast] = {}
        self._handles: list[RemovableHandle] = []
        self.rows: RowTracker | None = None  # set by ``start_rows``: None, untracked
        # which chunks are tracked (None: every one), and this chunk's key among them
        self.row_checks: RowChecks | None = None
        # Called once the program is read (``attach``), before the rules are hooked: watch
        # checks a program not seen yet there, and adds its check's reasons. The check on a
        # few examples does not see rows the data moves (a sort across the batch) as the
        # row tracker does: an untracked step of a new program still takes the fallback.
        self.on_program: Callable[[], None] | None = None
        self.row_key: Hashable = None
        # what the forward ran (its layer calls, its graph's structure), read by ``attach``
        self.program: tuple[Hashable, tuple[object, ...]] | None = None

    # -------------------------------------------------------------------- phases

    def forward(self, model: nn.Module, x: Tensor | Inputs) -> Any:
        given = (x.args, x.kwargs) if isinstance(x, Inputs) else (x,)
        rows = self.start_rows(model, given, model.buffers)
        with self.recorder, self.recorder.recording(), rows or nullcontext():
            return call_model(model, x)

    def start_rows(self, model: nn.Module, given: Any,
                   fixed: Callable[[], Iterable[Tensor]]) -> RowTracker | None:
        """The row tracker for this forward (``given``: the model's arguments, ``fixed``: its
        buffers), or None where ``row_checks`` leaves the chunk untracked; not entered."""
        if self.layout is None:  # the probe: the rules do not run
            self.rows = None
        elif self.row_checks is None:
            self.rows = RowTracker(given, fixed())
        else:
            self.row_key = chunk_key(given, model.training)
            self.rows = self.row_checks.tracker(self.row_key, given, fixed, model.parameters)
        return self.rows

    def attach(self, roots: Sequence[Node], outputs: Sequence[Node] = ()) -> None:
        """Read the graph and hook the calls, between the forward and the backward pass.
        ``outputs``: the model's output nodes, when ``roots`` is a loss computed from them."""
        nodes, users = walk(roots)
        if self.layout is None:
            self._attach_probe(users)
            return
        calls = tuple([(c.key, tuple([(o.shape, o.dtype) for o in c.outputs]))
                       for c in self.recorder.calls])  # lists: no generator frames
        self.program = (calls, graph_structure(nodes))
        if self.on_program is not None:
            self.on_program()
        if self.row_checks is not None:
            self._check_rows(*self.program)
        if outputs:
            self.loss_uses = loss_users(roots[0], outputs, self._ids)
            for name in self.loss_uses:
                self.reasons[name] = LOSS_USE
        owners: defaultdict[Node, list[CallRecord]] = defaultdict(list)
        why: dict[tuple[str, int], str] = {}
        feeding = self.rows.feeding_moves() if self.rows is not None else set()
        tops = set(roots)

        def reached(node: Node) -> bool:
            return node in users or node in tops

        for call in self.recorder.calls:
            reason = self._call_reason(call, users)
            nodes_out = [o.node for o in call.outputs if o.node is not None]
            # every output off the backward pass: unused (then no parameter of it is reached,
            # and this says nothing), or rebased by an in-place write, its tensor gone
            if reason is None and ((nodes_out and not any(map(reached, nodes_out)))
                                   or any(o.rebased(reached) for o in call.outputs)):
                reason = ("its output was written in place after the call (an output that is a "
                          "view, such as a Linear's on a 3-d input, then takes a new history: "
                          "its gradient no longer passes the layer's own operation)")
            if reason is None and feeding and any(o.node in feeding for o in call.outputs):
                reason = (f"its output's rows are then moved by the data (by "
                          f"{self.rows.moved_by}), so they stop being the examples' own")
            outputs = [o.node for o in call.outputs]
            inside = region(outputs, call.input_nodes)
            if reason is None and call.written():
                reason = ("its input was written in place after the call (h.add_(f(h))), and "
                          "its rule would read the input as it is now, not as the call saw it")
            if reason is None and _written_past(outputs, inside, users):
                reason = ("its output was written in place after the call while read before "
                          "(h.add_(f(h)) on a view such as a Linear's on a 3-d input): the "
                          "write's gradient passes the layer's own operation by")
            if reason:
                why[call.key] = reason
            for node in inside:
                owners[node].append(call)
        contributing: dict[str, list[CallRecord]] = {}
        for name, using in parameter_users(nodes, self._ids).items():
            if name in self.reasons:
                continue
            calls: list[CallRecord] = []
            for node in using:
                claimants = [c for c in owners.get(node, ())
                             if name in self.plan.claims[c.prefix].values()]
                if len(claimants) != 1:
                    self.reasons[name] = (
                        f"used outside its module's call (by {name_of(node)})" if not claimants
                        else f"used inside several calls at once (by {name_of(node)})")
                    break
                call = claimants[0]
                if call.key in why:
                    self.reasons[name] = f"{call.label}: {why[call.key]}"
                    break
                if call not in calls:
                    calls.append(call)
            else:
                contributing[name] = calls
        self._contributions = {name: len(calls) for name, calls in contributing.items()}
        for call in self.recorder.calls:
            claimed = self.plan.claims[call.prefix].values()
            if call.key not in why and any(call in contributing.get(k, ()) for k in claimed):
                self._hook_call(call)
                if self.own_sums:
                    self._own_sums(call, contributing)

    def _check_rows(self, calls: Hashable, graph: tuple[object, ...]) -> None:
        """A tracked chunk noted for the untracked; an untracked chunk that ran otherwise
        leaves every parameter to the exact fallback (``rows.RowChecks``)."""
        assert self.row_checks is not None
        if self.rows is not None:
            self.row_checks.tracked(self.row_key, calls, graph, self.rows)
        elif not self.row_checks.same(self.row_key, calls, graph):
            for name in self.params:
                self.reasons.setdefault(name, UNTRACKED_CHANGE)

    def _own_sums(self, call: CallRecord, contributing: dict[str, list[CallRecord]]) -> None:
        """The parameters of ``call`` (its only contributing call) whose batch gradient its
        rule gives at no extra cost: autograd is asked for the call's output gradient instead,
        so a backward that needs nothing below the call (a first layer) skips it."""
        own = call.entry.own_sums
        # a call broadcast over the examples reads its per-example gradients off the
        # broadcast's, by prehooks on nodes that a captured backward does not run
        if (own is None or call.key in self._broadcasts or len(call.outputs) != 1
                or call.outputs[0].node is None
                or not isinstance(call.main_input, Tensor)):
            return
        claims = self.plan.claims[call.prefix]
        names = [claims[local] for local in own(call.module, call.main_input,
                                                call.outputs[0].shape) if local in claims]
        names = [k for k in names if k not in self.reasons and _only(contributing.get(k), call)]
        if names:
            self.rule_sums.update(names)
            self._captures.append(call)

    def capture_edges(self) -> list[GradientEdge]:
        """The outputs whose gradients ``captured`` takes, for ``torch.autograd.grad``."""
        return [GradientEdge(c.outputs[0].node, c.outputs[0].index) for c in self._captures]

    def captured(self, grads: Sequence[Tensor | None]) -> None:
        """The captured output gradients, for the calls whose node the backward did not run
        (no prehook fired: nothing below them was asked for)."""
        for call, grad in zip(self._captures, grads, strict=True):
            if call.grads and call.key not in self._stacked:  # not run, nor held to run
                self.backward_seen = True
                call.grads = [grad]
                self._run(call)

    def finish(self) -> None:
        """After the backward pass: deferred calls, cross terms, and zeros for parameters
        that took no part in this pass."""
        self._remove_hooks()
        # the recorded inputs are the forward's own (not detached)
        with torch.no_grad(), _no_autocast(self._first.device.type):
            self._finish()

    def _finish(self) -> None:
        for call in self._deferred:
            self._run(call)
        self._deferred.clear()
        self._run_stacks()
        for name, forms in self._pending.items():
            numel = self.params[name].numel()
            if len(forms) > 1 and forms[0].n * numel <= DEFER_NUMEL:  # small: summed, and
                self._defer([name], sum_dense(forms))  # normed with the others
            else:
                self._sq_norms[name] = combined_sq_norms(forms, numel)
            for form in forms:
                self._fingerprint(name, form)
            if not all(f.batch_sum_exact for f in forms):
                self.totals[name] = sum(f.total() for f in forms).reshape(self.params[name].shape)
        self._pending.clear()
        held = {name for names, _ in self._dense for name in names}  # normed when read
        for name, p in self.params.items():
            if name not in self.reasons and name not in self._sq_norms and name not in held:
                # no use of it reached the loss
                self._sq_norms[name] = p.new_zeros(self.n, dtype=norm_dtype(p.dtype))
                self.unused.add(name)

    def close(self) -> None:
        self._remove_hooks()

    # ------------------------------------------------------------------ per call

    def _call_reason(self, call: CallRecord, users: dict[Node, list[Edge]]) -> str | None:
        assert self.layout is not None
        layout = self.layout.get(call.key)
        if layout is None:
            return ("this call did not happen when the model was checked (data-dependent "
                    "control flow?)")
        if layout.reason:
            return layout.reason
        x, entry, n = call.main_input, call.entry, self.n
        if not isinstance(x, Tensor):
            return f"its argument {call.main!r} is a {type(x).__name__}, not a tensor"
        if self.rows is not None and self.rows.reads_marked(list(call.inputs.values())):
            return (f"its input's rows are chosen by the data (by {self.rows.moved_by}), so "
                    "which example each row belongs to changes from chunk to chunk")
        if entry.example_axis is None and layout.axis is None:
            return self._find_broadcast(call, users)
        axis = layout.axis if entry.example_axis is None else entry.example_axis(call.module)
        assert axis is not None
        if x.dim() <= axis or x.shape[axis] != n:
            return (f"its input {tuple(x.shape)} does not hold the {n} examples along "
                    f"dimension {axis}")
        if entry.example_axis is None and any(
            len(o.shape) <= axis or o.shape[axis] != n for o in call.outputs
        ):
            return f"its output does not hold the {n} examples along dimension {axis}"
        if entry.unsupported is not None:
            return entry.unsupported(Call(call.module, call.inputs, [], call.main), n)
        return None

    def _find_broadcast(self, call: CallRecord, users: dict[Node, list[Edge]]) -> str | None:
        if len(call.outputs) != 1 or call.outputs[0].node is None:
            return "it runs on a tensor with no example axis"
        found = broadcast_chain(call.outputs[0].node, users)
        if found is None:
            return ("it runs on a tensor with no example axis, and its output is not broadcast "
                    "over the examples by an addition")
        chain, edge = found
        adjacent = chain[-1] if chain else call.outputs[0].node
        self._broadcasts[call.key] = _Broadcast(edge, adjacent)
        return None

    def _hook_call(self, call: CallRecord) -> None:
        call.grads = [None] * len(call.outputs)
        broadcast = self._broadcasts.get(call.key)
        if broadcast is not None:
            self._hook_broadcast(broadcast)
        by_node: defaultdict[Node, list[int]] = defaultdict(list)
        for k, out in enumerate(call.outputs):
            if out.node is not None:
                by_node[out.node].append(k)
        single = len(call.outputs) == 1
        if not single:
            self._deferred.append(call)

        def make(node: Node, slots: list[int]) -> Callable[[tuple], None]:
            def prehook(grad_outputs: tuple) -> None:
                self.backward_seen = True
                for k in slots:
                    call.grads[k] = grad_outputs[call.outputs[k].index]
                if single:
                    self._ready(call)

            return prehook

        for node, slots in by_node.items():
            self._handles.append(node.register_prehook(make(node, slots)))

    def _hook_broadcast(self, broadcast: _Broadcast) -> None:
        node, _ = broadcast.edge

        def on_output(grad_outputs: tuple) -> None:
            broadcast.grad = grad_outputs[0]

        def on_operand(grad_outputs: tuple) -> None:
            if broadcast.operand_shape is None:
                broadcast.operand_shape = grad_outputs[0].shape

        self._handles.append(node.register_prehook(on_output))
        self._handles.append(broadcast.adjacent.register_prehook(on_operand))

    def _run(self, call: CallRecord, saved: bool = True) -> None:
        """The rule on one call's inputs and output gradients, under no_grad: the recorded
        inputs are the forward's own tensors, and a backward with create_graph runs its
        hooks with grad enabled. ``saved``: what the call's nodes saved is still there (the
        backward has not passed them), for the rule to read."""
        device = self._first.device.type
        if not torch.is_grad_enabled() and not torch.is_autocast_enabled(device):
            self._run_rule(call, saved)  # a plain backward's hook: no mode to set (host time)
            return
        with torch.no_grad(), _no_autocast(device):
            self._run_rule(call, saved)

    def _run_rule(self, call: CallRecord, saved: bool = True) -> None:
        assert self.layout is not None
        entry, layout = call.entry, self.layout[call.key]
        inputs = dict(call.inputs)
        grads = [
            g if g is not None else torch.zeros(o.shape, dtype=self._dtype(call),
                                                device=self._device(call))
            for g, o in zip(call.grads, call.outputs, strict=True)
        ]
        call.grads = []  # release them with the rule's forms
        main = call.main
        nodes = [o.node for o in call.outputs] if saved and not call.saved_hooks else []
        if entry.example_axis is None and layout.axis != 0:
            nodes = []
            x = inputs[main]
            if layout.axis is None:
                inputs[main] = x.expand(self.n, *x.shape)  # a new leading axis
                grads = [self._per_example(self._broadcasts[call.key], layout, call)]
            elif layout.axis:
                inputs[main] = x.movedim(layout.axis, 0)
                grads = [g.movedim(layout.axis, 0) for g in grads]
        inputs, grads = self._in_working_precision(call, inputs, grads)
        forms = entry.rule(Call(call.module, inputs, grads, main, nodes))
        claims = self.plan.claims[call.prefix]
        for local, form in forms.items():
            name = claims.get(local)
            if name is None or name not in self._contributions:
                continue
            if self._contributions[name] > 1:
                self._pending[name].append(form)
                continue
            self._store([name], form)
            self._fingerprint(name, form)
            self._batch_sum(name, form)

    def _batch_sum(self, name: str, form: PerExampleGrad) -> None:
        """Σ_i g_i of one call's parameter where autograd's is not taken (``rule_sums``: added
        into ``into`` by the form's own kernel, or kept in ``totals``) or is not the sum of
        the examples' (``batch_sum_exact`` False)."""
        if self.into is not None and name in self.rule_sums and form.batch_sum_exact:
            form.add_total_to(self.into[name])
            self.added.add(name)
        elif not form.batch_sum_exact or name in self.rule_sums:
            self.totals[name] = form.total().reshape(self.params[name].shape)

    def _ready(self, call: CallRecord) -> None:
        """A one-output call's gradient has arrived: its rule runs now, or, for a call whose
        parameters are its own (no cross terms), with its like stacked (``stacking.py``) at
        the end of the backward pass, batch sums asked of the rule included
        (``_batch_sum``); once ``defer_budget`` numbers of held gradients wait, the held
        calls run first."""
        assert self.layout is not None
        claimed = self.plan.claims[call.prefix].values()
        own = True  # a loop, not all(generator): per call, every step (host time)
        for k in claimed:
            if self._contributions.get(k, 1) != 1:
                own = False
                break
        key = stacking.stack_key(call, self.layout[call.key].axis,
                                 sums=not self.rule_sums.isdisjoint(claimed)) if own else None
        if key is None:
            self._run(call)
            return
        grad = call.grads[0]
        assert grad is not None  # (stack_key stacks no call without one)
        if self._waiting + grad.numel() > self.defer_budget:
            self._run_stacks()
        self._stacks.setdefault(key, []).append(call)
        self._stacked.add(call.key)
        self._waiting += grad.numel()

    def _run_stacks(self) -> None:
        """The held calls: each key's as one call over their examples stacked (one alone as
        itself)."""
        stacks, self._stacks, self._waiting = self._stacks, {}, 0
        for calls in stacks.values():
            if len(calls) == 1:
                self._run(calls[0], saved=False)  # held: the backward has passed it
                continue
            with torch.no_grad(), _no_autocast(self._first.device.type):
                self._run_stack(calls)

    def _run_stack(self, calls: list[CallRecord]) -> None:
        """The rule once on the calls' examples stacked; each form's rows k·n to (k+1)·n are
        call k's parameter's (``stacking.rows``)."""
        first = calls[0]
        inputs, grads = stacking.stacked(calls)
        for call in calls:
            call.grads = []  # release them with the rule's forms
        inputs, grads = self._in_working_precision(first, inputs, grads)
        forms = first.entry.rule(Call(first.module, inputs, grads, first.main))
        for local, form in forms.items():
            names = [self.plan.claims[c.prefix].get(local) for c in calls]
            names = [k if k in self._contributions else None for k in names]
            if not any(names):
                continue
            self._store(names, form)
            for k, name in enumerate(names):
                if name is None or (name not in self.fingerprint_vectors
                                    and name not in self.rule_sums and form.batch_sum_exact):
                    continue
                part = form.part(stacking.rows(k, self.n))
                self._fingerprint(name, part)
                self._batch_sum(name, part)

    def _store(self, names: list[str | None], form: PerExampleGrad) -> None:
        """A form's per-example squared norms (of one call's parameter, or of several calls'
        stacked): small materialised gradients held to be normed with their like, else now."""
        small = form.small_dense() if isinstance(form, Outer) else form
        if isinstance(small, Dense) and small.deferrable:  # normed with its like later
            self._defer(names, small.grads)
        else:
            self._keep(names, form.sq_norms())

    def _keep(self, names: list[str | None], sq_norms: Tensor) -> None:
        """Squared norms of ``len(names)`` calls' examples stacked, each call's to its
        parameter (None: nobody's)."""
        parts = sq_norms.split(self.n) if len(names) > 1 else (sq_norms,)
        for k, v in zip(names, parts, strict=True):
            if k is not None:
                self._sq_norms[k] = v

    def _defer(self, names: list[str | None], grads: Tensor) -> None:
        """Hold small per-example gradients (of one call's parameter, or of several calls'
        stacked, ``_keep``) to norm them with their like (fewer operations); once
        ``defer_budget`` numbers are held, norm those now (the extra memory's cap)."""
        if grads.numel() > self.defer_budget:  # never held
            self._keep(names, Dense(grads).sq_norms())
            return
        if self._held + grads.numel() > self.defer_budget:
            self._flush()
        self._dense.append((names, grads))
        self._held += grads.numel()

    def _flush(self) -> None:
        if self._dense:
            self._sq_norms.update(grouped_row_sq_norms(self._dense))
        self._dense.clear()
        self._held = 0

    @property
    def sq_norms(self) -> dict[str, Tensor]:
        """Every parameter's per-example squared norms, (n,) each (after ``finish``): what
        is still held is normed when this is read."""
        self._flush()
        return self._sq_norms

    def sq_parts(self) -> tuple[dict[str, Tensor], list[Tensor]]:
        """What a sum over the examples and the parameters needs (S), without norming each
        example's rows: the per-example squared norms computed so far, and the per-example
        gradients still held, every entry of which counts squared (``steps.batch_sums`` norms
        them whole, in one multi-tensor operation). A held stack with rows nobody asked for
        (None) is normed by rows here, and those rows left out."""
        partial = [(names, t) for names, t in self._dense if None in names]
        if partial:
            self._sq_norms.update(grouped_row_sq_norms(partial))
            self._dense = [(names, t) for names, t in self._dense if None not in names]
        return self._sq_norms, [t for _, t in self._dense]

    def _in_working_precision(self, call: CallRecord, inputs: dict[str, Any],
                              grads: list[Tensor]) -> tuple[dict[str, Any], list[Tensor]]:
        """The rules compute in one dtype: float32 for low-precision tensors (a bfloat16
        model, or bfloat16 outputs and output gradients under autocast), else the
        parameters'. A call whose output is lower precision than its floating inputs ran on
        inputs cast down (autocast casts a Linear's input to bfloat16): the rule reads them
        as rounded, the activations the operation actually used. A ``low_precision`` rule
        gets them in the call's own dtype, unwidened, where the working dtype is float32
        (its forms widen to float32; a float64 model's other forms are float64)."""
        work = norm_dtype(self._dtype(call))
        out = lowest(*(o.dtype for o in call.outputs if o.dtype.is_floating_point))
        if out in LOW_PRECISION and work not in LOW_PRECISION:
            inputs = {k: _rounded(v, out) for k, v in inputs.items()}
            if (call.entry.low_precision and work == torch.float32
                    and all(g.dtype == out for g in grads)):
                return inputs, grads  # the rule's forms widen or multiply them (``products``)
            inputs = {k: _widened(v, work) for k, v in inputs.items()}
        else:
            inputs = {k: _widened(v, work) for k, v in inputs.items()}
        return inputs, [_widened(g, work) for g in grads]

    @property
    def precision(self) -> torch.dtype:
        """The lowest precision this pass computed in: the parameters', or lower where
        autocast or a cast in the forward made low-precision tensors."""
        seen = (self.rows.lowest if self.rows is not None else
                self.row_checks.lowest(self.row_key) if self.row_checks is not None else None)
        outputs = (o.dtype for c in self.recorder.calls for o in c.outputs)
        return lowest(self._dtype(None), seen, *outputs)  # type: ignore[arg-type]

    def _per_example(self, b: _Broadcast, layout: CallLayout, call: CallRecord) -> Tensor:
        """Row i of the result: ∂f_i/∂(the call's output), from the broadcast's gradient."""
        assert b.grad is not None and b.operand_shape is not None
        assert layout.consumer_axis is not None
        grad, axis, n = b.grad, layout.consumer_axis, self.n
        if grad.dim() <= axis or grad.shape[axis] != n:
            raise BatchboundError(
                f"{call.label}: the broadcast of its output {tuple(grad.shape)} does not hold "
                f"the {n} examples along dimension {axis}, as it did when the model was checked")
        # The operand, right-aligned to the broadcast's shape, has size 1 along the examples.
        operand = [1] * (grad.dim() - len(b.operand_shape)) + list(b.operand_shape)
        if operand[axis] != 1:
            raise BatchboundError(f"{call.label}: its output is not broadcast over the examples")
        operand[axis] = n
        per = grad.sum_to_size(operand)
        per = per.movedim(axis, 0) if axis else per
        factor = broadcast_factor(b.edge)
        per = per * factor if factor != 1.0 else per
        shape = (n, *call.outputs[0].shape)
        return per if per.shape == shape else per.reshape(shape)

    def _fingerprint(self, name: str, form: PerExampleGrad) -> None:
        if name in self.fingerprint_vectors:
            a, b = self.fingerprint_vectors[name]
            value = project(form, a, b)
            self.fingerprints[name] = self.fingerprints.get(name, 0) + value
            if isinstance(form, Outer) and form.indexed:
                self.fingerprint_indexed.add(name)
            bound, held = project_bound(form, a, b), self.fingerprint_bounds.get(name, (0, 0))
            self.fingerprint_bounds[name] = None if bound is None or held is None else (
                held[0] + bound[0], held[1] + bound[0] * bound[1])

    # --------------------------------------------------------------------- probe

    def _attach_probe(self, users: dict[Node, list[Edge]]) -> None:
        for call in self.recorder.calls:
            x = call.main_input
            main = x.shape if isinstance(x, Tensor) else None
            shapes = ProbeShapes(call.entry, call.module, main, kind=type(x).__name__)
            self.shapes[call.key] = shapes
            if len(call.outputs) != 1 or call.outputs[0].node is None:
                continue
            found = broadcast_chain(call.outputs[0].node, users)
            if found is not None:
                edge = found[1]

                def record(grad_outputs: tuple, shapes: ProbeShapes = shapes) -> None:
                    shapes.broadcast = grad_outputs[0].shape

                self._handles.append(edge[0].register_prehook(record))

    # -------------------------------------------------------------------- helpers

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _dtype(self, call: CallRecord | None) -> torch.dtype:
        return self._first.dtype

    def _device(self, call: CallRecord) -> torch.device:
        return self._first.device


def _written_past(outputs: list[Node | None], inside: set[Node],
                  users: dict[Node, list[Edge]]) -> bool:
    """Whether an in-place write after the call, on a view of what the call computed,
    sends gradient into the call's operations past its outputs' nodes: a ``CopySlices``
    outside the call whose base is one of the call's own nodes below an output's."""
    for node in outputs:  # loops, not generators: every call, every step (host time)
        if node is None:
            continue
        for child, _ in node.next_functions:
            if child in inside:
                for user, _ in users.get(child, ()):
                    if user not in inside and type(user).__name__ == "CopySlices":
                        return True
    return False


def _only(calls: list[CallRecord] | None, call: CallRecord) -> bool:
    """Whether ``call`` is the one call in ``calls`` (by identity: records hold tensors)."""
    return calls is not None and len(calls) == 1 and calls[0] is call


def _no_autocast(device_type: str) -> Any:
    """The rules compute in their working precision (``_in_working_precision``), also when
    the backward runs under autocast (a ``loss.backward()`` inside the autocast block, or
    ``measure`` called under it): autocast would cast their float32 operands back down to
    bfloat16 (two casts per product) and round the per-example gradients and their norms."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return nullcontext()


def grouped_row_sq_norms(dense: list[tuple[list[str | None], Tensor]]) -> dict[str, Tensor]:
    """‖row i‖² of each (k·n, ...) tensor, rows k·n to (k+1)·n for its k-th name (one name:
    one call's parameter; several: calls stacked, ``stacking.py``; None: rows nobody asked
    for), the tensors of one shape, dtype and device stacked and reduced together, then all
    the norms of one dtype and device squared and split at once: one norm for all of a
    model's same-width biases and LayerNorm weights instead of one per parameter
    (tests/unit/test_watch_fused.py compares it with the per-tensor reduction)."""
    groups: defaultdict[tuple, list[tuple[list[str | None], Tensor]]] = defaultdict(list)
    for names, t in dense:
        groups[(tuple(t.shape), t.dtype, t.device)].append((names, t))
    names_of: defaultdict[tuple, list[str | None]] = defaultdict(list)  # per dtype and device
    norms: defaultdict[tuple, list[Tensor]] = defaultdict(list)  # flat row norms per group
    for (shape, dtype, device), members in groups.items():
        for names, _ in members:
            names_of[(dtype, device)] += names
        if len(members) == 1:
            t = members[0][1]
            norms[(dtype, device)].append(t if len(shape) == 1 else torch.linalg.vector_norm(
                t, dim=tuple(range(1, t.dim()))))
            continue
        together = torch.stack([t for _, t in members])
        # (k·n,) tensors: each row is one number, squared below as it is
        rows = together if len(shape) == 1 else torch.linalg.vector_norm(
            together, dim=tuple(range(2, together.dim())))
        norms[(dtype, device)].append(rows.reshape(-1))  # member by member
    out: dict[str, Tensor] = {}
    for key, parts in norms.items():  # one square and one split per dtype and device
        rows = torch.cat(parts) if len(parts) > 1 else parts[0]
        n = rows.shape[0] // len(names_of[key])
        out.update((name, sq) for name, sq in zip(names_of[key], rows.square().split(n),
                                                  strict=True) if name is not None)
    return out


def _widened(value: Any, dtype: torch.dtype = torch.float32) -> Any:
    """Floating tensors in ``value`` (and in its tuples and lists) of a lower precision
    than ``dtype``, as ``dtype`` (exact: widening loses nothing)."""
    if isinstance(value, Tensor):
        if value.is_floating_point() and value.dtype != dtype and lowest(
                value.dtype, dtype) == value.dtype:
            return value.to(dtype)
        return value
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(_widened(item, dtype) for item in value)
    return value


def _rounded(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in ``value`` wider than ``dtype``, rounded to it."""
    if isinstance(value, Tensor):
        if value.is_floating_point() and lowest(value.dtype, dtype) == dtype:
            return value.to(dtype)
        return value
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(_rounded(item, dtype) for item in value)
    return value


# Fingerprints per parameter: a use outside the rules whose projection on one pair of
# random vectors is small by chance shows on another (with 1, a regulariser of 10 % of the
# step's gradient passed 2 in 10 times on a sequence model's Linear)
FINGERPRINTS = 4
# And as many single entries (a = e_i, b = e_j): a dense unit pair's bound, Σ|a|ᵀ|term||b|,
# is about √numel times the projection it bounds (the terms' signs cancel in the sum, not in
# the bound), so on a 256 × 256 layer a regulariser of 10 % of the step's gradient passed it;
# an entry's bound Σ_t |u_ti||v_tj| is on the entry's own scale
# (tests/unit/test_watch_fingerprints.py)
COORDINATES = 4


def draw_fingerprint_vectors(params: dict[str, nn.Parameter]) -> dict[str, tuple[Tensor, Tensor]]:
    """For each parameter p, viewed as a matrix (rows = its first dimension), ``FINGERPRINTS``
    fixed random unit vectors a_k (rows) and b_k (columns), then ``COORDINATES`` fixed random
    unit coordinate vectors, as the columns of a and b; a local generator leaves the global
    RNG alone."""
    return {name: _draw_fingerprint_vectors(p) for name, p in params.items()}


def _draw_fingerprint_vectors(p: Tensor) -> tuple[Tensor, Tensor]:
    rows = p.shape[0] if p.dim() else 1
    cols = p.numel() // rows
    generator = torch.Generator(device=p.device).manual_seed(p.numel())
    dtype = norm_dtype(p.dtype)  # the rules' forms are float32 for a low-precision model
    a = torch.randn(rows, FINGERPRINTS, generator=generator, device=p.device, dtype=dtype)
    b = torch.randn(cols, FINGERPRINTS, generator=generator, device=p.device, dtype=dtype)
    a, b = a / torch.linalg.vector_norm(a, dim=0), b / torch.linalg.vector_norm(b, dim=0)
    entries = [torch.randint(size, (1, COORDINATES), generator=generator, device=p.device)
               for size in (rows, cols)]
    a_e, b_e = (torch.zeros(size, COORDINATES, device=p.device, dtype=dtype).scatter_(
        0, index, 1.0) for size, index in zip((rows, cols), entries, strict=True))
    return torch.cat([a, a_e], dim=1), torch.cat([b, b_e], dim=1)


def fingerprint_of(grad: Tensor, vectors: tuple[Tensor, Tensor]) -> Tensor:
    """a_kᵀ grad b_k for each column k (``forms.project`` of a materialised gradient)."""
    a, b = vectors
    grad = grad.reshape(a.shape[0], b.shape[0]).to(a.dtype)  # a bfloat16 .grad: widened, exact
    return ((a.T @ grad) * b.T).sum(dim=1)


@dataclass
class HooksResult:
    losses: Tensor
    sq_norms: dict[str, Tensor]  # the parameters the rules computed
    grad_sum: dict[str, Tensor]  # every parameter: autograd's, or the rules' own sums
    reasons: dict[str, str]  # parameter -> why the rules could not compute it
    loss_uses: set[str] = field(default_factory=set)  # of those, the loss's own: loop only
    precision: torch.dtype = torch.float32  # the lowest the forward computed in
    loss_gap: float | None = None  # with ``split_loss``: ``losses.split_gap``
    loss_joins: str = ""  # with ``split_loss``: ``losses.loss_joining``
    program: Hashable = None  # what the forward ran (``HooksPass.program``)


def hooks_stats(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss_fn: PerExampleLoss,
    plan: HookPlan,
    params: dict[str, nn.Parameter],
    layout: Layout,
    *,
    excluded: dict[str, str] | None = None,
    offset: int = 0,
    into: dict[str, Tensor] | None = None,
    kinds: OutputKinds | None = None,
    row_checks: RowChecks | None = None,
    finite: DeferredFinite | None = None,
    split_loss: bool = False,
    read_loss: bool = False,
) -> HooksResult:
    """One chunk through the hooks engine. ``layout`` comes from ``rule_check.py``; ``excluded``
    parameters are left to the caller from the start (with their reasons). ``into``: running
    sums (each parameter's shape, ``norm_dtype``, contiguous) that the rules add the batch
    sums they compute themselves to (``own_sums``); those parameters are then left out of
    ``grad_sum``, which holds the others as usual. ``kinds``: see ``check_outputs_read``.
    ``row_checks``: which chunks the row tracker sees (None: this one); ``finite``: where the
    losses' finiteness is checked later (None: now); ``split_loss``: the loss also computed on
    halves of the chunk (``losses.split_gap``), for a user's loss; ``read_loss``: whether
    its operations join the examples, too (``losses.loss_joining``), on its first chunk."""
    n = x.shape[0]
    run = HooksPass(plan, params, layout, n, excluded)
    run.row_checks = row_checks
    run.own_sums = True  # autograd is asked here, for what the rules do not sum themselves
    run.into = into
    try:
        outputs = run.forward(model, x)
        with run.rows.loss_casts() if run.rows is not None else nullcontext():
            losses = loss_fn(outputs, y)
        if finite is None:
            check_losses(losses, n, offset)
        else:
            check_shape(losses, n)
            finite.add(losses, offset)
        total = losses.sum()
        check_outputs_read(total, outputs, n, kinds)
        gap = split_gap(loss_fn, outputs, y, losses) if split_loss else None
        joins = loss_joining(loss_fn, outputs, y, n).why if read_loss else ""
        run.attach([total.grad_fn], output_nodes(outputs))
        wanted = [k for k in params if k not in run.reasons and k not in run.rule_sums]
        edges = run.capture_edges()
        grads: Sequence[Tensor | None] = [None] * len(wanted)
        if (wanted or edges) and total.requires_grad:
            found = gradients(total, [*(params[k] for k in wanted), *edges])
            grads = found[: len(wanted)]
            run.captured(found[len(wanted):])
        run.finish()
    finally:
        run.close()
    grad_sum = {}
    for name, g in zip(wanted, grads, strict=True):
        g = torch.zeros_like(params[name]) if g is None else g.to_dense() if g.is_sparse else g
        if name in run.unused and bool(g.any()):
            run.reasons[name] = ("it gets a gradient that no operation in the autograd graph "
                                 "accounts for (a custom autograd.Function using it unseen?)")
            continue
        grad_sum[name] = run.totals.get(name, g)
    for name in run.rule_sums - run.added:  # in the parameters' order below
        grad_sum[name] = run.totals[name] if name in run.totals else torch.zeros_like(
            params[name])
    grad_sum = {name: grad_sum[name] for name in params if name in grad_sum}
    sq_norms = {k: v for k, v in run.sq_norms.items() if k in grad_sum or k in run.added}
    return HooksResult(losses.detach(), sq_norms, grad_sum, run.reasons, run.loss_uses,
                       run.precision, gap, joins, run.program)


def batch_output(k: int, shape: tuple[int, ...], n: int,
                 way_out: str = "leave it out of the per-example loss") -> str:
    """Why a loss may not read output ``k``: a quantity of the batch, not the examples'."""
    examples = f"{n} example" + ("s" if n != 1 else "")
    size = " at any batch size" if n in shape else ""  # n experts, by coincidence
    return (f"the loss reads output {k} of the model, shape {shape}{size}, which does not "
            f"hold the {examples} "
            "along any dimension: a quantity of the whole batch computed inside the "
            "model (a mixture of experts' load-balancing auxiliary loss, a statistic of the "
            "batch, a Hugging Face model's own loss over padded sequences: a mean over the "
            "batch's tokens, which weighs each example by the others' lengths) couples the "
            "examples, so per-example gradients do not exist (for the last, compute each "
            f"sequence's loss from the logits and take their mean); {way_out}")


def check_outputs_read(total: Tensor, outputs: Any, n: int,
                       kinds: OutputKinds | None = None) -> None:
    """Refuse a per-example loss that reads an output with no dimension of the examples: its
    value is the batch's, so example i's loss would change with the other examples. Read on
    the loss's own graph (from ``total`` down to the model's outputs), by construction,
    whatever the output is called. ``kinds`` (``rule_check.output_kinds``): also the outputs
    whose shape does not follow the number of examples, with a dimension of n by coincidence
    (n experts); not those of the parameters alone (a learned temperature), which are the
    same for every example and couple none."""
    if n == 1:  # a batch of one has nothing to couple, and (n, 1).squeeze() is a scalar
        return
    kinds = kinds or OutputKinds()
    leaves = [t for t in flatten(outputs) if isinstance(t, Tensor)]
    batchless = {(t.grad_fn, t.output_nr): k for k, t in enumerate(leaves)
                 if t.grad_fn is not None and (n not in t.shape or k in kinds.fixed)
                 and k not in kinds.parameters}
    if not batchless or total.grad_fn is None:
        return
    stops = {t.grad_fn for t in leaves if t.grad_fn is not None}
    for node in region([total.grad_fn], stops):
        for edge in node.next_functions:
            k = batchless.get(edge)
            if k is not None:
                raise BatchboundError(batch_output(k, tuple(leaves[k].shape), n))


def output_nodes(outputs: Any) -> list[Node]:
    """The autograd nodes of a model's outputs (any nesting of tuples, lists and dicts)."""
    return [t.grad_fn for t in flatten(outputs) if isinstance(t, Tensor) and t.grad_fn]


def output_sum(outputs: Any) -> Tensor | None:
    """Σ of every floating output that requires grad: a scalar whose graph holds all of the
    model's operations (the probe's stand-in for a loss)."""
    total = None
    for t in flatten(outputs):
        if isinstance(t, Tensor) and t.requires_grad and t.is_floating_point():
            total = t.sum() if total is None else total + t.sum()
    return total
