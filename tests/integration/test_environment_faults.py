"""Round 4 of hostile conditions (issue 39): the environment checked before start, and the
result first. A leftover or malformed ``WORLD_SIZE``/``RANK``, too little shared memory for
``train --workers``, SIGINT to one pool worker, and an output folder removed during training
each end with one line and an exit code that says what happened; nothing computed is lost."""

from __future__ import annotations

import json
import os
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
