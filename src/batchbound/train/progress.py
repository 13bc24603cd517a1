"""The progress bar (tqdm, on stderr, rank 0 only): epoch, loss, accuracy, samples/s and B.

The bar appears with the first training step, so that an error found before it (a checkpoint
that does not fit, bad data) is the only line on stderr. When stderr is not a terminal (a log
file, a pipe, a scheduler's output) a bar's carriage returns would make one endless line:
there the same fields are written as a plain line every LOG_INTERVAL seconds, and at the end.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm.auto import tqdm

LOG_INTERVAL = 30.0  # seconds between progress lines in a log


class Progress:
    def __init__(self, enabled: bool, total: float | None, unit: str, interval: float = 0.2,
                 terminal: bool | None = None):
        self.enabled = enabled
        self.total = total
        self.unit = unit  # "epoch" or "it": what the bar counts
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self.interval = interval if self.terminal else LOG_INTERVAL
        self._last = 0.0
        self.bar: Any = None  # made by the first update
        self._line: str | None = None  # a log's progress line not yet written
        self._state: tuple[float, int, float, float, int] | None = None  # the last update's

    def update(
        self,
        epoch: float,
        iteration: int,
        loss: float,
        acc: float | None,
        samples_per_second: float,
        batch_size: int,
        force: bool = False,
    ) -> None:
        if not self.enabled:
            return
        self._state = (epoch, iteration, loss, samples_per_second, batch_size)
        if not self.terminal:  # the last state, for close()
            self._line = self._log_line(epoch, iteration, loss, acc, samples_per_second,
                                        batch_size)
        now = time.perf_counter()
        if not force and now - self._last < self.interval and self._last > 0:
            return
        self._last = now
        if not self.terminal:
            print(self._line, file=sys.stderr, flush=True)
            self._line = None
            return
        if self.bar is None:
            self.bar = tqdm(
                total=self.total,
                unit=self.unit,
                file=sys.stderr,
                dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n:.2f}/{total_fmt} [{elapsed}<{remaining}{postfix}]",
            )
        self.bar.n = round(epoch if self.unit == "epoch" else iteration, 2)
        postfix = {"it": iteration, "loss": f"{loss:.4g}"}
        if acc is not None:
            postfix["acc"] = f"{acc:.3f}"
        postfix["samples/s"] = f"{samples_per_second:.0f}"
        postfix["B"] = batch_size
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.refresh()

    def evaluated(self, acc: float | None) -> None:
        """The step's update comes before its evaluation and shows the one before: where that
        evaluation reached the target, the last line said an accuracy below it. The pending
        log line (or the bar) takes the new one; a line already written stays as it was."""
        if not self.enabled or self._state is None or acc is None:
            return
        epoch, iteration, loss, samples_per_second, batch_size = self._state
        if self.terminal:
            self.update(epoch, iteration, loss, acc, samples_per_second, batch_size, force=True)
        elif self._line is not None:
            self._line = self._log_line(epoch, iteration, loss, acc, samples_per_second,
                                        batch_size)

    def _log_line(self, epoch: float, iteration: int, loss: float, acc: float | None,
                  samples_per_second: float, batch_size: int) -> str:
        done = epoch if self.unit == "epoch" else iteration
        total = f"/{self.total:g}" if self.total is not None else ""
        fields = [f"{self.unit} {done:.2f}{total}", f"it {iteration}", f"loss {loss:.4g}",
                  *([f"acc {acc:.3f}"] if acc is not None else []),
                  f"samples/s {samples_per_second:.0f}", f"B {batch_size}"]
        return "progress: " + ", ".join(fields)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self._line is not None:  # a log ends on the run's last state
            print(self._line, file=sys.stderr, flush=True)
            self._line = None
