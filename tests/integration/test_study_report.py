"""End to end: a study runs into the store and renders a report whose HTML parses and whose
images are present and non-empty; the same with the real trainer on a tiny grid."""

from __future__ import annotations

import base64
from html import unescape
from html.parser import HTMLParser

import pytest

from batchbound.cli import main
from batchbound.study.report import write_report
from batchbound.study.runner import run_study
from batchbound.study.spec import study_from_dict
from batchbound.study.store import Store


def spec(**train):
    return study_from_dict({
        "study": {"name": "rep", "description": "report test"},
        "data": {"datasets": ["digits"]},
        "models": {"family": "fc", "params": 3000, "depths": [1, 2, 4]},
        "batches": {"sizes": [32, 64, 128, 256, 512]},
        "lr": {"grid": [0.1, 0.3], "tune_epochs": 0.5},
        "train": {"targets": {"train_acc": 0.6}, "max_epochs": 12, "repeats": 2,
                  "diversity_every_epochs": 1, **train},
    })


class Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[bytes] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            src = dict(attrs)["src"]
            assert src.startswith("data:image/png;base64,")
            self.images.append(base64.b64decode(src.split(",", 1)[1]))


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    outcome = run_study(spec(), root / "s.sqlite", jobs=0, progress=False,
                        trainer="simulated_trainer:execute")
    assert outcome.failed == 0 and outcome.executed == outcome.total == 30 + 30
    return root


@pytest.fixture(scope="module")
def report(simulated):
    return write_report(simulated / "s.sqlite", "rep", simulated / "report")


def test_report_renders(report):
    paths = report
    parser = Images()
    parser.feed(paths.html.read_text())
    assert {"html", "table", "figure", "img"} <= set(parser.tags)
    assert len(parser.images) == len(paths.figures) >= 6
    for image in parser.images:
        assert image.startswith(b"\x89PNG") and len(image) > 5000
    for png in paths.figures:
        assert png.stat().st_size > 5000 and png.with_suffix(".svg").stat().st_size > 5000
    text = paths.markdown.read_text()
    assert text.startswith("## Answer") and "## The papers' claims" in text
    assert "### Glossary" in text and "An Empirical Model of Large-Batch Training" in text
    html = unescape(paths.html.read_text())
    # the answer comes before any figure, and cites the papers by title once
    assert html.index("id='answer'") < html.index("<figure")
    assert html.count("The Effect of Network Width on the Performance") == 1
    assert "Environment" in html and "torch" in html and '"max_epochs": 12' in html
    # analyses ran on the simulated data: thresholds found, speedup never beats linear
    a = paths.analysis
    assert a.shapes["threshold_batch"].notna().sum() >= 2
    speed = a.speedups
    assert (speed["speedup"] <= speed["ideal"] + 1e-9).all()


