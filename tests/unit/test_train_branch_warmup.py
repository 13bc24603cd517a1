"""Batch-size warmup's branch trigger: the decision on constructed losses, a real run that
doubles, its cost in the result, and resume."""

from __future__ import annotations

import itertools
import os
import signal

import pytest

from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig
from batchbound.train.adaptive import parse_batch_policy
from batchbound.train.branches import MIN_SPREAD, branch_point, doubles
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Trainer

E = 128  # examples per constructed branch


def runs(ends: dict[int, float], replicate: float, start: float = 1.0, stop: float = 0.5):
    """A ``run`` whose B0 branch falls linearly from ``start`` to ``stop`` over E examples
    (8 points), whose other branches end at ``ends``, and whose B0 replicate at ``replicate``."""
    b0 = min(ends)
    calls: list[tuple[int, int]] = []

    def run(batch: int, evaluations: int, seed: int) -> list[tuple[int, float]]:
        calls.append((batch, seed))
        if batch == b0 and len(calls) == 1:  # the base run; the replicate (also B0) ends below
            return [(E * k // 8, start + (stop - start) * k / 8) for k in range(9)]
        end = replicate if batch == b0 else ends[batch]
        return [(0, start), (E, end)]

    return run, calls


def loss_at(ratio: float) -> float:
    """The loss B0's constructed run reaches after ratio·E examples."""
    return 1.0 - 0.5 * ratio


@pytest.mark.parametrize("r2, r4, replicate, expected", [
    (1.0, 1.0, 1.0, True),  # 2B and 4B as good per example as B: B_crit ≫ 2B
    (0.95, 0.9, 0.98, True),  # B_crit ≈ 8B, well measured
    (0.75, 0.6, 0.98, False),  # exactly B_crit = 2B: not *above* it with confidence
    (0.5, 0.25, 1.0, False),  # B_crit = 0: a larger batch wastes its examples
    (1.0, 1.0, 0.3, False),  # the replicate says the branches are mostly chance
])
def test_the_decision_on_constructed_losses(r2, r4, replicate, expected):
    b0 = 16
    run, calls = runs({b0: 0.5, 2 * b0: loss_at(r2), 4 * b0: loss_at(r4)}, loss_at(replicate))
    point = branch_point(run, [b0, 2 * b0, 4 * b0], seed=7, iteration=100, z=1.0)
    assert point is not None
    assert point.ratios[2 * b0] == pytest.approx(r2) and point.ratios[4 * b0] == pytest.approx(r4)
    assert point.spread == pytest.approx(max(abs(1 - replicate) / 2 ** 0.5, MIN_SPREAD))
    assert doubles(point) is expected
    assert doubles(point) == (point.low >= 2 * b0)
    # B0 (evaluated along the way), 2B, 4B, then B0 again with another data order
    assert calls == [(16, 7), (32, 7), (64, 7), (16, 8)]


def test_a_higher_confidence_doubles_later():
    b0 = 16
    run, _ = runs({b0: 0.5, 32: loss_at(0.95), 64: loss_at(0.9)}, loss_at(0.98))
    assert doubles(branch_point(run, [16, 32, 64], 7, 100, z=1.0))
    assert not doubles(branch_point(run, [16, 32, 64], 7, 100, z=3.0))


def test_no_progress_at_b0_never_doubles():
    run, calls = runs({16: 0.5, 32: 0.1, 64: 0.1}, 0.5, start=1.0, stop=1.0)
    assert branch_point(run, [16, 32, 64], 7, 100) is None
    assert not doubles(None)
    assert calls == [(16, 7)]  # nothing else is run


def test_the_branch_trigger_is_the_default_and_the_noise_trigger_an_option():
    policy = parse_batch_policy("warmup")
    assert (policy.trigger, policy.every, policy.lr) == ("branch", 100, "auto")
    assert policy.branch_rule() == "srsr"  # for every optimiser (train/adaptive.py says why)
    assert parse_batch_policy("warmup(lr=blr)").branch_rule() == "blr"
    assert parse_batch_policy("warmup(cadence=doubling)") == policy
    noise = parse_batch_policy("warmup(trigger=noise)")
    assert (noise.trigger, noise.every, noise.lr) == ("noise", 50, "noise")
    # fraction and lr=noise are the noise trigger's: specs naming them keep their meaning
    assert parse_batch_policy("warmup(every=25,fraction=0.25)").trigger == "noise"
    assert parse_batch_policy("warmup(lr=noise)").trigger == "noise"
    for spec, words in (("warmup(trigger=branch,fraction=0.5)", "noise trigger's option"),
                        ("warmup(trigger=branch,lr=noise)", "belongs to trigger=noise"),
                        ("warmup(trigger=noise,steps=4)", "branch trigger's"),
                        ("warmup(trigger=noise,cadence=doubling)", "branch trigger's"),
                        ("warmup(cadence=fixed)", "cadence must be doubling"),
                        ("warmup(trigger=sometimes)", "unknown trigger"),
                        ("warmup(steps=0)", "steps must be >= 1"),
                        ("warmup(z=0)", "z must be > 0")):
        with pytest.raises(BatchboundError, match=words):
            parse_batch_policy(spec)


# mnist5k's fc at B0 = 4 and a small rate, far below its stable limit, so lsr (named: auto is
# srsr) can raise it: the critical batch is well above 2B at first
WARM = dict(dataset="mnist5k", model="fc(depth=2,params=20000)", batch_size=4, lr=0.01,
            max_epochs=None, max_iterations=150, eval_every_epochs=None,
            eval_every_iterations=150, batch_policy="warmup(every=50,steps=4,lr=lsr)")


@pytest.mark.slow
def test_a_real_run_doubles_with_its_rate_and_counts_the_branches():
    result = Trainer(TrainConfig(**WARM), DistContext()).run()
    sizes = [int(v) for _, _, _, v in result.curve("batch_size")]
    assert sizes[0] == 4 and sizes[-1] > 4
    assert all(b in (2 * a, 4 * a) for a, b in itertools.pairwise(sizes))  # never down
    rates = [v for _, _, _, v in result.curve("lr")]
    assert rates[-1] == pytest.approx(0.01 * sizes[-1] / 4)  # lsr, as asked
    # tests at 50·B0 = 200 examples and then at the first 200·2^j beyond the last; each
    # test that made progress ran B (E/B steps), 2B and 4B, E = 4 steps × 4B examples
    changes = [(int(i), int(v)) for i, _, _, v in result.curve("batch_size")]
    tests = [int(i) for i, _, _, _ in result.curve("warmup_critical_batch")]
    expected, seen, due = [], 0, 200
    for it in range(1, 151):
        seen += max(b for i, b in changes if i < it)  # the batch step `it` trained at
        if seen >= due:
            expected.append(it)
            while due <= seen:
                due *= 2
    assert tests == expected and len(tests) >= 2
    # every test records its growth, the one the batch sizes show
    growths = {int(i): int(v) for i, _, _, v in result.curve("warmup_growth")}
    assert set(growths) == set(tests)
    for i, b in changes[1:]:
        assert growths[i] == b // max(v for j, v in changes if j < i)
    steps = examples = 0
    for it in tests:
        b = max(v for i, v in changes if i < it)
        e = 4 * 4 * b
        steps += e // b + e // (2 * b) + e // (4 * b)
        examples += 3 * e
    assert result.final["policy_branch_steps"] == steps
    assert result.final["policy_branch_examples"] == examples


@pytest.mark.slow
def test_resume_mid_branch_warmup_is_bit_identical(tmp_path):
    config = TrainConfig(**{**WARM, "checkpoint_every": 25})
    expected = Trainer(config, DistContext()).run()
    path = tmp_path / "run.ckpt"
    first = Trainer(config, DistContext(), checkpoint_path=path)
    step = first.train_step

    def interrupted(*args: object) -> dict:
        if first.iteration == 120:  # after the first doublings
            os.kill(os.getpid(), signal.SIGTERM)
        return step(*args)

    first.train_step = interrupted  # type: ignore[method-assign]
    assert first.run().status == "stopped"
    again = Trainer(config, DistContext(), checkpoint_path=path)
    resumed = again.run(resume=True)
    strip = [(i, e, m, v) for i, e, _, m, v in resumed.curves]
    assert strip == [(i, e, m, v) for i, e, _, m, v in expected.curves]
    assert len(expected.curve("batch_size")) > 1  # interrupted mid-warmup, after a doubling
    for key in ("policy_branch_steps", "policy_branch_examples", "train_loss"):
        assert resumed.final[key] == expected.final[key]


def test_a_checkpoint_of_the_noise_trigger_is_refused_by_the_branch_trigger(tmp_path):
    """Before the branch trigger, ``warmup(every=5)`` meant the noise trigger, under the same
    config key: such a checkpoint (its noise estimate saved, no trigger named) is refused."""
    import torch

    from batchbound.train.checkpoint import load_checkpoint

    small = dict(dataset="digits", model="fc(depth=1,params=800)", batch_size=16, lr=0.1,
                 max_iterations=10, eval_every_iterations=10, checkpoint_every=10)
    path = tmp_path / "old.ckpt"
    Trainer(TrainConfig(**small, batch_policy="warmup(every=5,trigger=noise)"), DistContext(),
            checkpoint_path=path).run()
    branch = TrainConfig(**{**small, "max_iterations": 20}, batch_policy="warmup(every=5)")
    saved = load_checkpoint(path)
    assert saved["state"]["warm_state"]  # the noise trigger's estimate
    del saved["state"]["warm_trigger"]  # as an older checkpoint holds it
    saved["config_hash"] = branch.config_hash()
    torch.save(saved, path)
    with pytest.raises(BatchboundError, match="trigger=noise, this run's is trigger=branch"):
        Trainer(branch, DistContext(), checkpoint_path=path).run(resume=True)


def test_plain_warmup_names_its_trigger_so_no_stored_noise_run_is_reused() -> None:
    """Plain `warmup` meant the noise trigger before the branch trigger was the default: the
    config names the trigger now, so its key differs from the one those runs were stored under."""
    branch = TrainConfig(batch_size=16, batch_policy="warmup(every=25)")
    assert branch.batch_policy == "warmup(every=25,trigger=branch,cadence=doubling)"
    assert TrainConfig(batch_size=16, batch_policy="warmup").batch_policy == \
        "warmup(trigger=branch,cadence=doubling)"
    # the branch trigger's earlier every-K-steps cadence was stored as trigger=branch alone
    old = "warmup(every=25,trigger=branch)"
    assert TrainConfig(batch_size=16, batch_policy=old).batch_policy == \
        f"{old[:-1]},cadence=doubling)"
    noise = TrainConfig(batch_size=16, batch_policy="warmup(every=25,trigger=noise)")
    assert noise.batch_policy == "warmup(every=25,trigger=noise)"
    assert branch.config_hash() != noise.config_hash()
    assert TrainConfig.from_dict(branch.to_dict()).config_hash() == branch.config_hash()
