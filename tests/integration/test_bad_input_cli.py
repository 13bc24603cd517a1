"""The command line's classes of bad input (issue 14): each case is refused with one line
``batchbound <cmd>: error: ...`` naming the problem, exit code 2, no traceback, no hang, and
before any work starts, so that nothing is lost.

Cases run the CLI in this process (``refused``); the few that used to hang or allocate run as
their own process with a time limit (``refused_subprocess``). A case that is accepted starts
work, which the ``no_work`` fixture turns into a failure (or, for ``train``, costs one
iteration and fails on the exit code)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
from bad_input import BAD_INPUT, refused, refused_subprocess

pytestmark = BAD_INPUT

QUICK = ["--max-iterations", "1", "--no-progress"]  # an accepted train case costs little


def _unwritable(path: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=path):
            return False
    except OSError:
        return True


@pytest.fixture
def readonly(tmp_path: Path) -> Path:
    """A directory nobody can create files in (root ignores permission bits, so as root
    a read-only system folder stands in)."""
    folder = tmp_path / "readonly"
    folder.mkdir()
    folder.chmod(0o500)
    if _unwritable(folder):
        yield folder
        folder.chmod(0o700)
        return
    folder.chmod(0o700)
    for candidate in (Path("/sys"), Path("/proc/sys")):
        if candidate.is_dir() and _unwritable(candidate):
            yield candidate
            return
    pytest.skip("no unwritable directory on this machine")


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("x")
    return path


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Training, a study's runs or a report's analyses starting is the defect."""

    def started(*args: object, **kwargs: object) -> None:
        raise AssertionError("bad input was accepted: the work started")

    monkeypatch.setattr("batchbound.cli.train.train", started)
    monkeypatch.setattr("batchbound.study.runner.run_study", started)
    monkeypatch.setattr("batchbound.study.report.analyze", started)


# ------------------------------------------------------ 1. argparse's own errors: one line

