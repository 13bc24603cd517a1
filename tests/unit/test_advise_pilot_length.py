"""The shortest pilot under an Adam-type optimiser: its first step has no second moment to
weight the two-batch estimate by and is not estimated, so 20 steps give 19 estimates. The
refusal before any timing let 20 steps through, and its suggested --pilot-fraction named 20:
the user waited for the timing and the pilot to be refused ("the pilot has 19 estimated
steps"), and the fraction it had suggested was refused again."""

from __future__ import annotations

import pytest

from batchbound.advise import advice, advise
from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig

ADAMW = TrainConfig(dataset="digits", model="fc(depth=1,params=800)", batch_size=16,
                    lr=0.003, optimizer="adamw")


def test_twenty_adam_steps_are_refused_before_any_timing(monkeypatch) -> None:
    def no_timing(*args: object, **kwargs: object) -> None:
        raise AssertionError("timed the steps of a plan it refuses")

    monkeypatch.setattr(advice, "_timings", no_timing)
    with pytest.raises(BatchboundError, match=r"is 20 steps; the noise scale needs at least 20 "
                                              r"estimated ones .*--pilot-fraction 0.06 or more"):
        advise(ADAMW, planned_iterations=400, pilot_fraction=0.05, max_workers=1,
               critical_batch="noise")
    # SGD estimates every step: its 20 are enough (refused here only by the stand-in timing)
    with pytest.raises(AssertionError, match="timed the steps"):
        advise(ADAMW.replace(optimizer="sgd", lr=0.05), planned_iterations=400,
               pilot_fraction=0.05, max_workers=1, critical_batch="noise")


def test_twenty_one_adam_steps_are_enough() -> None:
    out = advise(ADAMW, planned_iterations=420, pilot_fraction=0.05, max_workers=1,
                 critical_batch="noise").to_dict()
    assert out["pilot"]["iterations"] == 21 and out["pilot"]["metric"] == "adam"
    assert out["pilot"]["segments"][0]["start"] == 2  # the first step: not estimated
