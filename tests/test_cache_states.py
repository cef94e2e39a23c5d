"""The cache is an explicit state machine (docs/INTERNALS.md "The cache's phases"): its phase is declared
(engine.state.Phase: empty, prompt, compressed, decoding), it moves only along engine.state.NEXT through
`KVCompileCache.enter`, which refuses any other move before anything changes, and each phase's state is written
by the one module that owns it. The plan is bound once (`bind`, before a layer holds pages).

Checked on the source (AST), as tests/test_store_ownership.py checks the store: outside kvcompile/cache.py nothing
assigns a cache's phase state or plan (`cache.prompt = ...`, `cache.plan = ...`); `enter` is called only by the
modules that own the phase and the state it is given; the fields of a phase's state (`cache.prompt.held[i] = x`,
`rec = cache.reconstruction; rec.span = s`) are written only by their owners; `bind` only where a plan is refined
before the prompt. The layers' contents (`cache.stores`, `rings`, `states`, `windows`: the lists, a layer's
entry, a part of what a layer holds but a store's fields, which tests/test_store_ownership.py checks) are written
by cache.py alone, in its declared methods (`hold_store`, `push_query`, ...). Then at run time: the moves of
generate(), a prompt in chunks, a policy that compresses chunk by chunk, KVzip (one pass and chunked) and a
continued cache (multi-turn), and the illegal moves refused."""
from __future__ import annotations

import ast
import copy
import dataclasses
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kvcompile
import kvcompile.engine.op  # noqa: F401  (registers torch.ops.kvcompile.attend)
from kvcompile.cache import KVCompileCache
from kvcompile.engine.state import HOLDS, NEXT, Phase
from kvcompile.kvzip import RepeatPrompt
from tiny import prompt, tiny_model

PACKAGE = Path(__file__).resolve().parent.parent / "kvcompile"
STATE = {"prompt", "chunks", "compressing", "reconstruction", "decoding"}  # a phase's state, by its name on the cache
FIXED = STATE | {"plan", "phase", "seq_length", "_state", "_phase", "_plan"}  # assigned by cache.py alone
# the modules that write each state's fields, and that give it to `enter`
OWNERS = {"prompt": {"engine/prefill.py", "engine/chunked.py", "engine/cascade.py"},
          "chunks": {"engine/prefill.py", "cache.py"},  # cache.py: expect_prompt announces a prompt's chunks
          "compressing": {"engine/chunked.py", "kvzip.py", "cache.py"},
          "reconstruction": {"kvzip.py", "engine/reconstruction.py"},
          "decoding": {"engine/decode.py"}}
ENTERS = {"PROMPT": {"engine/prefill.py", "engine/chunked.py", "kvzip.py", "cache.py"},
          "COMPRESSED": {"engine/prefill.py", "engine/chunked.py", "kvzip.py"},  # where a prompt ends
          "DECODING": {"engine/decode.py"}}
BINDS = {"engine/prefill.py", "engine/chunked.py", "integrations/generate.py"}  # plans refined before the prompt
# cache.py's methods that set its phase, state and plan: the move, the binding, a copy's plan, and the façade's
# moves of every state at once (rows for beam search, devices for a pipeline)
CACHE_WRITERS = {"__init__", "enter", "bind", "copy_with", "_select_rows", "state_to"}
MUTATORS = {"append", "extend", "insert", "pop", "clear", "update", "remove", "setdefault"}
# the layers' contents, lists on the cache written only by its own methods (`hold_store`, `push_query`, ...)
CONTENTS = {"stores", "rings", "states", "windows"}
CONTENTS_WRITERS = {"__init__", "hold_store", "hold_stores", "hold_queries", "push_query", "record_state",
                    "hold_windows", "_select_rows", "attend_window", "crop"}  # cache.py's methods that write them


