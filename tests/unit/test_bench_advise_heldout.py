"""benchmarks/advise.py's held-out case reads a text the project does not ship: Debian's
/usr/share/common-licenses, concatenated in name order, as a user would with ``cat``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path("/usr/share/common-licenses")


def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("bench_advise", ROOT / "benchmarks" /
                                                      "advise.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.skipif(not SOURCE.is_dir(), reason="no /usr/share/common-licenses here")
def test_the_held_out_text_is_the_licenses_concatenated(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    module = bench()
    path = Path(module.licenses_text())
    expected = b"".join(f.read_bytes() for f in sorted(SOURCE.iterdir()) if f.is_file())
    assert path.is_relative_to(tmp_path) and path.read_bytes() == expected
    path.write_bytes(b"stale")  # a changed file is rewritten, not trusted
    assert Path(module.licenses_text()).read_bytes() == expected
    case = module.CASES["licenses-gpt-adamw"]
    assert case["dataset"].format(licenses=path) == f"text(path={path})"
    assert (case["b0"], case["epochs"], case["batches"]) == (16, 2, (64, 256))


def test_a_crossing_is_read_on_the_mean_curve_not_a_lucky_evaluation():
    module = bench()
    half = module.HALF_WINDOW
    # a loss falling by 1 per evaluation, with one evaluation far below its neighbours
    curve = [(10 * i, 100.0 - i, float(i)) for i in range(40)]
    curve[12] = (120, 50.0, 12.0)
    target = 100.0 - 30
    first = next(i for i, v, _ in curve if v <= target)
    assert first == 120  # the lucky evaluation
    iteration, seconds = module.crossing(curve, target)
    # the centred mean of 2·half + 1 evaluations: the lucky one moves it by 38/(2·half + 1)
    assert (iteration, seconds) == (300, 30.0)  # where 100 − i reaches 70
    assert module.crossing(curve[:half + 5], target) == (float("inf"), float("inf"))


def test_losses_keeps_one_evaluation_per_iteration():
    module = bench()

    class Run:
        def curve(self, metric):
            assert metric == "train_loss"
            return [(10, 0, 1.0, 5.0), (20, 0, 2.0, 4.0), (20, 0, 2.0, 4.0), (30, 0, 3.0, 3.5)]

    assert module.losses(Run()) == [(10, 5.0, 1.0), (20, 4.0, 2.0), (30, 3.5, 3.0)]
