"""The progress bar (tqdm, on stderr, rank 0 only): epoch, loss, accuracy, samples/s and B."""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm


class Progress:
    def __init__(self, enabled: bool, total: float | None, unit: str, interval: float = 0.2):
        self.unit = unit  # "epoch" or "it": what the bar counts
        self.interval = interval
        self._last = 0.0
        self.bar = tqdm(
            total=total,
            unit=unit,
            file=sys.stderr,
            disable=not enabled,
            dynamic_ncols=True,
            bar_format="{l_bar}{bar}| {n:.2f}/{total_fmt} [{elapsed}<{remaining}{postfix}]",
        )

    @property
    def enabled(self) -> bool:
        return not self.bar.disable

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
        if self.bar.disable:
            return
        now = time.perf_counter()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        self.bar.n = round(epoch if self.unit == "epoch" else iteration, 2)
        postfix = {"it": iteration, "loss": f"{loss:.4g}"}
        if acc is not None:
            postfix["acc"] = f"{acc:.3f}"
        postfix["samples/s"] = f"{samples_per_second:.0f}"
        postfix["B"] = batch_size
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