def _is_cache(node: ast.expr) -> bool:
    """An expression that names a cache: `cache`, `*_cache`, `past_key_values`, `x.cache`."""
    if isinstance(node, ast.Name):
        return node.id in ("cache", "past_key_values") or node.id.endswith("_cache")
    return isinstance(node, ast.Attribute) and node.attr == "cache"


class _Function(ast.NodeVisitor):
    """The writes of phase state in one module; `found` gets (line, state or '', what) for each."""

    def __init__(self, found: list, aliases: dict | None = None, contents: dict | None = None, selves=()):
        self.found = found
        self.aliases = dict(aliases or {})  # local name -> the state it is bound to
        self.contents = dict(contents or {})  # local name -> (the layer contents it is part of, its depth)
        self.selves = tuple(selves)  # names that are a cache too (`self`, scanning cache.py itself)

    def contents_of(self, node: ast.expr) -> tuple[str, int] | None:
        """(name, depth) where `node` is a cache's layer contents or a part of one: `cache.stores` (depth 0), a
        layer's `cache.rings[i]` (1), a part of a layer's `cache.windows[i].keys` (2), or a name bound to one."""
        depth = 0
        while isinstance(node, (ast.Subscript, ast.Attribute)):
            if isinstance(node, ast.Attribute) and node.attr.lstrip("_") in CONTENTS and (
                    _is_cache(node.value) or (isinstance(node.value, ast.Name) and node.value.id in self.selves)):
                return node.attr.lstrip("_"), depth
            node, depth = node.value, depth + 1
        if isinstance(node, ast.Name) and node.id in self.contents:
            name, at = self.contents[node.id]
            return name, at + depth
        return None

    def contents_target(self, node: ast.AST, target: ast.expr) -> None:
        """An assignment to `target` writes a layer's contents: the list, a layer's entry in it, or (but a store's
        fields: tests/test_store_ownership.py) a part of what a layer holds."""
        found = None if isinstance(target, ast.Name) else self.contents_of(target)
        if found is not None and (found[0] != "stores" or found[1] <= 1):
            self.report(node, f"contents {found[0]}", "writes a layer's contents")

    def state_of(self, node: ast.expr) -> str | None:
        """The phase state `node` is (cache.prompt, or a name bound to it), else None."""
        if isinstance(node, ast.Attribute) and node.attr in STATE and _is_cache(node.value):
            return node.attr
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        return None

    def field_of(self, node: ast.expr) -> str | None:
        """The state whose field (or an element of one) `node` is: cache.prompt.held[i], rec.span."""
        while isinstance(node, ast.Subscript):
            node = node.value
        return self.state_of(node.value) if isinstance(node, ast.Attribute) else None

    def report(self, node: ast.AST, state: str, why: str) -> None:
        self.found.append((node.lineno, state, f"{why}: {ast.unparse(node)[:100]}"))

    def target(self, node: ast.AST, target: ast.expr) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self.target(node, t)
            return
        attr = target
        while isinstance(attr, ast.Subscript):
            attr = attr.value
        if isinstance(attr, ast.Attribute) and attr.attr in FIXED and _is_cache(attr.value):
            self.report(node, "", "assigns a cache's phase, state or plan")
        state = self.field_of(target)
        if state is not None:
            self.report(node, state, "writes a field of the phase state")
        self.contents_target(node, target)

    def bind(self, target: ast.expr, value: ast.expr | None) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            values = value.elts if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(
                target.elts) else [None] * len(target.elts)
            for t, v in zip(target.elts, values):
                self.bind(t, v)
        elif isinstance(target, ast.Name):
            state = None if value is None else self.state_of(value)
            if state is not None:
                self.aliases[target.id] = state
            else:
                self.aliases.pop(target.id, None)
            found = None if value is None else self.contents_of(value)
            if found is not None:
                self.contents[target.id] = found
            else:
                self.contents.pop(target.id, None)

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self.target(node, t)
        self.generic_visit(node)
        for t in node.targets:
            self.bind(t, node.value)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.target(node, node.target)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for t in node.targets:
            self.contents_target(node, t)
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        """`for s in cache.windows` binds s to a layer's entry (`for i, s in enumerate(...)` too)."""
        it, target = node.iter, node.target
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate" and it.args \
                and isinstance(target, ast.Tuple) and len(target.elts) == 2:
            it, target = it.args[0], target.elts[1]
        found = self.contents_of(it)
        if found is not None and isinstance(target, ast.Name):
            self.contents[target.id] = (found[0], found[1] + 1)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.target(node, node.target)
            self.bind(node.target, node.value)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args and (
                _is_cache(node.args[0]) or self.state_of(node.args[0]) is not None):
            self.report(node, self.state_of(node.args[0]) or "", "sets an attribute of a cache or its state")
        if isinstance(func, ast.Attribute):
            name = func.attr
            state = self.field_of(func.value)  # a method of a state's field: prompt.held.append(x)
            if state is not None and (name in MUTATORS or (name.endswith("_") and not name.startswith("_"))):
                self.report(node, state, "changes a field of the phase state in place")
            if name == "enter":
                phase = node.args[0] if node.args else None
                if not (isinstance(phase, ast.Attribute) and isinstance(phase.value, ast.Name)
                        and phase.value.id == "Phase"):
                    self.report(node, "?", "enters a phase not named")
                else:
                    self.report(node, f"enter {phase.attr}", "enters a phase")
                for kw in node.keywords:
                    self.report(node, kw.arg or "?", "gives a phase its state")
            if name == "bind" and _is_cache(func.value):
                self.report(node, "bind", "binds a cache's plan")
            found = self.contents_of(func.value)  # cache.stores.append(s), ring.copy_(x)
            if found is not None and ((found[1] == 0 and name in MUTATORS | {"sort", "reverse", "__setitem__"}) or (
                    found[0] != "stores" and found[1] > 0 and name.endswith("_") and not name.startswith("_"))):
                self.report(node, f"contents {found[0]}", "changes a layer's contents in place")
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:  # a nested function: its own names
        inner = _Function(self.found, self.aliases, self.contents, self.selves)
        for stmt in node.body:
            inner.visit(stmt)

    visit_AsyncFunctionDef = visit_FunctionDef


