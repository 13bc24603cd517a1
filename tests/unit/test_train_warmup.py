"""Batch-size warmup: the rule, its rate changes, the loop acting on it, and resume."""

from __future__ import annotations

import itertools
import math
import os
import signal

import pytest

from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig
from batchbound.train.adaptive import parse_batch_policy
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Trainer

WARM = dict(dataset="mnist5k", model="fc(depth=2,params=20000)", batch_size=16, lr=0.1,
            max_epochs=None, max_iterations=700, eval_every_epochs=None,
            eval_every_iterations=700, batch_policy="warmup(every=25,trigger=noise)")


def test_the_rule_doubles_once_within_the_fraction_and_never_lowers():
    policy = parse_batch_policy("warmup(max=64,every=10,fraction=0.5)")
    assert policy.warmup and policy.every == 10
    assert policy.warmed(16, noise=100.0, noise_se=20.0) == 32  # 32 ≤ 0.5·80
    assert policy.warmed(16, noise=60.0, noise_se=10.0) == 16  # 32 > 25
    assert policy.warmed(16, noise=1e6, noise_se=0.0) == 32  # one doubling per decision
    assert policy.warmed(64, noise=1e6, noise_se=0.0) == 64  # the ceiling
    assert policy.warmed(32, noise=1.0, noise_se=0.0) == 32  # never lowered
    assert policy.warmed(32, noise=math.inf, noise_se=0.0) == 32  # no usable estimate


@pytest.mark.parametrize("rule, factor", [
    ("noise", (1 + 48 / 16) / (1 + 48 / 32)), ("lsr", 2.0), ("srsr", math.sqrt(2)),
    ("blr", 1.0)])
def test_the_rate_rules(rule, factor):
    policy = parse_batch_policy(f"warmup(lr={rule})")
    assert policy.lr_change(16, 32, noise=48.0, start=16) == pytest.approx(factor)


@pytest.mark.parametrize("spec, words", [
    ("warmup(fraction=0)", "fraction must be in (0, 1]"),
    ("warmup(lr=cubic)", "unknown lr rule"),
    ("warmup(start=4)", "no option 'start'"),
])
def test_bad_warmup_specs(spec, words):
    with pytest.raises(BatchboundError, match=words.replace("(", r"\(").replace(")", r"\)")
                       .replace("]", r"\]")):
        parse_batch_policy(spec)


def test_config_gives_warmup_its_estimate_and_refuses_a_scaling_strategy():
    config = TrainConfig(batch_size=16, batch_policy="warmup")
    assert config.online_diversity == "two_batch" and config.micro_batch == 8
    with pytest.raises(BatchboundError, match="use strategy blr"):
        TrainConfig(batch_size=16, batch_policy="warmup", strategy="lsr(base_batch=16)")
    with pytest.raises(BatchboundError, match="whole micro-batches"):
        TrainConfig(batch_size=16, micro_batch=5, batch_policy="warmup")


def test_the_loop_raises_the_batch_and_the_rate_as_the_noise_scale_grows():
    result = Trainer(TrainConfig(**WARM), DistContext()).run()
    sizes = [int(v) for _, _, _, v in result.curve("batch_size")]
    assert sizes[0] == 16 and sizes[-1] > 16
    assert all(b == 2 * a for a, b in itertools.pairwise(sizes))  # doublings only
    rates = [v for _, _, _, v in result.curve("lr")]
    assert rates[-1] > rates[0]  # the noise rule raises the rate with the batch
    noise = [v for _, _, _, v in result.curve("warmup_noise_scale")]
    assert len(noise) == 700 // 25 and noise[-1] > noise[0]


def test_resume_mid_warmup_is_bit_identical(tmp_path):
    config = TrainConfig(**{**WARM, "checkpoint_every": 50})
    expected = Trainer(config, DistContext()).run()
    path = tmp_path / "run.ckpt"
    first = Trainer(config, DistContext(), checkpoint_path=path)
    step = first.train_step

    def interrupted(*args: object) -> dict:
        if first.iteration == 520:  # after the first doubling
            os.kill(os.getpid(), signal.SIGTERM)
        return step(*args)

    first.train_step = interrupted  # type: ignore[method-assign]
    assert first.run().status == "stopped"
    again = Trainer(config, DistContext(), checkpoint_path=path)
    resumed = again.run(resume=True)
    strip = [(i, e, m, v) for i, e, _, m, v in resumed.curves]
    assert strip == [(i, e, m, v) for i, e, _, m, v in expected.curves]
    sizes = [v for _, _, _, v in expected.curve("batch_size")]
    assert len(sizes) > 1  # the interruption came mid-warmup, after a doubling
