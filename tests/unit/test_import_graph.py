"""The package's import graph: no cycles, and rooms import only the rooms before them
(docs/architecture.md's one-way flow). Imports inside functions count; imports under
``if TYPE_CHECKING:`` do not (they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
# each room may import itself and the rooms before it
ROOMS = ["errors", "lifetime", "files", "environment", "spec", "config", "theory", "data", "models",
         "diversity", "train", "advise", "study", "integrations", "cli"]
# advise and study are siblings after train: neither imports the other (the command line
# hands a study's measured data to advise, and advise's table to the report)
SIBLINGS = ("advise", "study")


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
               for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_no_import_cycles_between_modules() -> None:
    graph = _graph()
    packages = {m for m, p in _modules().items() if p.name == "__init__.py"}
    # a package's __init__ re-exports its modules; cycles through it are only re-exports
    edges = {m: deps - packages for m, deps in graph.items() if m not in packages}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                cycles.append([*path[path.index(dep):], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_rooms_import_only_earlier_rooms() -> None:
    order = {room: i for i, room in enumerate(ROOMS)}
    backwards = []
    for module, deps in _graph().items():
        room = _room(module)
        if room not in order:
            continue
        for dep in deps:
            other = _room(dep)
            if other in order and order[other] > order[room]:
                backwards.append(f"{module} -> {dep}")
    assert sorted(set(backwards)) == []


def test_advise_and_study_never_import_each_other() -> None:
    crossing = sorted(f"{module} -> {dep}" for module, deps in _graph().items()
                      for dep in deps if {_room(module), _room(dep)} == set(SIBLINGS))
    assert crossing == []
