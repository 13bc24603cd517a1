"""`train --resume` on a run that had finished (the command rerun as the checkpoint refusal
says, `add --resume to continue it`): the result is the finished run's, not one whose curves
hold the last evaluation's test metrics twice (the iteration of the test split's last
evaluation was not in the checkpoint, so the resumed run evaluated it again)."""

from __future__ import annotations

from batchbound.train import TrainConfig
from batchbound.train.distributed import DistContext
from batchbound.train.loop import Trainer

SMALL = dict(dataset="digits", model="fc(depth=1,params=800)", batch_size=32, lr=0.1,
             max_iterations=12, eval_every_iterations=6, checkpoint_every=6, dtype="float64")


def _without_seconds(curves: list) -> list:
    return [(i, e, m, v) for i, e, _, m, v in curves]


def test_resuming_a_finished_run_repeats_nothing(tmp_path) -> None:
    for eval_test in ("every", "last"):
        config = TrainConfig(**SMALL, eval_test=eval_test)
        path = tmp_path / f"{eval_test}.ckpt"
        finished = Trainer(config, DistContext(), checkpoint_path=path).run()
        assert finished.status == "complete"
        again = Trainer(config, DistContext(), checkpoint_path=path).run(resume=True)
        assert again.status == "complete"
        assert _without_seconds(again.curves) == _without_seconds(finished.curves), eval_test
        assert {k: v for k, v in again.final.items() if k != "seconds"} == \
            {k: v for k, v in finished.final.items() if k != "seconds"}
