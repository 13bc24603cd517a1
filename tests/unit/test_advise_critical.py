"""The critical batch from branches (advise/critical.py): the inversion, the fit and its
interval on ratios made by the model itself, reading a run against B0's curve, the budget,
the trajectories past the pilot and how the two predictions are combined."""

from __future__ import annotations

import math

import pytest

from batchbound.advise.critical import (
    CAP,
    MIN_SPREAD,
    combine,
    examples_ratio,
    fit_point,
    invert,
    plan_branches,
    trajectories,
)
from batchbound.advise.iterations import Pilot, predict_iterations
from batchbound.errors import BatchboundError


def model_ratios(b_crit: float, ladder: list[int]) -> dict[int, float]:
    """What McCandlish's model says: B keeps (B0 + B_crit)/(B + B_crit) of B0's progress."""
    return {b: (ladder[0] + b_crit) / (b + b_crit) for b in ladder}


@pytest.mark.parametrize("b_crit", [0.0, 5.0, 24.0, 100.0])
def test_invert_recovers_the_critical_batch(b_crit: float) -> None:
    b0 = 16
    for batch in (32, 64, 128):
        ratio = (b0 + b_crit) / (batch + b_crit)
        assert invert(ratio, batch, b0, cap=1e9) == pytest.approx(b_crit, abs=1e-9)
    assert invert(1.0, 32, b0, cap=512) == 512  # keeps up fully: only the cap bounds it
    assert invert(0.3, 32, b0, cap=512) == 0.0  # worse than steps alone: B_crit = 0


@pytest.mark.parametrize("b_crit", [4.0, 24.0, 90.0])
def test_fit_recovers_the_model_and_brackets_it(b_crit: float) -> None:
    ladder = [16, 32, 64, 128]
    point = fit_point(model_ratios(b_crit, ladder), 16, MIN_SPREAD, iteration=50)
    assert point.critical_batch == pytest.approx(b_crit, rel=0.03)
    assert point.low <= b_crit <= point.high
    assert point.low < point.high  # the noise floor still gives an interval


def test_a_noisier_branch_gives_a_wider_interval() -> None:
    decreases = model_ratios(24.0, [16, 32, 64])
    quiet = fit_point(decreases, 16, MIN_SPREAD, 1)
    noisy = fit_point(decreases, 16, 3 * MIN_SPREAD, 1)
    assert noisy.low <= quiet.low and noisy.high >= quiet.high
    assert noisy.high - noisy.low > quiet.high - quiet.low


def test_keeping_up_everywhere_is_capped_not_infinite() -> None:
    point = fit_point({16: 1.0, 32: 1.0, 64: 1.0}, 16, MIN_SPREAD, 1)
    assert point.critical_batch == pytest.approx(CAP * 64, rel=0.02)
    assert point.high == CAP * 64 and math.isfinite(point.high)


def test_a_run_is_read_as_the_examples_b0_needed_for_its_loss() -> None:
    curve = [(0, 10.0), (100, 8.0), (200, 7.0), (300, 7.5), (400, 6.0)]  # noisy, not linear
    assert examples_ratio(curve, 8.0) == pytest.approx(100 / 400)
    assert examples_ratio(curve, 7.5) == pytest.approx(150 / 400)
    # the bump at 300 is ignored (running minimum 7.0 there): 6.5 is half way to 6.0 at 400
    assert examples_ratio(curve, 6.5) == pytest.approx(350 / 400)
    assert examples_ratio(curve, 7.0) == pytest.approx(200 / 400)
    assert examples_ratio(curve, 10.0) == 0.0 and examples_ratio(curve, 11.0) == 0.0
    assert examples_ratio(curve, math.inf) == 0.0  # a diverged run kept nothing
    assert examples_ratio(curve, 5.0) == 1.0  # lower than B0 got: keeps up (at least)


