"""Dead code in src/batchbound: module-level functions, classes and constants, and methods,
that nothing in the repository uses. ``make lint`` runs it; exit 1 lists them.

A name counts as used when any Python file under src/, tests/, benchmarks/, examples/ or
tools/ loads it (a name or an attribute), imports it, or spells it as a string (``__all__``,
``getattr``, pyproject's entry points), anywhere but its own definition. That
over-counts (two things of one name keep each other alive) but never flags live code, so a
finding is always worth a look. A private module-level name (``_x``) is used only by its own
module or by an import of it. Not flagged: dunder names, methods a framework calls by name
(``FRAMEWORK``), names a decorator registers (the registry is their use), and ``KEEP``.

    python tools/deadcode.py        # from the repository root; no dependency
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("src", "tests", "benchmarks", "examples", "tools")
# Methods torch, Lightning, Hugging Face or Ray call by name on our subclasses.
FRAMEWORK = re.compile(r"on_[a-z_]+|forward|setup|teardown|extra_repr|state_dict|"
                       r"load_state_dict|step|zero_grad|get_lr|main|find_class")
KEEP: set[str] = set()  # name: why, for anything used in a way this cannot see


def definitions(tree: ast.Module) -> list[tuple[str, int, str]]:
    """(name, line, kind) for what the module defines at its top level and in its classes."""
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.decorator_list:
                continue  # registered: the registry is its use
            out.append((node.name, node.lineno, type(node).__name__))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out += [(t.id, node.lineno, "constant") for t in targets if isinstance(t, ast.Name)]
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if (isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and not item.decorator_list and not FRAMEWORK.fullmatch(item.name)):
                    out.append((item.name, item.lineno, "method"))
    return [d for d in out if not (d[0].startswith("__") and d[0].endswith("__"))]


def imports(tree: ast.Module) -> set[str]:
    return {a.name.split(".")[-1] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            for a in node.names}


def uses(tree: ast.Module) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.name.split(".")[-1])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", node.value))
    return found


def dead(root: Path = ROOT) -> list[str]:
    used: set[str] = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*",
                                    (root / "pyproject.toml").read_text()))
    imported: set[str] = set()
    defined = []
    for folder in SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            here = uses(tree)
            used |= here
            imported |= imports(tree)
            if folder == "src":
                defined += [(path.relative_to(root), here, *d) for d in definitions(tree)]
    found = []
    for path, here, name, line, kind in defined:
        private = name.startswith("_") and kind != "method"
        alive = (name in here or name in imported) if private else name in used
        if not alive and name not in KEEP:
            found.append(f"{path}:{line}: {kind} {name} is never used")
    return found


def main() -> int:
    found = dead()
    print("\n".join(found) if found else "no dead code")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
