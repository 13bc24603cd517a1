"""The registry of the papers' experiments a report can show a section for.

Each experiment is one function ``build(a) -> Section | None`` registered with
``@register_experiment``: it looks at a ``summary.StudyAnalysis`` and returns its section
(what the experiment measures, its tables, its figures, and the numbers its claims read)
when the study holds the data it needs, else None. Which experiment applies is decided by
the data (a study with replicated data sets gets the replication section, whatever its
name), never by the preset's name. Claims that speak about a section declare
``needs=("section:KEY",)`` in ``batchbound.study.claims``; the report shows their verdicts
inside the section and in the list of claims.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:  # the bundle's module imports this one
    from batchbound.study.summary import StudyAnalysis

Figure = tuple[str, str, Callable[[Any], None]]  # (file stem, caption, draw(fig))


@dataclass
class Section:
    key: str  # the HTML anchor and the claims' ``section:KEY``
    title: str
    source: str  # a key of batchbound.study.references.REFERENCES
    text: str  # what was run and how to read it, one paragraph
    tables: list[tuple[str, pd.DataFrame]] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # what the claims read


Builder = Callable[["StudyAnalysis"], "Section | None"]
EXPERIMENTS: dict[str, Builder] = {}


def register_experiment(build: Builder) -> Builder:
    EXPERIMENTS[build.__name__] = build
    return build


def sections(a: StudyAnalysis) -> list[Section]:
    """The section of every registered experiment the study's data supports, in order."""
    return [s for s in (build(a) for build in EXPERIMENTS.values()) if s is not None]
