"""advise's figure as a reader sees it: every label inside the axes, worker counts written
as counts."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from batchbound.advise import figure
from batchbound.advise.advice import Advice
from batchbound.advise.answer import Row


def _advice() -> Advice:
    """A cluster's curve: time falls to P = 16, then rises to P = 1024 (B capped at 1024)."""
    rows = []
    for k in range(11):
        p = 2**k
        seconds = 0.13 * 0.7**k if k <= 4 else 0.13 * 0.7**4 * 1.6 ** (k - 4)
        rows.append(Row(workers=p, batch_size=min(16 * p, 1024), lr=0.1, iterations=200.0,
                        seconds_per_iteration=seconds / 200, compute_seconds=seconds / 400,
                        communication_seconds=seconds / 400, seconds_to_target=seconds,
                        best=True))
    return Advice(68.5, rows, rows[3], 8, "")


@pytest.fixture
def drawn(monkeypatch, tmp_path):
    kept = []
    monkeypatch.setattr(figure.plt, "close", kept.append)  # keep the figure to look at it
    figure.plot_advice(_advice(), tmp_path / "a.png")
    assert (tmp_path / "a.png").stat().st_size > 10_000
    yield kept[0]
    plt.close(kept[0])


def test_every_point_label_stays_inside_the_axes(drawn):
    drawn.canvas.draw()
    box = drawn.axes[0].bbox
    labels = [t for t in drawn.axes[0].texts if t.get_text().startswith("B=")]
    assert len(labels) == 11
    for text in labels:  # "B=1024" at the last point ran over the frame, off the figure
        extent = text.get_window_extent()
        assert box.x0 <= extent.x0 and extent.x1 <= box.x1 and extent.y1 <= box.y1, \
            text.get_text()


def test_workers_are_written_as_counts(drawn):
    drawn.canvas.draw()
    ax = drawn.axes[0]
    low, high = ax.get_xlim()
    shown = [t.get_text() for t in ax.get_xticklabels() if low <= t.get_position()[0] <= high]
    assert "1" in shown and "1024" in shown and not [s for s in shown if "^" in s], shown
