"""advise with the critical batch from branches, end to end on a small plan: the budget is
kept and said before each part, the JSON carries the branches and the noise scale's
prediction beside each row, and an Adam-type optimiser gets the square-root rule."""

from __future__ import annotations

import math

import pytest

from batchbound.advise import advise
from batchbound.advise.critical import combine
from batchbound.errors import BatchboundError
from batchbound.train import TrainConfig

CONFIG = TrainConfig(dataset="digits", model="fc(depth=1,params=800)", batch_size=16, lr=0.003,
                     optimizer="adamw", betas=(0.9, 0.95))


@pytest.fixture
def conclusive(monkeypatch):
    """The branch path end to end: at this plan's 128 examples per branch the floor on σ
    (0.1) makes the interval span every value the branches can tell apart, and advise
    falls back to the noise scale (test_inconclusive_…); with the floor at 0.01 the
    measured σ (about 0.016) gives an interval (about 22–47) the rows can predict from."""
    import batchbound.train.branches as branches

    monkeypatch.setattr(branches, "MIN_SPREAD", 0.01)


def test_adamw_plan_with_branches_within_budget(conclusive) -> None:
    said: list[str] = []
    # 0.2: at the default 0.1 this plan's branches could not take 10 steps at 2·B0
    advice = advise(CONFIG, planned_epochs=8, max_workers=1, budget=0.2, log=said.append)
    out = advice.to_dict()
    planned = out["pilot"]["planned_iterations"]
    assert out["pilot"]["iterations"] == math.ceil(0.1 * planned)  # half the budget
    # the parts' costs are said before they start, in order
    pilot_line = next(i for i, t in enumerate(said) if t.startswith("pilot: ") and " s" in t)
    branch_line = next(i for i, t in enumerate(said) if t.startswith("branches: "))
    measured_line = next(i for i, t in enumerate(said) if t.startswith("branches at "))
    assert pilot_line < branch_line < measured_line
    # the budget: pilot + branches ≤ 20 % of the plan's examples
    pilot_examples = out["pilot"]["iterations"] * 16
    branch_examples = int(said[branch_line].split("examples = ")[0].rsplit(" ", 2)[-2])
    assert pilot_examples + branch_examples <= 0.2 * planned * 16
    assert out["critical_batch"] == "branches" and len(out["branches"]) == 1
    point = out["branches"][0]
    assert point["interval"][0] <= point["critical_batch"] <= point["interval"][1]
    # the rows: the branches' and the noise scale's predictions joined by their precision,
    # both kept beside the result
    for row in out["rows"]:
        assert row["noise_iterations"] is not None
        joined = combine(row["branch_iterations"], tuple(row["branch_interval"]),
                         row["noise_iterations"], tuple(row["noise_interval"]))
        assert row["iterations"] == pytest.approx(joined.iterations)
        assert row["branch_weight"] == pytest.approx(joined.branch_weight)
        assert row["pilot_interval"] == pytest.approx(list(joined.interval))
        low, high = row["iterations_interval"]
        assert low <= row["iterations"] <= high
        if row["disagree"]:
            assert low <= row["noise_interval"][0] and row["noise_interval"][1] <= high
    at_b0 = next(r for r in out["rows"] if r["batch_size"] == 16)
    assert at_b0["iterations"] == pytest.approx(planned)
    at_64 = next(r for r in out["rows"] if r["batch_size"] == 64)
    assert at_64["lr"] == pytest.approx(0.003 * 2)  # √(64/16): the Adam default rule
    assert out["strategy"] == "srsr" and out["optimizer"] == "adamw"
    # the noise scale in AdamW's own metric, from its second step on
    assert out["pilot"]["metric"] == "adam" and "1/(√v̂ + ε)" in out["assumptions"]
    assert "square-root" in out["assumptions"] and "Adam-type" in out["assumptions"]
    assert "rate rule srsr" in advice.summary()


def test_noise_only_and_bad_budgets() -> None:
    advice = advise(CONFIG.replace(optimizer="sgd", betas=(0.9, 0.999), lr=0.1),
                    planned_epochs=4, max_workers=1, critical_batch="noise")
    out = advice.to_dict()
    assert out["critical_batch"] == "noise" and "branches" not in out
    assert out["strategy"] == "noise" and out["pilot"]["fraction"] == 0.1
    with pytest.raises(BatchboundError, match="must exceed the pilot fraction"):
        advise(CONFIG, planned_epochs=2, max_workers=1, pilot_fraction=0.1, budget=0.1)
    with pytest.raises(BatchboundError, match="unknown critical batch source"):
        advise(CONFIG, planned_epochs=2, max_workers=1, critical_batch="guess")
    with pytest.raises(BatchboundError, match="optimizer is a name"):
        advise(CONFIG, planned_epochs=2, optimizer=lambda p: None)  # type: ignore[arg-type]