def test_the_plan_fits_the_budget_and_says_its_cost() -> None:
    plan = plan_branches(16, n=10_000, largest=10_000, budget_examples=7_000,
                         planned_examples=100_000, points=1)
    assert plan.ladder == (16, 32, 64, 128)
    assert plan.total_examples <= 7_000 and plan.examples >= 10 * 128  # 10 steps at 128
    assert plan.examples == 1280  # 7000 // 5 = 1400, down to a multiple of 128
    assert "6.4 % of the plan" in plan.text(lambda b: 0.01)
    assert plan.seconds(lambda b: 0.01) == pytest.approx(0.01 * (plan.examples // 16 * 2 + sum(
        plan.examples // b for b in (32, 64, 128))))
    small = plan_branches(16, n=10_000, largest=10_000, budget_examples=3_000,
                          planned_examples=100_000, points=1)
    assert small.ladder == (16, 32, 64)  # fewer rungs rather than too few steps
    with pytest.raises(BatchboundError, match="branch budget"):
        plan_branches(16, n=10_000, largest=10_000, budget_examples=900,
                      planned_examples=100_000, points=1)


def test_trajectories_plateau_and_bracket() -> None:
    ladder = [16, 32, 64]
    point = fit_point(model_ratios(24.0, ladder), 16, MIN_SPREAD, iteration=100)
    noise = Pilot(16, 0.1, 1000, (50, 100, 400, 1000), (3.0, 5.0, 9.0, 17.0))
    central, low, high = trajectories([point], noise, 16, 0.1, 100, 1000)
    # half way in log between the plateau and the noise scale's growth (4× past the pilot)
    assert central.noise_scale(1000) == pytest.approx(point.critical_batch * 2.0)
    assert low.noise_scale(1000) == pytest.approx(point.low)
    assert high.noise_scale(1000) == pytest.approx(point.high * 4.0)  # noise grew 4× past it
    for batch in (32, 128):
        k = [predict_iterations(p, batch, "noise") for p in (central, low, high)]
        assert k[2] <= k[0] <= k[1]
    assert predict_iterations(central, 16, "noise") == pytest.approx(1000)


def test_combine_spans_both_only_when_they_disagree() -> None:
    agree = combine(500, (450, 560), 700, (520, 900))
    assert not agree.disagree and agree.interval == (450, 560)
    assert (agree.branch_iterations, agree.noise_iterations) == (500, 700)
    split = combine(500, (450, 560), 800, (700, 900))
    assert split.disagree and split.interval == (450, 900) and split.noise_iterations == 800


def test_combine_weights_each_estimate_by_its_precision_in_log() -> None:
    # closed form: σ = ln(hi/lo)/4 each; the mean of the logs weighted by 1/σ²
    branch, b_band, noise, n_band = 500.0, (450.0, 560.0), 700.0, (520.0, 900.0)
    wb, wn = (4 / math.log(b_band[1] / b_band[0])) ** 2, (4 / math.log(n_band[1] / n_band[0])) ** 2
    expected = math.exp((wb * math.log(branch) + wn * math.log(noise)) / (wb + wn))
    joined = combine(branch, b_band, noise, n_band)
    assert joined.iterations == pytest.approx(expected)
    assert joined.branch_weight == pytest.approx(wb / (wb + wn))
    assert branch < joined.iterations < noise  # the narrower band pulls harder
    assert joined.iterations - branch < noise - joined.iterations
    # equally wide bands: the geometric mean
    assert combine(400, (200, 800), 900, (450, 1800)).iterations == pytest.approx(600)


def test_a_branch_ladder_that_tells_little_leaves_the_prior_in_charge() -> None:
    # LeNet-5 on the H100 (fashion-lenet, 1875-step plan): one branch point, B_crit 12
    # (0–168); B = 2048 predicted 1200 (178–1875) from it, 500 (218–1210) from n·Δ;
    # training took 665. Weighted by precision the row is 677.
    joined = combine(1200, (178, 1875), 500, (218, 1210))
    assert 600 < joined.iterations < 760 and joined.branch_weight < 0.5
    assert joined.interval == (178, 1875) and not joined.disagree


def test_combine_with_a_silent_or_an_exact_band() -> None:
    # a band with no lower end says nothing: the other estimate alone
    assert combine(500, (0.0, 900), 700, (600, 800)).iterations == pytest.approx(700)
    assert combine(500, (450, 560), 700, (0.0, math.inf)).iterations == pytest.approx(500)
    both_silent = combine(500, (0.0, 900), 700, (0.0, 900))
    assert both_silent.iterations == 500  # the measurement, as before the prior was joined
    # a zero-width band is exact
    assert combine(500, (500, 500), 700, (600, 800)).iterations == pytest.approx(500)
    # the interval always holds the central value
    far = combine(300, (100, 2000), 900, (880, 920))
    assert far.interval[0] <= far.iterations <= far.interval[1]


def test_adam_type_is_told_by_name_or_by_the_factorys_betas() -> None:
    import torch

    from batchbound.advise.advice import _adaptive
    from batchbound.train import TrainConfig
    from batchbound.train.loop import Parts

    assert _adaptive(TrainConfig(optimizer="adamw"), None)
    assert _adaptive(TrainConfig(optimizer="adam"), None)
    assert not _adaptive(TrainConfig(), None)
    assert not _adaptive(TrainConfig(), Parts(optimizer=lambda p: torch.optim.SGD(p, lr=0.1)))
    assert _adaptive(TrainConfig(), Parts(optimizer=lambda p: torch.optim.NAdam(p, lr=0.1)))


def test_the_replicate_is_read_on_the_base_runs_subset() -> None:
    """B0's replicate runs at seed + 1 (another data order) but is evaluated on the pilot's
    subset: at a rate of 1e-12 nothing moves, so both curves must agree point for point (with the
    replicate's own subset they differed by the subsets' difference, read as noise)."""
    import torch

    from batchbound.advise.critical import branch
    from batchbound.train import TrainConfig
    from batchbound.train.distributed import DistContext
    from batchbound.train.loop import Trainer

    config = TrainConfig(dataset="digits", model="fc(depth=1,params=2000)", batch_size=16,
                         lr=0.1)
    trainer = Trainer(config, DistContext(device=torch.device("cpu")))
    model, opt = trainer.model.state_dict(), trainer.optimizer.state_dict()
    data = trainer.source

    def curve(seed: int) -> list[tuple[int, float]]:
        return branch(config.replace(seed=seed), data, torch.device("cpu"), model, opt, 16,
                      1e-12, 4, 2, 200, None, subset_seed=config.seed)

    base, replicate = curve(config.seed), curve(config.seed + 1)
    assert [i for i, _ in base] == [i for i, _ in replicate]
    assert [v for _, v in base] == pytest.approx([v for _, v in replicate], rel=1e-7)


def test_the_fewest_iterations_join_the_branches_and_the_noise_scale_as_the_rows_do() -> None:
    from batchbound.advise.advice import _fewest
    from batchbound.advise.iterations import minimum_iterations
    from batchbound.advise.trajectory import Segment, extrapolate

    segs = [Segment(1, 20, 8.0, 1.0, 2.0), Segment(21, 40, 10.0, 1.0, 1.6),
            Segment(41, 60, 12.0, 1.5, 1.4)]
    path = extrapolate(segs, 60, 600, 16, 0.1)
    assert _fewest(path, None) == pytest.approx(minimum_iterations(path.central))
    measured = tuple(Pilot(16, 0.1, 600, (60,), (1.0 + b,)) for b in (40.0, 10.0, 160.0))
    s_min = [minimum_iterations(p) for p in (path.central, path.low, path.high)]
    b_min = [minimum_iterations(p) for p in measured]
    expected = combine(b_min[0], (min(b_min[1:]), max(b_min[1:])), s_min[0],
                       (min(s_min[1:]), max(s_min[1:]))).iterations
    assert _fewest(path, measured) == pytest.approx(expected)
    assert min(b_min[0], s_min[0]) < expected < max(b_min[0], s_min[0])


def test_the_loss_trend_runs_on_the_steps_the_optimiser_has_been_moving() -> None:
    from batchbound.advise.trajectory import Segment, _grid, extrapolate

    lag, p = 9.0, 0.5
    segs = [Segment(a, a + 19, 10.0, 1.0, 3.0 * ((a + 9.5) - lag) ** -p)
            for a in (1, 21, 41, 61, 81)]
    shifted = extrapolate(segs, 100, 1000, 16, 0.1, lag)
    assert shifted.loss_exponent == pytest.approx(p) and shifted.lag == lag
    plain = extrapolate(segs, 100, 1000, 16, 0.1)  # read from step 0, the trend looks steeper
    assert plain.loss_exponent > p + 0.05
    # past the pilot the noise scale grows as ((t − lag)/(tp − lag))^p
    first, k = _grid(100, 1000)[0], 1000
    growth = shifted.central.noise_scale(k) / shifted.central.noise_scale(first)
    assert growth == pytest.approx(((k - lag) / (first - lag)) ** p)
    assert "counted from 9 steps in" in shifted.assumption


def test_advise_reads_the_lag_of_the_config_or_the_users_factory() -> None:
    import torch

    from batchbound.advise.advice import _lag
    from batchbound.train import TrainConfig
    from batchbound.train.loop import Parts

    config = TrainConfig(dataset="digits", model="fc", lr=0.01, momentum=0.9)
    assert _lag(config, None)[0] == pytest.approx(9.0, rel=1e-4)
    assert _lag(config.replace(momentum=0.0), None) == (0.0, None)
    factory = Parts(optimizer=lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.5))
    assert _lag(config, factory)[0] == pytest.approx(1.0, rel=1e-4)
    closure_only = Parts(optimizer=lambda p: torch.optim.LBFGS(p, lr=0.1))
    lag, why = _lag(config, closure_only)  # cannot step without a closure: no lag, said
    assert lag == 0.0 and why is not None and "closure" in why

    class Float32Only(torch.optim.SGD):  # an outside optimiser with its own demands
        def step(self, closure=None):
            assert all(p.dtype == torch.float32 for g in self.param_groups
                       for p in g["params"]), "float32 parameters only"
            return super().step(closure)

    lag, why = _lag(config, Parts(optimizer=lambda p: Float32Only(p, lr=0.1, momentum=0.9)))
    assert lag == 0.0 and why == "AssertionError: float32 parameters only"


def _segments(kappa_exponent: float, loss_exponent: float, se: float = 1.0) -> list:
    """Five pilot segments whose loss is 3·t^−p and whose B_noise·L is 10·t^r exactly."""
    from batchbound.advise.trajectory import Segment

    out = []
    for a in (1, 21, 41, 61, 81):
        t = a + 9.5
        loss = 3.0 * t**-loss_exponent
        out.append(Segment(a, a + 19, 10.0 * t**kappa_exponent / loss, se, loss))
    return out


def test_kappa_continues_its_rise_over_the_pilot() -> None:
    from batchbound.advise.trajectory import _grid, extrapolate

    p, r = 0.2, 0.3
    path = extrapolate(_segments(r, p), 100, 1000, 16, 0.1)
    assert path.loss_exponent == pytest.approx(p) and path.kappa_growth == pytest.approx(r)
    first, k = _grid(100, 1000)[0], 1000
    growth = path.central.noise_scale(k) / path.central.noise_scale(first)
    assert growth == pytest.approx((k / first) ** (p + r))  # B_noise = κ(t)/L(t)
    # the low end stays the plateau, the high end still grows as t: the central lies between
    for t in (first, 500, k):
        assert path.low.noise_scale(t) <= path.central.noise_scale(t) <= path.high.noise_scale(t)
    assert "κ ∝ t^0.30" in path.assumption


def test_a_falling_kappa_is_the_start_and_a_steep_rise_is_capped_at_the_high_end() -> None:
    from batchbound.advise.trajectory import _grid, extrapolate

    falling = extrapolate(_segments(-0.5, 0.2), 100, 1000, 16, 0.1)
    assert falling.kappa_growth == 0.0 and "κ ∝" not in falling.assumption
    steep = extrapolate(_segments(2.0, 0.2), 100, 1000, 16, 0.1)
    assert steep.kappa_growth == pytest.approx(0.8)  # r + p ≤ 1: no faster than t
    first = _grid(100, 1000)[0]
    assert steep.central.noise_scale(1000) / steep.central.noise_scale(first) == \
        pytest.approx(1000 / first)


def test_a_rise_within_one_standard_error_of_none_is_not_used() -> None:
    from batchbound.advise.trajectory import _grid, _kappa_trend, extrapolate

    clear = _segments(0.3, 0.2)  # B_noise ≈ 11–16 ± 1: r = 0.3 is several SE from 0
    r, se = _kappa_trend(clear[1:], 0.0)
    # the SE by hand: each segment's relative error carried through the slope of a fit on log t
    x = [math.log(s.middle) for s in clear[1:]]
    mean = sum(x) / len(x)
    spread = sum((v - mean) ** 2 for v in x)
    by_hand = math.sqrt(sum((v - mean) ** 2 * (s.se / s.noise) ** 2
                            for v, s in zip(x, clear[1:], strict=True))) / spread
    assert r == pytest.approx(0.3) and se == pytest.approx(by_hand) and se < 0.3
    assert extrapolate(clear, 100, 1000, 16, 0.1).kappa_growth == pytest.approx(0.3)
    noisy = _segments(0.3, 0.2, se=8.0)  # the same rise, each segment ± 50–70 %
    r, se = _kappa_trend(noisy[1:], 0.0)
    assert r == pytest.approx(0.3) and se > r
    path = extrapolate(noisy, 100, 1000, 16, 0.1)
    assert path.kappa_growth == 0.0 and path.kappa_trend == (pytest.approx(r), pytest.approx(se))
    assert "within one standard error of none: κ held constant" in path.assumption
    first = _grid(100, 1000)[0]  # past the pilot B_noise grows as 1/L(t) alone: t^p
    assert path.central.noise_scale(1000) / path.central.noise_scale(first) == \
        pytest.approx((1000 / first) ** 0.2)


def test_a_rise_out_of_the_first_segment_is_not_a_trend() -> None:
    from batchbound.advise.trajectory import extrapolate

    two = _segments(1.0, 0.1)[:2]  # a pilot of two segments: the first is the start's
    assert extrapolate(two, 40, 400, 16, 0.1).kappa_growth == 0.0
    three = _segments(0.3, 0.1)[:3]  # two after the first: their trend counts
    assert extrapolate(three, 60, 600, 16, 0.1).kappa_growth == pytest.approx(0.3)


def test_a_pilot_whose_gradient_is_all_noise_is_refused_naming_the_remedies():
    """Every step's estimate of ‖G‖² (the cross term C) negative: no segment can say what
    B_noise is, so the pilot is refused, not answered with a noise scale of 0 or ∞."""
    from batchbound.advise.trajectory import Step, segments
    from batchbound.errors import BatchboundError

    steps = [Step(i, 2.0, m2=5.0, cross=-0.5) for i in range(1, 61)]
    with pytest.raises(BatchboundError, match=r"over the pilot's 60 steps the gradient's "
                       r"signal was below its noise .*--pilot-fraction or the pilot's batch"):
        segments(steps, 1000)
    # the same steps with a positive ‖G‖² estimate are measured
    good = [Step(i, 2.0, m2=5.0, cross=0.5) for i in range(1, 61)]
    assert all(s.noise > 0 for s in segments(good, 1000))
