"""The online batch-size bound in a user's own DDP loop, as a communication hook.

    from batchbound.integrations.ddp import gns_hook, gns_hook_state

    ddp = DDP(model)
    state = gns_hook_state(len(train_set), local_batch_size=32)   # n, examples per rank
    ddp.register_comm_hook(state, gns_hook)
    ...                                      # the loop is unchanged
    print(state.monitor.batch_bound)         # n·Δ, also .noise_scale, .diversity, ..._se

**What it measures.** McCandlish et al.'s two-batch estimator (see
batchbound.diversity.online): the small batches are the ranks' own gradients, the big one
their average, which DDP computes anyway. Each bucket is averaged as torch's
``allreduce_hook`` averages it (divided by P and all-reduced in place); the hook takes this
rank's squared norm before and the average's after. With the last bucket it all-reduces four
numbers: the mean of the ranks' own norms and three describing their batches. The cost is
one norm per bucket on each side and one all-reduce of four numbers per step.

**When the numbers are folded.** The hook keeps each step's numbers on the device; reading
``state.monitor`` folds them into the ``OnlineDiversity`` (one host sync). A step counts once
its backward is over; steps with non-finite gradients (the ones a GradScaler skips) are never
folded and are counted in ``state.skipped``.

**Gradients kept from before a step.** DDP reduces what ``.grad`` holds, so a parameter whose
``.grad`` the loop's ``zero_grad`` leaves as it was (a trainable parameter outside the
optimizer) puts the earlier steps' gradient into the step's: the estimate would be wrong (an
outside review measured 89 % on the bound through the Lightning callback). The hook reads, as
each step's first backward reaches a parameter, whether its ``.grad`` holds a non-zero value
(on the device, no sync); such a step is not folded, on every rank, and is counted in
``state.skipped`` and ``state.carried``, with a warning once. (Zeros kept by
``zero_grad(set_to_none=False)`` change nothing and count as cleared.) The hook sees the
parameters from its first call on, so the first step is not checked so.

**Uneven inputs under ``Join``.** A rank that has run out of data shadows the others'
all-reduces: DDP runs the hook there on zero buckets, outside any backward pass. Read as a
rank of ``local_batch_size`` examples with a zero gradient, those steps put the bound 50 %
off (an outside review); they are skipped on every rank instead (NaN through the same
all-reduce), counted in ``state.skipped``, and on the joined rank in ``state.shadowed``.

**Units.** ``local_batch_size`` is the number of examples behind the gradient DDP reduces on
this rank, and ``reduction`` says how that gradient combines them: ``"mean"`` when the loss
that was backpropagated is their mean (divided by the accumulation steps too, as with
``loss / accum``), ``"sum"`` when it is their sum. Ranks may have different local batch sizes
(set ``state.local_batch_size`` per step if it changes): the sizes ride along in the buffer.
``loss_scale`` undoes AMP loss scaling: a number, or the ``torch.amp.GradScaler`` itself,
whose current scale the hook reads on the device at the step's first bucket.

**Gradient accumulation with no_sync.** DDP calls the hook only on the step that syncs, with
each rank's gradient accumulated over its micro-batches: the small batch is then the rank's
whole local batch (micro-batch × accumulation steps), which is what ``local_batch_size`` must
count. The estimate is unbiased but uses no micro-batch information (the Lightning
callback under DDP does the same, counting the micro-batches' sizes for you).

Needs P ≥ 2 ranks, float32 or float64 gradient buckets, and a DDP without another comm hook.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook inspects the hook's
# annotations and wants the real dist.GradBucket and Future types, not strings.
import math

import torch
import torch.distributed as dist
from torch import Tensor

from batchbound.diversity.loss_scale import check_loss_scale, loss_scale_of
from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError, warn
from batchbound.integrations.common import (
    REDUCTIONS,
    Number,
    StepRecords,
    as_tensor,
)

# Reduced once per step with the last bucket, each divided by P before the SUM all-reduce
# (so means arrive): ‖L_r‖²/(S·U_r)², U_r, U_r²/B_r, 1/B_r. L_r is rank r's gradient, S the
# loss scale, U_r the factor from its examples' mean gradient to L_r/S and B_r that mean's
# effective size.


class GNSHookState:
    """What ``gns_hook`` needs on this rank and what it has measured. Make it with
    ``gns_hook_state``; read ``monitor``."""

    def __init__(
        self,
        monitor: OnlineDiversity,
        local_batch_size: int,
        reduction: str,
        loss_scale: object,
        process_group: dist.ProcessGroup | None,
        world_size: int,
    ) -> None:
        self.records = StepRecords(monitor)
        self.local_batch_size = local_batch_size
        self.reduction = reduction
        self.loss_scale = loss_scale
        self.process_group = process_group
        self.world_size = world_size
        self._window: tuple[Number, Number] | None = None
        self._bigs: list[Tensor] = []  # this step's buckets: ‖R‖² of the averaged gradient
        self._local: Tensor | None = None  # this step's ‖L_r‖², summed over its buckets
        self._small: Tensor | None = None  # the step's four means, once reduced
        self._scale: Number = 1.0
        self._extras: tuple[tuple, Tensor] | None = None
        # Gradients kept from before a step (module docstring): the parameters hooked, whether
        # the next backward is a step's first, this step's Σ‖.grad‖² as its first backward
        # reached them (None: every .grad was None), and past steps' sums, read with the monitor
        self._hooked: set[int] = set()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._first_backward = True
        self._queued = False  # this backward's end is queued (``_backward_ended``)
        self._ended = False  # the step ended in this backward
        self._kept: Tensor | None = None
        self._kept_steps: list[Tensor] = []
        self.carried = 0  # steps not folded for gradients kept from before them
        self.shadowed = 0  # steps this rank ran the hook after it joined (``joined``)

    @property
    def monitor(self) -> OnlineDiversity:
        """The estimator, with every finished step folded in."""
        self._collect()
        self._count_carried()
        return self.records.fold()

    @property
    def skipped(self) -> int:
        """Steps not folded because their gradients were not finite (AMP-skipped steps), or
        held gradients kept from before the step (``carried``)."""
        self._collect()
        self._count_carried()
        self.records.fold()
        return self.records.skipped

    # ------------------------------------------------------ gradients kept from before

    def follow(self, parameters: list[Tensor]) -> None:
        """Hook the bucket's parameters not hooked yet."""
        for p in parameters:
            if id(p) not in self._hooked and p.requires_grad:
                self._hooked.add(id(p))
                self._handles.append(p.register_hook(self._kept_hook(p)))

    def _kept_hook(self, param: Tensor):  # type: ignore[no-untyped-def]
        def hook(grad: Tensor) -> None:
            if not self._queued:
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
            if not self._first_backward:
                return
            kept = param.grad
            if kept is not None:  # before this backward adds to it
                with torch.no_grad():
                    sq = torch.linalg.vector_norm(kept, dtype=torch.float64).square()
                    self._kept = sq if self._kept is None else self._kept + sq

        return hook

    def _backward_ended(self) -> None:
        """The next backward is a step's first where this one ended the step."""
        self._first_backward, self._ended, self._queued = self._ended, False, False

    def refuse_kept(self, own: Tensor) -> Tensor:
        """``own`` as NaN where this step's parameters held a non-zero gradient from before it
        (all-reduced, the step is then skipped on every rank); on the device."""
        kept, self._kept = self._kept, None
        if self._queued:  # after the step's last backward, ``_backward_ended`` opens the next
            self._ended = True
        else:  # no hooked parameter in this backward (the first step: hooked from now on)
            self._first_backward = True
        if kept is None:
            return own
        self._kept_steps.append(kept)
        return torch.where(kept > 0, torch.full_like(own, math.nan), own)

    def joined(self, own: Tensor) -> Tensor:
        """``own`` as NaN on a rank that has joined (uneven inputs under ``Join``): DDP runs
        the hook on zero buckets there, in step with the others' backward, and a zero
        gradient of ``local_batch_size`` examples would be read as data; the step is
        skipped on every rank instead."""
        if not self.shadowed:
            warn("batchbound: gns_hook: this rank has joined (uneven inputs under Join): the "
                 "steps it shadows with no data of its own are skipped on every rank")
        self.shadowed += 1
        return torch.full_like(own, math.nan)

    def _count_carried(self) -> None:
        if not self._kept_steps:
            return
        found = sum(v > 0 for v in torch.stack(self._kept_steps).tolist())
        self._kept_steps = []
        if found and not self.carried:
            warn("batchbound: gns_hook: trainable parameters held a gradient from before the "
                 "step (zero_grad does not clear a parameter outside the optimizer), which "
                 "DDP reduced with the step's own: those steps are skipped; freeze such "
                 "parameters (requires_grad=False) or clear their .grad")
        self.carried += found

    def set_window(self, total_weight: Number, effective_size: Number) -> None:
        """For framework callbacks that follow micro-batches: this rank's gradient is
        S·total_weight times a weighted mean of its examples' gradients whose effective size
        is effective_size (batchbound.integrations.common). Overrides local_batch_size and
        reduction until ``clear_window``."""
        self._window = (total_weight, effective_size)

    def clear_window(self) -> None:
        self._window = None

    def window(self) -> tuple[Number, Number]:
        if self._window is not None:
            return self._window
        b = self.local_batch_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise BatchboundError(f"local_batch_size must be a positive integer, got {b!r}")
        return (1.0, float(b)) if self.reduction == "mean" else (float(b), float(b))

    def extras(self, weight: Number, size: Number, device: torch.device) -> Tensor:
        """U_r/P, U_r²/B_r/P, 1/B_r/P for this rank's window, float64 on ``device`` (kept
        while the window stays: no host-to-device copy per step)."""
        key = (float(weight), float(size), device)
        if self._extras is None or self._extras[0] != key:
            world = self.world_size
            values = [float(weight) / world, float(weight * weight / size) / world,
                      1.0 / float(size) / world]
            self._extras = (key, torch.tensor(values, dtype=torch.float64, device=device))
        return self._extras[1]

    def end_step(self) -> None:
        """Turn the finished step's bucket numbers into one record (no host sync). Called by
        the next step's first bucket and by ``monitor``; callbacks call it after backward."""
        self._collect()

    def _collect(self) -> None:
        if self._small is None:
            return
        small, big = self._small, torch.stack(self._bigs).sum()
        self._small, self._bigs = None, []
        weight, weight2_per_size, inv_size = small[1], small[2], small[3]
        scale2 = as_tensor(self._scale, small.device) ** 2
        self.records.add(torch.stack([
            small[0],                                        # mean_r ‖G_r‖²
            1.0 / inv_size,                                  # harmonic mean of B_r
            big / (scale2 * weight * weight),                # ‖R/(S·mean U)‖²
            self.world_size * weight * weight / weight2_per_size,  # its effective size
        ]))


