"""``batchbound --help`` (and ``--version``, and a bare ``batchbound``) import none of torch,
numpy, pandas or matplotlib: the list of commands comes from ``cli/commands.py``, and only
the command asked for is imported. Checked on sys.modules, not on a clock, so a busy machine
cannot fail it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "numpy", "pandas", "matplotlib")
PROBE = """
import contextlib, io, json, sys
from batchbound.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    try:
        code = main({argv!r})
    except SystemExit as exc:
        code = exc.code
print(json.dumps({{"code": code, "out": out.getvalue(),
                  "heavy": [m for m in {heavy!r} if m in sys.modules]}}))
"""


def _run(argv: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv, heavy=HEAVY)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--version"], []])
def test_top_level_help_imports_no_heavy_library(argv: list[str]) -> None:
    result = _run(argv)
    assert result["heavy"] == [], result
    if argv[:1] in (["--help"], ["-h"]):
        assert result["code"] == 0
        from batchbound.cli.commands import COMMANDS, SUMMARY

        for name in COMMANDS:  # every command listed, with its line
            assert name in result["out"] and SUMMARY[name].split()[0] in result["out"]


def test_a_commands_help_still_shows_its_own_options() -> None:
    result = _run(["measure", "--help"])
    assert result["code"] == 0 and "--engine" in result["out"]
    assert "MODULE:CALLABLE" in result["out"]  # a user's own factory, as train's help says
    assert "torch" in result["heavy"]  # the control: the probe does see an import


def test_every_command_uses_its_listed_line() -> None:
    from batchbound.cli import build_parser
    from batchbound.cli.commands import COMMANDS, SUMMARY

    actions = build_parser()._subparsers._group_actions[0]  # argparse's own registry
    listed = {a.dest: a.help for a in actions._choices_actions}
    assert list(actions.choices) == COMMANDS and listed == SUMMARY


def test_progress_in_a_log_is_plain_lines_not_carriage_returns(capsys) -> None:
    from batchbound.train.progress import Progress

    progress = Progress(True, 3.0, "epoch", terminal=False)
    for i in range(1, 200):
        progress.update(i / 100, i, 1.0 / i, 0.5, 1000.0, 32)
    progress.close()
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and 2 <= len(lines) <= 3  # the first, the last, nothing between
    assert lines[0] == ("progress: epoch 0.01/3, it 1, loss 1, acc 0.500, samples/s 1000, "
                        "B 32")
    assert lines[-1].startswith("progress: epoch 1.99/3, it 199, loss 0.005025")


def test_a_studys_progress_in_a_log_is_plain_lines(capsys) -> None:
    from batchbound.study.runner import _Progress

    progress = _Progress(5, enabled=True)
    assert progress.bar is None  # no bar: stderr is captured, not a terminal
    for _ in range(5):
        progress.advance(None, None)  # type: ignore[arg-type]
    progress.close()
    err = capsys.readouterr().err
    assert "\r" not in err and err.splitlines() == ["study: 5/5 runs"]


def test_a_runs_last_progress_line_shows_the_evaluation_that_ended_it(capsys) -> None:
    """The step's update comes before its evaluation: the last line said acc 0.949 where the
    run had just reached its 0.95 target (the README's tour)."""
    from batchbound.train.progress import Progress

    progress = Progress(True, 100.0, "epoch", terminal=False)
    progress.update(0.04, 1, 2.3, 0.099, 1000.0, 64)  # written: the first line
    progress.update(8.5, 191, 0.11, 0.949, 1000.0, 64)  # pending: within the interval
    progress.evaluated(0.956)
    progress.evaluated(None)  # a regression run has no accuracy: nothing changes
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["progress: epoch 0.04/100, it 1, loss 2.3, acc 0.099, samples/s 1000, B 64",
                     "progress: epoch 8.50/100, it 191, loss 0.11, acc 0.956, samples/s 1000, "
                     "B 64"]


def test_an_evaluation_never_adds_a_line_of_its_own(capsys) -> None:
    from batchbound.train.progress import Progress

    progress = Progress(True, 3.0, "epoch", terminal=False)
    progress.evaluated(0.5)  # before any step: nothing to show
    progress.update(0.5, 1, 1.0, 0.4, 10.0, 8)  # the first update is written at once
    progress.evaluated(0.6)  # that line stands; the next one will carry 0.6
    progress.close()
    assert capsys.readouterr().err.splitlines() == [
        "progress: epoch 0.50/3, it 1, loss 1, acc 0.400, samples/s 10, B 8"]
