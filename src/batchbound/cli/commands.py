"""The subcommands, in the order ``batchbound --help`` lists them, with the one line it shows
for each. Kept apart from the commands' modules, which import torch: ``batchbound --help``
lists them from here without importing any (see ``build_parser`` in ``cli/__init__.py``)."""

from __future__ import annotations

SUMMARY = {
    "measure": "measure gradient diversity Δ and the batch-size bound B = n·Δ",
    "data": "list the data sets and check which are available",
    "models": "list model families, describe a spec, print a fixed-budget shape table",
    "train": "train with synchronous data-parallel mini-batch SGD until targets or limits",
    "advise": "how many workers and what batch size, and how long",
    "study": "plan, run and export batch-size studies",
    "report": "write a study's HTML report and Markdown summary",
    "demo": "run the width-vs-depth demo study and write its report",
}
COMMANDS = list(SUMMARY)
