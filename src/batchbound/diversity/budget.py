"""How many examples a chunk of ``measure`` may hold for its work to fit a memory budget.

A chunk's peak is set by what its forward saves for the backward pass (activations, which
grow with the examples), the output gradients the backward then holds beside them, and the
layer rules' per-example forms (sums over positions, Gram matrices), plus what does not grow
with the chunk: the parameters, autograd's gradient sum and measure's float64 totals.

The per-example part is measured, not guessed: the bytes of the tensors the forward saves
for backward (``torch.autograd.graph.saved_tensors_hooks``, each storage once, the
parameters left out), at two chunk sizes k and 2k on the first examples, so that anything
the model saves whatever the batch cancels. The chunk is then

    chunk = (budget − fixed) / (per_example · PER_EXAMPLE_FACTOR),

with ``fixed`` = the parameters' bytes × ``FIXED_FACTOR`` (the weights, their gradient sum,
measure's float64 totals and block) and ``PER_EXAMPLE_FACTOR`` covering output gradients and
the rules' forms beside the saved activations. The factors are conservative estimates,
checked on a GPU by benchmarks/gpu.py, which prints the peak against the budget.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from batchbound.diversity.calls import Inputs, call_model
from batchbound.diversity.losses import PerExampleLoss
from batchbound.errors import BatchboundError

PER_EXAMPLE_FACTOR = 3.0
FIXED_FACTOR = 5.0  # weights + autograd's gradient sum + float64 totals (2×) + the block
MEASURED_EXAMPLES = 2  # the per-example bytes: the forward on this many examples, then twice


def saved_bytes(model: nn.Module, x: Tensor | Inputs, y: Tensor | Inputs,
                loss_fn: PerExampleLoss) -> int:
    """Bytes of the distinct storages the forward and the loss save for backward, the
    model's parameters and buffers excluded (no backward runs)."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Any:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(call_model(model, x), y).sum()  # Inputs: model(*args, **kwargs), a dict's
    return sum(seen.values())


def chunk_for_budget(model: nn.Module, x: Tensor | Inputs, y: Tensor | Inputs,
                     loss_fn: PerExampleLoss, budget: int, most: int) -> int:
    """The largest chunk (at most ``most``) whose estimated peak fits ``budget`` bytes, from
    the first examples of (x, y) (module docstring). Refuses a budget the model's fixed part
    alone exceeds, or that cannot hold one example."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise BatchboundError(f"memory_budget must be a positive number of bytes, got {budget!r}")
    fixed = FIXED_FACTOR * sum(p.numel() * p.element_size() for p in model.parameters())
    k = min(MEASURED_EXAMPLES, x.shape[0] // 2)
    if k >= 1:
        small = saved_bytes(model, x[:k], y[:k], loss_fn)
        large = saved_bytes(model, x[: 2 * k], y[: 2 * k], loss_fn)
        per_example = max(large - small, 0) / k
    else:  # one example: take all it saves as its own
        per_example = saved_bytes(model, x[:1], y[:1], loss_fn)
    per_example = max(per_example * PER_EXAMPLE_FACTOR, 1.0)
    room = budget - fixed
    if room < per_example:
        raise BatchboundError(
            f"memory_budget {budget / 2**20:.1f} MiB cannot hold measure()'s work: about "
            f"{fixed / 2**20:.1f} MiB for the parameters, their gradient sum and the float64 "
            f"totals, and {per_example / 2**20:.2f} MiB per example; raise the budget")
    return max(1, min(most, int(room // per_example)))
