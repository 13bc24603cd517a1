"""Round 4 of hostile conditions (issue 39): the environment checked before start, and the
result first. A leftover or malformed ``WORLD_SIZE``/``RANK``, too little shared memory for
``train --workers``, SIGINT to one pool worker, and an output folder removed during training
each end with one line and an exit code that says what happened; nothing computed is lost."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bad_input import BAD_INPUT, FAULT, refused

TRAIN = ["train", "--dataset", "digits", "--model", "fc(depth=1,params=800)", "-B", "64",
         "--no-progress", "--json", "--no-stop-at-targets"]


@FAULT
def test_an_output_folder_removed_during_training_keeps_the_result(tmp_path):
    """`train --output D/res.json` with D removed mid-run: the result is printed (and kept in
    a file of its own), then one line says --output could not be written (exit 1); it was a
    FileNotFoundError traceback after the whole run, the result never printed."""
    folder, checkpoint = tmp_path / "D", tmp_path / "ck" / "c.pt"
    folder.mkdir()
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchbound", *TRAIN, "--max-iterations", "1500",
         "--eval-every-iterations", "500", "--checkpoint-every", "20", "--checkpoint",
         str(checkpoint), "--output", str(folder / "res.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    deadline = time.time() + 120
    while not checkpoint.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.time() < deadline
        time.sleep(0.05)
    shutil.rmtree(folder)
    out, err = proc.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert proc.returncode == 1, err
    assert "Traceback" not in err and len(lines) == 1, err
    assert f"cannot write {folder / 'res.json'} after the run" in lines[0]
    summary = json.loads(out)  # printed first
    assert summary["config_hash"]
    kept = Path(lines[0].split("the whole result is kept in ")[1])
    assert kept.parent == tmp_path and kept.exists()
    assert json.loads(kept.read_text())["config_hash"] == summary["config_hash"]


# ------------------------------------------------------------- the torchrun environment

ENVIRONMENTS = {
    "WORLD_SIZE=two": ({"WORLD_SIZE": "two"}, r"WORLD_SIZE='two' is not an integer >= 1"),
    "a leftover WORLD_SIZE=2": ({"WORLD_SIZE": "2"},
                                r"WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are "
                                r"not.*left over from another job"),
    "a leftover RANK=1": ({"RANK": "1"}, r"RANK='1' without a world of several ranks"),
    "RANK past the world": ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": "29500"}, r"RANK=2 is not below WORLD_SIZE=2"),
    "a restart count not a number": ({"TORCHELASTIC_RESTART_COUNT": "x"},
                                     r"TORCHELASTIC_RESTART_COUNT='x' is not an integer"),
    "a port past 65535": ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a port"),
}
TORCHRUN = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT")


@BAD_INPUT
@pytest.mark.parametrize("case", list(ENVIRONMENTS))
def test_a_torchrun_environment_torchrun_could_not_make_is_one_line(monkeypatch, capsys,
                                                                     tmp_path, case):
    variables, match = ENVIRONMENTS[case]
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    refused([*TRAIN, "--max-iterations", "2", "--output", str(tmp_path / "r.json")], match,
            capsys)
    assert not (tmp_path / "r.json").exists()


@BAD_INPUT
def test_a_study_is_not_run_in_a_torchrun_environment(monkeypatch, capsys, tmp_path):
    from study_processes import TRAINER

    spec = tmp_path / "spec.toml"
    spec.write_text('[study]\nname = "e"\n[data]\ndatasets = ["digits"]\n[models]\n'
                    'specs = ["fc(depth=1,width=8)"]\n[batches]\nsizes = [64]\n[lr]\n'
                    'grid = [0.1]\ntuning = "none"\n[train]\ntargets = { train_acc = 0.5 }\n'
                    'max_epochs = 1\nrepeats = 1\n')
    for name in TORCHRUN:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    store = tmp_path / "s.sqlite"
    refused(["study", "run", str(spec), "--store", str(store), "--jobs", "0", "--trainer",
             TRAINER, "--no-progress"], r"WORLD_SIZE=2 is set but RANK", capsys)
    assert not store.exists()  # before the store is made


# ------------------------------------------------------------------- shared memory


def _small_shm_available() -> bool:
    return shutil.which("unshare") is not None and os.geteuid() == 0 and subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /dev/shm"],
        capture_output=True).returncode == 0


@BAD_INPUT
@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_a_full_shared_memory_refuses_local_workers_before_they_start(tmp_path):
    """`train --workers 2` with a /dev/shm too small for the data set: one line naming the
    shared memory and what it needs (it was 48 lines from torch, in every rank). The run
    sees its own mount namespace with a 64 KiB /dev/shm, so the machine's is untouched."""
    if not _small_shm_available():
        pytest.skip("needs root and unshare to give the run a small /dev/shm")
    argv = [sys.executable, "-m", "batchbound", *TRAIN, "--workers", "2", "--max-iterations",
            "2"]
    command = "mount -t tmpfs -o size=64k tmpfs /dev/shm && exec " + " ".join(
        f"'{a}'" for a in argv)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True,
                          text=True, env=env, timeout=300, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert re.search(r"2 local workers need about \d+ MB of shared memory \(/dev/shm\) to "
                     r"receive the data set; 0 MB is free", lines[0]), lines[0]


def test_the_shared_memory_estimate_counts_the_data_set():
    from batchbound.data import load_dataset
    from batchbound.train.launch import SHARED_MEMORY_PER_WORKER, shared_memory_bytes

    data = load_dataset("digits")
    tensors = data.x_train.nbytes + data.y_train.nbytes + data.x_test.nbytes \
        + data.y_test.nbytes
    assert shared_memory_bytes(data, 2) == tensors + 2 * SHARED_MEMORY_PER_WORKER


