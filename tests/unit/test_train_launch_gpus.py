"""``train --workers P --device cuda`` on a machine with fewer than P GPUs: one line naming
both numbers, exit 2, before any worker starts (CUDA faked by monkeypatching torch.cuda)."""

from __future__ import annotations

import pytest
import torch

from batchbound.cli import main
from batchbound.train import launch

ARGS = ["train", "--dataset", "digits", "--model", "fc(depth=1,params=800)", "--batch-size",
        "32", "--lr", "0.2", "--max-epochs", "1", "--no-progress"]


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def no_spawn(*args: object, **kwargs: object) -> None:
        raise AssertionError("a worker was spawned before the GPU check")

    monkeypatch.setattr(launch.mp, "start_processes", no_spawn)


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_more_workers_than_gpus_is_one_line_exit_2(one_gpu, capsys, device: str) -> None:
    assert main([*ARGS, "--workers", "2", "--device", device]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert "--workers 2" in err and "needs 2 GPUs" in err and "has 1" in err


def test_a_pinned_gpu_for_several_workers_is_refused(one_gpu, capsys) -> None:
    assert main([*ARGS, "--workers", "2", "--device", "cuda:0"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda:0" in err and "one GPU per worker" in err


def test_enough_gpus_pass_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    launch._check_gpus("cuda", torch.device("cuda", 0), 2)  # no error
    launch._check_gpus("cpu", torch.device("cpu"), 8)  # CPU workers need no GPU
