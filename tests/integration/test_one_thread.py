"""One torch thread per process, whatever OMP_NUM_THREADS or the cores say
(``batchbound.kernels.threads``): a float sum split over two threads adds in another order,
and SGD carries the last bit into every later number."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from batchbound import kernels
from batchbound.errors import BatchboundError

TRAIN = ["train", "--dataset", "digits", "--model", "fc(depth=2,params=4000)", "-B", "256",
         "--lr", "0.3", "--max-iterations", "60", "--no-progress", "--json"]


def _train(**env: str) -> dict:
    full = {k: v for k, v in os.environ.items()
            if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", kernels.THREADS_ENV)}
    done = subprocess.run([sys.executable, "-m", "batchbound", *TRAIN], capture_output=True,
                          text=True, env={**full, **env}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_train_gives_bit_identical_numbers_at_one_and_two_omp_threads() -> None:
    one, two = _train(OMP_NUM_THREADS="1"), _train(OMP_NUM_THREADS="2")
    numbers = [{k: v for k, v in r["final"].items() if k != "seconds"} for r in (one, two)]
    assert numbers[0] == numbers[1] and len(numbers[0]) > 3  # every float, to the last bit
    assert one["final"]["train_loss"].hex() == two["final"]["train_loss"].hex()
    assert one["threads"] == two["threads"] == 1


def test_two_threads_do_change_the_numbers_here() -> None:
    """The control: asked for two threads, this run's last bits differ (else the test above
    could not fail)."""
    one, two = _train(), _train(**{kernels.THREADS_ENV: "2"})
    assert two["threads"] == 2
    assert one["final"]["train_loss"] != two["final"]["train_loss"]


def test_batchbound_threads_is_read_and_checked(monkeypatch) -> None:
    monkeypatch.setenv(kernels.THREADS_ENV, "2")
    previous = torch.get_num_threads()
    with kernels.computing_threads() as count:
        assert count == 2 and torch.get_num_threads() == 2
    assert torch.get_num_threads() == previous  # the caller's count is put back
    for bad in ("0", "two", "-1", ""):
        monkeypatch.setenv(kernels.THREADS_ENV, bad)
        with pytest.raises(BatchboundError, match=kernels.THREADS_ENV):
            kernels.threads()


def test_a_bad_batchbound_threads_is_one_line_and_exit_2() -> None:
    done = subprocess.run([sys.executable, "-m", "batchbound", *TRAIN], capture_output=True,
                          text=True, env={**os.environ, kernels.THREADS_ENV: "lots"},
                          timeout=300)
    assert done.returncode == 2 and "BATCHBOUND_THREADS='lots'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_python_api_computes_on_one_thread_and_gives_the_callers_count_back() -> None:
    from batchbound.train import TrainConfig, train

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        config = TrainConfig(dataset="digits", model="fc(depth=1,params=800)", batch_size=32,
                             lr=0.1, max_iterations=5)
        result = train(config)
        assert result.environment["threads"] == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
