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