def state_writes(source: str) -> list[tuple[int, str, str]]:
    """(line, state, what) of every write of a phase's state or a cache's plan in `source` (state '' for an
    assignment that only cache.py may make, 'enter X' for a move to phase X, 'bind' for a plan bound)."""
    found: list = []
    _Function(found).visit(ast.parse(source))
    return sorted(found)


def allowed(module: str, state: str) -> bool:
    if state.startswith("enter "):
        return module in ENTERS.get(state.split()[1], ())
    if state == "bind":
        return module in BINDS
    return module in OWNERS.get(state, ())


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "cache.py" or p.parent != PACKAGE)


def test_the_scan_reads_the_phase_modules():
    scanned = {p.relative_to(PACKAGE).as_posix() for p in modules()}
    assert {"engine/prefill.py", "engine/chunked.py", "engine/decode.py", "kvzip.py", "engine/op.py"} <= scanned
    found = {state for p in modules() for _, state, _ in state_writes(p.read_text())}
    assert {"prompt", "chunks", "compressing", "reconstruction", "enter PROMPT", "enter COMPRESSED",
            "enter DECODING", "decoding", "bind"} <= found  # every owner's writes are seen


@pytest.mark.parametrize("path", modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_only_the_owning_module_writes_a_phase_state(path):
    module = path.relative_to(PACKAGE).as_posix()
    bad = [(line, what) for line, state, what in state_writes(path.read_text()) if not allowed(module, state)]
    assert not bad, "\n".join(f"kvcompile/{module}:{line}: {what}" for line, what in bad)


def test_cache_py_sets_its_phase_state_and_plan_in_its_declared_methods_only():
    tree = ast.parse((PACKAGE / "cache.py").read_text())
    writers = set()
    for function in ast.walk(tree):
        if isinstance(function, ast.FunctionDef):
            for node in ast.walk(function):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                    node, (ast.AugAssign, ast.AnnAssign)) else []
                for t in targets:
                    while isinstance(t, ast.Subscript):
                        t = t.value
                    if isinstance(t, ast.Attribute) and t.attr in ("_state", "_phase", "_plan"):
                        writers.add(function.name)
    assert writers and writers <= CACHE_WRITERS, writers - CACHE_WRITERS


