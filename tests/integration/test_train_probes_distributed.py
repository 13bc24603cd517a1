"""Snapshots and final probes under two gloo processes equal one process's: rank 0 keeps the
snapshots, the probes shard their passes over the ranks and all-reduce."""

from __future__ import annotations

import numpy as np
import pytest

from batchbound.train import TrainConfig, train

pytestmark = pytest.mark.distributed

CONFIG = TrainConfig(
    dataset="digits",
    model="fc(depth=1,params=800)",
    batch_size=33,
    lr=0.2,
    max_iterations=15,
    eval_every_iterations=5,
    dtype="float64",
    snapshot_every_epochs=0.1,
    final_probes=("osg", "linear_error"),
)


def test_two_workers_match_one() -> None:
    one = train(CONFIG)
    two = train(CONFIG.replace(workers=2))
    assert one.status == two.status == "complete"
    (e1, w1), (e2, w2) = one.snapshot_matrix(), two.snapshot_matrix()
    assert np.array_equal(e1, e2) and len(e1) == 5  # 0, 0.1, 0.2, 0.3 and the end
    assert np.allclose(w1, w2, rtol=1e-6, atol=1e-7)  # float32 copies of float64 weights
    for key in ("osg_mean", "osg_sd", "linear_error", "linear_error_sd", "final_lr",
                "final_train_loss"):
        assert two.final[key] == pytest.approx(one.final[key], rel=1e-9), key
