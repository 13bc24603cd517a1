"""Faults as users meet them, with real processes: a write cut short by a file-size
limit, a launcher or an advice killed mid-run. Each must leave no process, no temporary
folder and no half-written file behind, and keep what was there before."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bad_input import FAULT
from study_processes import alive, descendants

pytestmark = [FAULT, pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                        reason="reads /proc")]

TRAIN = [sys.executable, "-m", "batchbound", "train", "--dataset", "digits", "--model",
         "fc(depth=1,params=800)", "-B", "64", "--no-progress"]


def _env(tmp: Path) -> dict[str, str]:
    """A temporary folder of the test's own, so that what a command leaves there is seen."""
    tmp.mkdir(exist_ok=True)
    return {**os.environ, "PYTHONWARNINGS": "ignore", "TMPDIR": str(tmp)}


def _limit_files(kib: int):
    def limit() -> None:  # a shell's `ulimit -f KIB`: a write past it fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (kib * 1024, kib * 1024))
    return limit


def test_an_output_cut_short_keeps_the_previous_one_and_leaves_no_part(tmp_path):
    """`ulimit -f` smaller than the result: the --output written by an earlier run stays whole,
    and no truncated copy of the result is left in the working or temporary folder."""
    tmp = tmp_path / "tmp"
    out = tmp_path / "out.json"
    earlier = {"config": {}, "config_hash": "0123456789abcdef", "status": "complete"}
    out.write_text(json.dumps(earlier))  # an earlier run's result: the only file -o replaces
    done = subprocess.run([*TRAIN, "--max-iterations", "10", "--output", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, env=_env(tmp),
                          preexec_fn=_limit_files(2), timeout=120)
    assert done.returncode == 1, done.stderr
    assert "config hash:" in done.stdout  # the result is printed first
    assert f"cannot write {out} after the run: File too large" in done.stderr
    assert "it was not kept anywhere else" in done.stderr
    assert json.loads(out.read_text()) == earlier
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.json.lock", "out.json", "tmp"]
    assert [p.name for p in tmp.iterdir() if "batchbound" in p.name] == []  # (torch's own stay)


def _children_named(pid: int, word: str, count: int, proc: subprocess.Popen,
                    seconds: float = 180) -> list[int]:
    deadline = time.time() + seconds
    while True:
        found = sorted(p for p in descendants(pid) if word in _cmdline(p))
        if len(found) >= count:
            return found
        assert proc.poll() is None, proc.communicate()[1]
        assert time.time() < deadline, f"no {word} process started"
        time.sleep(0.1)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:  # it ended meanwhile
        return ""


def _gone(pids: list[int], seconds: float = 20) -> None:
    deadline = time.time() + seconds
    while alive(set(pids)) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(set(pids)), f"left behind: {alive(set(pids))}"


ADVISE = [sys.executable, "-m", "batchbound", "advise", "--planned-epochs", "4",
          "--critical-batch", "noise", "--max-workers", "2"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_an_advice_killed_while_timing_its_ranks_takes_them_along(tmp_path, sig):
    """`advise` killed while its ranks time the step on 2 processes: the ranks end within
    seconds (they timed on for nobody, as orphans) and their folder goes with them."""
    tmp = tmp_path / "tmp"
    proc = subprocess.Popen(ADVISE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=tmp_path, env=_env(tmp), start_new_session=True)
    try:
        ranks = _children_named(proc.pid, "step_timer", 2, proc)
        assert [p.name for p in tmp.iterdir() if p.name.startswith("batchbound-steps-")]
        os.kill(proc.pid, sig)
        proc.communicate(timeout=60)
        _gone(ranks, seconds=8)
        assert [p.name for p in tmp.iterdir() if p.name.startswith("batchbound-")] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


DISTRIBUTED = ["--workers", "2", "--max-iterations", "600", "--checkpoint-every", "20",
               "--eval-every-iterations", "300", "--no-stop-at-targets", "--json"]


def _summary(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return {k: v for k, v in summary["final"].items()
            if "second" not in k and "per_s" not in k}  # wall clock: differs run to run


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_launcher_leaves_no_rank_and_no_folder_and_resumes_identical(tmp_path):
    """`train --workers 2` whose launcher is killed with SIGKILL: its ranks stop within
    seconds and take the launcher's temporary folder along (it held the result for no one),
    and `--resume` ends as the unbroken run does (gloo on CPU sums in a fixed order)."""
    tmp = tmp_path / "tmp"
    checkpoint = tmp_path / "ck.pt"
    proc = subprocess.Popen([*TRAIN, *DISTRIBUTED, "--checkpoint", str(checkpoint)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                            env=_env(tmp), start_new_session=True)
    try:
        ranks = _children_named(proc.pid, "spawn_main", 2, proc)
        deadline = time.time() + 120
        while not checkpoint.exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1]
            time.sleep(0.05)
        assert [p.name for p in tmp.iterdir() if p.name.startswith("batchbound-")]
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        _gone(ranks)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert [p.name for p in tmp.iterdir() if p.name.startswith("batchbound-")] == []
    resumed = subprocess.run([*TRAIN, *DISTRIBUTED, "--checkpoint", str(checkpoint),
                              "--resume"], capture_output=True, text=True, cwd=tmp_path,
                             env=_env(tmp), timeout=300)
    unbroken = subprocess.run([*TRAIN, *DISTRIBUTED], capture_output=True, text=True,
                              cwd=tmp_path, env=_env(tmp), timeout=300)
    assert _summary(resumed) == _summary(unbroken)
    assert _summary(resumed)["iterations"] == 600


def test_a_killed_run_rerun_without_resume_keeps_its_checkpoint(tmp_path):
    """`train --checkpoint ck.pt` killed with SIGKILL, then the same command again: refused in
    one line that names the file and --resume (exit 2), the checkpoint untouched, where it
    used to start at iteration 0 and write over it; with --resume the run ends."""
    checkpoint = tmp_path / "ck.pt"
    command = [*TRAIN, "--max-iterations", "400", "--checkpoint-every", "20", "--json",
               "--eval-every-iterations", "500", "--no-stop-at-targets", "--checkpoint",
               str(checkpoint)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=tmp_path, env=_env(tmp_path / "tmp"), start_new_session=True)
    deadline = time.time() + 120
    while not checkpoint.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    saved = checkpoint.read_bytes()
    again = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert again.returncode == 2, again.stderr
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{checkpoint} already holds a checkpoint" in lines[0]
    assert "--resume" in lines[0]
    assert checkpoint.read_bytes() == saved
    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True,
                             cwd=tmp_path, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["final"]["iterations"] == 400


KILLED_MID_WRITE = """
import os, sys, time
import torch
from batchbound.train import checkpoint as ck
os.replace = lambda *a: time.sleep(600)  # killed between the write and the replace
ck.save_checkpoint(sys.argv[1], {"config_hash": "abc", "weights": torch.zeros(1000)})
"""


def test_a_writer_killed_mid_checkpoint_leaves_no_temporary_file_for_long(tmp_path):
    """A SIGKILL between a checkpoint's write and its replace leaves `.ck.pt.HOST.PID.HEX.tmp`, the
    size of a checkpoint, at every kill; the next checkpoint written there removes those of
    dead writers (never a live writer's)."""
    import torch

    from batchbound.files import host_tag
    from batchbound.train import checkpoint as ck

    path = tmp_path / "ck.pt"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_WRITE, str(path)])
    deadline = time.time() + 120
    while not list(tmp_path.glob(".ck.pt.*.tmp")):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    (stale,) = tmp_path.glob(".ck.pt.*.tmp")
    assert stale.name.startswith(f".ck.pt.{host_tag()}.{proc.pid}.")
    live = tmp_path / f".ck.pt.{host_tag()}.{os.getpid()}.00000000.tmp"  # a writer at work
    live.write_bytes(b"partial")
    ck.save_checkpoint(path, {"config_hash": "abc", "weights": torch.ones(1000)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "ck.pt"]
    assert ck.load_checkpoint(path)["weights"].sum() == 1000


def test_data_rewritten_in_place_with_its_size_and_mtime_is_seen(tmp_path):
    """An npz rewritten in place (same inode) to the same size, its mtime put back (`cp -p`,
    `rsync -t`), after the study was planned, in the same process (`--jobs 0`): the content
    hashes were cached by inode, size and mtime, so the run trained on the new labels under
    the planned key; the ctime is in the cache's key now, and the run is refused."""
    import numpy as np

    from batchbound.errors import BatchboundError
    from batchbound.study.adapter import execute
    from batchbound.study.plan import make_plan
    from batchbound.study.spec import study_from_dict

    data = tmp_path / "d.npz"

    def write(labels_seed: int) -> None:
        x = np.random.default_rng(0).normal(size=(200, 5)).astype(np.float32)
        y = np.random.default_rng(labels_seed).integers(0, 3, size=200)
        with open(data, "r+b" if data.exists() else "wb") as fh:  # in place: the same inode
            np.savez(fh, x=x, y=y)

    write(1)
    spec = {"study": {"name": "files"}, "data": {"datasets": [f"npz(path={data})"]},
            "models": {"specs": ["fc(depth=1,width=8)"]}, "batches": {"sizes": [16]},
            "lr": {"grid": [0.1], "tuning": "none"},
            "train": {"targets": {"train_acc": 0.99}, "max_epochs": 2, "repeats": 1}}
    run = make_plan(study_from_dict(spec)).final_runs({})[0]
    before = os.stat(data)
    time.sleep(0.01)
    write(2)
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(data)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns)
    with pytest.raises(BatchboundError, match=r"changed after the study was planned"):
        execute(dict(run.fields), tmp_path / "ck", False)


STUDY = """
[study]
name = "faults"
[data]
datasets = ["digits"]
[models]
family = "fc"
params = 2000
depths = [1]
[batches]
sizes = [64, 256]
[lr]
grid = [0.1]
tuning = "none"
[train]
targets = { train_acc = 0.99 }
max_epochs = 2
repeats = 1
"""


def test_a_store_the_disk_cannot_write_at_its_start_is_a_fault(tmp_path):
    """`ulimit -f` too small for a new store's first pages: SQLite's disk I/O error, as at a
    later write, is a fault (exit 1) that says what may be wrong, not a refusal of the
    user's input (exit 2); with the limit lifted the same command runs the study."""
    from study_processes import TRAINER

    spec = tmp_path / "spec.toml"
    spec.write_text(STUDY)
    store = tmp_path / "s.sqlite"
    command = [sys.executable, "-m", "batchbound", "study", "run", str(spec), "--store",
               str(store), "--jobs", "0", "--trainer", TRAINER, "--no-progress"]
    env = {**_env(tmp_path / "tmp"), "BATCHBOUND_SIM_LOG": str(tmp_path / "log"),
           "BATCHBOUND_SIM_SLEEP": "0"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120,
                          preexec_fn=_limit_files(60))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert len(lines) == 1 and f"cannot write to the store {store}:" in lines[0], lines
    assert "file-size limit" in lines[0] and "every run recorded before is kept" in lines[0]
    again = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "2 runs executed" in again.stderr


def test_a_figure_cut_short_keeps_the_previous_one(tmp_path):
    """`advise --figure f.png` under a file-size limit smaller than the figure: the advice is
    printed, the fault is one line, and the f.png an earlier advice drew is kept whole (it
    used to be truncated to the limit) with no partial file beside it."""
    figure = tmp_path / "f.png"
    figure.write_bytes(b"an earlier figure")
    done = subprocess.run(
        [sys.executable, "-m", "batchbound", "advise", "--target-train-acc", "0.5",
         "--max-workers", "1", "--figure", str(figure)], capture_output=True, text=True,
        cwd=tmp_path, env=_env(tmp_path / "tmp"), preexec_fn=_limit_files(8), timeout=300)
    assert done.returncode == 1, done.stderr
    assert f"cannot write the figure {figure}: File too large" in done.stderr
    assert "the advice is printed above" in done.stderr
    assert figure.read_bytes() == b"an earlier figure"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".f.png.")] == []
