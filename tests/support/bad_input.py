"""Bad input, the way a user meets it: the ``batchbound`` command line refuses it with one
line naming the problem and exit code 2, no traceback, no hang, and nothing lost.

``refused(argv, match)`` runs the CLI in this process (``batchbound.cli.main``), so a case
costs milliseconds, not a Python start-up; an exception escaping ``main`` fails the test with
its traceback, which is the defect being tested for. ``refused_subprocess`` runs it as a
separate process with a time limit, for the cases that hung or died (allocation, signals).

Every test module of bad-input classes tags its cases with ``BAD_INPUT`` (a pytest marker
applied through ``pytestmark``) so that ``pytest -m bad_input --collect-only -q`` counts them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

BAD_INPUT = pytest.mark.bad_input
# A fault in the middle of work (a killed or silent rank, SIGTERM, a full disk): one line,
# nothing already saved lost, and the rerun resumes (``pytest -m fault``).
FAULT = pytest.mark.fault


def _check(rc: int, err: str, match: str, argv: Sequence[str]) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, f"{argv}: traceback instead of a clear error:\n{err}"
    assert rc == 2, f"{argv}: exit code {rc}, expected 2; stderr:\n{err}"
    assert len(lines) == 1, f"{argv}: expected one line on stderr, got {len(lines)}:\n{err}"
    assert "error:" in lines[0], f"{argv}: not an error line: {lines[0]!r}"
    assert re.search(match, lines[0]), f"{argv}: {lines[0]!r} does not match {match!r}"
    return lines[0]


def refused(argv: Sequence[str], match: str, capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``batchbound *argv`` in this process; assert a one-line error matching ``match``
    (a regular expression) and exit code 2. Returns the line."""
    from batchbound.cli import main

    capsys.readouterr()
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse exits itself
        rc = exc.code if isinstance(exc.code, int) else 1
    err = capsys.readouterr().err
    return _check(rc, err, match, argv)


def refused_subprocess(argv: Sequence[str], match: str, *, timeout: float = 60,
                       cwd: str | Path | None = None) -> str:
    """Run ``python -m batchbound *argv`` as its own process within ``timeout`` seconds
    (a hang fails the test); assert a one-line error matching ``match`` and exit code 2."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    try:
        proc = subprocess.run([sys.executable, "-m", "batchbound", *argv], capture_output=True,
                              text=True, timeout=timeout, cwd=cwd, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{argv}: hung for more than {timeout:g} s")
    return _check(proc.returncode, proc.stderr, match, argv)
