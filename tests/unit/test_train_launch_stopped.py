"""``train --workers P`` stopped by the user (Ctrl-C, SIGTERM) while a rank is still starting:
that rank has no handler yet and dies of the SIGTERM the launcher forwards. It was reported as
a rank killed by a signal, a fault (exit 1) that blamed the rank (an outside review); it is
the user's stop now: exit 130, saying what the checkpoint holds. The ranks are faked."""

from __future__ import annotations

import os
import signal

import pytest
import torch.multiprocessing as mp

from batchbound.cli import main
from batchbound.train import launch


class StartingRanks:
    """``start_processes``'s context: its join sees the user's SIGINT arrive, and then a rank
    that the forwarded SIGTERM killed."""

    processes: tuple = ()

    def join(self, grace_period: float) -> bool:
        os.kill(os.getpid(), signal.SIGINT)  # taken by the launcher's own handler
        raise mp.ProcessExitedException("process 1 terminated with signal SIGTERM",
                                        error_index=1, error_pid=1234, exit_code=-15,
                                        signal_name="SIGTERM")


def test_a_stop_while_ranks_start_is_an_interruption_not_a_rank_fault(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(launch.mp, "start_processes", lambda *a, **k: StartingRanks())
    # as the suite's earlier tests in this worker left it (one full run found SIGINT ignored
    # here; Lightning's fit, for one, ignores it for good after a KeyboardInterrupt): what
    # must come back is what was there
    before = signal.getsignal(signal.SIGINT)
    code = main(["train", "--dataset", "digits", "--model", "fc(depth=1,params=800)",
                 "--workers", "2", "--max-iterations", "3", "--no-progress"])
    said = capsys.readouterr().err.strip()
    assert code == 130
    assert said == ("batchbound train: error: stopped by SIGINT before every rank could stop at "
                    "a checkpoint (a rank was still starting); no --checkpoint was given, so a "
                    "rerun starts over")
    assert signal.getsignal(signal.SIGINT) is before  # put back