def test_cache_py_writes_the_layers_contents_in_its_declared_methods_only():
    tree = ast.parse((PACKAGE / "cache.py").read_text())
    writers = set()
    for cls in tree.body:
        for function in getattr(cls, "body", []) if isinstance(cls, ast.ClassDef) else []:
            if isinstance(function, ast.FunctionDef):
                found: list = []
                _Function(found, selves=("self",)).visit(function)
                if any(state.startswith("contents ") for _, state, _ in found):
                    writers.add(function.name)
    assert writers == CONTENTS_WRITERS, writers ^ CONTENTS_WRITERS


# the writes of layer contents that the cache's methods replaced, planted back into their modules
PLANTED = [
    ("engine/prefill.py", "cache.hold_store(layer, ", "cache.stores[layer] = (", "contents stores"),
    ("engine/prefill.py", "cache.hold_queries(layer, ", "cache.rings[layer] = (", "contents rings"),
    ("engine/prefill.py", "cache.record_state(layer, ", "cache.states[layer] = (", "contents states"),
    ("engine/decode.py", "cache.hold_store(layer, store)", "cache.stores[layer] = store", "contents stores"),
    ("engine/decode.py", "cache.push_query(layer, q[:, :, i, None])",
     "ring = cache.rings[layer]; ring.copy_(q[:, :, i, None])", "contents rings"),
    ("engine/chunked.py", "cache.hold_queries(layer, ", "cache.rings[layer] = (", "contents rings"),
    ("engine/chunked.py", "cache.hold_store(layer, ", "cache.stores[layer] = (", "contents stores"),
    ("engine/cascade.py", "cache.hold_store(layer, ", "cache.stores[layer] = (", "contents stores"),
    ("engine/batch.py", "cache.hold_stores(stores)", "cache.stores = stores", "contents stores"),
    ("engine/batch.py", "cache.hold_stores(pooled)", "cache.stores = pooled", "contents stores"),
    ("tools/sweep.py", "cache.hold_windows(windows)", "cache.windows = list(windows)", "contents windows"),
]


@pytest.mark.parametrize("module, now, planted, state", PLANTED, ids=[f"{p[0]}:{p[3]}" for p in PLANTED])
def test_a_write_of_the_layers_contents_planted_in_a_module_is_found(module, now, planted, state):
    source = (PACKAGE / module).read_text()
    assert source.count(now) == 1
    found = [s for _, s, _ in state_writes(source.replace(now, planted))]
    assert [s for s in found if s.startswith("contents ")] == [state]


