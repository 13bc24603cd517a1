"""End to end: a study runs into the store and renders a report whose HTML parses and whose
images are present and non-empty; the same with the real trainer on a tiny grid."""

from __future__ import annotations

import base64
from html import unescape
from html.parser import HTMLParser

import pytest

from batchbound.cli import main
from batchbound.study.report import SUPPORTED, write_report
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
    assert "## The seeds' claims" in text and "B_crit" in text
    html = unescape(paths.html.read_text())
    assert "Environment" in html and "torch" in html and '"max_epochs": 12' in html
    # analyses ran on the simulated data: thresholds found, speedup never beats linear
    a = paths.analysis
    assert a.shapes["threshold_batch"].notna().sum() >= 2
    speed = a.speedups
    assert (speed["speedup"] <= speed["ideal"] + 1e-9).all()


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


def test_claim_verdicts_are_computed_not_fixed(report):
    from batchbound.study.report import claims

    a = report.analysis
    verdicts = {c.claim[:40]: c.verdict for c in claims(a)}
    assert any(v == SUPPORTED for v in verdicts.values())
    flipped = a.shapes.assign(threshold_batch=a.shapes["depth"] * 16.0)  # B* grows with depth
    a.shapes = flipped
    text = next(c for c in claims(a) if "decreases with depth" in c.claim)
    assert text.verdict != SUPPORTED


def test_threshold_claim_leaves_out_shapes_that_never_train(report):
    from dataclasses import replace

    from batchbound.study.report import NOT_SUPPORTED, UNTESTABLE, claims

    a = report.analysis
    max_b = float(a.epochs["batch_size"].max())

    def verdict(b_stars):
        shapes = a.shapes.assign(threshold_batch=b_stars)
        claim = next(c for c in claims(replace(a, shapes=shapes)) if "threshold B*" in c.claim)
        return claim.verdict, claim.evidence

    # one shape never reaches the target (B* = NaN): judged on the others, and said so
    v, evidence = verdict([32.0, 64.0, float("nan")])
    assert v == SUPPORTED and "1 never reach the target" in evidence
    assert verdict([32.0, max_b, float("nan")])[0] == NOT_SUPPORTED
    assert verdict([float("nan")] * 3)[0] == UNTESTABLE
