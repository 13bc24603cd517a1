"""When evaluations fall due (train/cadence.py): every k epochs, or at k, k·q, k·q², ...;
the trainer evaluates exactly where the arithmetic says, and the report's first-evaluation
mark reads the same arithmetic."""

from __future__ import annotations

import itertools
import math

import pandas as pd
import pytest

from batchbound.errors import BatchboundError
from batchbound.study import analysis as A
from batchbound.train import TrainConfig, train
from batchbound.train.cadence import first_evaluations, next_due

N = 1438  # digits' training set


def test_geometric_cadence_steps_by_powers_of_q() -> None:
    assert next_due(0.01, 0.0, 0.01, 2.0) == 0.01  # not due yet
    assert next_due(0.01, 0.01, 0.01, 2.0) == pytest.approx(0.02)
    assert next_due(0.01, 0.05, 0.01, 2.0) == pytest.approx(0.08)  # skips 0.02 and 0.04
    assert next_due(0.01, 0.08, 0.01, 2.0) == pytest.approx(0.16)  # exactly at a power
    assert next_due(1e-12, 5.0, 1e-12, 1.001) > 5.0  # computed, not stepped


def _eval_epochs(batch: int, every: float, growth: float | None, epochs: float) -> list[float]:
    result = train(TrainConfig(dataset="digits", model="fc(depth=1,params=800)",
                               batch_size=batch, lr=0.1, max_epochs=epochs,
                               eval_every_epochs=every, eval_growth=growth))
    return sorted({e for _, e, _, _ in result.curve("train_loss")})


@pytest.mark.parametrize(("batch", "every", "growth"), [(16, 0.01, 1.5), (256, 0.01, 1.2),
                                                        (64, 0.05, None)])
def test_the_trainer_evaluates_where_the_cadence_says(batch, every, growth) -> None:
    seen = _eval_epochs(batch, every, growth, 3.0)
    step, expected, due, epoch = batch / N, [0.0], every, 0.0
    while epoch < 3.0 - 1e-9:  # step by step, as the loop does; the last step may overshoot
        epoch += step
        if epoch + 1e-9 >= due or epoch >= 3.0 - 1e-9:
            expected.append(epoch)
            due = next_due(due, epoch, every, growth)
    assert seen == pytest.approx(expected, abs=1e-6)
    assert first_evaluations(every, growth, step) == pytest.approx(tuple(seen[1:3]), abs=1e-6)
    if growth:  # the relative spacing stays q once a step is finer than the spacing
        ratios = [b / a for a, b in itertools.pairwise(seen[1:]) if b - a > 2 * step]
        assert ratios and max(ratios) < growth * 1.5


def test_geometric_evaluation_is_far_cheaper_over_a_long_run() -> None:
    # k = 0.005 epochs, q = 1.05 to 12 epochs: 161 evaluations, against 2400 every 0.005
    due, count = 0.005, 0
    while due <= 12:
        count, due = count + 1, next_due(due, due, 0.005, 1.05)
    assert count == math.floor(math.log(12 / 0.005, 1.05)) + 1 == 160


def test_eval_growth_is_checked_and_leaves_the_run_key_alone() -> None:
    base = dict(dataset="digits", model="fc(depth=1,params=800)", batch_size=16, lr=0.1)
    for bad in (1.0, 0.5, math.inf):
        with pytest.raises(BatchboundError, match="eval_growth"):
            TrainConfig(**base, eval_growth=bad)
    with pytest.raises(BatchboundError, match="eval_every_epochs"):
        TrainConfig(**base, eval_growth=1.1, eval_every_iterations=10)
    assert TrainConfig(**base).config_hash() == TrainConfig(**base, eval_growth=None).config_hash()
    assert TrainConfig(**base).config_hash() != TrainConfig(**base, eval_growth=1.1).config_hash()


def test_the_report_marks_a_target_seen_at_the_first_geometric_evaluation() -> None:
    # every 0.01 epochs growing ×1.5 with B = 16 (0.0111 epochs a step): the first
    # evaluation is after step 1 (0.0111), the second after step 2 (0.0222 ≥ 0.0167)
    config = '{"eval_every_epochs": 0.01, "eval_growth": 1.5, "batch_size": 16}'
    runs = pd.DataFrame({"key": ["a", "b"], "role": "final", "model_label": "m",
                         "batch_size": 16, "seed": [0, 1], "lr": 0.1, "n_train": N,
                         "status": "complete", "config_json": config})
    targets = pd.DataFrame({"key": ["a", "b"], "name": "t", "reached": 1,
                            "epoch": [16 / N, 32 / N], "iteration": [1, 2]})
    assert list(A.per_run_to_target(runs, targets)["first_eval"]) == [True, False]


def test_advise_pilots_evaluate_by_iterations_whatever_the_users_cadence() -> None:
    from batchbound.advise.pilot import pilot_config
    from batchbound.train import Target

    user = TrainConfig(dataset="digits", model="fc(depth=1,params=800)", batch_size=16,
                       lr=0.1, eval_every_epochs=0.01, eval_growth=1.05,
                       targets=(Target("train_acc", 0.9),))
    planned = pilot_config(user, 100, "norms", 1.0)
    assert planned.eval_growth is None and planned.eval_every_iterations == 100
    assert pilot_config(user, None, "norms", 1.0).eval_growth is None


def test_a_changing_batch_leaves_the_first_evaluation_unjudged_by_step() -> None:
    config = ('{"eval_every_epochs": 0.01, "eval_growth": 1.5, "batch_size": 16, '
              '"batch_policy": "warmup(every=5)"}')
    assert A._second_evaluation(config, N) == pytest.approx(0.015)  # by epochs alone


def _curves(result, metric: str) -> list[tuple[int, float]]:
    return [(i, v) for i, _, _, v in result.curve(metric)]


@pytest.mark.parametrize("target", [("train_acc", 0.9), None])
def test_eval_test_last_evaluates_the_test_split_once_with_the_same_numbers(target) -> None:
    # stopped by a target or by max_epochs: the run's last evaluation carries the test split,
    # with the value the every-evaluation run records at that iteration; train metrics agree
    from batchbound.train import Target

    base = dict(dataset="digits", model="fc(depth=1,params=800)", batch_size=32, lr=0.1,
                max_epochs=1.0, eval_every_epochs=0.1,
                targets=(Target(*target),) if target else ())
    every = train(TrainConfig(**base))
    last = train(TrainConfig(**base, eval_test="last"))
    assert _curves(last, "train_loss") == _curves(every, "train_loss")
    assert len(_curves(every, "test_acc")) > 3
    assert _curves(last, "test_acc") == _curves(every, "test_acc")[-1:]
    assert last.final["test_acc"] == every.final["test_acc"]
    assert TrainConfig(**base).config_hash() == TrainConfig(**base, eval_test="every").config_hash()


def test_eval_test_last_refuses_a_test_target() -> None:
    from batchbound.train import Target

    with pytest.raises(BatchboundError, match=r"test_acc.*eval_test"):
        TrainConfig(dataset="digits", model="fc(depth=1,params=800)", batch_size=32, lr=0.1,
                    eval_test="last", targets=(Target("test_acc", 0.9),))
    with pytest.raises(BatchboundError, match="eval_test"):
        TrainConfig(dataset="digits", model="fc(depth=1,params=800)", batch_size=32, lr=0.1,
                    eval_test="sometimes")
