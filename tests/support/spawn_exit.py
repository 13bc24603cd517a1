"""Lightning's ``ddp_spawn`` and the gloo abort at a rank's exit.

A rank can abort (SIGABRT, "terminate called without an active exception") at interpreter
exit when a gloo thread outlives its process group: docs/torchrun-abort.md. batchbound's own
runs free the group first; under Lightning's ``ddp_spawn`` the DDP model and its group are
Lightning's, so a test of what the ranks did *during* training tolerates that abort at exit,
and only when every rank wrote its results at the end of training (``on_train_end``)."""

from __future__ import annotations

import signal
import warnings
from collections.abc import Callable
from pathlib import Path


def fit_tolerating_exit_abort(fit: Callable[[], object], written: list[Path]) -> None:
    """Run ``fit``; an abort of a spawned rank after every path in ``written`` exists is
    warned about, anything else raised."""
    from torch.multiprocessing import ProcessExitedException

    try:
        fit()
    except ProcessExitedException as exc:
        finished = all(path.exists() for path in written)
        if exc.signal_name != signal.Signals.SIGABRT.name or not finished:
            raise
        warnings.warn(f"a rank aborted at exit after training ({exc}): the gloo teardown "
                      "race of docs/torchrun-abort.md", stacklevel=2)