def gns_hook_state(
    monitor_or_n: OnlineDiversity | int | None,
    local_batch_size: int,
    reduction: str = "mean",
    *,
    loss_scale: object = None,
    process_group: dist.ProcessGroup | None = None,
    decay: float | None = 0.95,
    sampling: str = "without_replacement",
) -> GNSHookState:
    """The hook's state on this rank (call after ``init_process_group``).

    ``monitor_or_n``: an OnlineDiversity to feed, or the training-set size n (None if
    unknown) for a new one with ``decay`` and ``sampling``. ``local_batch_size``: examples
    behind this rank's gradient per step; ``reduction``: ``"mean"`` or ``"sum"`` (module
    docstring). ``loss_scale``: None, a number, or a ``torch.amp.GradScaler``."""
    if not dist.is_available() or not dist.is_initialized():
        raise BatchboundError("gns_hook_state needs an initialised torch.distributed process "
                              "group (call init_process_group first)")
    if reduction not in REDUCTIONS:
        raise BatchboundError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    world_size = dist.get_world_size(process_group)
    if world_size < 2:
        raise BatchboundError("the two-batch estimate compares each rank's gradient with their "
                              "average: it needs at least 2 ranks")
    if isinstance(monitor_or_n, OnlineDiversity):
        monitor = monitor_or_n
    else:
        monitor = OnlineDiversity(monitor_or_n, decay=decay, sampling=sampling)
    state = GNSHookState(monitor, local_batch_size, reduction, loss_scale, process_group,
                         world_size)
    state.window()  # validate now, not inside the first backward
    check_loss_scale(loss_scale)
    return state


