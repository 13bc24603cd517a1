"""``batchbound train --checkpoint F`` under torchrun over an existing checkpoint.

In a single process, rerunning a killed run's command without ``--resume`` is refused (it would
start at iteration 0 and write over the checkpoint). Under torchrun the check was skipped,
because an agent's restart reruns the same command and must resume by itself; so a fresh
``torchrun`` launch rerun without ``--resume`` started afresh over the checkpoint. Now a group
with no restarted agent (``TORCHELASTIC_RESTART_COUNT`` 0 on every rank) is refused on every
rank, naming ``--resume``; one restarted agent (a replaced node's counts 0 beside it) makes
every rank resume. The two ranks run as torchrun starts them: fresh interpreters with its
environment (rank 0 hosts the store)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchbound.train.distributed import free_port

pytestmark = pytest.mark.distributed

RANK = "import sys; from batchbound.cli import main; sys.exit(main(sys.argv[1:]))"
TRAIN = ["train", "--workers", "2", "--dataset", "digits", "--model", "fc(depth=1,params=800)",
         "-B", "32", "--max-iterations", "6", "--eval-every-iterations", "3",
         "--checkpoint-every", "3", "--no-progress", "--json"]


def _pair(args: list[str], restarts: tuple[int, int]) -> list[tuple[int, str, str]]:
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   OMP_NUM_THREADS="1", TORCHELASTIC_RUN_ID="test",
                   TORCHELASTIC_RESTART_COUNT=str(restarts[rank]))
        procs.append(subprocess.Popen([sys.executable, "-c", RANK, *TRAIN, *args], env=env,
                                      text=True, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE))
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=300)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:  # a rank left waiting in a collective: no process left behind
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def test_a_fresh_torchrun_launch_over_a_checkpoint_is_refused_and_a_restart_resumes(
        tmp_path: Path) -> None:
    checkpoint = tmp_path / "run.ckpt"
    first = _pair(["--checkpoint", str(checkpoint)], (0, 0))
    for rank, (code, _, stderr) in enumerate(first):
        assert code == 0, f"rank {rank} exited {code}: {stderr[-2000:]}"
    saved = checkpoint.read_bytes()

    # the same command rerun as a fresh launch, without --resume: every rank refuses
    again = _pair(["--checkpoint", str(checkpoint)], (0, 0))
    for rank, (code, stdout, stderr) in enumerate(again):
        assert code == 2, f"rank {rank} exited {code}: {stderr[-2000:]}"
        lines = stderr.strip().splitlines()
        assert len(lines) == 1, (rank, stderr)
        assert f"{checkpoint} already holds a checkpoint" in lines[0] and "--resume" in lines[0]
        assert stdout == ""
    assert checkpoint.read_bytes() == saved

    # an agent's restart (rank 1 on a replacement node counts none): every rank resumes
    restarted = _pair(["--checkpoint", str(checkpoint)], (1, 0))
    for rank, (code, _, stderr) in enumerate(restarted):
        assert code == 0, f"rank {rank} exited {code}: {stderr[-2000:]}"
    result = json.loads(restarted[0][1].strip().splitlines()[-1])
    assert result["final"]["iterations"] == 6
    assert "resuming from the checkpoint" in restarted[0][2]
