"""The report as a list of blocks, each rendered to HTML and to Markdown by the block
itself, so that ``summary.md`` carries every section ``report.html`` has.

``report.document`` builds the blocks from the analyses; ``to_html`` and ``to_markdown``
render them. A ``Section`` groups blocks under an HTML anchor (Markdown has no wrapper).
Text may mark **bold** spans; citations are paper keys (``batchbound.study.references``),
links in HTML and ``[key]`` in Markdown.
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd

from batchbound.study.claims import CONTRADICTED, INCONCLUSIVE, SUPPORTED, Finding
from batchbound.study.claims.registry import fmt
from batchbound.study.references import REFERENCES

VERDICT_CSS = {SUPPORTED: "supported", CONTRADICTED: "not", INCONCLUSIVE: "inconclusive"}
CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222}table{border-collapse:collapse;font-size:13px;margin:1em 0}td,th{border:1px solid
#ccc;padding:3px 7px;text-align:right}th{background:#f2f2f2}figure{margin:1.5em 0}
figcaption{font-size:13px;color:#555}.supported{color:#176317}.not{color:#a31515}
.inconclusive{color:#8a6d00}.untestable{color:#777}#answer{overflow-x:auto;background:#f4f8fc;
border:1px solid #c9dbee;padding:0.5em 1.2em 1em;border-radius:6px}.failed{background:#fdecea;
border:1px solid #e6a29c;padding:0.6em 1em}table.glossary td{text-align:left}
table.glossary th{text-align:left;white-space:nowrap}.differs{color:#7a4b00}
pre{background:#f7f7f7;padding:1em;font-size:12px;white-space:pre-wrap;overflow-wrap:break-word}
table.glossary td{overflow-wrap:anywhere}td.text{text-align:left;min-width:10em}
td.long{min-width:16em}
.wide{overflow-x:auto;max-width:100%;background:linear-gradient(to left,#fff 40%,#fff0) right/
28px 100% no-repeat local,radial-gradient(farthest-side at 100% 50%,#0003,#0000) right/12px
100% no-repeat scroll #fff}.wide th:first-child,.wide td:first-child{position:sticky;left:0;
background:#fff;z-index:1}.wide th:first-child{background:#f2f2f2}.wide{margin:1em 0}
.wide table{margin:0}"""


def cell(value: Any) -> str:
    """A table cell as text: yes/no, n/a, miss, numbers by ``fmt``."""
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, (float, np.floating)):
        return fmt(float(value))  # n/a, miss, −∞, whole numbers, 3 significant digits
    return str(value)


def _cite_html(key: str) -> str:
    return f"<a href='#ref-{key}'>[{key}]</a>" if key in REFERENCES else ""


def _cite_md(key: str) -> str:
    return f"[{key}]" if key else ""


def _bold(text: str) -> str:
    """Escape, then turn **name** into <b>name</b>."""
    return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", html.escape(text))


class Block(Protocol):
    def html(self) -> str: ...

    def markdown(self) -> str: ...


@dataclass(frozen=True)
class Heading:
    level: int
    text: str
    cite: str = ""  # a paper key
    anchor: str = ""

    def html(self) -> str:
        anchor = f" id='{html.escape(self.anchor)}'" if self.anchor else ""
        cite = f" {_cite_html(self.cite)}" if self.cite else ""
        return f"<h{self.level}{anchor}>{html.escape(self.text)}{cite}</h{self.level}>"

    def markdown(self) -> str:
        cite = f" {_cite_md(self.cite)}" if self.cite else ""
        return f"{'#' * self.level} {self.text}{cite}"


@dataclass(frozen=True)
class Text:
    text: str
    style: str = ""  # "" | "small" | "warning" (boxed in HTML)

    def html(self) -> str:
        if self.style == "warning":
            return f"<p class='failed'>{_bold(self.text)}</p>"
        if self.style == "small":
            return f"<p><small>{_bold(self.text)}</small></p>"
        return f"<p>{_bold(self.text)}</p>"

    def markdown(self) -> str:
        return self.text


def _td(text: str) -> str:
    """A cell; a sentence (a note, an interval with its reason, "averaged over training") is
    left-aligned and kept at least 10em wide (a long one 16em): squeezed to its longest word
    it would stand one word a line. A number with a short mark ("32 (at the grid edge)")
    stays a number."""
    sentence = " " in text and (len(text) > 24 or (len(text) > 12 and text[0].isalpha()))
    if not sentence:
        return f"<td>{html.escape(text)}</td>"
    long = " long" if len(text) > 60 else ""  # a note of 100 letters: 16em, 5 lines not 9
    return f"<td class='text{long}'>{html.escape(text)}</td>"


