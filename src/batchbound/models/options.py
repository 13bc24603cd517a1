"""Checks for the values a model spec carries, so every family rejects bad input the same way.

Spec values arrive from ``batchbound.spec.parse_spec`` as ints, floats, booleans, words and
lists; these helpers turn them into the types a builder needs or raise BatchboundError with
the family and option named.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from batchbound.errors import BatchboundError

# Bounds on every integer option: a size past MAX_SIZE overflows torch's shape arithmetic
# before any memory check can run, and a network of more than MAX_LAYERS layers takes
# minutes just to construct.
MAX_SIZE = 2**31 - 1
MAX_LAYERS = 1000


def positive_int(family: str, key: str, value: Any, minimum: int = 1,
                 maximum: int = MAX_SIZE) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BatchboundError(f"{family}: {key} must be an integer >= {minimum}, got {value!r}")
    if value > maximum:
        raise BatchboundError(f"{family}: {key} must be at most {maximum:,}, got {value:,}")
    return value


def layer_count(family: str, key: str, value: Any, minimum: int = 1) -> int:
    """A number of layers (a depth, blocks in a chunk): at most MAX_LAYERS."""
    return positive_int(family, key, value, minimum, MAX_LAYERS)


def parameter_budget(family: str, value: Any) -> int:
    """A parameter budget: a whole number >= 1; ``2.5e6`` (parsed as a float) is accepted."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BatchboundError(
            f"{family}: params (the parameter budget) must be a whole number >= 1, got {value!r}"
        )
    if value > MAX_SIZE**2:  # no width solves it without overflowing torch's sizes
        raise BatchboundError(f"{family}: params (the parameter budget) must be at most "
                              f"{MAX_SIZE**2:.3g}, got {value:.3g}")
    return value


def positive_float(family: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise BatchboundError(f"{family}: {key} must be a number > 0, got {value!r}")
    return float(value)


def flag(family: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise BatchboundError(f"{family}: {key} must be true or false, got {value!r}")
    return value


def choice(family: str, key: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise BatchboundError(
            f"{family}: unknown {key} {value!r}; choose from {', '.join(choices)}"
        )
    return str(value)


def int_list(family: str, key: str, value: Any, minimum: int = 1,
             maximum: int = MAX_SIZE) -> list[int]:
    """A list of at most MAX_LAYERS integers in [minimum, maximum] (a bare integer is a list
    of one)."""
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, (list, tuple)):
        raise BatchboundError(f"{family}: {key} must be a list such as [2,2,2,2], got {value!r}")
    if len(items) > MAX_LAYERS:
        raise BatchboundError(f"{family}: {key} has {len(items):,} entries; at most "
                              f"{MAX_LAYERS:,}")
    return [positive_int(family, f"each entry of {key}", item, minimum, maximum)
            for item in items]


def one_of_width_params(family: str, width: Any, params: Any) -> None:
    """Width and a parameter budget are two ways to say the same thing: exactly one may be given."""
    if width is not None and params is not None:
        raise BatchboundError(
            f"{family}: give width or params, not both (params=P solves the width)"
        )


def closest_integer(
    count: Callable[[int], int], budget: int, lo: int = 1, hi: int = 1 << 24
) -> int:
    """The integer x in [lo, hi] whose ``count(x)`` is closest to ``budget`` (ties: smaller x).

    ``count`` must be non-decreasing in x (true of a parameter count as a width grows), so
    the answer is the first x with count(x) >= budget or the first x with the count just below
    it; both are found by an exponential then binary search, O(log hi) calls of ``count``.
    """

    def first_at_least(value: int) -> int | None:
        """The smallest x in [lo, hi] with count(x) >= value, or None."""
        if count(lo) >= value:
            return lo
        below, step = lo, 1  # invariant: count(below) < value
        while True:
            upper = min(hi, below + step)
            if count(upper) >= value:
                break
            if upper == hi:
                return None
            below, step = upper, 2 * step
        while upper - below > 1:
            mid = (below + upper) // 2
            below, upper = (below, mid) if count(mid) >= value else (mid, upper)
        return upper

    above = first_at_least(budget)
    candidates = [] if above is None else [above]
    if above != lo:
        under = hi if above is None else above - 1
        candidates.append(first_at_least(count(under)) or lo)
    return min(candidates, key=lambda x: (abs(count(x) - budget), x))


def meta_parameter_count(build: Callable[[], nn.Module]) -> int:
    """Parameters of the module ``build()`` makes, built on the meta device (no memory, no RNG)."""
    with torch.device("meta"):
        module = build()
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
