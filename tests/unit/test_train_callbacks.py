"""The trainer's callbacks (train/callbacks.py): built from the config in the loop's order,
their checkpoint state under the names earlier versions wrote, cadences that cannot spin."""

from __future__ import annotations

from batchbound.train import TrainConfig
from batchbound.train.callbacks import (
    BatchPolicyCallback,
    DiversityMeasurement,
    Snapshots,
    next_due,
)
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Trainer

SMALL = dict(dataset="digits", model="fc(depth=1,params=800)", batch_size=32, lr=0.1,
             max_iterations=20, eval_every_iterations=5)


def test_built_from_the_config_in_the_loops_order() -> None:
    assert Trainer(TrainConfig(**SMALL), DistContext()).callbacks == []
    trainer = Trainer(TrainConfig(**SMALL, snapshot_every_epochs=0.5, diversity_every_epochs=1,
                                  batch_policy="warmup(every=5,trigger=noise)"), DistContext())
    assert [type(c) for c in trainer.callbacks] == [Snapshots, DiversityMeasurement,
                                                    BatchPolicyCallback]


def test_checkpoint_state_keeps_the_names_older_checkpoints_hold() -> None:
    trainer = Trainer(TrainConfig(**SMALL, snapshot_every_epochs=0.5, diversity_every_epochs=1,
                                  batch_policy="warmup(every=5,trigger=noise)"), DistContext())
    trainer.run()
    state = trainer.state_dict()
    assert {"next_snapshot_epoch", "snapshots", "next_diversity_epoch", "warm_state",
            "iteration", "batch_size", "lr_factor"} <= set(state)
    assert state["next_snapshot_epoch"] == 0.5 and state["next_diversity_epoch"] == 1.0
    assert state["warm_state"]  # the warmup's estimate, folded every step
    assert [i for i, _, _ in state["snapshots"]] == [0]  # 20 steps of 32 < half an epoch


def test_a_cadence_far_below_one_step_is_computed_not_stepped() -> None:
    assert next_due(0.0, 5.0, 1e-12) > 5.0
    assert next_due(6.0, 5.0, 1.0) == 6.0  # not due yet: unchanged
    assert next_due(1.0, 1.0, 0.5) == 1.5
