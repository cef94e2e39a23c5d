"""The pipeline reads one way (docs/INTERNALS.md "The pipeline") and the package's layers depend one way
(docs/INTERNALS.md "Layers"). Checked on the source: no import cycle among kvcompile's modules (imports
inside functions count); the part library imports nothing of the engine; and the layers:

- core (kvcompile/ and its subpackages but the three below) imports neither the integrations, the tools,
  the reference nor the package's public façade (kvcompile/__init__.py, which names the integrations' entry);
- the reference (kvcompile/reference.py), the specification, imports only what it specifies: the part
  library and the shared definitions (SPECIFIED); nothing but the tools imports it;
- integrations (kvcompile/integrations/) import the core and each other, never the tools or the reference;
- tools (kvcompile/tools/, and `python3 -m kvcompile`) may import everything; only tools import them.

Each rule is also run on a synthetic graph with a planted violation, so that it cannot pass vacuously."""
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
    a.b when that is a module, and a itself; `from kvcompile import b` counts the package kvcompile only
    for a name b that is no module: a public name its façade imports on first use)."""
    return imports_of(path.read_text(), known)


def imports_of(source: str, known: set[str]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            if node.module != "kvcompile" or any(name not in known for name in names):
                names.append(node.module)
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


# --- the layers ----------------------------------------------------------------------------------

# what the reference specifies and may import: the part library and the definitions shared with the engine
# (the budget arithmetic, the selection and merge definitions, the quantizer's formula)
SPECIFIED = {"kvcompile.policy", "kvcompile.spec", "kvcompile.layer_state", "kvcompile.allocation",
             "kvcompile.selection", "kvcompile.kernels.quantize", "kvcompile.kernels", "kvcompile.policies"}
FACADE = "kvcompile"  # the public names, imported on first use (kvcompile.compile, compress_context, ...)


def layer(name: str) -> str:
    if name.startswith("kvcompile.tools.") or name in ("kvcompile.tools", "kvcompile.__main__"):
        return "tools"
    if name.startswith("kvcompile.integrations.") or name == "kvcompile.integrations":
        return "integrations"
    if name == "kvcompile.reference":
        return "reference"
    if name == FACADE:
        return "facade"
    if name in SPECIFIED or name.startswith("kvcompile.policies."):
        return "specified"
    return "core"


# which layers each layer may import (its own included where listed)
ALLOWED = {
    "specified": {"specified"},
    "core": {"core", "specified"},
    "reference": {"specified"},
    "integrations": {"integrations", "core", "specified", "facade"},
    "facade": {"integrations", "core", "specified"},
    "tools": {"tools", "integrations", "core", "specified", "facade", "reference"},
}


def violations(graph: dict[str, set[str]], of: str) -> list[tuple[str, str]]:
    """The imports a module of layer `of` makes that its layer may not: (importer, imported)."""
    return sorted((a, b) for a, targets in graph.items() if layer(a) == of
                  for b in targets if layer(b) not in ALLOWED[of])


def test_every_layer_holds_modules():
    """The classification sees the tree: each layer has the modules it should (no rule runs on nothing)."""
    found = {}
    for name in GRAPH:
        found.setdefault(layer(name), set()).add(name)
    assert set(found) == set(ALLOWED), sorted(found)
    for name, where in [("kvcompile.integrations.generate", "integrations"), ("kvcompile.integrations.batching",
                        "integrations"), ("kvcompile.integrations.server", "integrations"),
                        ("kvcompile.integrations.vllm.packing", "integrations"), ("kvcompile.tools.cli", "tools"),
                        ("kvcompile.tools.ruler", "tools"), ("kvcompile.tools.sweep", "tools"),
                        ("kvcompile.reference", "reference"), ("kvcompile.engine.op", "core"),
                        ("kvcompile.store.pages", "core"), ("kvcompile.plan", "core"), ("kvcompile.cache", "core"),
                        ("kvcompile.selection", "specified"), ("kvcompile.policies.scoring", "specified")]:
        assert name in GRAPH and layer(name) == where, name


@pytest.mark.parametrize("of", sorted(ALLOWED))
def test_each_layer_imports_only_what_it_may(of):
    """core: no integration, tool, reference or façade; the reference: only what it specifies; integrations:
    no tool or reference; the façade: no tool or reference; tools: anything."""
    assert not violations(GRAPH, of), violations(GRAPH, of)


def test_the_reference_reaches_only_what_it_specifies():
    """Not only its own imports: everything they import in turn is the part library or a shared definition,
    so an equality test of the engine against the reference compares two computations."""
    assert reachable("kvcompile.reference") <= SPECIFIED | {n for n in GRAPH if n.startswith("kvcompile.policies.")}, \
        sorted(n for n in reachable("kvcompile.reference") if layer(n) != "specified")


def test_only_tools_import_the_reference_and_the_tools():
    """The reference is a leaf of production: no core module, integration or the façade imports it, nor a tool."""
    for name, targets in GRAPH.items():
        if layer(name) != "tools":
            assert not {t for t in targets if layer(t) in ("reference", "tools")}, (name, sorted(targets))


PLANTED = [  # (importer, imported): each breaks one rule
    ("kvcompile.engine.op", "kvcompile.integrations.batching"),
    ("kvcompile.cache", "kvcompile.tools.sweep"),
    ("kvcompile.plan", "kvcompile.reference"),
    ("kvcompile.spec", FACADE),
    ("kvcompile.selection", "kvcompile.engine.compress"),
    ("kvcompile.reference", "kvcompile.engine.prefill"),
    ("kvcompile.reference", "kvcompile.tools.sweep"),
    ("kvcompile.integrations.vllm.packing", "kvcompile.reference"),
    ("kvcompile.integrations.server", "kvcompile.tools.models"),
    (FACADE, "kvcompile.tools.cli"),
]


@pytest.mark.parametrize("importer, imported", PLANTED)
def test_a_planted_violation_is_found(importer, imported):
    """The real graph plus one forbidden import: the rule of the importer's layer names exactly it."""
    graph = {name: set(targets) for name, targets in GRAPH.items()}
    graph[importer].add(imported)
    assert violations(graph, layer(importer)) == [(importer, imported)]


def test_the_allowed_directions_are_not_refused():
    """The same check passes the imports each layer may make (so that it is not refusing everything)."""
    allowed = {("kvcompile.tools.cli", "kvcompile.reference"), ("kvcompile.tools.ruler", "kvcompile.integrations.server"),
               ("kvcompile.integrations.server", "kvcompile.engine.op"), ("kvcompile.integrations.server", FACADE),
               ("kvcompile.engine.op", "kvcompile.selection"), ("kvcompile.reference", "kvcompile.policies.scoring"),
               (FACADE, "kvcompile.integrations.generate")}
    graph = {name: set(targets) for name, targets in GRAPH.items()}
    for a, b in allowed:
        graph[a].add(b)
    for of in ALLOWED:
        assert not violations(graph, of), of


def test_the_import_reader_counts_what_runs():
    """`from kvcompile import selection` is the module (the façade imports nothing eagerly); `from kvcompile
    import compile` is the façade's public name (it imports the generate integration); imports inside
    functions count."""
    known = set(GRAPH)
    assert imports_of("from kvcompile import selection as s", known) == {"kvcompile.selection"}
    assert imports_of("from kvcompile import compile", known) == {FACADE}
    assert imports_of("def f():\n    from kvcompile.integrations import batching\n", known) == {
        "kvcompile.integrations", "kvcompile.integrations.batching"}
    assert imports_of("import kvcompile.tools.cli", known) == {"kvcompile.tools.cli"}
