"""``batchbound advise`` end to end on digits: the JSON the issue asks for, in under a minute
of its own CPU (not the machine's wall clock), and bad input as one line with exit code 2; the
same command twice beside CPU hogs gives the same answer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from batchbound.cli import main

COMMAND = ["advise", "--dataset", "digits", "--model", "fc(depth=2,params=4000)", "--lr", "0.1",
           "--target-train-acc", "0.95"]


def _cpu_seconds() -> float:
    """CPU seconds of this process and the rank processes it waited for."""
    import resource

    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def test_advise_json_on_this_machine(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    start = _cpu_seconds()
    code = main([*COMMAND, "--max-workers", "2", "--json", "--figure", str(tmp_path / "a.png")])
    seconds = _cpu_seconds() - start  # its own work, whatever else runs on the machine
    assert code == 0 and seconds < 60
    advice = json.loads(capsys.readouterr().out)
    assert advice["batch_bound"] > 1
    best = [r for r in advice["rows"] if r["best"]]
    assert [r["workers"] for r in best] == [1, 2]
    assert {r["workers"] for r in advice["rows"]} == {1, 2}  # every candidate batch, each P
    trusted = advice["timing_reliable"]
    assert advice["recommended_on"] == ("seconds" if trusted else "iterations")
    band = advice["model_error"]  # no recorded run of this job: every recorded row counts
    assert band["left_out"] == 0 and band["per_doubling"][0] < 0 <= band["per_doubling"][1]
    for row in advice["rows"]:
        low, high = row["iterations_interval"]
        assert low <= row["iterations"] <= high
        p_low, p_high = row["pilot_interval"]  # the model's error only widens
        assert low <= p_low and p_high <= high
        assert row["batch_size"] % row["workers"] == 0
        if not trusted:  # a busy machine: the seconds are unknown, not guessed
            assert row["seconds_to_target"] is None and row["speedup"] is None
            continue
        s_low, s_high = row["seconds_interval"]
        assert s_low <= row["seconds_to_target"] <= s_high
        assert row["seconds_to_target"] == pytest.approx(
            row["iterations"] * row["seconds_per_iteration"])
        assert row["seconds_per_iteration"] == pytest.approx(
            row["compute_seconds"] + row["communication_seconds"])
    if trusted:
        assert best[0]["communication_seconds"] == 0
        assert best[1]["communication_seconds"] > 0  # timed with gloo
    else:
        assert advice["recommended"]["workers"] == 1 and advice["timing_warning"]
    assert set(advice["recommended"]) == {"workers", "batch_size", "lr", "iterations",
                                          "iterations_interval", "seconds_to_target",
                                          "seconds_interval"}
    assert advice["pilot"]["iterations"] > 0 and isinstance(trusted, bool)
    assert "workers_stop_paying" in advice and "McCandlish" in advice["assumptions"]
    assert (tmp_path / "a.png").stat().st_size > 10_000


def test_advise_projects_to_a_cluster(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.toml"
    cluster.write_text("[network]\nbandwidth_gbytes_per_s = 10\nlatency_us = 5\n"
                       "[cluster]\nmax_workers = 1024\n"
                       "[device]\nexamples_per_second = 20000\nmax_micro_batch = 64\n")
    assert main([*COMMAND, "--cluster", str(cluster), "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)
    workers = [r["workers"] for r in advice["rows"]]
    assert workers[0] == 1 and workers[-1] <= 1024
    assert all(r["batch_size"] <= 64 * r["workers"] for r in advice["rows"])


@pytest.mark.parametrize("extra, message", [
    ([], "or a target"),
    (["--cluster", "/nonexistent.toml"], "does not exist"),
    (["--max-workers", "100000"], "cores"),
    (["--figure", "/nonexistent/dir/a.png"], "does not exist"),
])
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], extra: list[str],
                                          message: str) -> None:
    args = [a for a in COMMAND if a not in ("--target-train-acc", "0.95")] if not extra else \
        COMMAND
    code = main([*args, *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and message in err[-1] and err[-1].startswith("batchbound advise: error")


def test_timing_workers_never_reimports_the_callers_script(tmp_path: Path) -> None:
    """P local workers are fresh interpreters, so a script without a __main__ guard is not
    run again by each of them (multiprocessing's spawn would)."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from batchbound.advise.timing import time_workers\n"
        "from batchbound.train import TrainConfig\n"
        "print('script ran', flush=True)\n"
        "config = TrainConfig(dataset='digits', model='fc(depth=1,params=500)', lr=0.1,\n"
        "                     batch_size=4)\n"
        "curve, communication = time_workers(config, 2, [1, 4], 1, repeats=5)\n"
        "print(curve.sizes, communication > 0)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.count("script ran") == 1
    assert "(1, 4) True" in done.stdout


def test_advise_takes_every_pilot_option_from_trains_schema() -> None:
    """One schema: each TrainConfig field is a pilot flag (with train's own help) or excluded
    with a reason, so a new field forces the choice."""
    import dataclasses

    from batchbound.cli import build_parser
    from batchbound.cli.advise import PILOT_EXCLUDED, PILOT_FIELDS
    from batchbound.train import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(PILOT_FIELDS) | set(PILOT_EXCLUDED) == fields
    assert not set(PILOT_FIELDS) & set(PILOT_EXCLUDED)
    parser = build_parser()
    helps = {}
    for name in ("train", "advise"):
        sub = parser._subparsers._group_actions[0].choices[name]  # argparse's own registry
        helps[name] = {a.dest: a.help for a in sub._actions}
    for name in PILOT_FIELDS:
        assert name in helps["advise"] and name in helps["train"], name
        if name != "batch_size":  # advise's B0 defaults to 16
            assert helps["advise"][name] == helps["train"][name], name


HOG = "import time\nend = time.monotonic() + 240\nwhile time.monotonic() < end: pass"


@pytest.mark.slow
def test_the_same_command_twice_beside_cpu_hogs_recommends_the_same(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Two CPU hogs (ended by the test, and by themselves within 4 minutes) make the seconds
    untrustworthy: both runs say so and answer on iterations, which the pilot fixes."""
    from batchbound.advise.timing import OtherWork

    if not OtherWork().known:
        pytest.skip("no /proc/stat: other processes' CPU cannot be seen here")
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(2)]
    answers = []
    try:
        for _ in range(2):
            assert main([*COMMAND[:-2], "--planned-epochs", "3", "--max-workers", "1",
                         "--json"]) == 0
            answers.append(json.loads(capsys.readouterr().out))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    first, second = answers
    assert first["recommended_on"] == second["recommended_on"] == "iterations"
    assert "cores busy while timing" in first["timing_warning"]
    assert first["recommended"] == second["recommended"]
    assert first["recommended"]["seconds_to_target"] is None
    assert [r["batch_size"] for r in first["rows"] if r["best"]] == [
        first["recommended"]["batch_size"]]