class Headings(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self._in = False

    def handle_starttag(self, tag, attrs):
        if tag in ("h1", "h2", "h3"):
            self._in, self.text = True, ""

    def handle_endtag(self, tag):
        if tag in ("h1", "h2", "h3"):
            self._in = False
            self.found.append(" ".join(self.text.split()))

    def handle_data(self, data):
        if self._in:
            self.text += data


def test_summary_md_carries_every_section_of_the_html(report):
    parser = Headings()
    parser.feed(report.html.read_text())
    markdown = [line.lstrip("#").strip() for line in report.markdown.read_text().splitlines()
                if line.startswith("#")]
    assert "Tables" in parser.found and "Study spec" in parser.found
    assert sorted(parser.found) == sorted(markdown)


def test_every_table_of_the_page_scrolls_inside_it(report):
    """A data table wider than the page (the epochs table's 17 columns) scrolls in its own
    box; the name/text tables (glossary, environment) wrap instead."""
    page = report.html.read_text()
    tables = page.count("<table")
    boxed = page.count("<div class='wide'><table>")
    assert boxed >= 8 and tables == boxed + page.count("<table class='glossary'>")


def test_every_verdict_line_states_its_independent_units(report):
    lines = [line for line in report.markdown.read_text().splitlines()
             if line.startswith("- **") and line.split("**")[1] in (
                 "supported", "contradicted", "inconclusive", "not testable")]
    assert lines and all("(n = " in line for line in lines)
    html = unescape(report.html.read_text())
    assert html.count("(n = ") >= len(lines)


def test_report_cli(simulated):
    assert main(["report", "nope", "--store", str(simulated / "s.sqlite")]) == 2
    assert main(["study", "export", str(simulated / "s.sqlite"), "--out",
                 str(simulated / "csv")]) == 0
    assert (simulated / "csv" / "curves.csv").stat().st_size > 1000


def test_real_trainer_tiny_study(tmp_path):
    tiny = study_from_dict({
        "study": {"name": "real"},
        "data": {"datasets": ["digits"]},
        "models": {"family": "fc", "params": 2000, "depths": [1, 2]},
        "batches": {"sizes": [64, 256]},
        "lr": {"grid": [0.3], "tuning": "none"},
        "train": {"targets": {"train_acc": 0.8}, "max_epochs": 3, "repeats": 1,
                  "diversity_every_epochs": 1},
    })
    outcome = run_study(tiny, tmp_path / "r.sqlite", jobs=0, progress=False)
    assert (outcome.executed, outcome.failed) == (4, 0)
    with Store(tmp_path / "r.sqlite") as store:
        frames = store.frames("real")
    assert set(frames["runs"]["status"]) <= {"complete", "diverged"}
    assert len(frames["targets"]) == 4 and frames["curves"]["metric"].eq("train_loss").any()
    assert frames["diversity"]["metric"].eq("diversity").any()
    again = run_study(tiny, tmp_path / "r.sqlite", jobs=0, progress=False)
    assert (again.executed, again.skipped) == (0, 4)


def test_diverged_runs_and_several_thresholds(tmp_path):
    """LSR scales η past 1 at large batches, where the simulated trainer diverges: the
    report says so in its answer, its tables and its fits; two thresholds of one metric
    are each analysed."""
    lsr = study_from_dict({
        "study": {"name": "div"},
        "data": {"datasets": ["digits"]},
        "models": {"family": "fc", "params": 3000, "depths": [1, 2]},
        "batches": {"sizes": [32, 64, 128, 256, 512, 1024]},
        "lr": {"strategy": "lsr(base_batch=32)", "grid": [0.05], "tuning": "none"},
        "train": {"targets": {"train_acc": [0.3, 0.35]}, "max_epochs": 30, "repeats": 2,
                  "diversity_every_epochs": 1},
    })
    outcome = run_study(lsr, tmp_path / "d.sqlite", jobs=0, progress=False,
                        trainer="simulated_trainer:execute")
    assert outcome.failed == 0
    paths = write_report(tmp_path / "d.sqlite", "div", tmp_path / "report", max_workers=1)
    a = paths.analysis
    assert a.targets == ["train_acc>=0.3", "train_acc>=0.35"]
    assert set(a.by_target["target"]) == set(a.targets)
    # η = 0.05·B/32 > 1 only at B = 1024: both runs of both models diverge there
    dead = a.epochs[a.epochs["batch_size"] == 1024]
    assert (dead["diverged"] == 2).all() and (a.epochs[a.epochs["batch_size"] < 1024]
                                               ["diverged"] == 0).all()
    assert (a.critical["diverged"] == 2).all()  # left out of the fit, and counted
    # at B = 512, η = 0.8 is so far off that training accuracy ends at 0.11 (chance 0.1):
    # those runs collapsed; they are counted and left out like the diverged ones
    assert (a.epochs[a.epochs["batch_size"] == 512]["collapsed"] == 2).all()
    assert (a.critical["collapsed"] == 2).all()
    assert (a.loss_thresholds["from_batch"] == 256).all()  # not from the diverged runs
    assert (a.loss_speedups[a.loss_speedups["batch_size"] == 1024]["speedup"] == 0).all()
    html = unescape(paths.html.read_text())
    assert "Diverged runs: 2 of 12." in html and "Every target" in html
    assert "Collapsed runs (accuracy at chance or loss never below its start" in html
    assert "final collapsed: 4" in html
    assert "train_acc>=0.35" in html


def test_failed_runs_are_reported_and_exit_non_zero(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHBOUND_SIM_CRASH_LR", "0.3")
    small = study_from_dict({
        "study": {"name": "fails"},
        "data": {"datasets": ["digits"]},
        "models": {"family": "fc", "params": 3000, "depths": [1]},
        "batches": {"sizes": [32, 64, 128]},
        "lr": {"grid": [0.1, 0.3], "tuning": "none"} if False else
        {"grid": [0.3], "tuning": "none"},
        "train": {"targets": {"train_acc": 0.6}, "max_epochs": 4, "repeats": 1},
    })
    outcome = run_study(small, tmp_path / "f.sqlite", jobs=1, progress=False,
                        trainer="simulated_trainer:execute")
    assert outcome.failed == 3
    paths = write_report(tmp_path / "f.sqlite", "fails", tmp_path / "report", max_workers=1)
    assert paths.failed == 3
    assert "**3 runs failed**" in paths.markdown.read_text()


def test_every_column_of_the_tables_section_is_explained(report):
    """The Tables section shows the analyses' CSV names (e_min, one_run, at_bound …): the
    report says what each holds."""
    from batchbound.study.columns import COLUMNS

    a = report.analysis
    for frame in (a.epochs, a.speedups, a.regimes, a.critical, a.loss_thresholds, a.diversity):
        assert set(frame.columns) <= set(COLUMNS), set(frame.columns) - set(COLUMNS)
    html = unescape(report.html.read_text())
    assert "<th>e_min</th><td>E_min = S_min·B_crit" in html
    assert "- **one_run**: every batch has one run" in report.markdown.read_text()
