"""Examples paired inside the forward pass, where the data decides whether they interact.

The first chunk's check against the per-example loop (``rule_check.self_check``) sees
examples that interact on that chunk. It cannot see a forward whose interaction the data
switches on later: attention among the examples of one group, ``(q @ k.T).masked_fill(
group[:, None] != group[None, :], -inf)``, has every example alone on a chunk whose
groups are all different, and pairs them on the next. Such a forward builds, somewhere, a
tensor with one dimension per example on two of its axes (an n × n score, a mask between
examples, a distance matrix): at 2 and at 3 examples, two of its dimensions follow the batch
size while the others stay put. ``OpShapes`` records every ATen operation's output shapes
over the two small forward passes that ``rule_check.output_kinds`` runs anyway, and
``pairing`` names the first such operation. A chunk of such a model is then checked by value
(``prepared.PreparedStats``): its examples' losses, the model run on halves of the chunk
split by each bit of the examples' positions (any two examples fall in different halves
once), against their losses in the whole chunk.

Only a tensor that pairs the examples is seen this way, by its shape; a forward that mixes
them within one axis (a ``cumsum`` or sort along the examples) is left to the first
chunk's check (docs/diversity.md).
"""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from batchbound.diversity.calls import flatten

Shapes = list[tuple[Any, list[tuple[int, ...]]]]  # (operation, its outputs' shapes), in order


class OpShapes(TorchDispatchMode):
    """Records each ATen operation of a forward pass with its tensor outputs' shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: Shapes = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.shapes.append((func, [tuple(t.shape) for t in flatten(out) if hasattr(t, "shape")]))
        return out


def pairing(small: Shapes, large: Shapes, sizes: tuple[int, int]) -> str:
    """Why the forward may pair its examples: the first operation with an output whose size
    follows the batch along two or more dimensions, all others the same; "" where none
    does. The k-th call of an operation at one size is compared with its k-th at the other,
    so a path that differs with the batch size (experts that get no token) misaligns only
    the operations it repeats a different number of times."""
    lo, hi = sizes
    seen: dict[Any, list[list[tuple[int, ...]]]] = {}
    for op, outs in large:
        seen.setdefault(op, []).append(outs)
    count: dict[Any, int] = {}
    for op, outs in small:
        k = count[op] = count.get(op, -1) + 1
        more = seen.get(op, [])
        if k >= len(more):
            continue
        for s, t in zip(outs, more[k], strict=False):
            if len(s) != len(t):
                continue
            follow = [d for d in range(len(s)) if (s[d], t[d]) == (lo, hi)]
            if len(follow) >= 2 and all(s[d] == t[d] for d in range(len(s)) if d not in follow):
                return (f"its forward pass pairs the examples ({op.overloadpacket.__name__} "
                        f"makes a tensor of shape {t} at {hi} examples, {s} at {lo}: "
                        f"dimensions {', '.join(map(str, follow))} both follow the batch)")
    return ""
