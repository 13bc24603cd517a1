"""TensorBoard output end to end: a real run's curves read back through TensorBoard's reader,
and ``batchbound study run --tensorboard DIR`` writes one directory per run, completes DIR on
a resumed study, rewrites without doubling, and refuses a bad DIR before any run starts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from batchbound.cli import main
from batchbound.study.store import Store
from batchbound.train import TrainConfig, train
from batchbound.train import tensorboard as tb

pytest.importorskip("tensorboard")

SPEC = """
[study]
name = "board"
[data]
datasets = ["digits"]
[models]
specs = ["fc(depth=1,params=800)"]
[batches]
sizes = [64, 128]
[lr]
grid = [0.3]
tuning = "none"
[train]
targets = { train_acc = 0.99 }
max_epochs = 0.3
eval_every_epochs = 0.1
diversity_every_epochs = 0.15
repeats = 1
"""


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_curves_equal(logdir: Path, curves: list[tuple]) -> None:
    """Every tag, step and value of the curves, and nothing else but progress/ and final/."""
    expected: dict[str, list[tuple[int, float]]] = {}
    for iteration, _, _, metric, value in curves:
        expected.setdefault(tb.tag_for(metric), []).append((int(iteration), value))
    got = scalars(logdir)
    assert {t for t in got if not t.startswith(("progress/", "final/"))} == set(expected)
    for tag, points in expected.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        np.testing.assert_allclose([v for _, v in got[tag]], [v for _, v in points],
                                   rtol=1e-6, err_msg=tag)


def test_a_real_run_reads_back_exactly(tmp_path: Path) -> None:
    config = TrainConfig(dataset="digits", model="fc(depth=1,params=800)", batch_size=32,
                         lr=0.1, max_iterations=5, eval_every_iterations=1,
                         online_diversity="norms", diversity_every_epochs=0.05)
    result = train(config, progress=False)
    metrics = {m for *_, m, _ in result.curves}
    assert {"batch_loss", "train_loss", "test_acc", "lr", "batch_size", "diversity",
            "batch_bound", "online_diversity", "online_batch_bound"} <= metrics
    logdir = tmp_path / tb.run_name(config.to_dict(), result.config_hash)
    tb.write_run(result, logdir)
    assert_curves_equal(logdir, result.curves)
    assert [s for s, _ in scalars(logdir)["train/batch_loss"]] == [1, 2, 3, 4, 5]


def run_dirs(board: Path) -> dict[str, Path]:
    return {p.name: p for p in board.iterdir() if p.is_dir()}


def test_study_writes_one_directory_per_run(tmp_path: Path, capsys) -> None:
    spec, store, board = tmp_path / "spec.toml", tmp_path / "s.sqlite", tmp_path / "board"
    spec.write_text(SPEC)
    argv = ["study", "run", str(spec), "--store", str(store), "--jobs", "0", "--no-progress",
            "--tensorboard", str(board)]
    assert main(argv) == 0
    assert f"tensorboard --logdir {board}" in capsys.readouterr().err
    with Store(store) as s:
        frames = s.frames("board")
    runs = frames["runs"]
    assert len(runs) == 2 and set(runs.status) == {"complete"}
    dirs = run_dirs(board)
    assert sorted(dirs) == sorted(
        tb.run_name(row, row["key"]) for row in runs.to_dict("records"))
    assert all("_B64_" in n or "_B128_" in n for n in dirs)
    rows = {key: [] for key in runs.key}
    for name in ("curves", "diversity"):
        for r in frames[name].itertuples():
            rows[r.key].append((r.iteration, r.epoch, r.seconds, r.metric, r.value))
    for key, curves in rows.items():
        (directory,) = [d for n, d in dirs.items() if n.endswith(key[:8])]
        curves.sort(key=lambda r: r[0])
        assert_curves_equal(directory, curves)
        assert {"diversity/exact", "train/loss", "test/acc"} <= set(scalars(directory))

    # a resumed study (nothing left to run) completes a directory that went missing and
    # leaves the others as they were: one event file each, no doubled points
    victim = sorted(dirs)[0]
    for path in dirs[victim].iterdir():
        path.unlink()
    dirs[victim].rmdir()
    before = {n: sorted(p.name for p in d.iterdir()) for n, d in dirs.items() if n != victim}
    assert main(argv) == 0
    after = run_dirs(board)
    assert sorted(after) == sorted(dirs)
    for name, files in before.items():
        assert sorted(p.name for p in after[name].iterdir()) == files
    assert len([p for p in after[victim].iterdir() if "tfevents" in p.name]) == 1
    key = next(k for k in rows if victim.endswith(k[:8]))
    assert_curves_equal(after[victim], sorted(rows[key], key=lambda r: r[0]))


def test_unwritable_tensorboard_dir_fails_before_any_run(tmp_path: Path, capsys) -> None:
    spec, store = tmp_path / "spec.toml", tmp_path / "s.sqlite"
    spec.write_text(SPEC)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = main(["study", "run", str(spec), "--store", str(store), "--jobs", "0",
                 "--no-progress", "--tensorboard", str(blocker / "board")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("batchbound study: error: cannot write TensorBoard files to ")
    assert err.count("\n") == 1
    assert not store.exists()  # no run started
