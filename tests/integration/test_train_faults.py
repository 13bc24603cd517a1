"""`batchbound train` under faults (issue 29), as a user meets them: a rank killed or
stopped mid-run, SIGTERM, a full disk under the checkpoint, two runs given one checkpoint.
Each ends with one line on stderr and an exit code that says what happened, leaves no
process behind, and loses nothing: the run resumes from its last checkpoint.

Exit codes: 0 done, 1 a fault (what was saved is kept), 2 refused before any work, 75
stopped at a checkpoint by SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bad_input import FAULT, refused
from full_disk import fill, small_disk
from study_processes import alive, descendants

pytestmark = [pytest.mark.distributed, FAULT]

# long enough to be interrupted: at most a few seconds a run once nothing interrupts it
COMMON = ["--dataset", "digits", "--model", "fc(depth=1,params=800)", "-B", "64",
          "--eval-every-iterations", "500", "--checkpoint-every", "20", "--no-progress",
          "--json", "--no-stop-at-targets"]


def start(checkpoint: Path, *extra: str, iterations: int = 1500) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(
        [sys.executable, "-m", "batchbound", "train", *COMMON, "--max-iterations",
         str(iterations), "--checkpoint", str(checkpoint), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True)


def wait_for_checkpoint(proc: subprocess.Popen, checkpoint: Path, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not checkpoint.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.time() < deadline, "no checkpoint written"
        time.sleep(0.05)


def ranks(proc: subprocess.Popen) -> list[int]:
    """The local worker processes of a `--workers P` run, rank 0 first (spawned in order)."""
    deadline = time.time() + 60
    while True:
        found = sorted(pid for pid in descendants(proc.pid)
                       if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text())
        if len(found) >= 2 or time.time() > deadline:
            return found
        time.sleep(0.1)


def ended(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def resume_to_the_end(checkpoint: Path, *extra: str, iterations: int) -> dict:
    """`--resume` from the checkpoint finishes the run: the iterations before the fault are
    not done again, and the summary shows every iteration."""
    proc = start(checkpoint, "--resume", *extra, iterations=iterations)
    rc, out, err = ended(proc)
    assert rc == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["status"] == "complete" and summary["final"]["iterations"] == iterations
    return summary


def no_process_left(pids: list[int]) -> None:
    deadline = time.time() + 15
    while alive(set(pids)) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(set(pids)), f"left behind: {alive(set(pids))}"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_rank_killed_mid_run_is_one_line_and_resumes(tmp_path):
    checkpoint = tmp_path / "ck.pt"
    proc = start(checkpoint, "--workers", "2")
    wait_for_checkpoint(proc, checkpoint)
    workers = ranks(proc)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    rc, _, err = ended(proc)
    line = one_line(err)
    assert rc == 1 and "ProcessExitedException" not in err
    assert f"rank 1 (pid {workers[1]}) was killed by SIGKILL" in line
    assert f"the checkpoint {checkpoint} is intact: rerun with --resume" in line
    no_process_left(workers)
    resume_to_the_end(checkpoint, "--workers", "2", iterations=1500)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_stopped_rank_is_named_within_the_stall_timeout(tmp_path):
    """SIGSTOP (a debugger, a swapped-out or frozen process): its peer's all-reduce gives up
    after --stall-timeout, the roll call names the silent rank, nothing is left running."""
    checkpoint = tmp_path / "ck.pt"
    proc = start(checkpoint, "--workers", "2", "--stall-timeout", "5")
    wait_for_checkpoint(proc, checkpoint)
    workers = ranks(proc)
    os.kill(workers[1], signal.SIGSTOP)
    stopped_at = time.time()
    rc, _, err = ended(proc)
    took = time.time() - stopped_at
    line = one_line(err)
    assert rc == 1
    assert "rank 1 of 2 stopped answering" in line and "--stall-timeout 5 s" in line, line
    assert f"the checkpoint {checkpoint} is intact" in line
    assert 5 <= took < 5 + 30, took  # the timeout, the roll call, the others' grace
    no_process_left(workers)
    resume_to_the_end(checkpoint, "--workers", "2", "--stall-timeout", "5", iterations=1500)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sigterm_stops_at_a_checkpoint_with_its_own_exit_code(tmp_path, workers):
    """SIGTERM (a scheduler's preemption) stops at a checkpoint and exits 75, not 0; the
    resumed run finishes. With --diversity-every-epochs 1e-12 (Δ measured after every
    step): its cadence used to spin without end, ignoring the signal."""
    checkpoint = tmp_path / "ck.pt"
    tiny = ("--workers", workers, "--diversity-every-epochs", "1e-12")
    proc = start(checkpoint, *tiny, iterations=400)
    wait_for_checkpoint(proc, checkpoint)
    time.sleep(1)
    sent = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    rc, out, err = ended(proc)
    assert time.time() - sent < 30
    assert rc == 75, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["status"] == "stopped" and 20 <= summary["final"]["iterations"] < 400
    assert err.strip().splitlines()[-1] == (f"stopped: the checkpoint {checkpoint} is intact: "
                                            "rerun with --resume to continue from it")
    resume_to_the_end(checkpoint, *tiny, iterations=400)


def test_two_runs_given_one_checkpoint(tmp_path, capsys):
    """The second run is refused at the start (one line, exit 2) under the same path or
    another spelling of it; the first one is not disturbed and completes."""
    checkpoint = tmp_path / "ck.pt"
    first = start(checkpoint, iterations=1500)
    wait_for_checkpoint(first, checkpoint)
    (tmp_path / "alias").symlink_to(tmp_path, target_is_directory=True)
    for same in (checkpoint, tmp_path / "alias" / "ck.pt"):
        refused(["train", *COMMON, "--max-iterations", "5", "--checkpoint", str(same)],
                rf"{same} is an output of another run that is still going \(pid \d+", capsys)
    rc, out, err = ended(first)
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1])["final"]["iterations"] == 1500
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ck.pt.lock", "alias", "ck.pt"]


def test_a_full_disk_under_the_checkpoint(tmp_path):
    """The checkpoint's disk fills mid-run: one line naming it (exit 1), the previous
    checkpoint intact, no temporary file left; with space again, the run resumes."""
    with small_disk(1024) as disk:
        checkpoint = disk / "ck.pt"
        proc = start(checkpoint)
        wait_for_checkpoint(proc, checkpoint)
        size = checkpoint.stat().st_size
        filler = fill(disk, leave=size // 2)  # room for less than one more checkpoint
        rc, _, err = ended(proc)
        line = one_line(err)
        assert rc == 1
        assert f"cannot write the checkpoint {checkpoint}: No space left on device" in line
        assert "the previous one is kept" in line
        assert sorted(p.name for p in disk.iterdir()) == [".ck.pt.lock", "ck.pt", "filler"]
        filler.unlink()
        resume_to_the_end(checkpoint, iterations=1500)
