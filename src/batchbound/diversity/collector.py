"""Python's cyclic garbage collector held off while one step's or chunk's bookkeeping runs.

A hooks pass makes a few thousand small containers a step on a transformer (each call's
record, the graph's edges, the hooks' closures), all freed by reference counting when the
step ends. With the collector on, they cross its threshold several times a step: each young
collection walks them, and those alive at that moment are promoted to the older
generations, until a full collection walks the whole process's heap (145 ms every ~100
steps with transformers imported, 379 000 objects: 1.5 ms a step on average, on GPT-2's
structure at width 32). Held off, they are freed before any collection sees them; whatever
cyclic garbage the step leaves is collected after it, as usual (benchmarks/host.py and
docs/benchmarks.md measure the difference).

Between ``measure``'s chunks the collector runs, and the objects alive there (a chunk's
tensors and records) are promoted until a full collection walks the process's heap: one
of 100–150 ms every ten calls of ``measure`` on the MLP of ``benchmarks/diversity.py``
(transformers imported). ``heap_frozen`` sets the heap that was there before the call
aside for its duration (``gc.freeze``), so a full collection walks only what the call made.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off inside the block and on again after it, where it was on (a
    caller who turned it off keeps it off; a nested block changes nothing)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextmanager
def heap_frozen() -> Iterator[None]:
    """The objects alive before the block left out of the collector's walks until it ends
    (``gc.freeze``, undone by ``gc.unfreeze``); nothing is left out of a collection after
    it. A caller who froze objects itself keeps them frozen: the block then changes
    nothing."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
