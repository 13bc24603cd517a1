"""Checkpoint writes under faults (issue 29): every write has a temporary file of its own,
so two writers of one path never take each other's file; a write that fails (a full disk)
leaves the previous checkpoint and no temporary file. The full disk here is an OSError
raised by the file's write (runs without root); tests/integration/test_train_faults.py fills
a real one."""

from __future__ import annotations

import errno
import threading

import pytest
import torch
from bad_input import FAULT

from batchbound.errors import FaultError
from batchbound.train import checkpoint as ck

pytestmark = FAULT


def state(value: float) -> dict:
    return {"config_hash": "abc", "weights": torch.full((1000,), value)}


def test_two_writers_of_one_path_never_collide(tmp_path):
    """Two writers of one path (two runs given the same --checkpoint, before the claim that
    refuses the second): with one shared `.tmp` name one of them used to fail with
    FileNotFoundError; now each finishes and the file is always one whole checkpoint."""
    path = tmp_path / "ck.pt"
    errors: list[BaseException] = []

    def write(value: float) -> None:
        try:
            for _ in range(30):
                ck.save_checkpoint(path, state(value))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(v,)) for v in (1.0, 2.0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    weights = ck.load_checkpoint(path, "abc")["weights"]
    assert weights.unique().numel() == 1 and float(weights[0]) in (1.0, 2.0)
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]


def test_a_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    ck.save_checkpoint(path, state(1.0))
    before = path.read_bytes()

    class Full:
        def __init__(self, *args: object) -> None:
            pass

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def write(self, data: object) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    real_open = open

    def full_open(file, mode="r", *args, **kwargs):  # the temporary file hits a full disk
        if str(file).endswith(".tmp"):
            real_open(file, mode).close()  # created, as on a real disk, then the write fails
            return Full()
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full_open)
    with pytest.raises(FaultError, match=r"cannot write the checkpoint .*ck.pt: No space left "
                                         r"on device \([\d,]+ bytes; the previous one is kept\)"):
        ck.save_checkpoint(path, state(2.0))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # no temporary file left
