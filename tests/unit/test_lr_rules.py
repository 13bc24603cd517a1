"""The learning-rate rule registry: one registration reaches the trainer, the study's
strategy grid, advise's rows and batch-size warmup's rate, read when used (not at import)."""

from __future__ import annotations

import math

import pytest

from batchbound.advise import advise
from batchbound.advise.iterations import Pilot, lr_scale, strategies
from batchbound.advise.timing import Cluster
from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig
from batchbound.train.adaptive import parse_batch_policy
from batchbound.train.lr_rules import LR_RULES, register_lr_rule
from batchbound.train.schedule import parse_strategy, strategy_help


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
    assert "noise" in strategies() and set(LR_RULES) <= set(strategies())
    assert math.isclose(LR_RULES["srsr"].scale(9.0), 3.0)


@pytest.fixture
def cube_root():
    """A rule registered after every module was imported, removed afterwards."""
    register_lr_rule("cbrt", "η0·(B/B0)^(1/3)")(lambda r: r ** (1 / 3))
    yield "cbrt"
    del LR_RULES["cbrt"]


def test_a_rule_registered_after_import_is_accepted_by_advise(cube_root):
    assert cube_root in strategies() and cube_root in strategy_help()
    config = TrainConfig(dataset="digits", model="fc(depth=1,params=2000)", batch_size=16,
                         lr=0.1, device="cpu")
    cluster = Cluster(bandwidth_bytes_per_s=1e9, latency_s=1e-5, max_workers=2,
                      examples_per_second=1e5)
    advice = advise(config, planned_iterations=60, pilot_fraction=0.5, cluster=cluster,
                    strategy=cube_root)
    assert f"strategy '{cube_root}' (η(B) = η0·(B/B0)^(1/3))" in advice.to_dict()["assumptions"]
    rows = advice.to_dict()["rows"]
    assert rows and all(r["lr"] == pytest.approx(0.1 * (r["batch_size"] / 16) ** (1 / 3))
                        for r in rows)
    with pytest.raises(BatchboundError, match="unknown strategy 'cubic'; choose from noise, "
                       "blr, lsr, srsr, cbrt"):
        advise(config, planned_iterations=60, cluster=cluster, strategy="cubic")


@pytest.mark.parametrize("rule, factor", [("lsr", 2.0), ("srsr", math.sqrt(2)), ("blr", 1.0)])
def test_warmup_takes_the_trainers_rules(rule, factor):
    policy = parse_batch_policy(f"warmup(lr={rule})")
    assert policy.lr == rule
    assert policy.lr_change(16, 32, noise=48.0, start=16) == pytest.approx(factor)
    # after doublings the rate is s(B/B0)·η0: the factors multiply up to the rule's own
    steps = [policy.lr_change(b, 2 * b, noise=48.0, start=16) for b in (16, 32, 64)]
    assert math.prod(steps) == pytest.approx(LR_RULES[rule].scale(128 / 16))


def test_warmup_takes_a_rule_registered_after_import(cube_root):
    policy = parse_batch_policy(f"warmup(lr={cube_root})")
    assert policy.lr_change(16, 128, noise=1.0, start=16) == pytest.approx(2.0)
    with pytest.raises(BatchboundError, match="unknown lr rule 'linear'; choose from noise, "
                       "blr, lsr, srsr, cbrt"):
        parse_batch_policy("warmup(lr=linear,trigger=noise)")
    with pytest.raises(BatchboundError, match="unknown lr rule 'linear'; choose from auto, "
                       "blr, lsr, srsr, cbrt"):  # the branch trigger's (the default) rules
        parse_batch_policy("warmup(lr=linear)")


def test_the_help_lists_a_rule_registered_after_import(cube_root, capsys):
    from batchbound.cli import main

    for command in ("train", "advise"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "cbrt: η0·(B/B0)^(1/3)" in " ".join(capsys.readouterr().out.split())
