"""The learning-rate rule registry: one registration reaches the trainer, the study's
strategy grid and advise's rows."""

from __future__ import annotations

import math

import pytest

from batchbound.advise.iterations import STRATEGIES as ADVISE_STRATEGIES
from batchbound.advise.iterations import Pilot, lr_scale
from batchbound.train.lr_rules import LR_RULES, register_lr_rule
from batchbound.train.schedule import parse_strategy


@pytest.mark.parametrize("name, factor", [("blr", 1.0), ("lsr", 4.0), ("srsr", 2.0)])
def test_the_papers_rules(name, factor):
    assert LR_RULES[name].scale(4.0) == pytest.approx(factor)
    strategy = parse_strategy(name if name == "blr" else f"{name}(base_batch=16)")
    assert strategy.lr(0.1, 64, epoch=10.0) == pytest.approx(0.1 * factor)


def test_a_new_rule_is_one_registration(monkeypatch):
    monkeypatch.setitem(LR_RULES, "cbrt", LR_RULES["lsr"])  # room for the test's rule
    del LR_RULES["cbrt"]
    register_lr_rule("cbrt", "η0·(B/B0)^(1/3)")(lambda r: r ** (1 / 3))
    try:
        strategy = parse_strategy("cbrt(base_batch=8)")
        assert strategy.lr(1.0, 64, epoch=1.0) == pytest.approx(2.0)
        pilot = Pilot(8, 1.0, 10, (0,), (5.0,))
        assert lr_scale("cbrt", 64, pilot) == pytest.approx(2.0)
        with pytest.raises(ValueError, match="registered twice"):
            register_lr_rule("cbrt", "again")(lambda r: r)
    finally:
        del LR_RULES["cbrt"]
    assert "noise" in ADVISE_STRATEGIES and set(LR_RULES) <= set(ADVISE_STRATEGIES)
    assert math.isclose(LR_RULES["srsr"].scale(9.0), 3.0)