CONTENTS_WRITES = {
    "the list": ("def f(cache, s):\n    cache.stores = s", "contents stores"),
    "a layer's entry": ("def f(cache, s):\n    cache.stores[0] = s", "contents stores"),
    "a private list": ("def f(cache, s):\n    cache._rings[0] = s", "contents rings"),
    "a layer's ring in place": ("def f(cache, x):\n    cache.rings[0].copy_(x)", "contents rings"),
    "a ring through an alias": ("def f(cache, x):\n    ring, n = cache.rings[1], 2\n    ring[:, :, -1] = x",
                                "contents rings"),
    "a ring in place through an alias": ("def f(cache, x):\n    ring = cache.rings[1]\n    ring.copy_(x)",
                                         "contents rings"),
    "the list through an alias": ("def f(past_key_values, s):\n    rings = past_key_values.rings\n"
                                  "    rings[0] = s", "contents rings"),
    "the list in place": ("def f(kv, s):\n    kv.cache.windows.append(s)", "contents windows"),
    "a window's field": ("def f(cache, k):\n    cache.windows[3].keys = k", "contents windows"),
    "a window in a loop": ("def f(cache, k):\n    for i, w in enumerate(cache.windows):\n        w.keys = k",
                           "contents windows"),
    "a recorded state's tensor": ("def f(cache):\n    cache.states[0].keys.zero_()", "contents states"),
    "deleted": ("def f(cache):\n    del cache.states[0]", "contents states"),
}
CONTENTS_READS = {
    "reads": "def f(cache):\n    ring = cache.rings[0]\n    n = ring.shape[2] + len(cache.stores)\n"
             "    w = [x for x in cache.windows if x is not None]",
    "the cache's methods": "def f(cache, s, r):\n    cache.hold_store(0, s)\n    cache.push_query(0, r)",
    "a store's methods (its own test's)": "def f(cache, k):\n    store = cache.stores[0]\n    store.append(k)\n"
                                          "    for s in cache.stores:\n        s.release()",
    "other objects": "def f(self, plan, stores):\n    self.windows = plan.layer_kinds.windows\n    stores[0] = 1",
    "a rebound name": "def f(cache, x):\n    ring = cache.rings[0]\n    ring = x\n    ring.copy_(x)",
}


@pytest.mark.parametrize("source, state", CONTENTS_WRITES.values(), ids=CONTENTS_WRITES.keys())
def test_the_check_finds_each_kind_of_write_of_the_layers_contents(source, state):
    found = state_writes(textwrap.dedent(source))
    assert ", ".join(s for _, s, _ in found) == state, found


@pytest.mark.parametrize("source", CONTENTS_READS.values(), ids=CONTENTS_READS.keys())
def test_the_check_lets_reads_of_the_layers_contents_pass(source):
    assert state_writes(textwrap.dedent(source)) == []


WRITES = {
    "a state": ("def f(cache, s):\n    cache.prompt = s", ""),
    "the plan": ("def f(past_key_values, p):\n    past_key_values.plan = p", ""),
    "the length": ("def f(cache):\n    cache.seq_length += 1", ""),
    "setattr": ("def f(cache, s):\n    setattr(cache, 'decoding', s)", ""),
    "a field": ("def f(cache, t):\n    cache.decoding.length = t", "decoding"),
    "an element of a field": ("def f(cache, i, x):\n    cache.prompt.held[i] = x", "prompt"),
    "through an alias": ("def f(cache, s):\n    rec = cache.reconstruction\n    rec.span = s", "reconstruction"),
    "through a tuple alias": ("def f(cache, x):\n    plan, prompt = cache.plan, cache.prompt\n"
                              "    prompt.entropy.append(x)", "prompt"),
    "in place": ("def f(cache):\n    cache.decoding.budgets.add_(1)", "decoding"),
    "a move": ("def f(cache, s):\n    cache.enter(Phase.DECODING, decoding=s)", "decoding, enter DECODING"),
    "a binding": ("def f(cache, p):\n    cache.bind(p)", "bind"),
}
READS = {
    "reads": "def f(cache):\n    n = cache.prompt.width + cache.seq_length\n    b = cache.decoding.budgets[:, 0]",
    "a state's own method": "def f(cache):\n    cache.decoding.advance(1)",
    "the cache's methods": "def f(cache):\n    cache.advance(1)\n    cache.crop(-1)",
    "other objects": "def f(self, entry, prompt):\n    self.plan = entry.plan\n    self.chunks += 1\n"
                     "    prompt.held.append(1)",
    "a rebound name": "def f(cache, x):\n    prompt = cache.prompt\n    prompt = x\n    prompt.held = 1",
}


