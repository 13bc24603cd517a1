"""TensorBoard output: what is written reads back equal through TensorBoard's own reader,
rewrites replace, bad directories and a missing package fail up front in one line."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from batchbound.errors import BatchboundError
from batchbound.train import RunResult, TargetResult, TrainConfig
from batchbound.train import tensorboard as tb

# writing and reading need the tensorboard package (an optional dependency)
needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                       reason="tensorboard not installed")
ROWS = [
    (0, 0.0, 0.0, "lr", 0.1), (0, 0.0, 0.0, "batch_size", 32.0),
    (0, 0.0, 0.0, "train_loss", 2.3), (0, 0.0, 0.0, "test_acc", 0.1),
    (1, 0.02, 0.25, "batch_loss", 2.2), (1, 0.02, 0.25, "online_diversity", 0.031),
    (1, 0.02, 0.25, "online_batch_bound", 44.6),
    (2, 0.04, 0.5, "batch_loss", math.inf), (2, 0.04, 0.5, "diversity", 0.02),
    (2, 0.04, 0.5, "batch_bound", 28.8), (2, 0.04, 0.5, "train_grad_noise", 7.0),
    (2, 0.04, 0.5, "weird metric", 1.5),
]


def result(**changes: object) -> RunResult:
    config = TrainConfig(model="fc(depth=1,params=800)", batch_size=32, max_iterations=2)
    fields = dict(config=config, config_hash=config.config_hash(), status="diverged",
                  curves=list(ROWS), final={"train_loss": 2.3, "iterations": 2, "osg_mean": 0.5},
                  targets=[TargetResult("train_acc>=0.9", "train_acc", 0.9)],
                  message="diverged at iteration 2")
    return RunResult(**{**fields, **changes})  # type: ignore[arg-type]


def accumulator(logdir: Path):  # type: ignore[no-untyped-def]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float, float]]]:
    acc = accumulator(logdir)
    return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


@needs_tensorboard
def test_every_curve_row_reads_back_under_its_tag(tmp_path: Path) -> None:
    run = result()
    path = tb.write_run(run, tmp_path / "run", finished_at=1000.0)
    assert path.parent == tmp_path / "run" and "tfevents" in path.name
    scalars = read_scalars(tmp_path / "run")
    expected: dict[str, list[tuple[int, float]]] = {}
    for iteration, _, _, metric, value in ROWS:
        expected.setdefault(tb.tag_for(metric), []).append((iteration, value))
    assert {t for t in scalars if not t.startswith(("final/", "progress/"))} == set(expected)
    for tag, points in expected.items():
        got = scalars[tag]
        assert [s for s, _, _ in got] == [s for s, _ in points]
        np.testing.assert_allclose([v for _, v, _ in got], [v for _, v in points],
                                   rtol=1e-6)  # float32 on disk
    assert scalars["train/batch_loss"][1][1] == math.inf
    assert set(expected) >= {"train/loss", "test/acc", "optim/lr", "optim/batch_size",
                             "diversity/exact", "diversity/batch_bound", "diversity/online",
                             "diversity/online_batch_bound", "train/grad_noise",
                             "other/weird metric"}
    # wall time: finished_at minus the training seconds still to come
    assert [w for *_, w in scalars["optim/lr"]] == pytest.approx([999.5])
    assert [w for *_, w in scalars["diversity/exact"]] == pytest.approx([1000.0])
    assert [s for s, _, _ in scalars["progress/epoch"]] == [0, 1, 2]
    assert [v for _, v, _ in scalars["progress/epoch"]] == pytest.approx([0.0, 0.02, 0.04])
    assert [(s, v) for s, v, _ in scalars["final/osg_mean"]] == [(2, 0.5)]


@needs_tensorboard
def test_config_text_and_hparams(tmp_path: Path) -> None:
    run = result()
    tb.write_run(run, tmp_path)
    acc = accumulator(tmp_path)
    config_text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| batch_size | `32` |" in config_text and "fc(depth=1,params=800)" in config_text
    run_text = acc.Tensors("run/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "diverged" in run_text and run.config_hash in run_text and "not reached" in run_text
    from tensorboard.plugins.hparams import metadata

    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    session = metadata.parse_session_start_info_plugin_data(
        content[metadata.SESSION_START_INFO_TAG])
    assert session.hparams["batch_size"].number_value == 32
    assert session.hparams["status"].string_value == "diverged"
    assert session.hparams["model"].string_value == "fc(depth=1,params=800)"
    assert "max_epochs" in session.hparams and "max_seconds" not in session.hparams  # None
    assert metadata.EXPERIMENT_TAG not in content  # TensorBoard builds it from all runs


@needs_tensorboard
def test_rewrite_replaces_the_event_file(tmp_path: Path) -> None:
    first = tb.write_run(result(), tmp_path, finished_at=50.0)
    (tmp_path / "notes.txt").write_text("kept")
    (tmp_path / "sub").mkdir()
    second = tb.write_run(result(curves=ROWS[:4]), tmp_path, finished_at=60.0)
    events = sorted(p for p in tmp_path.iterdir() if "tfevents" in p.name)
    assert first != second and not first.exists()
    assert events == [second] and (tmp_path / "notes.txt").exists()
    scalars = read_scalars(tmp_path)
    assert [s for s, _, _ in scalars["train/loss"]] == [0]  # no points left from the first
    assert "train/batch_loss" not in scalars
    marker = json.loads((tmp_path / tb.MARKER).read_text())
    assert marker["rows"] == 4 and tb.written_key(tmp_path) == result().config_hash


@needs_tensorboard
def test_stored_nulls_and_missing_seconds(tmp_path: Path) -> None:
    rows = [(0, None, None, "train_loss", None), (3, 0.1, 0.3, "train_loss", 1.0)]
    tb.write_run(result(curves=rows, final={}), tmp_path, finished_at=10.0)
    (first, second) = read_scalars(tmp_path)["train/loss"]
    assert math.isnan(first[1]) and first[2] == pytest.approx(9.7)  # the run's start
    assert second[:2] == (3, 1.0)


def test_tags_follow_the_mapping_then_the_fallback() -> None:
    assert tb.tag_for("test_loss") == "test/loss"
    assert tb.tag_for("online_snr") == "diversity/online_snr"
    assert tb.tag_for("diversity_chunked") == "diversity/diversity_chunked"
    assert tb.tag_for("grad_norm") == "other/grad_norm"


def test_run_names_are_readable_safe_and_keyed() -> None:
    labels = {"data": "digits", "model": "fc(depth=2,width=36)", "model_label": "L=2 K=36",
              "strategy": "lsr(base_batch=64)", "batch_size": 256, "lr": 0.3, "seed": 1,
              "mechanism": "dropconnect(p=0.1)"}
    name = tb.run_name(labels, "0123456789abcdef")
    assert name == "digits_L=2-K=36_lsr-base-batch=64_B256_lr0.3_seed1_dropconnect-p=0.1_01234567"
    assert "/" not in tb.run_name({"data": "npz(path=/a/b.npz)"}, "k" * 16)
    config = TrainConfig(model="fc(depth=1,params=800)").to_dict()
    assert tb.run_name(config, "feedbeef00") == \
        "digits_fc-depth=1-params=800_blr_B64_lr0.1_seed0_feedbeef"


@needs_tensorboard
def test_unwritable_logdir_is_one_line_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(BatchboundError, match="cannot write TensorBoard files") as info:
        tb.check_logdir(blocker / "runs")
    assert "\n" not in str(info.value)
    assert tb.check_logdir(tmp_path / "new" / "dir").is_dir()


def test_missing_tensorboard_names_the_install(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(BatchboundError, match=r"pip install .batchbound\[tensorboard\]."):
        tb.check_logdir(tmp_path)
    with pytest.raises(BatchboundError, match=r"pip install .batchbound\[tensorboard\]."):
        tb.write_run(result(), tmp_path)


def test_importing_batchbound_does_not_import_tensorboard() -> None:
    code = ("import sys, batchbound, batchbound.train, batchbound.cli, "
            "batchbound.study.runner, batchbound.train.tensorboard; "
            "print(any(m.split('.')[0] == 'tensorboard' or m == 'torch.utils.tensorboard' "
            "for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
