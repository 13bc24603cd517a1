"""What the integrations share: per-step two-batch numbers kept on the device, the
micro-batch bookkeeping of gradient accumulation, per-parameter gradient hooks, the metric
names, and importing an optional framework with an error that says what to install.

**Units.** Micro-batch j of an optimizer step has b_j examples and mean gradient G_j. What
reaches the parameters is h_j = S·c·w_j·G_j: S the AMP loss scale (1 without a scaler), c one
constant for the whole step (1/k for a framework that divides the loss by the k accumulation
steps, 1/N for a loss normalised by the step's N label tokens) and w_j a relative weight (1
for a loss that is the micro-batch's mean, b_j for its sum). The accumulated gradient is
A = Σ_j h_j, and A/(S·c·Σw) is a weighted mean of the examples' gradients with

    E‖A/(S·c·Σw)‖² = C + (M2 − C)/B_eff,    B_eff = (Σ_j w_j)² / Σ_j (w_j²/b_j),

while the micro-batches' E mean_j ‖G_j‖² = C + (M2 − C)·mean_j(1/b_j) (independent draws;
OnlineDiversity's module docstring has C and M2). That is McCandlish et al.'s two-batch pair:
the small batches are the micro-batches (size: their harmonic mean), the big one is A.
"""

from __future__ import annotations

import importlib
import math
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from batchbound.diversity.online import OnlineDiversity
from batchbound.errors import BatchboundError, warn

PREFIX = "gradient_diversity/"
REDUCTIONS = ("mean", "sum")
Number = float | Tensor
# Records waiting on the device; past this many they are folded (one sync) to bound memory.
_MAX_PENDING = 64


class MissingExtraError(BatchboundError, ImportError):
    """An optional framework is not installed (or does not import)."""