def gns_hook(state: GNSHookState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP communication hook: DDP's own averaging (÷P, all-reduce SUM, in place, as torch's
    ``allreduce_hook``), this rank's squared norm taken before and the average's after; with
    the last bucket, one all-reduce of four numbers describing the step on every rank."""
    buffer = bucket.buffer()
    if buffer.dtype not in (torch.float32, torch.float64):
        raise BatchboundError(f"gns_hook needs float32 or float64 gradient buckets, got "
                              f"{buffer.dtype}: train with autocast (float32 parameters) instead")
    state.follow(bucket.parameters())
    if bucket.index() == 0:  # DDP reduces buckets in index order: a new step begins
        state.end_step()
        state._scale = loss_scale_of(state.loss_scale, buffer.device)
        state._local = torch.zeros((), dtype=torch.float64, device=buffer.device)
    assert state._local is not None
    state._local += torch.linalg.vector_norm(buffer).double().square()  # (float64 norms: 5× slower)
    buffer.div_(state.world_size)
    group = state.process_group

    def finish(fut: torch.futures.Future[list[Tensor]]) -> Tensor:
        reduced = fut.value()[0]
        state._bigs.append(torch.linalg.vector_norm(reduced).double().square())
        return reduced

    averaged = dist.all_reduce(buffer, group=group, async_op=True).get_future().then(finish)
    if not bucket.is_last():
        return averaged
    weight, size = state.window()
    scaled = state._scale * weight
    own = state.refuse_kept((state._local / (scaled * scaled) / state.world_size).reshape(1))
    if torch._C._current_graph_task_id() == -1:  # called outside a backward: a joined rank
        own = state.joined(own)
    small = torch.cat([own, state.extras(weight, size, buffer.device)])
    state._small = small  # reduced in place; read once DDP has waited for this future
    described = dist.all_reduce(small, group=group, async_op=True).get_future()
    both = torch.futures.collect_all([averaged, described])
    return both.then(lambda _: averaged.value())
