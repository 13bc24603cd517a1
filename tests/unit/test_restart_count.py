"""A restart count counts only under torchrun: one left in a shell does not make a plain
``batchbound train`` rerun resume by itself (it said "restart 1 by torchrun")."""

from __future__ import annotations

import pytest

from batchbound.environment import restart_count


def test_a_leftover_restart_count_outside_torchrun_is_none(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restart_count() == 0
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert restart_count() == 1
