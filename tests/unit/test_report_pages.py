"""What a reader of the report sees: tables that stay readable at any width, figures whose
colours, axes and legends say what they draw, and a glossary for every abbreviation of the
answer's table. (Found by opening the reports in headless Chromium at 1280 and 800 px.)"""

from __future__ import annotations

import html
import math

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from matplotlib.colors import to_hex

from batchbound.study import plots as P
from batchbound.study.answer import GLOSSARY, Answer, answer_table
from batchbound.study.document import CSS, Table


@pytest.fixture
def ax():
    fig = plt.figure(figsize=(6.4, 4.6), dpi=110)  # the report's figure size
    yield fig.add_subplot()
    plt.close(fig)


def epochs(medians: dict[str, list[float]], batches=(32, 64, 128)) -> pd.DataFrame:
    """The analysis' epochs table for models named L=d K=w, NaN: the median run missed."""
    rows = []
    for label, values in medians.items():
        depth = int(label.split()[0][2:])
        for batch, m in zip(batches, values, strict=True):
            rows.append({"model_label": label, "depth": depth, "width": 10, "batch_size": batch,
                         "median": m, "min": m, "max": m, "runs": 2,
                         "diverged": 0, "collapsed": 0, "lr": 0.1})
    return pd.DataFrame(rows)


# ---- tables -------------------------------------------------------------------------------
def test_a_sentence_in_a_cell_is_not_squeezed_to_one_word_a_line():
    page = Table(pd.DataFrame({"model": ["L=1 K=41"], "B_crit": [131.0],
                               "note": ["119–146; above the batches that reached the target"]}
                              )).html()
    assert "<td class='text'>119–146; above the batches" in page
    assert "<td>131</td>" in page and "<td>L=1 K=41</td>" in page  # numbers, labels: as before
    assert "td.text{text-align:left;min-width:10em}" in CSS
    note = ("timing machine busy (other processes kept 0.87 of the 2 cores busy while timing): "
            "every row's seconds uncertain")
    wide = Table(pd.DataFrame({"note": [note], "mark": ["32 (at the grid edge)"],
                               "how": ["averaged over training"]})).html()
    assert f"<td class='text long'>{html.escape(note)}</td>" in wide
    assert "td.long{min-width:16em}" in CSS
    assert "<td>32 (at the grid edge)</td>" in wide  # a number with its mark stays a number
    assert "<td class='text'>averaged over training</td>" in wide


def test_a_scrolled_table_keeps_its_first_column_and_shows_more_lies_beyond():
    assert ".wide th:first-child,.wide td:first-child{position:sticky;left:0;" in CSS
    # the shadow at the right edge is fixed to the box; the white cover scrolls with the
    # table and hides it once the last column is in view
    assert "no-repeat local" in CSS and "no-repeat scroll" in CSS


# ---- figures ------------------------------------------------------------------------------
def _line_colours(ax) -> dict[str, str]:
    return {line.get_label(): to_hex(line.get_color()) for line in ax.get_lines()
            if not line.get_label().startswith("_")}


def test_a_model_keeps_its_colour_when_another_figure_lacks_a_model():
    nan = math.nan
    table = epochs({"L=1 K=10": [nan, nan, nan], "L=2 K=10": [4.0, 3.0, 2.5],
                    "L=4 K=10": [5.0, 3.0, 2.0]})
    # the speedup table has no row for L=1: none of its runs reached the target
    speedups = table[table["model_label"] != "L=1 K=10"].assign(
        speedup=lambda f: 4.0 / f["median"], ideal=1.0, iterations=1.0)
    colours = P.model_colours(table)
    fig = plt.figure()
    try:
        left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        P.epochs_vs_batch(left, table, 12.0, colours)
        P.speedup_curves(right, speedups, "speedup", colours)
        a, b = _line_colours(left), _line_colours(right)
        assert a["L=2 K=10"] == b["L=2 K=10"] and a["L=4 K=10"] == b["L=4 K=10"]
        assert a["L=2 K=10"] != a["L=4 K=10"]
    finally:
        plt.close(fig)


def _labels(axis) -> list[str]:
    low, high = sorted(axis.get_view_interval())
    ticks = [*axis.get_major_ticks(), *axis.get_minor_ticks()]
    return [t.label1.get_text() for t in ticks
            if t.label1.get_text() and low <= t.get_loc() <= high]


def test_a_log_axis_spanning_under_a_decade_names_more_than_one_height(ax):
    P.epochs_vs_batch(ax, epochs({"L=2 K=10": [6.5, 8.0, 11.0]}), 12.0)
    ax.figure.canvas.draw()
    labels = _labels(ax.yaxis)
    assert {"7", "8", "9", "10"} <= set(labels), labels


