"""The pipeline reads one way (docs/INTERNALS.md "The pipeline"): YAML → Policy → Plan → op → kernels → pages.
Checked on the source: no import cycle among kvcompile's modules (imports inside functions
count), the part library imports nothing of the engine, and the fast path (engine, cache,
plan, kernels) never imports the reference engine, which is the specification."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvcompile"


def module_name(path: Path) -> str:
    parts = path.resolve().relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        found[module_name(path)] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """kvcompile modules that `path` imports, anywhere in the file (`from a import b` counts
    a.b when that is a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        out |= {name for name in names if name in known}
    return out


GRAPH = {name: imports(path, set(modules())) - {name} for name, path in modules().items()}
PACKAGES = {name for name, path in modules().items() if path.name == "__init__.py"}


def reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_graph_is_read():
    assert "kvcompile.engine.op" in GRAPH and "kvcompile.plan" in GRAPH["kvcompile.engine.op"] | reachable(
        "kvcompile.engine.op")
    assert "kvcompile.kernels.merge" in GRAPH["kvcompile.engine.compress"]


@pytest.mark.parametrize("name", sorted(set(GRAPH) - PACKAGES))
def test_no_import_cycle(name):
    """A module is never reachable from itself (package __init__ files, which re-export
    their own submodules, are left out of the cycle check)."""
    graph = {k: v - PACKAGES for k, v in GRAPH.items()}
    seen, todo = set(), list(graph[name])
    while todo:
        nxt = todo.pop()
        assert nxt != name, f"{name} imports itself through {sorted(seen)}"
        if nxt not in seen:
            seen.add(nxt)
            todo.extend(graph.get(nxt, ()))


@pytest.mark.parametrize("fast", ["kvcompile.engine.op", "kvcompile.store", "kvcompile.cache", "kvcompile.plan", "kvcompile.integrations.generate",
                                  "kvcompile.kernels.select", "kvcompile.kernels.merge",
                                  "kvcompile.kernels.paged_attention", "kvcompile.kernels.window_scores"])
def test_the_fast_path_does_not_import_the_reference(fast):
    assert "kvcompile.reference" not in reachable(fast) | {fast}


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if n.startswith("kvcompile.policies.")))
def test_the_part_library_depends_on_nothing_of_the_engine(name):
    engine = {n for n in GRAPH if n.startswith(("kvcompile.engine", "kvcompile.store"))} | {"kvcompile.cache", "kvcompile.plan", "kvcompile.reference", "kvcompile.spec",
              "kvcompile.integrations.generate", "kvcompile.selection", "kvcompile.allocation"}
    assert not (reachable(name) & engine), sorted(reachable(name) & engine)