# ---------------------------------------------------- SIGINT to one worker of a study


@FAULT
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_sigint_to_one_pool_worker_stops_the_study_like_ctrl_c(tmp_path):
    """SIGINT to one of the two pool workers of `study run --jobs 2` is SIGINT to the study:
    every run stops at its checkpoint, one line, exit 75, and the rerun resumes them (it
    was a KeyboardInterrupt traceback, a broken pool and both runs failed)."""
    from study_processes import descendants, finish, log_entries, start_study

    spec = tmp_path / "spec.toml"
    spec.write_text('[study]\nname = "sigint"\n[data]\ndatasets = ["digits"]\n[models]\n'
                    'family = "fc"\nparams = 2000\ndepths = [1, 2]\n[batches]\n'
                    'sizes = [64, 256]\n[lr]\ngrid = [0.1]\ntuning = "none"\n[train]\n'
                    'targets = { train_acc = 0.99 }\nmax_epochs = 6\nrepeats = 1\n')
    store, log = tmp_path / "s.sqlite", tmp_path / "log"
    proc = start_study(spec, store, log, sleep=0.3, jobs=2)
    deadline = time.time() + 120
    while len(list((tmp_path / "s-checkpoints").glob("*/state.json"))) < 2:
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()
        time.sleep(0.05)
    workers = sorted(pid for pid in descendants(proc.pid)
                     if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text())
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    text = err.decode()
    lines = text.strip().splitlines()
    assert proc.returncode == 75, text
    assert "Traceback" not in text and len(lines) == 1, text
    assert "stopped by SIGINT" in lines[0] and "resumes" in lines[0]
    from batchbound.study.store import Store

    with Store(store, readonly=True) as s:
        assert "failed" not in {st for (st,) in s.db.execute("SELECT status FROM runs")}
    before = len(log_entries(log))
    finish(start_study(spec, store, log, sleep=0.0, jobs=2))
    assert sum(resumed for _, resumed in log_entries(log)[before:]) >= 2


@FAULT
def test_an_advice_figure_folder_removed_keeps_the_advice(tmp_path, monkeypatch, capsys):
    """`advise --figure D/a.png` with D removed while advise works: the advice is printed,
    then one line says the figure could not be written (exit 1), not a traceback after the
    whole pilot with the advice lost."""
    import batchbound.cli.advise as cli_advise
    from batchbound.cli import main

    folder = tmp_path / "D"
    folder.mkdir()
    real = cli_advise.plot_advice

    def removed_first(advice, path):  # the folder goes while advise works
        shutil.rmtree(folder)
        return real(advice, path)

    monkeypatch.setattr(cli_advise, "plot_advice", removed_first)
    code = main(["advise", "--dataset", "digits", "--model", "fc(depth=1,params=800)",
                 "--target-train-acc", "0.9", "--max-workers", "1", "--json", "--figure",
                 str(folder / "a.png")])
    out, err = capsys.readouterr()
    assert code == 1, err
    assert "Traceback" not in err
    assert json.loads(out)["batch_bound"] > 0  # the advice, printed
    last = err.strip().splitlines()[-1]
    assert f"cannot write the figure {folder / 'a.png'}" in last
    assert "the advice is printed above" in last


@BAD_INPUT
def test_more_pool_workers_than_memory_can_start_are_refused(tmp_path, capsys, monkeypatch):
    from study_processes import TRAINER

    import batchbound.train.launch as launch
    from batchbound.study.executor import LocalPool

    monkeypatch.setattr(launch, "available_memory_bytes", lambda: 3 * launch.WORKER_BYTES)
    spec = tmp_path / "spec.toml"
    spec.write_text('[study]\nname = "m"\n[data]\ndatasets = ["digits"]\n[models]\n'
                    'specs = ["fc(depth=1,width=8)"]\n[batches]\nsizes = [64]\n[lr]\n'
                    'grid = [0.1]\ntuning = "none"\n[train]\ntargets = { train_acc = 0.5 }\n'
                    'max_epochs = 1\nrepeats = 1\n')
    refused(["study", "run", str(spec), "--store", str(tmp_path / "s.sqlite"), "--jobs", "4",
             "--trainer", TRAINER, "--no-progress"],
            r"--jobs 4 needs about 1\.2 GB for its worker processes .* use fewer --jobs",
            capsys)
    assert LocalPool(3).jobs == 3
    monkeypatch.setattr("batchbound.study.executor.default_jobs", lambda: 16)
    assert LocalPool().jobs == 3  # the default pool: as many as fit


# ---------------------------------------------------- SIGINT or SIGTERM to advise's pilot


@FAULT
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_pilot_exits_130_saying_so(sig, tmp_path):
    """It said "the pilot ended stopped: stopped by SIGINT", exit 2, the code of bad input
    (an outside review)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchbound", "advise", "--model", "fc(depth=1,params=200)",
         "--critical-batch", "noise", "--planned-epochs", "100000", "--max-workers", "1"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    lines = []
    deadline = time.time() + 120
    while not any("pilot:" in line for line in lines):  # the pilot has started
        assert proc.poll() is None and time.time() < deadline, "".join(lines)
        lines.append(proc.stderr.readline().decode())
    time.sleep(1.0)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    said = err.decode().strip().splitlines()[-1]
    assert proc.returncode == 130
    assert said == (f"batchbound advise: error: the pilot was stopped by {sig.name}; advise "
                    "keeps nothing of it, so a rerun starts it again")
