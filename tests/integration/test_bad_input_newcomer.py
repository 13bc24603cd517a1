"""What a newcomer types on the first day, following the README: a model factory written as a
file's path, a data file that is a folder or not there, a spec file for ``report`` that is not
there, the plan given twice, a typo in a spec or a data set's name. Each is one line naming
the problem, exit code 2. And the help and presets say η for the learning rate, as the docs
do, and ``batchbound demo --help`` describes the study the demo runs."""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

import pytest
from bad_input import BAD_INPUT, refused

pytestmark = BAD_INPUT

FACTORY = '''
from torch import nn


def small(input_shape, num_outputs):
    return nn.Sequential(nn.Flatten(), nn.Linear(input_shape[0], num_outputs))
'''


@pytest.fixture()
def in_a_folder_with_a_factory(tmp_path: Path, monkeypatch):
    (tmp_path / "newmodels.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("newmodels", None)


@pytest.mark.parametrize("model, hint", [
    ("newmodels.py:small", "write newmodels:small$"),
    ("./newmodels:small", "write newmodels:small$"),
    ("src/newmodels.py:small", "run from src or put it on PYTHONPATH, and write newmodels:small$"),
])
@pytest.mark.parametrize("command", [["measure"], ["train", "--max-epochs", "0.1"],
                                     ["advise", "--planned-epochs", "1"],
                                     ["models", "describe"]])
def test_a_factory_given_as_a_files_path_names_the_form_to_write(
        model: str, hint: str, command: list[str], in_a_folder_with_a_factory, capsys) -> None:
    argv = [*command, model] if command == ["models", "describe"] else [*command, "--model",
                                                                          model]
    refused(argv, rf"model {model}: MODULE:CALLABLE takes the module's import name, not a "
            rf"file: {hint}", capsys)


def test_the_form_the_hint_names_works(in_a_folder_with_a_factory, capsys) -> None:
    from batchbound.cli import main

    assert main(["measure", "--model", "newmodels:small"]) == 0  # the control
    assert "newmodels:small" in capsys.readouterr().out


def test_a_dotted_module_is_still_a_module(in_a_folder_with_a_factory, capsys) -> None:
    # "pkg.python_models" holds ".py" but is an import name, not a file
    refused(["measure", "--model", "newmodels.python_models:small"],
            r"no module 'newmodels.python_models'", capsys)


@pytest.mark.parametrize("family", ["npz", "text", "libsvm"])
def test_a_data_file_that_is_a_folder_says_so(family: str, tmp_path: Path, capsys) -> None:
    refused(["data", "show", f"{family}(path={tmp_path})", "--load"],
            rf"{family}: path='{tmp_path}' is a directory \({tmp_path}\); give a file", capsys)


def test_an_absolute_path_that_is_not_there_is_named_once(tmp_path: Path, capsys) -> None:
    file = tmp_path / "nope.npz"
    line = refused(["data", "show", f"npz(path={file})", "--load"],
                   rf"npz: file '{file}' not found \(looked at {file}\)$", capsys)
    assert line.count(str(file)) == 2


def test_a_relative_path_names_both_places_it_looked(tmp_path: Path, monkeypatch,
                                                     capsys) -> None:
    monkeypatch.chdir(tmp_path)
    refused(["data", "show", "npz(path=nope.npz)", "--load", "--data-dir", str(tmp_path / "d")],
            rf"looked at nope.npz and {tmp_path / 'd' / 'nope.npz'}\)$", capsys)


@pytest.mark.parametrize("argv, match", [
    (["measure", "--model", "fc(depht=2,params=4000)"], r"model 'fc' has no option 'depht'"),
    (["measure", "--model", "fcc(depth=2)"], r"unknown model family 'fcc'"),
    (["train", "--dataset", "digitz"], r"unknown data set 'digitz'"),
    (["train", "--workers", "0"], r"workers must be a positive integer, got 0"),
    (["train", "--lr", "-0.1"], r"lr must be a positive number, got -0.1"),
    (["advise", "--lr", "-0.1", "--planned-epochs", "1"], r"lr must be a positive number"),
    (["advise", "--planned-epochs", "4", "--planned-iterations", "100"],
     r"give the plan as epochs or as iterations, not both"),
    (["advise", "--max-workers", "0", "--planned-epochs", "1"],
     r"max workers must be a positive integer, got 0"),
])
def test_the_first_days_typos(argv: list[str], match: str, tmp_path: Path, monkeypatch,
                              capsys) -> None:
    monkeypatch.chdir(tmp_path)
    refused(argv, match, capsys)


def _all_help(parser: argparse.ArgumentParser) -> str:
    text = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            text += [_all_help(sub) for sub in action.choices.values()]
    return "\n".join(text)


def test_help_and_presets_write_eta_for_the_learning_rate() -> None:
    from batchbound.cli import build_parser

    help_text = _all_help(build_parser())
    assert "--convention" in help_text and "η" in help_text  # the control: all of it is there
    assert "γ" not in help_text
    presets = resources.files("batchbound") / "presets"
    texts = {p.name: p.read_text(encoding="utf-8") for p in presets.iterdir()
             if p.name.endswith(".toml")}
    assert len(texts) > 10 and any("η" in t for t in texts.values())
    assert [name for name, text in texts.items() if "γ" in text] == []


def test_demo_help_describes_the_study_the_demo_runs() -> None:
    from batchbound.cli import build_parser
    from batchbound.cli.demo import PRESET

    parser = build_parser()
    demo = parser._subparsers._group_actions[0].choices["demo"]
    text = " ".join(demo.format_help().split())
    from batchbound.config import load_toml

    spec = load_toml(Path(str(resources.files("batchbound") / "presets" / f"{PRESET}.toml")))
    depths = [str(d) for d in spec["models"]["depths"]]
    assert f"depths {', '.join(depths[:-1])} and {depths[-1]}" in text
    words = {2: "two", 3: "three", 4: "four", 5: "five"}
    assert f"{words[spec['train']['repeats']]} seeds" in text
    assert f"batch sizes {spec['batches']['min']}-{spec['batches']['max']}" in text
    assert f"within {spec['train']['max_epochs']} epochs" in text


def test_every_benchmark_script_parses_its_arguments() -> None:
    """``python benchmarks/X.py --help`` must explain, not start minutes of work (adaptive.py
    had no parser: --help ran the benchmark). Read from the source: importing them is slow."""
    root = Path(__file__).resolve().parents[2] / "benchmarks"
    scripts = [p for p in sorted(root.glob("*.py"))
               if '__name__ == "__main__"' in p.read_text(encoding="utf-8")]
    assert len(scripts) > 5  # the control: the scripts are there
    assert [p.name for p in scripts if "ArgumentParser(" not in p.read_text(encoding="utf-8")
            ] == []


@pytest.mark.parametrize("argv, match", [
    (["--planned-epochs", "1"],  # digits: 90 iterations at B0 = 16, the pilot 9 of them
     r"the pilot's 0.1 of the planned 90 iterations is 9 steps; the noise scale needs at least "
     r"20: give --pilot-fraction 0.23 or more, or a longer plan"),
    (["--planned-epochs", "1", "--critical-batch", "noise"], r"is 9 steps; .*0.23 or more"),
    (["--planned-iterations", "10"], r"is 1 step; the noise scale needs at least 20: give a "
     r"longer plan \(--planned-epochs or --planned-iterations\)$"),
])
def test_a_plan_too_short_for_the_pilot_is_refused_before_any_timing(
        argv: list[str], match: str, monkeypatch, capsys) -> None:
    from batchbound.advise import advice

    def no_timing(*args: object, **kwargs: object) -> None:
        raise AssertionError("timed the steps of a plan it refuses")

    monkeypatch.setattr(advice, "_timings", no_timing)
    refused(["advise", "--max-workers", "1", *argv], match, capsys)


@pytest.mark.parametrize("argv, match", [
    (["measure", "--model", "fc(depht=2,params=4000)"],
     r"model 'fc' has no option 'depht' \(did you mean 'depth'\?\); options: depth, width"),
    (["measure", "--model", "fcc(depth=2)"], r"unknown model family 'fcc' \(did you mean 'fc'\?\)"),
    (["train", "--dataset", "mnist-5k"],
     r"unknown data set 'mnist-5k' \(did you mean 'mnist5k'\?\)"),
    (["measure", "--model", "fc(xyz=2)"], r"model 'fc' has no option 'xyz'; options: depth"),
    (["train", "--strategy", "lsrr"], r"strategy 'lsrr' \(did you mean 'lsr'\?\)"),
    (["train", "--mechanism", "dropconect(p=0.5)"],
     r"unknown mechanism 'dropconect' \(did you mean 'dropconnect'\?\)"),
    (["train", "--transform", "replicat(r=2)"],
     r"unknown transform 'replicat' \(did you mean 'replicate'\?\)"),
    (["train", "--loss", "crossentropy"],
     r"unknown loss 'crossentropy' \(did you mean 'cross_entropy'\?\)"),
])
def test_a_typo_is_answered_with_the_name_it_is_close_to(argv: list[str], match: str,
                                                         capsys) -> None:
    refused(argv, match, capsys)


def test_a_typo_in_a_study_spec_or_a_config_names_the_key_it_is_close_to(
        tmp_path: Path, capsys) -> None:
    preset = resources.files("batchbound") / "presets" / "width-depth-digits.toml"
    spec = tmp_path / "typo.toml"
    spec.write_text(preset.read_text(encoding="utf-8").replace("max_epochs = 30",
                                                               "max_epoch = 30"))
    refused(["study", "plan", str(spec)],
            r"\[train\]: unknown key\(s\) max_epoch \(did you mean 'max_epochs'\?\)", capsys)
    config = tmp_path / "run.toml"
    config.write_text("lrr = 0.1\n")
    refused(["train", "--config", str(config)],
            r"unknown train config field\(s\) lrr \(did you mean 'lr'\?\)", capsys)


@pytest.mark.parametrize("argv, match", [
    (["--workers", "2"], r"unrecognized arguments: --workers 2 \(--workers is batchbound "
     r"train's: the pilot runs on one process; --max-workers sets the rows\) \(see"),
    (["--online-diversity", "norms"], r"--online-diversity is batchbound train's: use "
     r"--estimator\)"),
    (["--max-seconds=3"], r"--max-seconds is batchbound train's: the pilot's length"),
    (["--bogus", "1"], r"unrecognized arguments: --bogus 1 \(see batchbound advise --help\)"),
])
def test_advise_says_why_it_does_not_take_a_flag_of_train(argv: list[str], match: str,
                                                          capsys) -> None:
    refused(["advise", "--planned-epochs", "4", *argv], match, capsys)


def test_advise_takes_trains_name_for_the_exact_cadence() -> None:
    from batchbound.cli import build_parser

    parsed = build_parser().parse_args(["advise", "--diversity-every-epochs", "0.2"])
    assert parsed.diversity_every == 0.2


def test_advises_assumptions_count_one_segment_as_one() -> None:
    from batchbound.advise.trajectory import Segment, extrapolate

    one = extrapolate([Segment(1, 36, 44.0, 3.0, 2.2)], 36, 360, 16, 0.1).assumption
    assert "pilot's 36 steps (one segment, ± two standard errors of its level)" in one
    segs = [Segment(1, 20, 8.0, 1.0, 2.0), Segment(21, 40, 10.0, 1.0, 1.6)]
    two = extrapolate(segs, 40, 400, 16, 0.1).assumption
    assert "(2 segments, ± two standard errors of their level)" in two


@pytest.mark.parametrize("model, where", [
    ("fc(depth=2,params=4000", r"expected ',' or '\)' at position 22 \(at its end\)"),
    ("fc(depth=2 params=4000)", r"at position 11 \(before 'params=4000\)'\)"),
])
def test_a_malformed_spec_is_one_line_naming_where(model: str, where: str, capsys) -> None:
    refused(["measure", "--model", model], rf"malformed spec '.*': .*{where}; expected name",
            capsys)
