"""The study spec validates with errors naming the key; the planner expands grids exactly."""

from __future__ import annotations

import re

import pytest

from batchbound.errors import BatchboundError
from batchbound.study.plan import FINAL, TUNE, make_plan
from batchbound.study.spec import load_study, preset_names, study_from_dict


def raw(**changes):
    spec = {
        "study": {"name": "t"},
        "data": {"datasets": ["digits"]},
        "models": {"family": "fc", "params": 4000, "depths": [1, 2, 4]},
        "batches": {"sizes": [16, 64, 256]},
        "lr": {"grid": [0.1, 0.3], "tuning": "lowest_loss_2_epochs"},
        "train": {"targets": {"train_acc": 0.9}, "max_epochs": 5, "repeats": 2},
    }
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if value is None:
            spec[section].pop(field)
        else:
            spec[section][field] = value
    return spec


def test_presets_load():
    assert {"width-depth-digits", "strategies-digits"} <= set(preset_names())
    for name in preset_names():
        spec = load_study(name)
        assert spec.name == name


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"batches__sizes": [64, 16]}, "[batches] sizes"),
        ({"batches__sizes": [0, 16]}, "[batches] sizes"),
        ({"lr__grid": [0.1, -1]}, "[lr] grid"),
        ({"lr__tuning": "magic"}, "[lr] tuning"),
        ({"lr__strategy": "cosine"}, "[lr] strategy"),
        ({"lr__tuning": "none"}, "[lr] grid"),
        ({"train__targets": {"train_f1": 0.9}}, "[train] targets"),
        ({"train__repeats": 0}, "[train] repeats"),
        ({"train__colour": "red"}, "[train]: unknown key(s) colour"),
        ({"models__depths": [-1, 2]}, "[models] depths"),
        ({"models__specs": ["fc(depth=1,width=8)"]}, "[models] specs/family"),
        ({"study__name": "a b"}, "[study] name"),
    ],
)
def test_bad_specs_name_the_key(change, needle):
    with pytest.raises(BatchboundError, match=re.escape(needle)):
        study_from_dict(raw(**change))


def test_batch_range_expands_powers_of_two():
    spec = study_from_dict(raw(batches__sizes=None, batches__min=32, batches__max=512))
    assert spec.batch_sizes == (32, 64, 128, 256, 512)
    with pytest.raises(BatchboundError, match="power of two"):
        study_from_dict(raw(batches__sizes=None, batches__min=30, batches__max=512))


def test_batch_larger_than_data_is_rejected_at_planning():
    with pytest.raises(BatchboundError, match="exceed"):
        make_plan(study_from_dict(raw(batches__sizes=[16, 4096])))


def test_planner_expands_the_grid():
    spec = study_from_dict(raw())
    plan = make_plan(spec)
    tune = plan.tuning_runs()
    # 3 shapes × 3 batch sizes × 2 step sizes × 1 tuning seed
    assert len(tune) == 18 and all(r.role == TUNE and r.epochs == 2 for r in tune)
    assert {(r.model.depth, r.batch_size, r.lr) for r in tune} == {
        (d, b, lr) for d in (1, 2, 4) for b in (16, 64, 256) for lr in (0.1, 0.3)}
    assert all(r.fields["targets"] == [] for r in tune)  # [width]: 2 epochs, lowest loss
    # family sweep: widths solved for ~4000 weights on 64 inputs and 10 classes
    widths = {r.model.depth: r.model.width for r in tune}
    assert widths[1] == 54 and all(abs(r.model.params - 4000) < 200 for r in tune)
    chosen = {r.group(): 0.3 for r in tune}
    finals = plan.final_runs(chosen)
    assert len(finals) == 18 == plan.final_count()  # 3 shapes × 3 B × 2 seeds
    assert all(r.role == FINAL and r.lr == 0.3 and r.epochs == 5 for r in finals)
    assert {r.seed for r in finals} == {0, 1}
    assert len({r.key for r in [*tune, *finals]}) == 36  # every config distinct


def test_fewest_steps_reuses_tuning_runs_as_finals():
    spec = study_from_dict(raw(lr__tuning="fewest_steps"))
    plan = make_plan(spec)
    tune = plan.tuning_runs()
    assert all(r.epochs == 5 and r.fields["targets"] for r in tune)
    finals = plan.final_runs({r.group(): 0.1 for r in tune})
    shared = {r.key for r in tune} & {r.key for r in finals}
    assert len(shared) == 9  # the seed-0 final at the chosen η is the tuning run itself


