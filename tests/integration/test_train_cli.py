"""``batchbound train``: --json parses, human output names epochs/iterations/seconds, errors."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from batchbound.cli import main

ARGS = [
    "train",
    "--dataset",
    "digits",
    "--model",
    "fc(depth=1,params=800)",
    "--batch-size",
    "32",
    "--lr",
    "0.2",
    "--max-epochs",
    "3",
    "--no-progress",
]


def test_json_summary(capsys) -> None:
    code = main([*ARGS, "--target-train-acc", "0.5", "0.999", "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["status"] == "complete" and len(summary["config_hash"]) == 16
    reached, missed = summary["targets"]
    assert reached["reached"] and reached["iteration"] > 0 and reached["epoch"] > 0
    assert reached["seconds"] > 0 and not missed["reached"]
    assert summary["final"]["epochs"] == pytest.approx(3, abs=0.05)


def test_human_output_and_full_result(tmp_path, capsys) -> None:
    out = tmp_path / "run.json"
    assert main([*ARGS, "--target-test-acc", "0.5", "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "test_acc>=0.5: reached after" in text and "epochs" in text and "iterations" in text
    full = json.loads(out.read_text())
    assert full["curves"]["columns"] == ["iteration", "epoch", "seconds", "metric", "value"]


def test_config_file_with_flag_overrides(tmp_path, capsys) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text(
        'dataset = "digits"\nmodel = "fc(depth=1,params=800)"\nbatch_size = 16\nlr = 0.3\n'
        'max_iterations = 5\ntargets = [{metric = "train_acc", threshold = 0.99}]\n'
    )
    assert main(["train", "--config", str(toml), "--lr", "0.05", "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["final"]["iterations"] == 5 and summary["final"]["lr"] == 0.05
    assert summary["targets"][0]["name"] == "train_acc>=0.99"


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--lr", "0"], "lr must be a positive"),
        (["--strategy", "fast"], "unknown learning-rate strategy"),
        (["--batch-size", "100000"], "larger than the training set"),
        (["--workers", "64"], "more workers (64)"),
    ],
)
def test_bad_input_exits_2_without_traceback(capsys, extra: list, words: str) -> None:
    assert main([*ARGS, *extra]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


@pytest.mark.slow
def test_done_when_command_two_workers() -> None:
    command = [
        sys.executable,
        "-m",
        "batchbound",
        "train",
        "--dataset",
        "digits",
        "--model",
        "fc(depth=2,params=4000)",
        "--batch-size",
        "64",
        "--lr",
        "0.1",
        "--target-train-acc",
        "0.95",
        "--workers",
        "2",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    assert "train_acc>=0.95: reached after" in done.stdout


@pytest.mark.slow
def test_torchrun_matches_single_process() -> None:
    common = [
        "--dataset",
        "digits",
        "--model",
        "fc(depth=1,params=800)",
        "-B",
        "33",
        "--max-iterations",
        "20",
        "--dtype",
        "float64",
        "--no-progress",
        "--json",
    ]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "batchbound",
        "train",
        *common,
    ]
    done = subprocess.run(torchrun, capture_output=True, text=True, timeout=600, check=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 prints, rank 1 does not
    two = json.loads(lines[0])
    single = subprocess.run(
        [sys.executable, "-m", "batchbound", "train", *common],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    one = json.loads(single.stdout)
    assert two["final"]["train_loss"] == pytest.approx(one["final"]["train_loss"], rel=1e-10)


@pytest.mark.slow
def test_sigterm_stops_workers_with_a_checkpoint_then_resume(tmp_path) -> None:
    ckpt = tmp_path / "run.ckpt"
    command = [
        sys.executable,
        "-m",
        "batchbound",
        "train",
        "--dataset",
        "digits",
        "--model",
        "fc(depth=1,params=800)",
        "-B",
        "16",
        "--max-epochs",
        "40",
        "--workers",
        "2",
        "--checkpoint",
        str(ckpt),
        "--checkpoint-every",
        "50",
        "--no-progress",
        "--json",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.5)  # the first periodic checkpoint: the workers are training
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    stopped = json.loads(out)
    assert stopped["status"] == "stopped", err
    assert 0 < stopped["final"]["iterations"] < 40 * 1438 // 16
    resumed = subprocess.run(
        [*command, "--resume"], capture_output=True, text=True, timeout=600, check=True
    )
    done = json.loads(resumed.stdout)
    assert done["status"] == "complete" and done["final"]["epochs"] == pytest.approx(40, abs=0.02)
    assert done["config_hash"] == stopped["config_hash"]



# a valid non-default command-line value for each TrainConfig field whose type alone does not
# give one
SAMPLE_VALUES = {
    "dataset": "digits", "data_dir": "/tmp", "transform": "subset(n=100)",
    "model": "fc(depth=1,params=800)", "loss": "mse", "strategy": "srsr(base_batch=16)",
    "mechanism": "sgld(sigma=0.1)", "batch_policy": "fixed", "device": "cpu",
    "final_probes": "osg", "workers": "1", "momentum": "0.5", "divergence_factor": "3",
    "online_diversity": "norms", "mechanism_granularity": "example", "betas": "0.9,0.95",
    "eps": "1e-6",
}
ADAM_ONLY = ("betas", "eps")  # refused with SGD, which would ignore them


def test_every_config_field_has_a_flag_that_sets_it() -> None:
    """The flags are generated from TrainConfig: each field is settable, with its type."""
    import argparse
    import dataclasses

    from batchbound.cli.train import build_config, register
    from batchbound.train import TrainConfig

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    for field in dataclasses.fields(TrainConfig):
        if field.name in ("targets", "stop_at_targets"):  # --target-*, --no-stop-at-targets
            continue
        if field.name == "data_files":  # a study's record of the files it read, not an option
            continue
        flags = field.metadata.get("flags") or (f"--{field.name.replace('_', '-')}",)
        choices = field.metadata.get("choices")
        value = SAMPLE_VALUES.get(field.name) or (choices[-1] if choices else "3")
        extra = ["--optimizer", "adamw"] if field.name in ADAM_ONLY else []
        args = parser.parse_args(["train", *extra, flags[0], value])
        got = getattr(build_config(args), field.name)
        parse = field.metadata.get("parse")
        expected = (parse(value) if parse else (value,) if isinstance(got, tuple)
                    else type(got)(value))
        assert got == expected, field.name


def test_tensorboard_flag_writes_event_files_tensorboard_reads(tmp_path, capsys) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tb"
    code = main(["train", "--max-iterations", "6", "--eval-every-iterations", "3",
                 "--online-diversity", "two_batch", "--micro-batch", "16", "--no-progress",
                 "--tensorboard", str(logdir)])
    assert code == 0
    events = EventAccumulator(str(logdir))
    events.Reload()
    tags = events.Tags()["scalars"]
    losses = events.Scalars(next(t for t in tags if t.endswith("batch_loss")))
    assert [e.step for e in losses] == [1, 2, 3, 4, 5, 6]
    assert any("online_batch_bound" in t for t in tags)


def test_tensorboard_directory_is_checked_before_training(tmp_path, capsys) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code = main([*ARGS, "--tensorboard", str(blocker / "tb")])
    assert code == 2
    err = capsys.readouterr().err
    assert "cannot write TensorBoard files" in err and "epoch" not in err


def test_a_missed_target_is_said_in_the_status_line(capsys) -> None:
    assert main([*ARGS, "--target-train-acc", "0.5", "0.9999"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("status: target missed: train_acc>=0.9999 (the run completed:")
    assert "complete (" not in first
