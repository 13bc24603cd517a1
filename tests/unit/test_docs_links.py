"""The README is a front door: short, every manual page one click away, and no link in the
README or docs/ that leads nowhere (a missing file or a heading that is not there)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
# The manual's sections, moved out of the README along their markers, and where they live.
MOVED = {"diversity": "diversity.md", "data": "data.md", "models": "models.md",
         "train": "train.md", "integrations": "integrations.md", "study": "study.md",
         "trust": "trust.md", "benchmarks": "benchmarks.md",
         "advise": "advise.md"}
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    out: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base, k = slug(heading), 0
        while (name := base if k == 0 else f"{base}-{k}") in out:
            k += 1
        out.add(name)
    return out


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 400


def test_each_moved_section_is_one_page_linked_from_the_readme():
    readme = README.read_text()
    for section, page in MOVED.items():
        holders = [p.name for p in PAGES if f"<!-- section:{section} -->" in p.read_text()]
        assert holders == [page], (section, holders)
        assert f"(docs/{page})" in readme, page
        assert f"<!-- section:{section} -->" not in readme, section
    for page in PAGES:  # every page one click from the front door
        assert f"(docs/{page.name}" in readme, page.name


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: p.name)
def test_every_relative_link_resolves(path: Path):
    text = FENCE.sub("", path.read_text())
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file, _, anchor = target.partition("#")
        where = (path.parent / file).resolve() if file else path
        assert where.exists(), f"{path.name}: {target} (no such file)"
        if anchor and where.suffix == ".md":
            assert anchor in anchors(where), f"{path.name}: {target} (no such heading)"


def test_the_slug_follows_github():
    assert slug("How many workers: `batchbound advise`") == "how-many-workers-batchbound-advise"
    assert slug("Mechanisms ([diversity])") == "mechanisms-diversity"
    assert slug("The papers' experiments at their scale") == "the-papers-experiments-at-their-scale"
