"""The README's demo block is what `batchbound demo` prints on a fresh store: discrete results
exactly, continuous ones within the README's stated 1 %."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block() -> str:
    text = README.read_text()
    start = text.index("```\n", text.index("<!-- section:demo -->")) + 4
    return text[start:text.index("```\n", start)]


# `batchbound demo` in a fresh interpreter, its report's "How many workers" table on one
# worker: timing 2 local workers per model (two fresh interpreters each, about 25 s of the
# demo's 75) prints nothing in the summary, and tests/integration/test_advise_from_study.py
# (test_from_study_on_this_machine_times_two_workers) times them on a study's store.
DEMO = ("import sys; from batchbound.advise import workers; from batchbound.cli import main; "
        "table = workers.workers_table; "
        "workers.workers_table = lambda inputs, _: table(inputs, 1); "
        "sys.exit(main(sys.argv[1:]))")


def test_readme_demo_block_is_the_demo_output(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", DEMO, "demo", "--fresh", "--store",
         str(tmp_path / "demo.sqlite"), "--out", str(tmp_path / "report")],
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_summary(done.stdout, readme_block())


NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")
# Continuous columns of the table (Δ avg, nΔ avg, Δ match, nΔ match, B_crit); the others
# (depth, width, B*, largest B, linear ≤) are discrete.
CONTINUOUS_COLUMNS = {2, 3, 4, 5, 9}
TOLERANCE = 0.01  # the README's stated tolerance for continuous numbers


def _close(a: str, b: str) -> bool:
    x, y = float(a), float(b)
    return abs(x - y) <= TOLERANCE * max(abs(x), abs(y))


def _continuous(line: str, index: int) -> bool:
    if line.startswith("target"):
        return "matched training loss" in line and index == len(NUMBER.findall(line)) - 1
    if line.startswith("critical batch size"):
        return index in (0, 2, 3)  # B_crit, its interval; 95 and the run counts are exact
    return index in CONTINUOUS_COLUMNS


def assert_same_summary(got: str, want: str) -> None:
    """Line by line: the words equal, discrete numbers equal, continuous ones within 1 %."""
    got_lines, want_lines = got.splitlines(), want.splitlines()
    assert len(got_lines) == len(want_lines), got
    for line, expected in zip(got_lines, want_lines, strict=True):
        assert NUMBER.sub("#", line) == NUMBER.sub("#", expected), (line, expected)
        numbers, wanted = NUMBER.findall(line), NUMBER.findall(expected)
        for index, (a, b) in enumerate(zip(numbers, wanted, strict=True)):
            same = _close(a, b) if _continuous(expected, index) else a == b
            assert same, f"{a} against {b} (number {index}) in\n{line}\n{expected}"


def _with_cell(block: str, row: int, column: int, value: str) -> str:
    lines = block.splitlines()
    cells = lines[row].split()
    cells[column] = value
    lines[row] = " ".join(cells)
    return "\n".join(lines)


def test_the_comparison_is_exact_for_discrete_and_tolerant_for_continuous():
    block = readme_block()
    aligned = "\n".join(" ".join(line.split()) for line in block.splitlines())
    assert_same_summary(aligned, aligned)
    delta = float(aligned.splitlines()[2].split()[2])
    assert_same_summary(_with_cell(aligned, 2, 2, f"{delta * 1.005:.4g}"), aligned)
    with pytest.raises(AssertionError):  # Δ 3 % off
        assert_same_summary(_with_cell(aligned, 2, 2, f"{delta * 1.03:.4g}"), aligned)
    with pytest.raises(AssertionError):  # another B*
        assert_same_summary(_with_cell(aligned, 2, 6, "64"), aligned)


def test_readme_cites_every_paper_once_by_title():
    from batchbound.study.references import REFERENCES

    text = " ".join(README.read_text().split()).replace("*", "")
    for citation in REFERENCES.values():
        title = (citation.split(", ")[1] if citation.startswith("McCandlish")
                 else citation.split(", ")[0]).split(" (")[0]
        assert text.count(title) == 1, title
