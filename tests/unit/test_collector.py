"""The cyclic garbage collector is held off over a watched step and a measured chunk
(diversity/collector.py): their bookkeeping is freed by reference counting before any
collection walks it, and the caller's collector state is what it was afterwards."""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import batchbound.diversity.prepared as prepared
import batchbound.diversity.steps as steps
from batchbound.diversity import OnlineDiversity, PreparedStats, watch
from batchbound.diversity.collector import collector_paused


@contextlib.contextmanager
def collections(threshold: int = 10) -> Iterator[list[int]]:
    """The generations collected inside the block, with the young generation's threshold
    lowered so that a few dozen containers alive at once start a collection."""
    started: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    old = gc.get_threshold()
    gc.collect()
    gc.set_threshold(threshold, *old[1:])
    gc.callbacks.append(seen)
    try:
        yield started
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*old)


def deep_mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(8, 8), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(8, 3))


def test_the_state_is_restored_also_after_an_error():
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused(), collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the caller's choice stays
    finally:
        gc.enable()


def states_inside(model: nn.Module) -> list[bool]:
    """Whether the collector was on, at the model's forward and at its backward."""
    seen: list[bool] = []

    def forward(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        seen.append(gc.isenabled())
        output.register_hook(lambda grad: seen.append(gc.isenabled()))

    model.register_forward_hook(forward)
    return seen


def test_a_watched_step_runs_with_the_collector_off(monkeypatch):
    model, monitor = deep_mlp(), OnlineDiversity()
    x, y = torch.randn(16, 8), torch.randint(3, (16,))

    def step() -> None:
        model.zero_grad()
        with watch(model, monitor):
            F.cross_entropy(model(x), y).backward()

    seen = states_inside(model)  # a hook of the user's: before the check, part of the form
    step()  # the first step plans and checks the model
    seen.clear()
    with collections() as started:
        step()
        paused = len(started)
        assert seen == [False, False] and gc.isenabled()
        monkeypatch.setattr(steps, "collector_paused", contextlib.nullcontext)
        step()
        unpaused = len(started) - paused
    assert paused <= 2 < unpaused  # as the block starts and as it ends, not in between


def test_a_measured_chunk_runs_with_the_collector_off(monkeypatch):
    model = deep_mlp().eval()
    x, y = torch.randn(64, 8), torch.randint(3, (64,))
    stats_of = PreparedStats(model, "cross_entropy")
    stats_of(x, y)  # the first chunk probes and checks the model
    seen = states_inside(model)
    with collections() as started:
        stats_of(x, y)
        paused = len(started)
        assert seen == [False, False] and gc.isenabled()
        monkeypatch.setattr(prepared, "collector_paused", contextlib.nullcontext)
        stats_of(x, y)
        unpaused = len(started) - paused
    assert paused <= 2 < unpaused


def test_measure_sets_the_heap_before_it_aside_and_back():
    """gc.freeze over measure(): a full collection inside walks only what it made; the
    heap is the collector's again after it, and cyclic garbage made inside is collected."""
    from batchbound.diversity import measure

    class Cycle:
        pass

    frozen: list[int] = []
    made: list[weakref.ref] = []
    model = deep_mlp()
    real = prepared.PreparedStats.__call__

    def call(self, *args, **kwargs):
        frozen.append(gc.get_freeze_count())
        cycle = Cycle()
        cycle.me = cycle  # garbage only the collector frees
        made.append(weakref.ref(cycle))
        return real(self, *args, **kwargs)

    assert gc.get_freeze_count() == 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(prepared.PreparedStats, "__call__", call)
        measure(model, (torch.randn(32, 8), torch.randint(0, 3, (32,))), "cross_entropy",
                chunk_size=8)
    assert frozen and min(frozen) > 1000  # the process's objects, set aside
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert made and all(ref() is None for ref in made)


def test_a_callers_frozen_heap_stays_frozen():
    from batchbound.diversity.collector import heap_frozen

    gc.freeze()
    try:
        before = gc.get_freeze_count()
        young = [[] for _ in range(1000)]  # not frozen: heap_frozen would freeze them too
        with heap_frozen():
            assert 0 < gc.get_freeze_count() <= before  # frozen objects may be freed
        assert 0 < gc.get_freeze_count() <= before and young
    finally:
        gc.unfreeze()
    with pytest.raises(RuntimeError), heap_frozen():
        raise RuntimeError("inside")
    assert gc.get_freeze_count() == 0