def test_a_log_axis_spanning_decades_labels_only_two_and_five(ax):
    P.epochs_vs_batch(ax, epochs({"L=2 K=10": [0.5, 8.0, 90.0]}), 100.0)
    ax.figure.canvas.draw()
    labels = set(_labels(ax.yaxis))
    assert {"1", "10", "100", "2", "5"} <= labels and not labels & {"3", "4", "30", "40"}


def test_censored_markers_are_explained_in_the_legend_not_written_over_them(ax):
    nan = math.nan
    P.epochs_vs_batch(ax, epochs({"L=1 K=10": [nan, nan, nan], "L=2 K=10": [4.0, 6.0, nan]}),
                      12.0)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "not reached (drawn at max epochs)" in legend and "max epochs (12)" in legend
    # a model that never reached the target has no line: its markers carry its name
    assert "L=1 K=10: never reached" in legend and "L=2 K=10" in legend
    assert not [t for t in ax.texts if "max epochs" in t.get_text()]


def test_a_series_with_nothing_drawn_says_so_in_the_legend(ax):
    table = pd.DataFrame({"model_label": ["L=1 K=10", "L=2 K=8"], "depth": [1, 2],
                          "delta_mean": [1e-3, 2e-3], "bound_mean": [2.0, 4.0],
                          "largest_batch": [math.nan, math.nan],
                          "threshold_batch": [32.0, 64.0]})
    P.largest_batch_vs_delta(ax, table, 6.0)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "largest B within 6 epochs: no model" in legend and "threshold B*" in legend


def test_the_loss_contour_colour_bar_reads_losses_not_their_logarithms():
    # its levels are log10 losses: "0.20" and "-0.00" named no loss a reader knows
    assert P._loss_of_level(-1e-9, None) == "1" and P._loss_of_level(0.2, None) == "1.58"
    assert P._loss_of_level(-1.0, None) == "0.1"


# ---- the answer's glossary ----------------------------------------------------------------
def test_every_abbreviation_of_the_answer_table_is_in_the_glossary():
    row = Answer(model="L=2 K=29", grid=(32.0, 512.0), first=32.0, linear=64.0,
                 stagnant=math.nan, b_crit=131.0, interval="119–146", degenerate="",
                 bound=2.3, bound_how="averaged over training", workers=1.0, batch=32.0,
                 lr=0.1, seconds=0.05, interpolated=False, diverged="0 of 10",
                 collapsed="0 of 10")
    names = [name for name, _, _ in GLOSSARY]
    plain = {"model", "workers", "batch"}  # words that say what they are
    for column in answer_table([row]).columns:
        assert column in plain or any(name in column for name in names
                                      if name not in ("n", "L, K")), column
    # the model's name is an abbreviation too
    assert "L, K" in names


def test_thousands_are_written_whole_not_in_e_notation():
    from batchbound.study.claims.registry import fmt

    # "118–2e+03" read as a typo; three significant digits, as before, written whole
    assert (fmt(1998.4), fmt(5240.7), fmt(-1500.3), fmt(999.96)) == ("2000", "5240", "-1500",
                                                                       "1000")
    assert (fmt(131.4), fmt(0.000132), fmt(2.5e6), fmt(1024.0)) == ("131", "0.000132",
                                                                     "2.5e+06", "1024")


def test_a_heatmap_does_not_stretch_a_two_percent_difference_over_its_colours():
    """1.00 and 1.02 epochs (both written "1.0" in their cells) were purple and yellow."""
    def norm(medians: list[float]):
        fig = plt.figure()
        try:
            ax = fig.add_subplot()
            P.epochs_heatmap(ax, epochs({"L=1 K=16": medians}, (16, 64, 256)), "depth", 12.0)
            return ax.images[0].norm
        finally:
            plt.close(fig)

    narrow = norm([1.002, 1.023, math.nan])
    assert narrow.vmax / narrow.vmin == pytest.approx(P.SPAN)
    assert narrow.vmin < 1.002 and narrow.vmax > 1.023
    wide = norm([1.0, 4.0, 9.0])  # a wide range keeps its own ends
    assert (wide.vmin, wide.vmax) == (1.0, 9.0)


def test_the_spec_lists_plain_values_on_one_line_and_stays_the_same_json():
    import json

    from batchbound.study.report import spec_text

    spec = {"batch_sizes": [16, 32, 64], "data": [{"dataset": "digits", "transform": None}],
            "lr": {"grid": [0.1, 0.3], "strategies": ["blr"]}, "models": {"options": {}},
            "train": {"targets": [["train_acc", 0.6]], "name": "Δ-study"}}
    text = spec_text(spec)
    assert json.loads(text) == spec
    assert '  "batch_sizes": [16, 32, 64],\n' in text and '"grid": [0.1, 0.3]' in text
    assert '"name": "Δ-study"' in text and '"options": {}' in text