@pytest.mark.parametrize("argv, match", [
    ([], "the following arguments are required: COMMAND"),
    (["nosuch"], "invalid choice: 'nosuch'"),
    (["train", "--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
    (["train", "-B", "1.5"], "argument --batch-size/-B: invalid int value: '1.5'"),
    (["train", "--convention", "median"], "argument --convention: invalid choice: 'median'"),
    (["train", "--target-train-acc"], "argument --target-train-acc: expected at least one"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["measure"], "required: --model"),
    (["measure", "--model", "fc", "--dtype", "float16"], "argument --dtype: invalid choice"),
    (["study"], "required: ACTION"),
    (["study", "run"], "required: file"),
    (["study", "run", "x", "--jobs", "two"], "argument --jobs: invalid integer 'two'"),
    (["study", "export", "s.sqlite", "--format", "xml"], "argument --format: invalid choice"),
    (["models", "family", "fc"], "required: --params"),
    (["models", "describe", "fc", "--outputs", "ten"], "argument --outputs: invalid integer"),
    (["data", "show"], "required: spec"),
    (["advise", "-P", "x"], "argument --max-workers/-P: invalid int value: 'x'"),
    (["demo", "--jobs", "x"], "argument --jobs: invalid integer 'x'"),
    (["report"], "required: study"),
    (["report", "a", "b"], "unrecognized arguments: b"),
])
def test_argparse_errors_are_one_line(argv: list[str], match: str, capsys) -> None:
    line = refused(argv, match, capsys)
    command = " ".join(["batchbound", *argv[:1]]) if argv and argv[0] != "nosuch" \
        else "batchbound"
    assert line.startswith(f"{command}: error: ") and line.endswith("--help)"), line


# -------------------------------------------------------------- 2. train --config FILE

CONFIGS = {
    "invalid.toml": (b"lr = = 1\n", r"config file .*invalid.toml is not valid TOML: Invalid"),
    "run.json": (b'{"lr": 0.1}\n', r"config file .*run.json is not valid TOML"),
    "garbage.bin": (bytes(range(256)) * 4, r"garbage.bin is not valid TOML: not UTF-8 text"),
    "unknown.toml": (b"lrr = 0.1\n", r"unknown train config field\(s\) lrr"),
    "table.toml": (b"[optim]\nlr = 0.1\n", r"unknown train config field\(s\) optim"),
    "string_batch.toml": (b'batch_size = "64"\n', r"batch_size: expected an integer, got '64'"),
    "float_batch.toml": (b"batch_size = 64.5\n", r"batch_size: expected an integer, got 64.5"),
    "string_momentum.toml": (b'momentum = "x"\n', r"momentum: expected a finite number"),
    "nan_decay.toml": (b"weight_decay = nan\n", r"weight_decay: expected a finite number, got nan"),
    "bool_epochs.toml": (b"max_epochs = true\n", r"max_epochs: expected a finite number"),
    "int_targets.toml": (b"targets = 5\n", r"targets is a list of \{metric, threshold\}"),
    "bad_target.toml": (b'targets = [{metric = "train_acc", threshold = "high"}]\n',
                        r"target train_acc threshold: expected a finite number, got 'high'"),
    "target_keys.toml": (b'targets = [{metric = "train_acc", value = 0.9}]\n',
                         r"a target is \{metric, threshold\}"),
    "int_model.toml": (b"model = 5\n", r"model: expected a string, got 5"),
    "list_device.toml": (b'device = ["cpu"]\n', r"device: expected a string"),
    "probes.toml": (b"final_probes = 3\n", r"final_probes is a list of probe names"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_train_config_file_contents(name: str, tmp_path: Path, no_work, capsys) -> None:
    content, match = CONFIGS[name]
    (tmp_path / name).write_bytes(content)
    refused(["train", "--config", str(tmp_path / name), *QUICK], match, capsys)


@pytest.mark.parametrize("where, match", [
    ("missing.toml", r"config file .*missing.toml does not exist"),
    (".", r"config file .* is a directory, not a file"),
    ("a_file/x.toml", r"cannot read config file .*: Not a directory"),
])
def test_train_config_file_that_is_not_there(where: str, match: str, tmp_path: Path,
                                             a_file: Path, no_work, capsys) -> None:
    refused(["train", "--config", str(tmp_path / where), *QUICK], match, capsys)


# ---------------------------------------------------------------- 3. study TOML specs

BASE = {
    "study": {"name": '"bad"'},
    "data": {"datasets": '["digits"]'},
    "models": {"specs": '["fc(depth=1,width=8)"]'},
    "batches": {"sizes": "[32, 64]"},
    "lr": {"grid": "[0.1]", "tuning": '"none"'},
    "train": {"targets": "{train_acc = 0.5}", "max_epochs": "1", "repeats": "1"},
}
SWEEP = {"models.specs": None, "models.family": '"fc"', "models.params": "4000",
         "models.depths": "[1, 2]"}


def spec_text(changes: dict[str, str | None], drop: tuple[str, ...] = ()) -> str:
    """BASE with ``{"section.key": raw TOML value, or None to drop it}`` applied and the
    sections in ``drop`` left out."""
    tables = {section: dict(keys) for section, keys in BASE.items() if section not in drop}
    for dotted, value in changes.items():
        section, key = dotted.split(".")
        tables.setdefault(section, {})
        if value is None:
            tables[section].pop(key, None)
        else:
            tables[section][key] = value
    return "".join(f"[{section}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())
                   for section, keys in tables.items())


def spec_file(folder: Path, changes: dict[str, str | None]) -> str:
    path = folder / "spec.toml"
    path.write_text(spec_text(changes))
    return str(path)


SPECS = [
    ({"batches.sizes": '"64"'}, r"\[batches\] sizes: expected a list"),
    ({"batches.sizes": "[-32, 64]"}, r"\[batches\] sizes: need a list of integers >= 1"),
    ({"batches.sizes": "[32.0, 64]"}, r"\[batches\] sizes: need a list of integers >= 1"),
    ({"batches.sizes": "[true, 64]"}, r"\[batches\] sizes: need a list of integers >= 1"),
    ({"batches.sizes": "[[32]]"}, r"\[batches\] sizes: need a list of integers >= 1"),
    ({"batches.sizes": "[]"}, r"\[batches\] sizes: need a list of integers >= 1"),
    ({"batches.sizes": None, "batches.min": "2.0", "batches.max": "64"},
     r"\[batches\] min: must be a power of two"),
    ({"lr.grid": '"0.1"'}, r"\[lr\] grid: expected a list"),
    ({"lr.grid": "[]"}, r"\[lr\] grid: need a non-empty list"),
    ({"lr.grid": "[nan]"}, r"\[lr\] grid: expected a list of finite numbers"),
    ({"lr.grid": "[inf]"}, r"\[lr\] grid: expected a list of finite numbers"),
    ({"lr.grid": '["0.1"]'}, r"\[lr\] grid: expected a list of finite numbers"),
    ({"lr.tuning": None, "lr.tune_seeds": "0.5"}, r"\[lr\] tune_seeds: expected an integer"),
    ({"lr.tune_epochs": '"2"'}, r"\[lr\] tune_epochs: expected a finite number"),
    ({"lr.strategy": "5"}, r"\[lr\] strategy: expected a list"),
    ({"train.repeats": "2.5"}, r"\[train\] repeats: expected an integer, got 2.5"),
    ({"train.workers": '"2"'}, r"\[train\] workers: expected an integer, got '2'"),
    ({"train.max_epochs": '"10"'}, r"\[train\] max_epochs: expected a finite number"),
    ({"train.max_epochs": "inf"}, r"\[train\] max_epochs: expected a finite number, got inf"),
    ({"train.momentum": "2"}, r"\[train\]: momentum must be in \[0, 1\)"),
    ({"train.weight_decay": "nan"}, r"\[train\] weight_decay: expected a finite number"),
    ({"train.weight_decay": "-1"}, r"\[train\]: weight_decay must be >= 0"),
    ({"train.stop_at_targets": '"yes"'}, r"\[train\] stop_at_targets: expected true or false"),
    ({"train.seed": "1.5"}, r"\[train\] seed: expected an integer"),
    ({"train.epochs": "3"}, r"\[train\]: unknown key\(s\) epochs"),
    ({"train.targets": '{train_acc = "high"}'}, r"train_acc threshold must be a number"),
    ({"train.targets": "{train_acc = 95}"}, r"write 0.95, not 95"),
    ({"train.targets": "{train_acc = nan}"}, r"\[train\] targets: expected a list"),
    ({"train.targets": "{train_loss = -1}"}, r"a loss is never negative"),
    ({"train.targets": "{train_acc = []}"}, r"empty list of thresholds"),
    ({"train.targets": "{}"}, r"need at least one target"),
    ({"train.mechanisms": "[]"}, r"\[train\] mechanisms: need at least one"),
    ({"train.final_probes": '["nope"]'}, r"unknown final probe\(s\) 'nope'"),
    ({"train.granularity": '"example"'}, r"unknown key\(s\) granularity"),
    ({**SWEEP, "models.depths": '"1,2"'}, r"\[models\] depths: expected a list"),
    ({**SWEEP, "models.depths": "[1.5]"}, r"\[models\] depths: expected a list of integers"),
    ({**SWEEP, "models.depths": "[]"}, r"\[models\] depths: need a list of integers"),
    ({**SWEEP, "models.params": '"4000"'}, r"\[models\] params: expected an integer"),
    ({**SWEEP, "models.params": "-5"}, r"\[models\] params: a family sweep needs params >= 1"),
    ({**SWEEP, "models.options": "5"}, r"\[models\] options: expected a table"),
    ({"models.specs": "[5]"}, r"\[models\] specs: expected a list of strings"),
    ({"models.specs": "[]"}, r"\[models\] specs/family"),
    ({"data.datasets": '"digits"'}, r"\[data\] datasets: need a list"),
    ({"data.datasets": "[5]"}, r"\[data\] datasets: each entry is a spec string or a table"),
    ({"data.datasets": "[]"}, r"\[data\] datasets: need a list"),
    ({"data.datasets": '[{dataset = 5}]'}, r"\[data\] dataset: expected a string"),
    ({"study.name": "5"}, r"\[study\] name: .*got 5"),
    ({"study.description": "5"}, r"\[study\] description: expected a string"),
    ({"study.colour": '"red"'}, r"\[study\]: unknown key\(s\) colour"),
    ({"extra.key": "1"}, r"\[top level\]: unknown key\(s\) extra"),
]


@pytest.mark.parametrize("changes, match", SPECS)
def test_study_spec_values(changes: dict, match: str, tmp_path: Path, capsys) -> None:
    refused(["study", "plan", spec_file(tmp_path, changes)], match, capsys)


@pytest.mark.parametrize("changes, match", [SPECS[0], SPECS[15], SPECS[19], SPECS[26]])
def test_study_run_and_report_refuse_a_bad_spec(changes: dict, match: str, tmp_path: Path,
                                                no_work, capsys) -> None:
    path = spec_file(tmp_path, changes)
    refused(["study", "run", path, "--store", str(tmp_path / "s.sqlite"), "--jobs", "0"],
            match, capsys)
    refused(["report", path, "--store", str(tmp_path / "s.sqlite")], match, capsys)
    assert not (tmp_path / "s.sqlite").exists()


@pytest.mark.parametrize("text, match", [
    (None, r"no study file .*missing.toml"),
    (b"", r"missing section \[study\]"),
    (b"[study\nname = 'x'\n", r"study spec .* is not valid TOML"),
    (bytes(range(256)) * 4, r"study spec .* is not valid TOML: not UTF-8 text"),
    (b"train = 5\n" + spec_text({}, drop=("train",)).encode(),
     r"study spec \[train\]: expected a table, got 5"),
    (b"study = 'x'\n" + spec_text({}, drop=("study",)).encode(), r"\[study\]: expected a table"),
])
@pytest.mark.parametrize("command", ["plan", "run"])
def test_study_files(text: bytes | None, match: str, command: str, tmp_path: Path, no_work,
                     capsys) -> None:
    path = tmp_path / "missing.toml"
    if text is not None:
        path.write_bytes(text)
    refused(["study", command, str(path)], match, capsys)


def test_study_spec_that_is_a_directory(tmp_path: Path, capsys) -> None:
    refused(["study", "plan", str(tmp_path)], r"is a directory, not a TOML file", capsys)


# --------------------------------------------- 4. names that become path components

@pytest.mark.parametrize("name", ['".."', '"."', '"a/b"', '"../../tmp/x"', '"a\\u0000b"',
                                  '".hidden"', '"-rf"', '"a b"', '"' + "x" * 101 + '"', '""'])
def test_study_names_that_are_not_one_folder(name: str, tmp_path: Path, no_work,
                                             capsys) -> None:
    path = spec_file(tmp_path, {"study.name": name})
    for argv in (["study", "plan", path], ["study", "run", path, "--jobs", "0"]):
        refused(argv, r"\[study\] name: need 1-100 letters, digits", capsys)


@pytest.mark.parametrize("name", ["..", ".", "a/b", "../../etc", "x\0y", "/abs", "a b"])
def test_report_names_that_are_not_one_folder(name: str, tmp_path: Path, monkeypatch,
                                              capsys) -> None:
    monkeypatch.chdir(tmp_path)  # runs/ relative to here: nothing outside is touched
    # one with a "/" reads as a spec file's path, and its error says no such file is there
    match = r"no study file" if "/" in name else r"\[study\] name: need 1-100 letters"
    refused(["report", name], match, capsys)


@pytest.mark.parametrize("name", ["/nope/study.toml", "nope.toml", "specs/nope.toml"])
def test_report_of_a_spec_file_that_is_not_there_names_the_file(name: str, tmp_path: Path,
                                                               monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    refused(["report", name], rf"no study file '{name}' and no preset of that name", capsys)


def test_presets_are_names_not_paths(tmp_path: Path, capsys) -> None:
    refused(["study", "plan", "../presets/width-depth-digits"], r"no study file", capsys)


# ---------------------------------------------- 5. sizes that cannot be allocated

@pytest.mark.parametrize("argv, match", [
    (["train", "--model", "fc(depth=1,width=1000000000)", *QUICK],
     r"model fc\(depth=1,width=1000000000\) has 75,000,000,010 parameters: 600.0 GB"),
    (["measure", "--model", "fc(depth=2,width=200000)"],
     r"has 40,015,200,010 parameters: 320.1 GB .* more than this machine's"),
    (["train", "--model", "fc(depth=100000,width=2)", *QUICK],
     r"depth \(hidden layers\) must be at most 1,000"),
    (["models", "family", "fc", "--params", "1000", "--depths", "1-100000000"],
     r"a depth is at most 1,000"),
])
def test_sizes_that_used_to_hang_or_allocate(argv: list[str], match: str) -> None:
    refused_subprocess(argv, match, timeout=120)


@pytest.mark.parametrize("command, model, match", [
    (["measure"], "gpt(width=1000000)", r"gpt\(width=1000000\) has [0-9,]+ parameters"),
    (["train", *QUICK], "gpt(width=1000000)", r"gpt\(width=1000000\) has [0-9,]+ parameters"),
    (["train", *QUICK], "gpt(depth=5000)", r"gpt: depth must be at most 1,000"),
    (["measure"], "lstm(layers=5000)", r"lstm: layers must be at most 1,000"),
])
def test_huge_language_models(command: list[str], model: str, match: str, tmp_path: Path,
                              capsys) -> None:
    text = tmp_path / "words.txt"
    text.write_text("\n\n".join(f"paragraph {i}: some words to predict" for i in range(40)))
    refused([*command, "--dataset", f"text(path={text},context=8)", "--model", model], match,
            capsys)


@pytest.mark.parametrize("argv, match", [
    (["train", "-B", "1000000000000", *QUICK], r"batch size 1000000000000 is larger than"),
    (["train", "--eval-subset", "1000000000", *QUICK], r"eval_subset 1000000000 exceeds"),
    (["train", "--model", "fc(width=1000000000000000000000)", *QUICK],
     r"width must be at most 2,147,483,647"),
    (["train", "--model", "resnet(blocks=[2,2,100000,2],width=4,image=[1,8,8])", *QUICK],
     r"each entry of blocks must be at most 1,000"),
    (["train", "--dtype", "float64", "--model", "fc(depth=1,width=1000000000)", *QUICK],
     r"\(8 bytes each\)"),
    (["models", "family", "fc", "--params", "1e300"],
     r"params \(the parameter budget\) must be at most 4.61e\+18, got 1e\+300"),
    (["models", "family", "fc", "--params", "1000", "--depths", "1,5000"],
     r"a depth is at most 1,000"),
])
def test_sizes_refused_before_allocation(argv: list[str], match: str, capsys) -> None:
    # checked against the data in train() (validate_against), before the model is built
    refused(argv, match, capsys)


def test_activations_too_big_for_memory(monkeypatch, capsys) -> None:
    # with 4 GB of memory the weights of fc(width=10^6) fit, its activations do not
    monkeypatch.setattr("batchbound.models.registry.memory_bytes", lambda: 4 * 10**9)
    model = ["--model", "fc(depth=1,width=1000000)"]
    refused(["train", *QUICK, *model], r"an evaluation chunk of 1,438 examples holds a layer "
            r"output of 1,000,000 values per example, 5.8 GB, .* lower eval_batch_size", capsys)
    refused(["train", *QUICK, *model, "--eval-batch-size", "64", "-B", "1024"],
            r"a worker's step of 1,024 examples .* 4.1 GB, .* lower batch_size", capsys)
    refused(["train", *QUICK, *model, "--eval-subset", "64", "--eval-batch-size", "64", "-B",
             "1024", "--dtype", "float64"], r"a worker's step of 1,024 examples .* 8.2 GB",
            capsys)


def test_a_study_of_an_absurd_model_fails_its_plan(tmp_path: Path, capsys) -> None:
    path = spec_file(tmp_path, {"models.specs": '["fc(depth=1,width=1000000000)"]'})
    refused(["study", "plan", path], r"has 75,000,000,010 parameters", capsys)
    refused(["study", "plan", spec_file(tmp_path, {"batches.sizes": "[32, 10000000000]"})],
            r"\[batches\] sizes: \[10000000000\] exceed the 1438 training examples", capsys)


# ------------------------------------------------- 6. outputs that cannot be written

def _outputs(tmp: Path, a_file: Path, readonly: Path) -> dict[str, tuple[str, str]]:
    """Unwritable output paths for a file and what the error says."""
    return {
        "a directory": (str(tmp), r"it is a directory"),
        "missing folder": (str(tmp / "missing" / "out"), r"missing does not exist"),
        "under a file": (str(a_file / "out"), r"a_file is not a directory"),
        "read-only": (str(readonly / "out"), r"is not writable"),
        "NUL": (str(tmp / "a\0b"), r"contains a NUL byte"),
    }


KINDS = ["a directory", "missing folder", "under a file", "read-only", "NUL"]
FILE_OPTIONS = [
    *[(["train", *QUICK, "--output"], kind) for kind in KINDS],
    # the checkpoint writer creates its folder: a missing one is fine
    *[(["train", *QUICK, "--checkpoint"], kind) for kind in KINDS if kind != "missing folder"],
    *[(["advise", "--target-train-acc", "0.5", "--figure"], kind) for kind in KINDS],
]


@pytest.mark.parametrize("option, kind", FILE_OPTIONS,
                         ids=[f"{o[0]} {o[-1]}: {kind}" for o, kind in FILE_OPTIONS])
def test_output_files_checked_before_work(option: list[str], kind: str, tmp_path: Path,
                                          a_file: Path, readonly: Path, no_work,
                                          capsys) -> None:
    path, match = _outputs(tmp_path, a_file, readonly)[kind]
    refused([*option, path], match, capsys)


@pytest.mark.parametrize("kind", ["a directory", "under a file", "read-only", "NUL"])
def test_study_store_checked_before_runs(kind: str, tmp_path: Path, a_file: Path,
                                         readonly: Path, no_work, capsys) -> None:
    path, match = _outputs(tmp_path, a_file, readonly)[kind]
    refused(["study", "run", spec_file(tmp_path, {}), "--jobs", "0", "--store", path], match,
            capsys)


def _dirs(tmp: Path, a_file: Path, readonly: Path) -> dict[str, tuple[str, str]]:
    """Unwritable output directories and what the error says."""
    return {
        "a file": (str(a_file), r"it is a file, not a directory"),
        "under a file": (str(a_file / "out"), r"a_file is not a directory"),
        "read-only": (str(readonly / "out"), r"is not writable"),
    }


@pytest.fixture
def empty_store(tmp_path: Path) -> Path:
    """A store that knows study 'bad' and holds none of its runs."""
    from batchbound.study.spec import load_study
    from batchbound.study.store import Store

    with Store(tmp_path / "empty.sqlite") as store:
        store.register_study("bad", load_study(spec_file(tmp_path, {})).to_dict())
    return tmp_path / "empty.sqlite"


@pytest.mark.parametrize("kind", ["a file", "under a file", "read-only"])
def test_output_directories_checked_before_work(kind: str, tmp_path: Path, a_file: Path,
                                                readonly: Path, empty_store: Path,
                                                monkeypatch, no_work, capsys) -> None:
    path, match = _dirs(tmp_path, a_file, readonly)[kind]
    monkeypatch.chdir(tmp_path)
    spec = spec_file(tmp_path, {})
    refused(["report", "bad", "--store", str(empty_store), "--out", path], match, capsys)
    refused(["study", "export", str(empty_store), "--out", path], match, capsys)
    refused(["study", "run", spec, "--jobs", "0", "--checkpoint-dir", path], match, capsys)
    refused(["demo", "--preset", spec, "--out", path], match, capsys)


@pytest.mark.parametrize("kind", ["a file", "under a file", "read-only", "NUL"])
def test_tensorboard_directories_checked_before_work(kind: str, tmp_path: Path, a_file: Path,
                                                     readonly: Path, no_work,
                                                     capsys) -> None:
    path = {"a file": a_file, "under a file": a_file / "tb", "read-only": readonly / "tb",
            "NUL": tmp_path / "a\0b"}[kind]
    match = r"cannot write TensorBoard files to "
    refused(["train", *QUICK, "--tensorboard", str(path)], match, capsys)
    refused(["study", "run", spec_file(tmp_path, {}), "--jobs", "0", "--tensorboard",
             str(path)], match, capsys)


def test_nul_in_output_directories(tmp_path: Path, empty_store: Path, no_work,
                                   capsys) -> None:
    bad = str(tmp_path / "a\0b")
    refused(["demo", "--out", bad], r"contains a NUL byte", capsys)
    refused(["report", "bad", "--store", str(empty_store), "--out", bad],
            r"contains a NUL byte", capsys)
    refused(["study", "export", str(empty_store), "--out", bad], r"contains a NUL byte", capsys)


def test_demo_store_checked_before_it_is_deleted(tmp_path: Path, a_file: Path, no_work,
                                                 capsys) -> None:
    refused(["demo", "--fresh", "--store", str(tmp_path)], r"it is a directory", capsys)
    refused(["demo", "--fresh", "--store", str(a_file / "s.sqlite")], r"is not a directory",
            capsys)


# ------------------------------------------------------------------- 7. device strings

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.mark.parametrize("device, match", [
    ("gpu", r"unknown device 'gpu'; choose from auto, cpu, cuda or cuda:i"),
    ("xyz", r"unknown device 'xyz'"),
    ("cpu:abc", r"unknown device 'cpu:abc'"),
    ("cuda:", r"unknown device 'cuda:'"),
    ("cuda:-1", r"unknown device 'cuda:-1'"),
    ("CUDA", r"unknown device 'CUDA'"),
    pytest.param("cuda:99", r"device 'cuda:99' requested but this machine has 0 CUDA",
                 marks=NO_CUDA),
    pytest.param("cuda", r"device 'cuda' requested but CUDA is not available", marks=NO_CUDA),
])
@pytest.mark.parametrize("command", [["train", *QUICK], ["advise", "--target-train-acc",
                                                          "0.5", "--max-epochs", "1"]],
                         ids=["train", "advise"])
def test_device_strings(command: list[str], device: str, match: str, capsys) -> None:
    refused([*command, "--device", device], match, capsys)


# ------------------------------------------------- 8. non-finite and out-of-range values

@pytest.mark.parametrize("argv, match", [
    (["--lr", "nan"], r"lr: expected a finite number, got nan"),
    (["--lr", "inf"], r"lr: expected a finite number, got inf"),
    (["--lr", "-1"], r"lr must be a positive number"),
    (["--lr", "0"], r"lr must be a positive number"),
    (["--momentum", "2"], r"momentum must be in \[0, 1\)"),
    (["--momentum", "nan"], r"momentum: expected a finite number"),
    (["--weight-decay", "nan"], r"weight_decay: expected a finite number, got nan"),
    (["--weight-decay", "-1"], r"weight_decay must be >= 0"),
    (["--max-seconds", "inf"], r"max_seconds: expected a finite number .*got inf"),
    (["--max-seconds", "0"], r"max_seconds must be > 0"),
    (["--max-epochs", "inf"], r"max_epochs: expected a finite number .*got inf"),
    (["--max-epochs", "-1"], r"max_epochs must be > 0"),
    (["--eval-every-epochs", "nan"], r"eval_every_epochs: expected a finite number"),
    (["--diversity-every-epochs", "inf"], r"diversity_every_epochs: expected a finite"),
    (["--snapshot-every-epochs", "nan"], r"snapshot_every_epochs: expected a finite"),
    (["--divergence-factor", "inf"], r"divergence_factor: expected a finite number"),
    (["--divergence-factor", "1"], r"divergence_factor must be > 1"),
    (["--batch-size", "0"], r"batch_size must be a positive integer, got 0"),
    (["--batch-size", "-4"], r"batch_size must be a positive integer, got -4"),
    (["--workers", "0"], r"workers must be a positive integer"),
    (["--micro-batch", "0"], r"micro_batch must be a positive integer"),
    (["--eval-batch-size", "0"], r"eval_batch_size must be a positive integer"),
    (["--eval-subset", "-1"], r"eval_subset must be a positive integer"),
    (["--max-iterations", "0"], r"max_iterations must be a positive integer"),
    (["--target-train-acc", "nan"], r"target train_acc threshold: expected a finite number"),
    (["--target-train-acc", "95"], r"write 0.95, not 95"),
    (["--target-train-acc", "0"], r"is a fraction in \(0, 1\]"),
    (["--target-train-loss", "-1"], r"target train_loss must be >= 0"),
    (["--target-test-loss", "inf"], r"target test_loss threshold: expected a finite"),
    (["--target-train-acc", "0.9", "0.9"], r"the same target is given twice"),
])
def test_train_values(argv: list[str], match: str, no_work, capsys) -> None:
    refused(["train", *QUICK, *argv], match, capsys)


@pytest.mark.parametrize("argv, match", [
    (["--lr", "nan"], r"lr: expected a finite number"),
    (["--diversity-every", "nan"], r"--diversity-every must be a positive number of epochs"),
    (["--diversity-every", "0"], r"--diversity-every must be a positive number of epochs, "
                                 r"got 0"),  # it named eval_every_epochs (an outside review)
    (["--max-epochs", "inf"], r"max_epochs: expected a finite number"),
    (["--max-workers", "0"], r"max workers must be a positive integer"),
    (["--batch-size", "0"], r"batch_size must be a positive integer"),
    (["--probe", "--probe-tolerance", "nan"], r"probe tolerance must be in \(0, 1\)"),
    (["--probe", "--probe-tolerance", "2"], r"probe tolerance must be in \(0, 1\)"),
])
def test_advise_values(argv: list[str], match: str, capsys) -> None:
    refused(["advise", "--target-train-acc", "0.5", *argv], match, capsys)


@pytest.mark.parametrize("argv, match", [
    (["measure", "--model", "fc(width=8)", "--chunk-size", "0"], r"chunk_size must be a pos"),
    (["models", "family", "fc", "--params", "nan"], r"--params must be a positive whole"),
    (["models", "family", "fc", "--params", "inf"], r"--params must be a positive whole"),
    (["models", "family", "fc", "--params", "2.5"], r"--params must be a positive whole"),
    (["models", "describe", "fc(width=8)", "--input-shape", "0", "--outputs", "3"],
     r"bad --input-shape '0': sizes >= 1"),
    (["models", "describe", "fc(width=8)", "--input-shape", "-4", "--outputs", "3"],
     r"bad --input-shape '-4'"),
    (["models", "describe", "fc(width=8)", "--input-shape", ",", "--outputs", "3"],
     r"bad --input-shape ','"),
    (["models", "describe", "fc(width=8)", "--input-shape", "4", "--outputs", "0"],
     r"argument --outputs: must be >= 1, got 0"),
])
def test_other_values(argv: list[str], match: str, capsys) -> None:
    refused(argv, match, capsys)


# ------------------------------------------------------------------------- 9. --jobs -1

@pytest.mark.parametrize("argv", [["demo", "--jobs", "-1"],
                                  ["demo", "--fresh", "--jobs", "-1"],
                                  ["study", "run", "width-depth-digits", "--jobs", "-1"]])
def test_negative_jobs(argv: list[str], no_work, capsys) -> None:
    refused(argv, r"argument --jobs: must be >= 0, got -1", capsys)


# ------------------------------------------------------ 10. reports that cannot be made

def test_report_of_a_study_with_no_runs(tmp_path: Path, empty_store: Path, capsys) -> None:
    refused(["report", "bad", "--store", str(empty_store), "--out", str(tmp_path / "r")],
            r"study bad has no runs in .*empty.sqlite: nothing to report; run `batchbound "
            r"study run` first", capsys)


def test_report_of_a_study_with_no_finished_runs(tmp_path: Path, monkeypatch,
                                                  capsys) -> None:
    """Rendered, saying so first (as a study whose runs all failed is), and exit code 1."""
    import batchbound.study.report as report
    from batchbound.advise.workers import COLUMNS
    from batchbound.cli import main
    from batchbound.study.plan import make_plan
    from batchbound.study.spec import load_study
    from batchbound.study.store import Store

    spec = load_study(spec_file(tmp_path, {}))
    with Store(tmp_path / "s.sqlite") as store:  # planned, never run
        store.register_study("bad", spec.to_dict())
        store.register_runs("bad", [(r.key, r.role, dict(r.fields), r.labels())
                                    for r in make_plan(spec).final_runs({})])
    monkeypatch.setattr("batchbound.advise.workers.workers_table",
                        lambda *a, **k: report.pd.DataFrame(columns=COLUMNS))
    capsys.readouterr()
    assert main(["report", "bad", "--store", str(tmp_path / "s.sqlite"), "--out",
                 str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["report: No run has finished yet (2 pending): nothing below is measured; "
                   "run `batchbound study run` to finish the study."]
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert summary.splitlines()[2] == f"**{err[0].removeprefix('report: ')}**"
    assert "No run has finished yet" in (tmp_path / "r" / "report.html").read_text()


@pytest.fixture
def finished_store(tmp_path: Path) -> Path:
    from batchbound.study.runner import run_study
    from batchbound.study.spec import load_study

    path = tmp_path / "done.sqlite"
    spec = load_study(spec_file(tmp_path, {"train.diversity_every_epochs": "1"}))
    outcome = run_study(spec, path, 0, progress=False, trainer="simulated_trainer:execute")
    assert outcome.failed == 0 and outcome.executed == 2
    return path


def test_report_folder_deleted_while_the_report_is_written(tmp_path: Path, finished_store,
                                                           monkeypatch, capsys) -> None:
    import batchbound.study.report as report
    from batchbound.advise.workers import COLUMNS

    out = tmp_path / "report"
    render = report.render_figures

    def render_then_delete(*args: object, **kwargs: object) -> object:
        drawn = render(*args, **kwargs)
        shutil.rmtree(out)  # another process cleans up while the report is written
        return drawn

    monkeypatch.setattr(report, "render_figures", render_then_delete)
    # the workers table times local processes: not what this case is about
    monkeypatch.setattr("batchbound.advise.workers.workers_table",
                        lambda *a, **k: report.pd.DataFrame(columns=COLUMNS))
    refused(["report", "bad", "--store", str(finished_store), "--out", str(out)],
            r"cannot write the report to .*report: No such file or directory", capsys)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_report_folder_made_read_only_while_the_report_is_written(
        tmp_path: Path, finished_store, monkeypatch, capsys) -> None:
    import batchbound.study.report as report
    from batchbound.advise.workers import COLUMNS

    out = tmp_path / "report"

    def lock(*args: object, **kwargs: object) -> object:
        out.chmod(0o500)
        return report.pd.DataFrame(columns=COLUMNS)

    monkeypatch.setattr("batchbound.advise.workers.workers_table", lock)
    try:
        refused(["report", "bad", "--store", str(finished_store), "--out", str(out)],
                r"cannot write the report to .*Permission denied", capsys)
    finally:
        out.chmod(0o700)


def test_more_local_workers_than_memory_can_start(capsys):
    """`train --workers 1000` used to start 1000 processes; it is refused before the first."""
    refused(["train", "--workers", "1000", "-B", "1000", "--dataset", "digits",
             "--no-progress"], r"1000 local worker processes need about [\d.]+ GB", capsys)


# ------------------------------- 11. files and numbers that hung, recursed or overflowed

DEEP_ARRAY = "a = " + "[" * 5000 + "]" * 5000 + "\n"  # RecursionError in the parser
DEEP_KEYS = "a" + ".a" * 5000 + " = 1\n"  # parsed flat, nested 5000 deep after
DEEP_TABLES = "x = " + "{a = " * 40 + "1" + "}" * 40 + "\n"


def _special(tmp_path: Path, kind: str) -> str:
    if kind == "fifo":  # opening one for reading waited for a writer forever
        os.mkfifo(tmp_path / "fifo.toml")
        return str(tmp_path / "fifo.toml")
    if kind == "huge":
        (tmp_path / "huge.toml").write_bytes(b"# padding\n" * 200_000)
        return str(tmp_path / "huge.toml")
    if kind.startswith("deep"):
        text = {"deep array": DEEP_ARRAY, "deep keys": DEEP_KEYS, "deep tables": DEEP_TABLES}
        (tmp_path / "deep.toml").write_text(text[kind])
        return str(tmp_path / "deep.toml")
    return "/dev/zero"  # read until memory ran out


FILES = {
    "fifo": r"is not a regular file \(a FIFO\); give a file",
    "zero": r"/dev/zero is not a regular file \(a character device\)",
    "huge": r"is larger than 1024 KiB \(2,000,000 bytes\)",
    "deep array": r"nests tables or arrays more than 32 deep",
    "deep keys": r"nests tables or arrays more than 32 deep",
    "deep tables": r"nests tables or arrays more than 32 deep",
}


@pytest.mark.parametrize("kind", list(FILES))
@pytest.mark.parametrize("command, what", [
    (["train", "--config"], "config file"),
    (["study", "plan"], "study spec"),
    (["study", "run"], "study spec"),
])
def test_files_that_are_not_small_flat_regular_files(kind: str, command: list[str], what: str,
                                                     tmp_path: Path, no_work,
                                                     capsys) -> None:
    path = _special(tmp_path, kind)
    started = time.perf_counter()
    refused([*command, path], rf"{what} .*{FILES[kind]}", capsys)
    assert time.perf_counter() - started < 5  # refused fast, before any work


@pytest.mark.parametrize("kind", list(FILES))
def test_cluster_files_too(kind: str, tmp_path: Path) -> None:
    """advise's cluster file goes through the same loader (called directly: advise's other
    checks come first on its command line)."""
    from batchbound.advise.timing import load_cluster
    from batchbound.errors import BatchboundError

    with pytest.raises(BatchboundError, match=rf"cluster file .*{FILES[kind]}"):
        load_cluster(_special(tmp_path, kind))


def test_a_fifo_config_does_not_hang_the_command(tmp_path: Path) -> None:
    """As its own process: a FIFO opened for reading used to block in open() forever."""
    refused_subprocess(["train", "--config", _special(tmp_path, "fifo")],
                       r"is not a regular file \(a FIFO\)", timeout=60)


INT64_MAX = 2**63 - 1


@pytest.mark.parametrize("argv, match", [
    (["train", "--seed", str(INT64_MAX + 1), *QUICK],
     r"seed: 9223372036854775808 does not fit in a 64-bit integer"),
    (["train", "--seed", str(-(2**63) - 1), *QUICK], r"seed: .* does not fit in a 64-bit"),
    (["train", "--max-iterations", str(2**64), "--no-progress"],
     r"max_iterations: 18446744073709551616 does not fit in a 64-bit integer"),
])
def test_integers_beyond_64_bits(argv: list[str], match: str, no_work, capsys) -> None:
    refused(argv, match, capsys)


@pytest.mark.parametrize("value, match", [
    ("0", r"--stall-timeout: must be a finite number > 0, got 0"),
    ("-5", r"--stall-timeout: must be a finite number > 0, got -5"),
    ("inf", r"--stall-timeout: must be a finite number > 0, got inf"),
    ("nan", r"--stall-timeout: must be a finite number > 0, got nan"),
    ("soon", r"--stall-timeout: invalid number of seconds 'soon'"),
])
def test_stall_timeouts(value: str, match: str, no_work, capsys) -> None:
    refused(["train", "--stall-timeout", value, *QUICK], match, capsys)


@pytest.mark.parametrize("changes, match", [
    ({"train.seed": str(INT64_MAX + 1)},
     r"\[train\] seed: 9223372036854775808 does not fit in a 64-bit integer"),
    ({"train.seed": str(INT64_MAX), "train.repeats": "2"},
     r"\[train\] seed: seeds 9223372036854775807 to 9223372036854775808 do not fit"),
    ({"train.repeats": "1000000000"},
     r"plans 2,000,000,000 runs \(0 tuning \+ 2,000,000,000 final: 2 grid cells × "
     r"1,000,000,000 repeats\); a study holds at most 100,000"),
    ({"lr.grid": "[" + ", ".join(f"{i + 1}e-3" for i in range(400)) + "]",
      "lr.tuning": '"lowest_loss_2_epochs"', "batches.sizes": "[" + ", ".join(
          str(b) for b in range(1, 301)) + "]"},
     r"plans 120,300 runs \(120,000 tuning \+ 300 final"),
])
def test_studies_too_big_to_plan(changes: dict, match: str, tmp_path: Path, no_work,
                                 capsys) -> None:
    started = time.perf_counter()
    for command in ("plan", "run"):
        refused(["study", command, spec_file(tmp_path, changes)], match, capsys)
    assert time.perf_counter() - started < 5  # refused from the spec, nothing planned


def test_a_seed_at_the_end_of_int64_trains(tmp_path: Path) -> None:
    """The largest seed is accepted and trains (with a mechanism and a probe, whose
    generators derive their own seeds from it): it used to overflow at run time."""
    from batchbound.cli import main

    assert main(["train", "--seed", str(INT64_MAX), "--mechanism", "dropconnect(p=0.1)",
                 "--final-probes", "linear_error", "--output", str(tmp_path / "r.json"),
                 *QUICK]) == 0


def test_workers_are_checked_against_available_memory(monkeypatch, capsys) -> None:
    """Memory that other jobs already use cannot start workers: the check reads what is
    available now, not the machine's total."""
    from batchbound.train import launch

    monkeypatch.setattr(launch, "available_memory_bytes", lambda: 2**30)  # 1 GB free
    refused(["train", "--workers", "4", "-B", "64", "--dataset", "digits", "--no-progress"],
            r"4 local worker processes need about 1.2 GB .* 1.0 GB available now", capsys)
    available = launch.available_memory_bytes()
    assert available is not None and 0 < available <= os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")


def test_a_reader_that_stops_early_is_no_traceback() -> None:
    """`batchbound study plan PRESET | head`: the pipe closes before the plan is written; the
    command ends quietly with 141, as a process ended by SIGPIPE (it used to print a
    BrokenPipeError traceback)."""
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        out = subprocess.run([sys.executable, "-m", "batchbound", "study", "plan",
                              "width-depth-digits"], stdout=write, stderr=subprocess.PIPE,
                             text=True, timeout=120)
    finally:
        os.close(write)
    assert out.returncode == 141 and "Traceback" not in out.stderr, out.stderr


def test_output_replaces_an_earlier_result_but_no_other_file(tmp_path: Path, capsys) -> None:
    """``train -o`` over a study spec or a data file replaced it with JSON (an outside
    review); only an earlier result is replaced now."""
    from batchbound.cli import main

    spec = tmp_path / "study.toml"
    spec.write_text("[study]\nname = 'mine'\n")
    refused(["train", *QUICK, "-o", str(spec)],
            r"study.toml exists and holds no batchbound result; give a new path", capsys)
    assert spec.read_text() == "[study]\nname = 'mine'\n"
    result = tmp_path / "result.json"
    for _ in range(2):  # the second run replaces the first one's result
        assert main(["train", *QUICK, "-o", str(result)]) == 0
    assert json.loads(result.read_text())["status"]


def test_tensorboard_keeps_another_runs_events_and_replaces_its_own(tmp_path: Path,
                                                                    capsys) -> None:
    """``--tensorboard DIR`` over another run's events deleted them (an outside review)."""
    from batchbound.cli import main

    logdir = tmp_path / "tb"
    assert main(["train", *QUICK, "--tensorboard", str(logdir)]) == 0
    first = sorted(p.name for p in logdir.iterdir() if "tfevents" in p.name)
    refused(["train", "--max-iterations", "2", "--no-progress", "--tensorboard", str(logdir)],
            r"holds another run's events .*give each run its own directory", capsys)
    assert sorted(p.name for p in logdir.iterdir() if "tfevents" in p.name) == first
    assert main(["train", *QUICK, "--tensorboard", str(logdir)]) == 0  # the same run: replaced
    assert len([p for p in logdir.iterdir() if "tfevents" in p.name]) == 1


def test_more_workers_than_cores_are_said_to_take_turns(monkeypatch) -> None:
    """--workers 64 on a 2-core machine ran without a word, its train_seconds those of 64
    processes sharing 2 cores (an outside review); as many as the cores: nothing said."""
    from batchbound.train import launch

    monkeypatch.setattr(launch, "usable_cores", lambda: 2)
    monkeypatch.setattr(launch, "available_memory_bytes", lambda: 2**40)
    with pytest.warns(UserWarning, match=r"64 local workers on the 2 CPU cores this process "
                                         r"may use take turns on them: the run takes about 32×"):
        launch._check_local_workers(64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch._check_local_workers(2)


def test_gpus_are_not_said_to_take_turns_on_the_cores(monkeypatch) -> None:
    """On GPUs the cores only launch the work: more GPU workers than cores say nothing."""
    from batchbound.train import launch

    monkeypatch.setattr(launch, "usable_cores", lambda: 2)
    monkeypatch.setattr(launch, "available_memory_bytes", lambda: 2**40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        launch._check_local_workers(4, torch.device("cuda"))