@dataclass(frozen=True)
class Table:
    frame: pd.DataFrame
    empty: str = "none"  # said instead of an empty table

    def html(self) -> str:
        if self.frame.empty:
            return f"<p>{html.escape(self.empty)}</p>"
        head = "".join(f"<th>{html.escape(str(c))}</th>" for c in self.frame.columns)
        body = "".join("<tr>" + "".join(_td(cell(v)) for v in row) + "</tr>"
                       for row in self.frame.itertuples(index=False))
        # a wide table (17 columns) scrolls inside the page instead of running off it; a
        # shadow at its right edge says more columns lie beyond, and the first column (the
        # model) stays in view while it scrolls
        return f"<div class='wide'><table><tr>{head}</tr>{body}</table></div>"

    def markdown(self) -> str:
        if self.frame.empty:
            return self.empty
        frame = self.frame
        lines = ["| " + " | ".join(map(str, frame.columns)) + " |",
                 "|" + "---|" * frame.shape[1]]
        for row in frame.itertuples(index=False):
            lines.append("| " + " | ".join(cell(v).replace("|", "\\|") for v in row) + " |")
        return "\n".join(lines)


@dataclass(frozen=True)
class Pairs:
    """Name → text rows (the glossary, the environment), with an optional paper key."""

    rows: tuple[tuple[str, str, str], ...]  # (name, text, paper key or "")

    def html(self) -> str:
        e = html.escape
        return ("<table class='glossary'>" + "".join(
            f"<tr><th>{e(name)}</th><td>{e(text)} {_cite_html(src)}</td></tr>"
            for name, text, src in self.rows) + "</table>")

    def markdown(self) -> str:
        return "\n".join(f"- **{name}**: {text}{' ' + _cite_md(src) if src else ''}"
                         for name, text, src in self.rows)


@dataclass(frozen=True)
class Figure:
    stem: str
    caption: str
    path: Path

    def html(self) -> str:
        e = html.escape
        data = base64.b64encode(self.path.read_bytes()).decode()
        return (f"<figure id='{e(self.stem)}'><img alt='{e(self.stem)}' "
                f"style='max-width:100%' src='data:image/png;base64,{data}'><figcaption>"
                f"{e(self.caption)}</figcaption></figure>")

    def markdown(self) -> str:
        return f"![{self.stem}](figures/{self.path.name}) {self.caption}"


def units(finding: Finding) -> str:
    return f" ({finding.n})" if finding.n else ""


@dataclass(frozen=True)
class Verdicts:
    """The papers' claims, each with its verdict, its n, its evidence and, where the study's
    setting differs from the paper's, that difference beside it."""

    findings: tuple[Finding, ...]

    def html(self) -> str:
        e = html.escape
        items = []
        for f in self.findings:
            css = VERDICT_CSS.get(f.verdict, "untestable")
            differs = (f"<br><small class='differs'>Setting differs from the paper: "
                       f"{e(f.differs)}.</small>" if f.differs else "")
            items.append(f"<li><b class='{css}'>{e(f.verdict)}</b> {_cite_html(f.source)}"
                         f"{e(units(f))}: {e(f.claim)} <br><small>{e(f.evidence)}</small>"
                         f"{differs}</li>")
        return f"<ul>{''.join(items)}</ul>" if items else ""

    def markdown(self) -> str:
        return "\n".join(
            f"- **{f.verdict}** {_cite_md(f.source)}{units(f)}: {f.claim} {f.evidence}"
            + (f" *Setting differs from the paper: {f.differs}.*" if f.differs else "")
            for f in self.findings)


@dataclass(frozen=True)
class Pre:
    text: str

    def html(self) -> str:
        return f"<pre>{html.escape(self.text)}</pre>"

    def markdown(self) -> str:
        return f"```\n{self.text}\n```"


@dataclass(frozen=True)
class References:
    def html(self) -> str:
        return "<ul>" + "".join(f"<li id='ref-{k}'>[{k}] {html.escape(v)}</li>"
                                for k, v in REFERENCES.items()) + "</ul>"

    def markdown(self) -> str:
        return "\n".join(f"- [{k}] {v}" for k, v in REFERENCES.items())


@dataclass(frozen=True)
class Section:
    anchor: str
    blocks: list[Any] = field(default_factory=list)

    def html(self) -> str:
        inner = "\n".join(b.html() for b in self.blocks if b.html())
        return f"<section id='{html.escape(self.anchor)}'>{inner}</section>"

    def markdown(self) -> str:
        return "\n\n".join(b.markdown() for b in self.blocks if b.markdown())


def to_html(blocks: list[Any], title: str) -> str:
    return "\n".join([f"<!doctype html><html><head><meta charset='utf-8'><title>"
                      f"{html.escape(title)}</title><style>{CSS}</style></head><body>",
                      *[b.html() for b in blocks], "</body></html>"])


def to_markdown(blocks: list[Any]) -> str:
    return "\n\n".join(b.markdown() for b in blocks if b.markdown()) + "\n"


def headings(blocks: list[Any]) -> list[str]:
    """Every heading's text, sections included, in order (what both renderings show)."""
    out = []
    for block in blocks:
        if isinstance(block, Section):
            out += headings(block.blocks)
        elif isinstance(block, Heading):
            out.append(block.text)
    return out
