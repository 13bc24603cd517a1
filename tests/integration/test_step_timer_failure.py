"""A step that fails on one rank while advise times the step on P local workers.

Before, a micro-batch that raised on rank 1 only left rank 0 waiting in the trainer's
all-reduce (a hang until the collective's timeout) or in a collective of another shape. Now
the ranks agree on the failure at their next all-reduce (``step_timer.Lockstep``): the
timing ends with one line naming the size and the rank, and no timing process is left. A
size that fails first (the step's smallest) is skipped, as a model that cannot train on one
example is; the rest are timed."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from batchbound.advise.timing import ComputeCurve, time_workers
from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig

pytestmark = pytest.mark.distributed

SRC = Path(__file__).resolve().parents[2] / "src"

# rank 1's forward raises at ``SIZE`` examples: on every call (``when="every"``: in the
# trainer's step, before its all-reduce) or on the second call of a step only (the timer's
# own forward, after the all-reduce)
MODEL = '''
import os
from torch import nn

SIZE, WHEN = {size}, {when!r}


class Flaky(nn.Module):
    def __init__(self, d, k):
        super().__init__()
        self.lin = nn.Linear(d, k)
        self.calls = 0

    def forward(self, x):
        if os.environ.get("RANK") == "1" and x.shape[0] == SIZE:
            self.calls += 1
            if WHEN == "every" or self.calls % 2 == 0:
                raise RuntimeError(f"rank 1 cannot take {{SIZE}} examples")
        return self.lin(x.flatten(1))


def net(input_shape, num_outputs):
    d = 1
    for s in input_shape:
        d *= s
    return Flaky(d, num_outputs)
'''

def _marked(mark: str) -> list[int]:
    """This user's live processes (but this one) whose environment carries ``mark``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if mark.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # another user's, or it ended meanwhile
                pass
    return found


def _time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int, when: str,
          sizes: tuple[int, ...] = (1, 4, 8)) -> tuple[ComputeCurve, float] | str:
    """``time_workers`` called here (its ranks are fresh interpreters, which import
    ``flaky`` from ``tmp_path``): the timed curve, or the one-line refusal."""
    (tmp_path / "flaky.py").write_text(MODEL.format(size=size, when=when))
    mark = f"BATCHBOUND_TEST_MARK={tmp_path}"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SRC), str(tmp_path)]))
    monkeypatch.setenv("BATCHBOUND_TEST_MARK", str(tmp_path))  # the ranks inherit it
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.delitem(sys.modules, "flaky", raising=False)
    config = TrainConfig(dataset="digits", model="flaky:net", lr=0.1, batch_size=4)
    try:
        return time_workers(config, 2, list(sizes), 1, repeats=3)
    except BatchboundError as exc:
        return str(exc)
    finally:
        sys.modules.pop("flaky", None)
        deadline = time.time() + 20
        while _marked(mark) and time.time() < deadline:
            time.sleep(0.1)
        assert not _marked(mark), "a timing process was left behind"


@pytest.mark.parametrize("when", ["every", "second"],
                         ids=["before-the-all-reduce", "after-the-all-reduce"])
def test_a_size_failing_on_one_rank_ends_the_timing_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    refused = _time(tmp_path, monkeypatch, 4, when)
    assert isinstance(refused, str) and "\n" not in refused, refused
    assert "micro-batch 4 failed on rank 1" in refused, refused
    assert "RuntimeError: rank 1 cannot take 4 examples" in refused, refused


def test_a_first_size_failing_on_one_rank_is_skipped(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # not 1: the trainer tries the model on one example as it builds it
    timed = _time(tmp_path, monkeypatch, 2, "every", (2, 4, 8))
    assert not isinstance(timed, str), timed
    curve, communication = timed
    assert curve.sizes == (4, 8) and communication > 0
