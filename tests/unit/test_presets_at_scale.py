"""The papers' experiments at their scale (docs/study.md): what each preset promises about its
regime — 5 seeds, batch grids from at most 0.1 % of n, the DropConnect comparison's settings
— read from the packaged specs, so a later edit that leaves the regime fails here. The
batch fraction needs the data set's size, so those tests plan the study (slow)."""

from __future__ import annotations

import pytest

from batchbound.errors import BatchboundError
from batchbound.study.plan import make_plan
from batchbound.study.spec import load_study

AT_SCALE = ["architectures-fashion", "generalization-fashion", "lm-speedup-fortunes"]


@pytest.mark.parametrize("name", [*AT_SCALE, "dropconnect-timing-fashion"])
def test_at_scale_presets_run_five_seeds(name):
    spec = load_study(name)
    assert spec.name == name
    assert spec.train.repeats == 5


def test_dropconnect_timing_fashion_is_the_papers_table_1_setting():
    spec = load_study("dropconnect-timing-fashion")
    assert spec.train.workers == 2
    assert spec.train.mechanisms == ("none", "dropconnect(p=0.4)", "dropconnect(p=0.5)")
    assert spec.train.mechanism_granularity == "example"  # the paper's per-example draws
    assert {256, 512} <= set(spec.batch_sizes)  # the paper's best batches, plain and DC
    assert spec.lr.tuning == "fewest_steps" and len(spec.lr.grid) >= 2  # γ tuned per cell
    assert len(spec.train.targets) == 3
    assert [t for _, t in spec.train.targets] == sorted(t for _, t in spec.train.targets)


def test_dropconnect_timing_fashion_model_is_lenet_5():
    from batchbound.models import build_model, model_shape

    model = build_model(load_study("dropconnect-timing-fashion").models.specs[0], (1, 28, 28), 10)
    convs = [m for m in model.modules() if type(m).__name__ == "Conv2d"]
    linears = [m for m in model.modules() if type(m).__name__ == "Linear"]
    assert [c.out_channels for c in convs] == [6, 16]  # LeNet-5's channels
    assert [f.out_features for f in linears] == [120, 84, 10]  # and its head
    assert model_shape(model).family == "lenet"


@pytest.mark.slow
@pytest.mark.parametrize("name", AT_SCALE)
def test_at_scale_batch_grids_start_at_most_a_thousandth_of_n(name):
    try:
        plan = make_plan(load_study(name))
    except BatchboundError as exc:  # the data set is not on this machine
        pytest.skip(f"{name}: {exc}")
    (info,) = plan.infos.values()
    assert min(plan.spec.batch_sizes) <= 0.001 * info.n_train
    assert info.n_train >= 50_000  # the papers' data sizes, not digits' 1 438