def test_base_batch_tuning_and_strategies_grid():
    spec = study_from_dict(raw(lr__strategy=["blr", "lsr(base_batch=16,warmup_epochs=1)",
                                             "srsr(base_batch=16)"], lr__tune_at="base_batch"))
    plan = make_plan(spec)
    tune = plan.tuning_runs()
    assert {r.batch_size for r in tune} == {16}
    assert len(tune) == 3 * 3 * 2  # shapes × strategies × η
    chosen = {r.group(): r.lr for r in tune if r.lr == 0.1}
    finals = plan.final_runs(chosen)
    assert len(finals) == 3 * 3 * 3 * 2
    assert {r.fields["strategy"] for r in finals} == set(spec.lr.strategies)
    assert all(r.lr == 0.1 for r in finals)


def test_transforms_change_the_planned_data_size():
    spec = study_from_dict(raw(data__datasets=[
        "digits", {"dataset": "digits", "transform": "subset(fraction=0.25)"}],
        batches__sizes=[16, 256]))
    plan = make_plan(spec)
    sizes = {r.data: r.n_train for r in plan.tuning_runs()}
    assert sizes == {"digits": 1438, "digits | subset(fraction=0.25)": 360}
    transforms = {r.fields["transform"] for r in plan.tuning_runs()}
    assert transforms == {None, "subset(fraction=0.25)"}
    with pytest.raises(BatchboundError, match="exceed"):
        make_plan(study_from_dict(raw(data__datasets=[
            {"dataset": "digits", "transform": "subset(fraction=0.1)"}])))


