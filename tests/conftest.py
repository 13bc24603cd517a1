"""Test-only helpers (tests/support) on the import path, for this process and its children."""

import os
import sys
from pathlib import Path

SUPPORT = str(Path(__file__).parent / "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (SUPPORT, os.environ.get("PYTHONPATH")) if p
)

# The test process computes on the kernels every batchbound command pins (batchbound.kernels),
# before any test computes a tensor, so in-process CLI calls can pin them too.
from batchbound import kernels  # noqa: E402

kernels.use()

# The tests' own tensors (references, users' models, Lightning and HF fits) on one torch
# thread too, as batchbound computes. Two threads at `nice` beside any busy process wait for
# each other at every op: the same files took over 60 s instead of 14 s beside one busy core
# (and the load-dependent suite time of 11 to 50 min). Tests of thread counts set their own.
import torch  # noqa: E402

torch.set_num_threads(1)
