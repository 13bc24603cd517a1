"""``make lint``'s dead-code check: none in the package, and it finds what it should."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("deadcode", ROOT / "tools" / "deadcode.py")
assert spec is not None and spec.loader is not None
deadcode = importlib.util.module_from_spec(spec)
spec.loader.exec_module(deadcode)


def test_the_package_has_no_dead_code():
    assert deadcode.dead() == []


def test_it_finds_unused_functions_constants_methods_and_private_helpers(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[project.scripts]\ntool = "pkg.cli:main"\n')
    pkg = tmp_path / "src" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "mod.py").write_text(textwrap.dedent('''
        LIMIT = 3
        UNUSED = 4
        _helper_used = 1

        def used():
            return LIMIT + _helper_used

        def unused():
            return 1

        def _private():  # a public "_private" elsewhere must not keep it alive
            return 2

        @register
        def registered():
            return 3

        class Box:
            def open(self):
                return used()

            def never(self):
                return 0

            def forward(self):
                return 0
        '''))
    (pkg / "other.py").write_text("from pkg.mod import Box\nBox().open()\nx = y._private\n")
    for folder in ("tests", "benchmarks", "examples", "tools"):
        (tmp_path / folder).mkdir()
    found = "\n".join(deadcode.dead(tmp_path))
    for name in ("constant UNUSED", "FunctionDef unused", "method never", "FunctionDef _private"):
        assert name in found, name
    for name in ("LIMIT", " used ", "_helper_used", "registered", "open", "forward", "Box "):
        assert name not in found, name