@pytest.mark.parametrize("source, state", WRITES.values(), ids=WRITES.keys())
def test_the_check_finds_each_kind_of_write(source, state):
    found = state_writes(textwrap.dedent(source))
    assert ", ".join(s for _, s, _ in found) == state, found


@pytest.mark.parametrize("source", READS.values(), ids=READS.keys())
def test_the_check_lets_reads_and_methods_pass(source):
    assert state_writes(textwrap.dedent(source)) == []


# --- the moves at run time ---------------------------------------------------------------------------------
SMALL = {"ranking": {"by_score": {"window": 2}}, "scoring": {"window_attention": {"window": 2}}}
REPEAT = RepeatPrompt(first=(5, 6, 7, 8), later=(9, 10), suffix=(11, 12))  # token ids of a tiny vocabulary


@pytest.fixture
def moves(monkeypatch):
    """The phases a cache goes through (consecutive repeats once), recorded at each `enter`."""
    seen: list[str] = []
    enter = KVCompileCache.enter

    def record(self, phase, **state):
        before = self.phase
        enter(self, phase, **state)
        for p in (before, phase):
            if not seen or seen[-1] != p.name:
                seen.append(p.name)

    monkeypatch.setattr(KVCompileCache, "enter", record)
    return seen


def one_layer(spec="snapkv", **over):
    h, g, d = 2, 2, 16
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=h, num_attention_heads=h * g, head_dim=d,
                             hidden_size=h * g * d)
    return KVCompileCache(kvcompile.load_spec(spec, per_head=12, **{**SMALL, **over}), config, page_size=4)


def attend(cache, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(1, 4, n, 16, generator=gen), *(torch.randn(1, 2, n, 16, generator=gen) for _ in "kv")
    return torch.ops.kvcompile.attend(q, k, v, None, 0, cache.ref, cache.token, 0.25)


def test_the_table_declares_every_phase_and_what_it_holds():
    assert set(NEXT) == set(HOLDS) == set(Phase)
    assert NEXT[Phase.EMPTY] == (Phase.PROMPT,) and Phase.PROMPT not in NEXT[Phase.DECODING]
    assert "decoding" in HOLDS[Phase.DECODING] and "chunks" not in HOLDS[Phase.COMPRESSED]


def test_a_prompt_then_decode_steps_then_reset(moves):
    cache = one_layer()
    assert cache.phase is Phase.EMPTY and cache.prompt is None
    attend(cache, 24)
    assert cache.phase is Phase.COMPRESSED and cache.prompt.width == 24 and cache.decoding is None
    attend(cache, 1, seed=1)
    attend(cache, 1, seed=2)
    assert cache.phase is Phase.DECODING and cache.seq_length == 26 and int(cache.decoding.length) == 26
    assert moves == ["EMPTY", "PROMPT", "COMPRESSED", "DECODING"]
    cache.reorder_cache(torch.tensor([0]))  # rows and crop keep the phase
    cache.crop(-1)
    assert cache.phase is Phase.DECODING and cache.seq_length == 25 and int(cache.decoding.length) == 25
    cache.reset()
    assert cache.phase is Phase.EMPTY and cache.prompt is None and cache.decoding is None


def test_a_prompt_in_expected_calls_is_held_then_compressed(moves):
    cache = one_layer()
    cache.expect_prompt(24)
    assert cache.phase is Phase.PROMPT and cache.chunks.length == 24
    attend(cache, 16)
    assert cache.phase is Phase.PROMPT and cache.chunks is not None and cache.stores[0] is None
    attend(cache, 8)
    assert cache.phase is Phase.COMPRESSED and cache.chunks is None and cache.prompt.width == 24
    assert moves == ["EMPTY", "PROMPT", "COMPRESSED"]


def test_a_prompt_that_ends_inside_a_call_decodes_the_tokens_after_it(moves):
    cache = one_layer()  # (assisted decoding sends the prompt's last chunk with candidate tokens)
    cache.expect_prompt(24)
    attend(cache, 16)
    attend(cache, 10, seed=1)
    assert cache.phase is Phase.DECODING and cache.seq_length == 26 and int(cache.decoding.length) == 26
    assert moves == ["EMPTY", "PROMPT", "COMPRESSED", "DECODING"]


def test_a_prompt_compressed_chunk_by_chunk(moves):
    cache = one_layer(schedule={"prefill": {"chunk": 8}})
    cache.expect_prompt(20)
    for n in (8, 8, 4):
        assert cache.phase is Phase.PROMPT and cache.compressing.length == 20
        attend(cache, n, seed=n)
    assert cache.phase is Phase.COMPRESSED and cache.compressing is None
    attend(cache, 1)
    assert moves == ["EMPTY", "PROMPT", "COMPRESSED", "DECODING"]


def generate(model, policy, ids, cache=None, **kwargs):
    with kvcompile.compiled(model, policy, repeat_prompt=REPEAT), torch.no_grad():
        return model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False,
                              return_dict_in_generate=True, **kwargs).past_key_values


