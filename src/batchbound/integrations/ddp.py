"""The online batch-size bound in a user's own DDP loop, as a communication hook.

    from batchbound.integrations.ddp import gns_hook, gns_hook_state

    ddp = DDP(model)
    state = gns_hook_state(len(train_set), local_batch_size=32)   # n, examples per rank
    ddp.register_comm_hook(state, gns_hook)
    ...                                      # the loop is unchanged
    print(state.monitor.batch_bound)         # n·Δ, also .noise_scale, .diversity, ..._se

**What it measures.** McCandlish et al.'s two-batch estimator (see
batchbound.diversity.online): the small batches are the ranks' own gradients, the big one
their average, which DDP computes anyway. For each bucket the hook takes this rank's squared
norm before anything is divided or reduced, appends it (and three numbers describing this
rank's batch) to the buffer DDP all-reduces anyway, and so receives the mean of the ranks'
local norms together with the averaged gradient, whose norm it takes afterwards: **no extra
collective**. The cost is one norm per bucket on each side and a copy of each bucket into
the send buffer (the division DDP does anyway); the reduced bucket goes back to DDP as is.

**When the numbers are folded.** The hook keeps each step's numbers on the device; reading
``state.monitor`` folds them into the ``OnlineDiversity`` (one host sync). A step counts once
its backward is over; steps with non-finite gradients (the ones a GradScaler skips) are never
folded and are counted in ``state.skipped``.

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
import torch
import torch.distributed as dist
from torch import Tensor

from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError
from batchbound.integrations.common import (
    REDUCTIONS,
    Number,
    StepRecords,
    as_tensor,
    check_loss_scale,
    loss_scale_of,
)

# Appended to each bucket, each divided by P before the SUM all-reduce (so means arrive):
# ‖L_r‖²/(S·U_r)², U_r, U_r²/B_r, 1/B_r. L_r is rank r's gradient, S the loss scale, U_r the
# factor from its examples' mean gradient to L_r/S and B_r that mean's effective size.
_EXTRAS = 4


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
        self._rows: list[Tensor] = []  # this step's buckets: [‖R‖², extras...]
        self._scale: Number = 1.0
        self._flats: dict[int, Tensor] = {}  # per bucket index: its send buffer
        self._extras: tuple[tuple, Tensor] | None = None

    @property
    def monitor(self) -> OnlineDiversity:
        """The estimator, with every finished step folded in."""
        self._collect()
        return self.records.fold()

    @property
    def skipped(self) -> int:
        """Steps not folded because their gradients were not finite (AMP-skipped steps)."""
        self._collect()
        self.records.fold()
        return self.records.skipped

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

    def _flat_for(self, index: int, buffer: Tensor) -> Tensor:
        """The bucket's send buffer (its gradient and the extras), kept from step to step:
        a fresh one per step costs an allocation (and page faults) the size of the bucket.
        DDP waits for every bucket's all-reduce before the step ends, so it is free again."""
        flat = self._flats.get(index)
        if (flat is None or flat.numel() != buffer.numel() + _EXTRAS
                or flat.dtype != buffer.dtype or flat.device != buffer.device):
            flat = torch.empty(buffer.numel() + _EXTRAS, dtype=buffer.dtype, device=buffer.device)
            self._flats[index] = flat
        return flat

    def extras(self, weight: Number, size: Number, buffer: Tensor) -> Tensor:
        """U_r/P, U_r²/B_r/P, 1/B_r/P for this rank's window, on the bucket's device and
        dtype (kept while the window stays: no host-to-device copy per bucket)."""
        key = (float(weight), float(size), buffer.dtype, buffer.device)
        if self._extras is None or self._extras[0] != key:
            world = self.world_size
            values = [float(weight) / world, float(weight * weight / size) / world,
                      1.0 / float(size) / world]
            self._extras = (key, torch.tensor(values, dtype=buffer.dtype, device=buffer.device))
        return self._extras[1]

    def end_step(self) -> None:
        """Turn the finished step's bucket numbers into one record (no host sync). Called by
        the next step's first bucket and by ``monitor``; callbacks call it after backward."""
        self._collect()

    def _collect(self) -> None:
        if not self._rows:
            return
        rows = torch.stack(self._rows)
        self._rows = []
        big, small = rows[:, 0].sum(), rows[:, 1].sum()
        weight, weight2_per_size, inv_size = rows[0, 2], rows[0, 3], rows[0, 4]
        scale2 = as_tensor(self._scale, rows.device) ** 2
        self.records.add(torch.stack([
            small,                                           # mean_r ‖G_r‖²
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
    """DDP communication hook: DDP's own averaging (÷P, all-reduce SUM) of the bucket with
    the local squared norm and this rank's batch description appended."""
    buffer = bucket.buffer()
    if buffer.dtype not in (torch.float32, torch.float64):
        raise BatchboundError(f"gns_hook needs float32 or float64 gradient buckets, got "
                              f"{buffer.dtype}: train with autocast (float32 parameters) instead")
    if bucket.index() == 0:  # DDP reduces buckets in index order: a new step begins
        state.end_step()
        state._scale = loss_scale_of(state.loss_scale, buffer.device)
    weight, size = state.window()
    world, n = state.world_size, buffer.numel()
    flat = state._flat_for(bucket.index(), buffer)
    torch.div(buffer, world, out=flat[:n])
    # this rank's own squared norm, before the division: ‖buffer/P‖²·P²/(S·U)² / P
    torch.linalg.vector_norm(flat[:n], out=flat[n])
    scaled = state._scale * weight
    flat[n : n + 1].square_().mul_(world / (scaled * scaled))
    flat[n + 1 :].copy_(state.extras(weight, size, buffer))

    def finish(fut: torch.futures.Future[list[Tensor]]) -> Tensor:
        reduced = fut.value()[0]
        big = torch.linalg.vector_norm(reduced[:n]).square().reshape(1)
        state._rows.append(torch.cat([big, reduced[n:]]).to(torch.float64))
        return reduced[:n]  # DDP copies it into the gradients (as it copies its own buffer)

    work = dist.all_reduce(flat, group=state.process_group, async_op=True)
    return work.get_future().then(finish)