def test_busy_machine_answer_from_the_branches_says_what_chose_it(monkeypatch,
                                                                 conclusive) -> None:
    """On a machine whose seconds cannot be trusted, with the branches predicting: the
    summary's S_min is the one the batch was chosen by (the branches', not the noise
    scale's), and it names the rate rule as the answer on seconds does."""
    import batchbound.advise.advice as advise_module

    used: list[float] = []

    def spy(rows, fewest):  # type: ignore[no-untyped-def]
        used.append(fewest)
        return real(rows, fewest)

    real = advise_module.on_iterations
    monkeypatch.setattr(advise_module, "_timing_check", lambda *_: "a test's hog")
    monkeypatch.setattr(advise_module, "on_iterations", spy)
    advice = advise(CONFIG, planned_epochs=8, max_workers=1, budget=0.2)
    out = advice.to_dict()
    assert out["recommended_on"] == "iterations" and out["critical_batch"] == "branches"
    assert out["minimum_iterations"] == used[0]
    summary = advice.summary()
    assert f"(S_min ≈ {used[0]:.0f}), the critical batch" in summary
    assert "rate rule srsr" in summary
    chosen = advice.recommended
    assert chosen.iterations <= 2 * used[0]
    smaller = [r for r in advice.rows if r.workers == 1 and r.batch_size < chosen.batch_size]
    assert all(r.iterations > 2 * used[0] for r in smaller)


def test_every_row_has_its_own_speedup_against_one_worker(monkeypatch) -> None:
    """Rows that are not their worker count's best carry their speedup against the best
    one-worker row in the JSON too (they showed the dataclass's 1.0)."""
    import batchbound.advise.advice as advise_module

    monkeypatch.setattr(advise_module, "_timing_check", lambda *_: None)  # seconds trusted
    out = advise(CONFIG, planned_epochs=4, max_workers=1, critical_batch="noise").to_dict()
    one = next(r for r in out["rows"] if r["best"] and r["workers"] == 1)
    others = [r for r in out["rows"] if not r["best"] and r["seconds_to_target"]]
    assert others
    for row in others:
        assert row["speedup"] == pytest.approx(one["seconds_to_target"]
                                               / row["seconds_to_target"])
        assert row["efficiency"] == pytest.approx(row["speedup"] / row["workers"])
        assert row["speedup"] < 1.0  # slower than the best one-worker row


def test_budget_errors_name_what_the_user_gave_before_any_timing(monkeypatch) -> None:
    import batchbound.advise.advice as advise_module

    def no_timing(*_):  # type: ignore[no-untyped-def]
        raise AssertionError("timed before refusing")

    monkeypatch.setattr(advise_module, "_timings", no_timing)
    with pytest.raises(BatchboundError, match=r"budget must be in \(0, 1\].*got nan"):
        advise(CONFIG, planned_epochs=4, max_workers=1, budget=math.nan)
    with pytest.raises(BatchboundError, match=r"pilot fraction 0\.6 leaves the branches "
                                              r"no budget"):
        advise(CONFIG, planned_epochs=4, max_workers=1, pilot_fraction=0.6)
    with pytest.raises(BatchboundError, match="branch budget"):
        advise(CONFIG, planned_epochs=4, max_workers=1, budget=0.0001)


def test_inconclusive_branches_are_said_and_the_noise_scale_predicts(monkeypatch) -> None:
    """Branches that measure nothing usable (B0's own run did not progress, or an interval
    over everything they can tell apart) are neither a refusal of the whole answer nor a
    number: the answer says why and predicts from the noise scale."""
    import batchbound.advise.advice as advice_module
    from batchbound.advise.critical import Inconclusive

    def nothing(*args, **kwargs):
        raise Inconclusive("the branch at B0 = 16 from iteration 9 made no progress")

    monkeypatch.setattr(advice_module, "measure", nothing)
    said: list[str] = []
    out = advise(CONFIG, planned_epochs=8, max_workers=1, budget=0.2,
                 log=said.append).to_dict()
    assert out["critical_batch"] == "noise" and "branches" not in out
    assert "made no progress" in out["branches_inconclusive"]
    assert "the branches were inconclusive: the branch at B0 = 16" in out["assumptions"]
    assert any(t.startswith("branches inconclusive: ") for t in said)
    for row in out["rows"]:  # the noise scale predicts: nothing shown beside it
        assert row["noise_iterations"] is None and not row["disagree"]


def test_branches_too_short_at_the_default_budget_are_not_run(monkeypatch) -> None:
    """At the default budget this plan leaves the branches 574 examples, and 3 branches of
    10 steps at 2·B0 take 960: they would read the transient after the branch, so they are
    not run, the pilot takes the whole 10 %, and the answer says so with the budget that
    would run them; the same budget given by the user is refused, as theirs to raise."""
    import batchbound.advise.advice as advice_module

    def never(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("branches run")

    monkeypatch.setattr(advice_module, "measure", never)
    said: list[str] = []
    out = advise(CONFIG, planned_epochs=8, max_workers=1, log=said.append).to_dict()
    planned = out["pilot"]["planned_iterations"]
    assert out["pilot"]["iterations"] == math.ceil(0.1 * planned)
    assert out["pilot"]["fraction"] == 0.1 and out["critical_batch"] == "noise"
    why = out["branches_inconclusive"]
    assert why.startswith("not run: the default budget left them 574 examples")
    assert "take 960" in why and "--budget 0.14 runs them" in why
    assert "the branches were inconclusive: not run" in out["assumptions"]
    skip_line = next(i for i, t in enumerate(said) if t.startswith("branches not run"))
    pilot_line = next(i for i, t in enumerate(said) if t.startswith("pilot: ") and " s" in t)
    assert skip_line < pilot_line  # said before the pilot starts
    with pytest.raises(BatchboundError, match="branch budget"):
        advise(CONFIG, planned_epochs=8, max_workers=1, budget=0.1)