@pytest.mark.parametrize("spec, over, kwargs", [
    ("snapkv", SMALL, {}),
    ("snapkv", SMALL, {"prefill_chunk_size": 8}),  # a prompt held in chunks, compressed whole
    ("snapkv", {**SMALL, "schedule": {"prefill": {"chunk": 8}}}, {}),  # compressed chunk by chunk
    ("kvzip_uniform", {"scoring": {"kvzip": {"chunk": 8}}}, {}),  # a reconstruction scorer, one pass
    ("kvzip_uniform", {"scoring": {"kvzip": {"chunk": 8}}, "schedule": {"prefill": {"chunk": 12}}}, {}),
], ids=["one call", "held chunks", "chunked", "kvzip", "kvzip chunked"])
def test_generate_and_a_continued_cache_move_along_the_table(moves, spec, over, kwargs):
    model = tiny_model("llama", layers=2)
    policy = kvcompile.load_spec(spec, per_head=12, **over)
    cache = generate(model, policy, prompt(30), **kwargs)
    assert cache.phase is Phase.DECODING and moves == ["EMPTY", "PROMPT", "COMPRESSED", "DECODING"]
    assert (cache.chunks, cache.compressing, cache.reconstruction) == (None, None, None)
    if spec == "snapkv":  # multi-turn: the next turn continues the cache, decoding
        length = cache.seq_length
        again = generate(model, policy, torch.cat([prompt(30), prompt(5, seed=2)], dim=1), cache=cache)
        assert again is cache and cache.phase is Phase.DECODING and cache.seq_length > length
        assert moves == ["EMPTY", "PROMPT", "COMPRESSED", "DECODING"]


def test_a_compressed_context_is_copied_and_each_copy_decodes_on_its_own():
    model = tiny_model("llama", layers=2)
    with kvcompile.compiled(model, kvcompile.load_spec("snapkv", per_head=12, **SMALL)), torch.no_grad():
        cache = model(prompt(30), use_cache=True).past_key_values
        assert cache.phase is Phase.COMPRESSED
        copied = copy.deepcopy(cache)
        model(prompt(1, seed=3), past_key_values=copied)
    assert copied.phase is Phase.DECODING and cache.phase is Phase.COMPRESSED and cache.decoding is None


# --- illegal moves: refused before anything changes ---------------------------------------------------------
def snapshot(cache):
    return (cache.phase, dict(cache._state), cache.plan, cache.seq_length, list(cache.stores))


