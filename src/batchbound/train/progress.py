"""The progress bar (tqdm, on stderr, rank 0 only): epoch, loss, accuracy, samples/s and B.

The bar appears with the first training step, so that an error found before it (a checkpoint
that does not fit, bad data) is the only line on stderr.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm.auto import tqdm


class Progress:
    def __init__(self, enabled: bool, total: float | None, unit: str, interval: float = 0.2):
        self.enabled = enabled
        self.total = total
        self.unit = unit  # "epoch" or "it": what the bar counts
        self.interval = interval
        self._last = 0.0
        self.bar: Any = None  # made by the first update

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
        now = time.perf_counter()
        if not force and now - self._last < self.interval:
            return
        self._last = now
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

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
