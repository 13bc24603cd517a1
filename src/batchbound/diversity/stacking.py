"""Small calls of like layers computed as one: their rule on their examples stacked.

A layer rule is per example: row i of its input and of its output gradient gives example
i's gradient and nothing else's. So the calls of several modules of one type with the same
configuration (``RuleEntry.config``: all that the rule reads of the module besides the
parameters' values), whose input and output gradient have the same shapes and dtypes, can
be computed as one call whose examples are all of theirs, stacked along dimension 0: rows
k·n to (k+1)·n of every form the rule returns are call k's, what the rule gives call k alone.
A model's repeated blocks (a transformer's LayerNorms and projections) then cost one launch
per operation for all of them instead of one per layer, which is what bounds a small
model's step on a GPU. Only small calls are stacked (``STACK_NUMEL``): for large ones the
copies into the stack cost more memory traffic than the launches they save.

The hooks engine (``hooks.HooksPass``) holds such calls' output gradients until the end of
the backward pass (or until its ``defer_budget`` of numbers waits) and runs each stack once.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor

from batchbound.diversity.calls import CallRecord
from batchbound.diversity.rules import DEFER_NUMEL

# A call whose input or output gradient holds more numbers than this runs on its own.
STACK_NUMEL = DEFER_NUMEL
# The same for a call whose rule also adds the batch sum into a running sum (``measure``'s
# Linear layers): its copies into the stack outweigh what stacking saves sooner. At
# DEFER_NUMEL the MLP's 256 × 512 calls of benchmarks/diversity.py took measure() from
# 1.24× to 1.28–1.30× a plain pass on CPU; the small calls of GPT-2 at width 32
# (benchmarks/host.py) gain.
SUMS_STACK_NUMEL = 2**16


def stack_key(call: CallRecord, axis: int | None, sums: bool = False) -> Hashable | None:
    """Calls with equal keys may be stacked (``axis``: where the call's examples lie, from
    the layout; ``sums``: its rule adds batch sums too); None: this call runs on its own. Its
    rule must have a ``config``, take one tensor argument and one output gradient, with the
    examples along dimension 0."""
    entry, x = call.entry, call.main_input
    g = call.grads[0] if len(call.grads) == 1 else None
    if (entry.config is None or entry.example_axis is not None or axis != 0
            or list(call.inputs) != [call.main] or not isinstance(x, Tensor) or g is None
            or max(x.numel(), g.numel()) > (SUMS_STACK_NUMEL if sums else STACK_NUMEL)):
        return None
    return (type(call.module), entry.config(call.module), x.shape, x.dtype, x.device, g.shape,
            g.dtype, call.outputs[0].dtype)


def stacked(calls: list[CallRecord]) -> tuple[dict[str, Tensor], list[Tensor]]:
    """The input and the output gradient of ``calls`` (of one key), stacked along the
    examples in the calls' order."""
    main = calls[0].main
    return ({main: torch.cat([call.inputs[main] for call in calls])},
            [torch.cat([call.grads[0] for call in calls])])


def rows(k: int, n: int) -> slice:
    """Call k's rows in a stack of calls of n examples each."""
    return slice(k * n, (k + 1) * n)