def test_decode_before_a_prompt_is_refused():
    from kvcompile.engine.op import decode

    cache = one_layer()
    q, k = torch.zeros(1, 4, 1, 16), torch.zeros(1, 2, 1, 16)
    with pytest.raises(RuntimeError, match="decode step on an empty cache"):
        decode(cache, q, k, k, 0, 0.25)
    assert cache.phase is Phase.EMPTY and cache.stores == [None] and cache.decoding is None
    with pytest.raises(RuntimeError, match="'empty' cannot move to 'decoding'"):
        cache.enter(Phase.DECODING)
    assert cache.phase is Phase.EMPTY


@pytest.mark.parametrize("steps", [0, 1], ids=["compressed", "decoding"])
def test_a_second_prompt_on_a_cache_that_holds_one_is_refused(steps):
    from kvcompile.engine.prefill import start_prompt

    cache = one_layer()
    attend(cache, 24)
    for i in range(steps):
        attend(cache, 1, seed=i + 1)
    before = snapshot(cache)
    with pytest.raises(RuntimeError, match="already holds a prompt"):
        cache.expect_prompt(8)
    with pytest.raises(RuntimeError, match="bound once"):  # start_prompt binds the plan first
        start_prompt(cache, None, 1, 8, torch.zeros(1, 2, 8, 16))
    with pytest.raises(RuntimeError, match="cannot move to 'taking a prompt'"):
        cache.enter(Phase.PROMPT, prompt=None)
    assert snapshot(cache) == before


def test_a_state_the_phase_does_not_hold_is_refused():
    cache = one_layer()
    attend(cache, 24)
    before = snapshot(cache)
    with pytest.raises(TypeError, match="holds prompt, decoding, not chunks"):
        cache.enter(Phase.DECODING, chunks=None)
    assert snapshot(cache) == before


def test_the_state_and_the_plan_are_read_only_and_the_plan_is_bound_once():
    cache = one_layer()
    plan = cache.plan
    for name in ("plan", "phase", "prompt", "chunks", "compressing", "reconstruction", "decoding"):
        with pytest.raises(AttributeError):
            setattr(cache, name, None)
    other = one_layer("h2o")
    with pytest.raises(RuntimeError, match="bound once"):  # another policy, even before the prompt
        cache.bind(other.plan)
    cache.bind(plan.with_headroom(8))  # refined before the prompt: fine
    attend(cache, 24)
    bound = cache.plan
    assert bound.bound and bound.headroom == 8
    with pytest.raises(RuntimeError, match="bound once"):
        cache.bind(dataclasses.replace(bound, decode_step=None))
    assert cache.plan is bound
    copied = cache.copy_with(dataclasses.replace(bound, decode_step=None))  # a copy runs another backend
    assert cache.plan is bound and copied.plan.decode_step is None and copied.phase is Phase.COMPRESSED
    with pytest.raises(ValueError, match="own policy"):
        cache.copy_with(other.plan)


def test_the_layers_contents_are_read_only_and_their_methods_refuse_what_does_not_fit():
    cache = one_layer(schedule={"decode": {"every": 2}})
    for name in CONTENTS:
        with pytest.raises(AttributeError):
            setattr(cache, name, [None])
    with pytest.raises(RuntimeError, match="without record=True"):
        cache.record_state(0, None)
    with pytest.raises(ValueError, match=r"one store per layer \(1\), got 2"):
        cache.hold_stores([None, None])
    with pytest.raises(ValueError, match=r"one entry per model layer \(1\) on an empty cache; got 2"):
        cache.hold_windows([None, None])
    attend(cache, 24)
    assert cache.stores[0] is not None and cache.rings[0] is not None
    with pytest.raises(ValueError, match="on a cache that is 'holding a compressed prompt'"):
        cache.hold_windows([None])
    ring = cache.rings[0]  # full (the plan's 2 rows): each step's query goes in place, the oldest out
    assert ring.shape[2] == cache.plan.ring_rows == 2
    for step in range(1, 4):
        before = ring[:, :, 1:].clone()
        attend(cache, 1, seed=step)
        assert cache.rings[0] is ring and torch.equal(ring[:, :, :1], before)