def require(module: str, extra: str) -> ModuleType:
    """Import an optional framework, or say which extra installs it and why it failed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name.split(".")[0]):
            raise MissingExtraError(
                f"{module} is not installed: pip install 'batchbound[{extra}]'"
            ) from exc
        raise MissingExtraError(f"importing {module} failed: {exc}") from exc
    except Exception as exc:  # a dependency that is installed but broken
        hint = ""
        files = [frame.filename for frame in traceback.extract_tb(exc.__traceback__)]
        if any("torchvision" in name for name in files):
            hint = (" (a torchvision wheel built for another torch, e.g. a CUDA torchvision "
                    "beside a CPU torch, breaks the import: uninstall torchvision or install "
                    "the build that matches torch)")
        raise MissingExtraError(f"importing {module} failed: {exc!r}{hint}") from exc


def check_options(every: int, reduction: str, n: int | None) -> None:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise BatchboundError(f"every must be a positive integer, got {every!r}")
    if reduction not in REDUCTIONS:
        raise BatchboundError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise BatchboundError(f"n must be a positive integer or None, got {n!r}")


def dataset_size(loader: Any) -> int | None:
    """len(loader.dataset) when the loader has a sized dataset (the training-set size n)."""
    dataset = getattr(loader, "dataset", None)
    try:
        size = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    return size if size > 0 else None


def diversity_metrics(monitor: OnlineDiversity) -> dict[str, float]:
    """The logged numbers. The noise scale is batch_bound − 1, so its SE is batch_bound's;
    diversity is batch_bound/n, so its SE is that over n. Without n (or before any step)
    the diversity keys are left out, and so is an SE that is not defined yet (< 2 steps)."""
    if monitor.steps == 0:
        return {}
    bound, se = monitor.batch_bound, monitor.batch_bound_se
    values = {"batch_bound": bound, "batch_bound_se": se,
              "noise_scale": monitor.noise_scale, "noise_scale_se": se}
    if monitor.n is not None:
        values["diversity"] = monitor.diversity
        values["diversity_se"] = se / monitor.n
    return {PREFIX + key: float(v) for key, v in values.items() if not math.isnan(v)}


def continue_estimate(monitor: OnlineDiversity, saved: Mapping[str, Any]) -> bool:
    """Continue ``monitor``, this run's, from the estimate a checkpoint saved
    (``OnlineDiversity.state_dict``), keeping this run's n and sampling (they enter only
    when the estimate is read: a data set that changed size is counted as it is now). An
    estimate made with another ``decay`` weighs its steps otherwise: the run's starts afresh
    then, with a warning. Whether it continued."""
    if saved["decay"] != monitor.decay:
        warn(f"batchbound: the checkpoint's gradient-noise estimate was made with decay="
             f"{saved['decay']}, this run's callback has decay={monitor.decay}; its estimate "
             "starts afresh")
        return False
    n, sampling = monitor.n, monitor.sampling
    monitor.load_state_dict(saved)
    monitor.n, monitor.sampling = n, sampling
    return True


def as_tensor(value: Number, device: torch.device) -> Tensor:
    """A 0-dim float64 tensor on ``device``; a Python number becomes a fill, not a copy from
    the host (which would wait for the device)."""
    if isinstance(value, Tensor):
        return value.reshape(()).to(dtype=torch.float64)
    return torch.full((), float(value), dtype=torch.float64, device=device)


class StepRecords:
    """One row per optimizer step, [‖G_small‖², small size, ‖G_big‖², big size] as a
    device tensor, folded into ``monitor`` with one host sync when asked (or every
    ``_MAX_PENDING`` steps). Steps whose numbers are not finite (an AMP step the scaler
    skipped for inf/NaN gradients) are counted in ``skipped``, never folded."""

    def __init__(self, monitor: OnlineDiversity) -> None:
        self.monitor = monitor
        self.skipped = 0
        self._pending: list[Tensor] = []

    def add(self, row: Tensor) -> None:
        self._pending.append(row.detach().reshape(4).to(torch.float64))
        if len(self._pending) >= _MAX_PENDING:
            self.fold()

    def fold(self) -> OnlineDiversity:
        if self._pending:
            devices = {r.device for r in self._pending}
            pending = self._pending if len(devices) == 1 else [r.cpu() for r in self._pending]
            rows = torch.stack(pending).tolist()  # the one host sync
            self._pending = []
            for small, small_size, big, big_size in rows:
                finite = all(math.isfinite(v) for v in (small, small_size, big, big_size))
                if finite and 0 < small_size < big_size:
                    self.monitor.update_two_batch(small, small_size, big, big_size)
                else:
                    self.skipped += 1
        return self.monitor


@dataclass
class Window:
    """The micro-batches of one optimizer step on this rank: sizes b_j and relative loss
    weights w_j (floats, or 0-dim tensors when they are counted on the device)."""

    sizes: list[Number] = field(default_factory=list)
    weights: list[Number] = field(default_factory=list)

    def add(self, size: Number, weight: Number) -> None:
        self.sizes.append(size)
        self.weights.append(weight)

    @property
    def count(self) -> int:
        return len(self.sizes)

    def total_weight(self) -> Number:
        return sum(self.weights)

    def harmonic_size(self) -> Number:
        return self.count / sum(1.0 / b for b in self.sizes)

    def effective_size(self) -> Number:
        """B_eff of the accumulated gradient (module docstring)."""
        return self.total_weight() ** 2 / sum(
            w * w / b for w, b in zip(self.weights, self.sizes, strict=True))


# Micro-batch gradients held (fused way) before their norms are taken in one operation.
STASH_BYTES = 256 * 2**20


class MicroBatchNorms:
    """Per-parameter tensor hooks that see each micro-batch's gradient h_j before it is
    added to ``.grad``, for the step's

        ‖h_j‖² per micro-batch j,   and   ‖A‖² = Σ_j ‖h_j‖² + 2 Σ_j ⟨A_{j−1}, h_j⟩,

    the accumulated gradient's squared norm as backward produced it: before DDP averages
    it, a GradScaler unscales it or a clipper shrinks it, whenever the framework lets a
    callback look. The numbers stay on the device; ``.grad`` is never written.

    Two ways to the same numbers (tests/unit/test_micro_batch_norms_fused.py checks they agree):

    - ``fused=True`` (one process): the hooks only keep references; at the end of each
      backward pass (an autograd final callback, before any framework code runs) one
      multi-tensor norm over the held gradients and the ``.grad`` fields gives ‖h_j‖² and
      ‖A_j‖², and the step's ‖A‖² is the last micro-batch's ‖A_j‖² (by the identity above,
      with ``.grad`` cleared before the step, as the trainers do). A parameter with no
      ``.grad`` yet needs no reference: its h_j is what ``.grad`` then holds. Held gradients
      past ``STASH_BYTES`` are reduced early. A backward pass that runs other backward passes
      inside it (reentrant checkpointing), or two in one micro-batch, is seen by the graph
      task ids: that step is dropped and the estimate goes on the exact per-parameter way.
    - ``fused=False`` (any process group): one norm, and one dot product with what ``.grad``
      already holds, per parameter in its hook; under DDP with bucket views ``.grad`` may be
      rewritten by the all-reduce while the backward runs, so the integrations use it there.

    A parameter whose ``.grad`` holds something when the step's backward first reaches the
    model (the trainer's ``zero_grad`` did not clear it: it is outside the optimizer, or
    zeroed with ``set_to_none=False``) is *carried*: its A is summed here from its h_j, as
    ``.grad`` would hold it from None, never read off ``.grad`` (a backbone left out of the
    optimizer grows its ``.grad`` step after step: read as A, the bound was 89 % off). That
    costs a copy of those gradients during the step, said once in a warning.

    ``start(size, weight)`` opens a micro-batch and ``stop()`` closes it; ``record(c, S)``
    turns the step's micro-batches into a StepRecords row (None with fewer than two)."""

    def __init__(self, params: Iterable[nn.Parameter], *, fused: bool = True,
                 names: Mapping[int, str] | None = None) -> None:
        self.window = Window()
        self.fused = fused
        self._all = list(params)
        self._names = dict(names or {})  # parameter id -> name, for the warning
        self.params = [p for p in self._all if p.requires_grad]
        self._norms: list[Tensor] = []  # this micro-batch: ‖h‖ per parameter
        self._dots: list[Tensor] = []  # this step: ⟨A_{j−1}, h_j⟩ per parameter and j
        self._micro: list[Tensor] = []  # this step: Σ_params ‖h_j‖² per micro-batch
        self._open = False
        # fused: this micro-batch's held gradients, parameters with no .grad before it, the
        # early-reduced part of Σ‖h_j‖², the graph tasks its hooks ran in, and its ‖A_j‖²
        self._held: list[Tensor] = []
        self._held_bytes = 0
        self._fresh: list[nn.Parameter] = []
        self._early: list[Tensor] = []
        self._tasks: set[int] = set()
        self._queued = False
        self._accumulated: Tensor | None = None
        self._broken = False  # this step saw nested or repeated backward passes
        self._mixed = False  # which parameters train changed within this step
        # this step's carried parameters (ids; None until its backward first reaches one)
        # and their A summed so far
        self._carried: set[int] | None = None
        self._own: dict[int, Tensor] = {}
        self._warned = False
        self._handles: list[RemovableHandle] = [
            p.register_hook(self._hook_for(p)) for p in self.params
        ]
        if not self._handles:
            raise BatchboundError("the model has no trainable parameters to watch")

    def _follow_trainable(self) -> None:
        """Hook the parameters that train now. Fine-tuning loops unfreeze (or freeze) them
        between steps (Lightning's BackboneFinetuning, gradual unfreezing); hooks fixed at the
        start would read the first set's norms as the model's. A change within a step drops
        that step: its micro-batches' gradients cover different parameters."""
        trainable = [p for p in self._all if p.requires_grad]
        if len(trainable) == len(self.params) and all(
                a is b for a, b in zip(trainable, self.params, strict=True)):
            return
        if self.window.count:
            self._mixed = True
        for handle in self._handles:
            handle.remove()
        self.params = trainable
        self._handles = [p.register_hook(self._hook_for(p)) for p in trainable]

    def _hook_for(self, param: nn.Parameter) -> Callable[[Tensor], None]:
        acc = torch.promote_types(param.dtype, torch.float32)

        def hook(grad: Tensor) -> None:
            if grad.is_sparse:
                raise BatchboundError("sparse gradients (nn.Embedding(sparse=True)) are not "
                                      "supported by the diversity callbacks")
            if not self._open:
                return  # a backward outside the training step the callback follows
            if self._carried is None:  # no .grad has changed in this step yet
                self._find_carried()
            if id(param) in self._carried:  # type: ignore[operator]
                self._carry(param, grad, acc)
                return
            if self.fused:
                self._hold(param, grad)
                return
            with torch.no_grad():
                self._norms.append(torch.linalg.vector_norm(grad, dtype=acc))
                before = param.grad
                if before is not None:
                    self._dots.append(torch.dot(before.reshape(-1).to(acc),
                                                grad.reshape(-1).to(acc)))

        return hook

    def _find_carried(self) -> None:
        carried = [(self._names.get(id(p), f"parameter {k}"), p)
                   for k, p in enumerate(self.params) if p.grad is not None]
        self._carried = {id(p) for _, p in carried}
        if carried and not self._warned:
            self._warned = True
            size = sum(p.numel() * p.element_size() for _, p in carried) / 2**20
            names = ", ".join(name for name, _ in carried[:3])
            warn(f"batchbound: {len(carried)} trainable parameters ({names}"
                 f"{' …' if len(carried) > 3 else ''}) hold a gradient from before the step "
                 "(the optimizer's zero_grad does not clear them: not in the optimizer, or "
                 "set_to_none=False): the diversity callback sums their step's gradient "
                 f"itself, holding a copy ({size:.1f} MiB) during each step; freeze them "
                 "(requires_grad=False) or clear their .grad to save it")

    def _carry(self, param: nn.Parameter, grad: Tensor, acc: torch.dtype) -> None:
        """A carried parameter's h_j: its norm, its dot with A_{j−1} (the exact way), and
        A_j = A_{j−1} + h_j kept here (fused: normed with the others at the backward's
        end)."""
        held = self._own.get(id(param))
        with torch.no_grad():
            if self.fused:
                self._hold_fused(grad)
            else:
                self._norms.append(torch.linalg.vector_norm(grad, dtype=acc))
                if held is not None:
                    self._dots.append(torch.dot(held.reshape(-1).to(acc),
                                                grad.reshape(-1).to(acc)))
            self._own[id(param)] = grad if held is None else held + grad

    # ------------------------------------------------------------------ fused

    def _hold(self, param: nn.Parameter, grad: Tensor) -> None:
        if param.grad is None:
            if self._task_seen():
                self._fresh.append(param)
            return
        self._hold_fused(grad)

    def _task_seen(self) -> bool:
        """This hook's backward pass noted (its end queued); False where it is a second one
        in the micro-batch (the step is then dropped)."""
        self._tasks.add(torch._C._current_graph_task_id())
        if len(self._tasks) > 1:  # nested or repeated backward passes: not one A_j to read
            self._broken = True
            return False
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        return True

    def _hold_fused(self, grad: Tensor) -> None:
        """h_j held, to be normed at the backward's end."""
        if not self._task_seen():
            return
        self._held.append(grad)
        self._held_bytes += grad.numel() * grad.element_size()
        if self._held_bytes > STASH_BYTES:
            self._early.append(_sq_sum(self._held))
            self._held, self._held_bytes = [], 0

    def _after_backward(self) -> None:
        """At the end of the backward pass: ‖h_j‖² and ‖A_j‖² in one multi-tensor norm."""
        if self._broken:
            return
        fresh = [p.grad for p in self._fresh if p.grad is not None]
        seen = {id(p) for p in self._fresh} | (self._carried or set())
        others = [p.grad for p in self.params if p.grad is not None and id(p) not in seen]
        others += self._own.values()  # the carried parameters' A_j, summed here
        tensors = [*fresh, *others, *self._held]
        if not tensors:
            return
        sq = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)).square()
        f, o = len(fresh), len(fresh) + len(others)
        micro = sq[:f].sum() + sq[o:].sum()
        if self._early:
            micro = micro + torch.stack(self._early).sum()
        self._norms = [micro]  # Σ_params ‖h_j‖², as the exact way's per-parameter norms
        self._accumulated = sq[:o].sum()
        self._held, self._held_bytes, self._fresh, self._early = [], 0, [], []

    # ------------------------------------------------------------------ a step

    def start(self, size: Number, weight: Number) -> None:
        self.stop()
        self._follow_trainable()
        self.window.add(size, weight)
        self._open = True
        self._tasks, self._queued = set(), False

    def stop(self) -> None:
        """Close the open micro-batch; one that saw no gradient is dropped from the step (its
        examples contributed nothing to A)."""
        if not self._open:
            return
        self._open = False
        if self._norms:
            self._micro.append(self._norms[0] if self.fused else _sum64(self._norms, square=True))
            self._norms = []
        else:
            self.window.sizes.pop()
            self.window.weights.pop()
        self._held, self._held_bytes, self._fresh, self._early = [], 0, [], []

    def record(self, constant: Number, scale: Number) -> Tensor | None:
        """The step's row: the micro-batches' mean ‖G_j‖² against A's, in the units of the
        examples' mean gradient (``constant`` is c, ``scale`` S; module docstring)."""
        self.stop()
        window, micro, dots, accumulated = self.window, self._micro, self._dots, self._accumulated
        self.window, self._micro, self._dots, self._accumulated = Window(), [], [], None
        self._carried, self._own = None, {}
        if self._broken:  # this step's numbers cannot be trusted: drop it, go the exact way
            self._broken, self.fused = False, False
            return None
        if self._mixed:
            self._mixed = False
            return None
        if window.count < 2:
            return None
        total = accumulated if self.fused else None
        if total is None:
            total = torch.stack(micro).sum() + 2 * (_sum64(dots) if dots else 0)
        return step_row(micro, total, window, constant, scale)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def step_row(micro: list[Tensor], total: Tensor, window: Window, constant: Number,
             scale: Number) -> Tensor:
    """[mean_j ‖G_j‖², harmonic size, ‖A/(S·c·Σw)‖², B_eff] from the micro-batches' Σ‖h_j‖²
    and ‖A‖² (module docstring), in few device operations: the sizes and weights are
    Python numbers (examples counted on the host) or 0-dim device tensors (tokens counted
    on the device), never copied from the host. tests/unit/test_micro_batch_norms_fused.py checks it
    against the Window's own formulas."""
    device = micro[0].device
    k = window.count
    m = torch.stack(micro)
    s_c = scale * constant if not isinstance(scale, Tensor) and not isinstance(
        constant, Tensor) else as_tensor(scale, device) * as_tensor(constant, device)
    numbers = all(not isinstance(v, Tensor) for v in (*window.sizes, *window.weights))
    if numbers:
        weights = [float(w) for w in window.weights]
        if len(set(weights)) == 1:  # every micro-batch weighted alike (a mean loss)
            small = m.sum() / (k * (weights[0] * s_c) ** 2)
        else:
            # 1/w_j² as device fills: a copy from the host would wait for the device
            inverse = torch.stack([as_tensor(1.0 / (w * w), device) for w in weights])
            small = (m * inverse).sum() / (k * s_c**2)
        big = total / (float(window.total_weight()) * s_c) ** 2
        sizes = (float(window.harmonic_size()), float(window.effective_size()))
        return torch.stack([small, as_tensor(sizes[0], device), big,
                            as_tensor(sizes[1], device)])
    w = torch.stack([as_tensor(v, device) for v in window.weights])
    b = torch.stack([as_tensor(v, device) for v in window.sizes])
    total_w = w.sum()
    small = (m / w.square()).sum() / (k * s_c**2)
    big = total / (total_w * s_c).square()
    harmonic = k / b.reciprocal().sum()
    effective = total_w.square() / (w.square() / b).sum()
    return torch.stack([small, harmonic, big, effective])


def _sq_sum(tensors: list[Tensor]) -> Tensor:
    """Σ ‖t‖² over the tensors, in float64, by one multi-tensor norm."""
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)).square().sum()


def _sum64(values: list[Tensor], *, square: bool = False) -> Tensor:
    """Σ v (or Σ v²) in float64 over 0-dim tensors, one stack when they share a dtype."""
    if len({v.dtype for v in values}) == 1:
        stacked = torch.stack(values).double()
    else:
        stacked = torch.stack([v.double() for v in values])
    return (stacked.square() if square else stacked).sum()
