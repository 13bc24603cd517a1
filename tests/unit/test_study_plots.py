"""What the report's figures draw stays inside the figure."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from batchbound.study import plots as P


def test_a_long_data_label_in_a_heatmap_title_stays_inside_the_figure():
    summary = pd.DataFrame({"model_label": "L=2 K=20", "depth": 2, "batch_size": [32, 128],
                            "median": [0.5, 1.0], "lr": [0.003, 0.001], "diverged": 0,
                            "collapsed": 0, "runs": 5})
    label = "epochs to target: fashion-mnist | neighbour_pair(side=0) · L=2 K=20 · mean"
    fig = plt.figure(figsize=(6.4, 4.6), dpi=110)  # the report's figure size
    try:
        ax = fig.add_subplot()
        P.epochs_heatmap(ax, summary, "depth", 15.0, title=label)
        fig.tight_layout()
        fig.canvas.draw()
        box = ax.title.get_window_extent()
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width
        assert "neighbour_pair(side=0)" in ax.title.get_text().replace("\n", " ")
    finally:
        plt.close(fig)
