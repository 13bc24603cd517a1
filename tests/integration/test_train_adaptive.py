"""The adaptive batch policy trains end to end, and the Δ̂ measurements it depends on count
in its training seconds (they did not before: its time to target looked free)."""

from __future__ import annotations

import pytest

from batchbound.train import TrainConfig, target_list, train

# max_epochs leaves room for any batch the policies may pick: pick=time follows this
# machine's step times, and a busy machine's may pick 512, which needs 32 epochs at this lr
# (16.6 at 256); the run still stops at its target.
BASE = TrainConfig(dataset="digits", model="fc(depth=2,params=4000)", lr=0.1, batch_size=16,
                   targets=target_list(train_acc=0.9), max_epochs=40, eval_every_epochs=0.5,
                   diversity_every_epochs=None)


@pytest.mark.parametrize("policy", ["adaptive(delta=1,min=16,max=512,every=20)",
                                    "adaptive(min=16,max=512,every=20,pick=time)"])
def test_adaptive_policy_counts_its_measurements_in_training_time(policy: str) -> None:
    result = train(BASE.replace(batch_policy=policy))
    assert result.status == "complete" and result.targets[0].reached
    timings = result.timings
    # only the policy measured Δ here (no monitoring cadence), and its time is training time
    assert timings["diversity_seconds"] > 0
    phases = sum(timings[f"{p}_seconds"] for p in ("data", "compute", "communication", "step"))
    assert timings["train_seconds"] >= phases + timings["diversity_seconds"] * 0.99
    sizes = [value for _, _, _, metric, value in result.curves if metric == "batch_size"]
    assert len(sizes) >= 2 and all(16 <= b <= 512 for b in sizes)
    if "pick=time" in policy:
        assert all(int(b) & (int(b) - 1) == 0 for b in sizes[1:])  # 16·2^k candidates