def test_cli_plan_json(capsys):
    import json

    from batchbound.cli import main

    assert main(["study", "plan", "width-depth-digits", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    roles = [r["role"] for r in plan["runs"]]
    # 5 depths × 7 batch sizes × 4 η tuning runs; 5 × 7 × 3 seeds finals
    assert roles.count("tune") == 140 and roles.count("final") == 105
    assert plan["estimate_seconds"] > 0
    assert main(["study", "plan", "no-such-study"]) == 2


def test_cli_plan_prints_whole_data_labels(capsys):
    from batchbound.cli import main

    assert main(["study", "plan", "replication-digits"]) == 0
    out = capsys.readouterr().out
    assert "digits | replicate(r=8)" in out  # cut at 12 characters, every r looked alike


def test_cli_plan_reads_user_files_from_data_dir(tmp_path, monkeypatch, capsys):
    import json

    import numpy as np

    from batchbound.cli import main

    monkeypatch.delenv("BATCHBOUND_DATA", raising=False)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "mine.npz", x=rng.normal(size=(300, 8)).astype("float32"),
             y=rng.integers(0, 3, size=300))
    study = tmp_path / "s.toml"
    study.write_text(
        '[study]\nname = "mine"\n[data]\ndatasets = ["npz(path=mine.npz)"]\n'
        '[models]\nspecs = ["linear(depth=0)"]\n[batches]\nsizes = [8, 32]\n'
        '[lr]\ngrid = [0.1]\n[train]\ntargets = { train_acc = 0.5 }\nmax_epochs = 2\n')
    assert main(["study", "plan", str(study), "--json"]) == 2  # not in the default dir
    capsys.readouterr()
    # the setting reaches the workers through the environment; monkeypatch restores it
    monkeypatch.setenv("BATCHBOUND_DATA", "/nonexistent")
    assert main(["study", "plan", str(study), "--json", "--data-dir", str(tmp_path)]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert {r["batch_size"] for r in runs} == {8, 32}
    assert {r["model_label"] for r in runs} == {"L=0"}


def test_a_bad_model_spec_fails_the_plan_not_every_run():
    with pytest.raises(BatchboundError, match="needs a width"):
        make_plan(study_from_dict(raw(models__family=None, models__params=None,
                                      models__depths=None, models__specs=["linear(depth=2)"])))


def test_family_sweeps_cover_conv_families_and_depth_zero():
    lenet = {"models__family": "lenet", "models__depths": [0, 1, 2], "batches__sizes": [16],
             "models__options": {"image": [1, 8, 8], "padding": 2}}
    shapes = make_plan(study_from_dict(raw(models__params=60000, **lenet))).shapes["digits"]
    assert [s.depth for s in shapes] == [0, 1, 2]
    assert all(abs(s.params - 60000) / 60000 < 0.01 for s in shapes[1:])
    # the convolutional trunk alone has 27,580 parameters: 20,000 cannot be met
    with pytest.raises(BatchboundError, match="cannot meet 20,000"):
        make_plan(study_from_dict(raw(models__params=20000, **lenet)))
    fc = make_plan(study_from_dict(raw(models__depths=[0, 1]))).shapes["digits"]
    assert fc[0].label == "L=0" and fc[0].params == 64 * 10 and fc[1].width == 54


def test_clashing_short_labels_fall_back_to_the_spec():
    specs = ["fc(depth=2,width=36)", "fc(depth=2,width=36,act=tanh)", "fc(depth=1,width=54)"]
    spec = study_from_dict(raw(models__family=None, models__params=None, models__depths=None,
                               models__specs=specs, batches__sizes=[16]))
    labels = [s.label for s in make_plan(spec).shapes["digits"]]
    assert labels == [*specs[:2], "L=1 K=54"]


def test_heatmap_rows_are_depth_only_when_depth_names_one_model():
    import pandas as pd

    from batchbound.study.plots import shape_axis

    one = pd.DataFrame({"depth": [1, 1, 2], "model_label": ["L=1 K=54", "L=1 K=54", "L=2 K=36"]})
    assert shape_axis(one, "depth") == "depth"
    two = pd.DataFrame({"depth": [2, 2], "model_label": ["fc(...)", "lenet L=2 K=84"]})
    assert shape_axis(two, "depth") == "model_label"
    assert shape_axis(one.assign(depth=[1, None, 2]), "depth") == "model_label"


def test_train_takes_any_trainconfig_field_as_an_override():
    """[train] is a partial TrainConfig: a field the study does not own reaches every run
    (and its key) only when set, TrainConfig checks it, and the grid's fields are refused."""
    base = make_plan(study_from_dict(raw()))
    plain = [r.key for r in base.tuning_runs()]
    changed = make_plan(study_from_dict(raw(train__dtype="float64", train__eval_subset=100)))
    runs = changed.tuning_runs()
    assert all(r.fields["dtype"] == "float64" and r.fields["eval_subset"] == 100 for r in runs)
    assert [r.key for r in runs] != plain  # a set override is part of the run's identity
    assert "dtype" not in base.tuning_runs()[0].fields  # unset: stored keys stay as they were
    with pytest.raises(BatchboundError, match=r"\[train\] batch_size: set by the study's grid"):
        study_from_dict(raw(train__batch_size=32))
    with pytest.raises(BatchboundError, match="dtype"):
        study_from_dict(raw(train__dtype="float16"))
    with pytest.raises(BatchboundError, match="unknown key"):
        study_from_dict(raw(train__no_such_option=1))


def test_train_optimizer_reaches_every_run():
    spec = study_from_dict(raw(train__optimizer="adamw", train__betas=[0.9, 0.95]))
    runs = make_plan(spec).tuning_runs()
    assert runs and all(r.fields["optimizer"] == "adamw" and list(r.fields["betas"]) ==
                        [0.9, 0.95] for r in runs)
    plain = make_plan(study_from_dict(raw())).tuning_runs()
    assert {r.key for r in runs}.isdisjoint({r.key for r in plain})
    assert all("optimizer" not in r.fields for r in plain)  # stored keys unchanged
    with pytest.raises(BatchboundError, match="momentum is SGD's"):
        study_from_dict(raw(train__optimizer="adam", train__momentum=0.9))


def test_diversity_every_epochs_zero_turns_the_exact_delta_off():
    # TOML has no None: 0 gives final runs no Δ measurement (and no pass over the data)
    off = study_from_dict(raw(train__diversity_every_epochs=0)).train
    on = study_from_dict(raw(train__diversity_every_epochs=2)).train
    assert off.run_fields(with_targets=True)["diversity_every_epochs"] is None
    assert on.run_fields(with_targets=True)["diversity_every_epochs"] == 2
    with pytest.raises(BatchboundError, match="diversity_every_epochs"):
        study_from_dict(raw(train__diversity_every_epochs=-1))