def test_a_heatmap_of_two_families_names_its_rows_by_model_not_hidden_layers():
    from batchbound.study.figures import heatmap_rows

    table = epochs({"L=1 K=16": [1.0, 1.2, 1.5], "L=3 K=4": [0.8, 1.3, 1.8]})
    one = pd.DataFrame({"model": ["fc(depth=1,width=16)", "fc(depth=3,width=4)"]})
    two = pd.DataFrame({"model": ["fc(depth=1,width=16)", "cnn1d(width=4,depth=2)"]})
    assert heatmap_rows(table, one) == "depth"
    assert heatmap_rows(table, two) == "model_label"
    fig = plt.figure()
    try:
        ax = fig.add_subplot()
        P.epochs_heatmap(ax, table, "model_label", 12.0)
        assert ax.get_ylabel() == "model"
        assert [t.get_text() for t in ax.get_yticklabels()] == ["L=1 K=16", "L=3 K=4"]
    finally:
        plt.close(fig)


def _diversity(labels: list[str], depths: list[int], widths: list[int]) -> pd.DataFrame:
    return pd.DataFrame({"model_label": labels, "depth": depths, "width": widths,
                         "batch_size": 16, "delta_mean": [0.02, 0.08][:len(labels)],
                         "delta_matched": math.nan, "matched_loss": math.nan})


def test_the_delta_figure_of_two_families_names_its_models_not_hidden_layers():
    from batchbound.study.figures import delta_axis

    two = pd.DataFrame({"model": ["fc(depth=1,width=16)", "cnn1d(width=4,depth=3)"]})
    one = pd.DataFrame({"model": ["fc(depth=1,width=16)", "fc(depth=3,width=4)"]})
    mixed = _diversity(["L=1 K=16", "cnn1d L=3 K=4"], [1, 3], [16, 4])
    assert delta_axis(mixed, two) == "model_label"
    assert delta_axis(_diversity(["L=1 K=16", "L=3 K=4"], [1, 3], [16, 4]), one) == "depth"
    assert delta_axis(_diversity(["L=2 K=8", "L=2 K=32"], [2, 2], [8, 32]), one) == "width"
    along = pd.DataFrame({"model_label": ["L=1 K=16", "L=1 K=16", "cnn1d L=3 K=4"],
                          "batch_size": 16, "epoch": 0.0, "diversity": [0.02, 0.021, 0.08]})
    fig = plt.figure(figsize=(6.4, 4.6), dpi=110)
    try:
        ax = fig.add_subplot()
        P.delta_vs_shape(ax, along, mixed, "model_label", "at initialisation")
        assert ax.get_xlabel() == "model" and "depth" not in ax.get_title()
        assert [t.get_text() for t in ax.get_xticklabels()] == ["L=1 K=16", "cnn1d L=3 K=4"]
        # a cnn1d is not one step deeper than an fc: no line joins the two models
        assert all(line.get_linestyle() == "None" for line in ax.get_lines())
        # one epoch measured: no colour bar spanning -0.1 … 0.1, the epoch in the legend
        assert len(fig.axes) == 1
        assert "each run, epoch 0" in [t.get_text() for t in ax.get_legend().get_texts()]
    finally:
        plt.close(fig)


def test_no_legend_and_no_warning_when_nothing_is_labelled(ax):
    import warnings

    table = epochs({"L=1 K=10": [math.nan, math.nan, math.nan]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels" on the terminal
        P.epochs_vs_batch(ax, table, budget=None)  # nothing reached, no budget line
        assert ax.get_legend() is None
        ax.plot([1, 2], [1, 2])
        P.legend(ax)
        assert ax.get_legend() is None
        ax.plot([1, 2], [2, 3], label="drawn")
        P.legend(ax)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["drawn"]


def test_a_run_measured_once_is_drawn_as_a_dot_not_an_empty_line(ax):
    along = pd.DataFrame({"key": ["a", "b", "b"], "model_label": ["L=1 K=16"] * 3,
                          "batch_size": 16, "epoch": [0.0, 0.0, 1.0],
                          "diversity": [0.02, 0.03, 0.05]})
    P.delta_along_training(ax, along)
    shapes = sorted((len(line.get_xdata()), line.get_linestyle(), line.get_marker())
                    for line in ax.get_lines())
    assert shapes == [(1, "None", "."), (2, "-", "None")]
