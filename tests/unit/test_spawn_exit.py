"""The ddp_spawn tests' tolerance of the gloo abort at exit: only after every rank wrote its
results, only for SIGABRT."""

from __future__ import annotations

from pathlib import Path

import pytest
from spawn_exit import fit_tolerating_exit_abort
from torch.multiprocessing import ProcessExitedException


def aborting(signal_name: str | None, exit_code: int = -6):
    def fit() -> None:
        raise ProcessExitedException("process 1 terminated", error_index=1, error_pid=1,
                                     exit_code=exit_code, signal_name=signal_name)
    return fit


def test_an_abort_after_training_is_warned_about(tmp_path: Path) -> None:
    written = [tmp_path / "rank0.pt", tmp_path / "rank1.pt"]
    for path in written:
        path.write_text("done")
    with pytest.warns(UserWarning, match="teardown race"):
        fit_tolerating_exit_abort(aborting("SIGABRT"), written)


def test_an_abort_before_every_rank_finished_or_another_failure_is_raised(
        tmp_path: Path) -> None:
    written = [tmp_path / "rank0.pt", tmp_path / "rank1.pt"]
    written[0].write_text("done")
    with pytest.raises(ProcessExitedException):
        fit_tolerating_exit_abort(aborting("SIGABRT"), written)  # rank 1 never finished
    written[1].write_text("done")
    with pytest.raises(ProcessExitedException):
        fit_tolerating_exit_abort(aborting("SIGSEGV", -11), written)
    with pytest.raises(ProcessExitedException):
        fit_tolerating_exit_abort(aborting(None, 1), written)  # an exit code, not a signal
