"""The README's demo block is what `batchbound demo` prints on a fresh store, verbatim."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_block() -> str:
    text = README.read_text()
    start = text.index("```\n", text.index("<!-- section:demo -->")) + 4
    return text[start:text.index("```\n", start)]


def test_readme_demo_block_is_the_demo_output(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "batchbound", "demo", "--fresh", "--store",
         str(tmp_path / "demo.sqlite"), "--out", str(tmp_path / "report")],
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == readme_block()


def test_readme_cites_every_paper_once_by_title():
    from batchbound.study.references import REFERENCES

    text = " ".join(README.read_text().split()).replace("*", "")
    for citation in REFERENCES.values():
        title = (citation.split(", ")[1] if citation.startswith("McCandlish")
                 else citation.split(", ")[0]).split(" (")[0]
        assert text.count(title) == 1, title
