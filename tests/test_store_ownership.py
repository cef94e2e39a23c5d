"""The page store has one owner (docs/INTERNALS.md "Paged cache layout"): the plan names each layer's store
class once, by storage kind, and no module of kvcompile outside `kvcompile/store/` writes a store's fields or
into its tensors; it calls the store's methods.

Checked on the source (AST). A store is an expression the engine holds stores in: a name `store` or
`*_store`, an element of `stores` (`cache.stores[i]`, a loop over `stores`), a tier (`x.high`, `x.low`),
or a name bound to one of these. A write is an assignment to an attribute of a store
(`store.room = 0`, `store.slots += x`), an assignment into one (`store.k_pages[p] = k`), an in-place op
on one (`store.lengths.add_(1)`), `setattr` on a store, the same through a local view of a store's
tensor (`pf = store.pos_pages.view(-1); pf[e] = p`), handing a store's tensor to a kernel that writes into
it (`quantize_pages_into(x, store.k_pages, ...)`), or asking a store for the tensors a kernel updates in
place (`store.tensors()`: the store runs that kernel itself)."""
from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kvcompile
import kvcompile.engine.op  # noqa: F401  (registers torch.ops.kvcompile.attend)
from kvcompile.cache import KVCompileCache
from kvcompile.store import ChannelCodeStore, CodeStore, LayerStore, TieredStore

PACKAGE = Path(__file__).resolve().parent.parent / "kvcompile"
STORE_PACKAGE = PACKAGE / "store"
# kernels that write into tensors they are given (kernels.quantize's `*_into*`, kernels.select's `gather_pages*`)
WRITERS = re.compile(r"into|^gather_pages|^gather_rows$")
# methods that return a view of a tensor (a write through them reaches the store's storage)
VIEWS = {"view", "reshape", "flatten", "unflatten", "view_as", "narrow", "select", "squeeze", "unsqueeze",
         "transpose", "permute", "expand", "expand_as", "as_strided", "t", "unbind", "split", "chunk", "diagonal",
         "movedim", "swapaxes", "detach"}


def _is_store_name(name: str) -> bool:
    return name == "store" or name.endswith("_store")


def _basic_index(index: ast.expr) -> bool:
    """An index that gives a view (slices, constants, ...), not a copy (advanced indexing)."""
    parts = index.elts if isinstance(index, ast.Tuple) else [index]
    return all(isinstance(p, (ast.Slice, ast.Constant)) for p in parts)


class _Function(ast.NodeVisitor):
    """The writes into stores in one function body (names bound in it are local to it)."""

    def __init__(self, found: list[tuple[int, str]]):
        self.found = found
        self.stores: set[str] = set()  # local names bound to a store
        self.views: set[str] = set()  # local names bound to a view of a store's tensor

    def is_store(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Name):
            return _is_store_name(node.id) or node.id in self.stores
        if isinstance(node, ast.Subscript):  # cache.stores[i], stores[i]
            value = node.value
            return (isinstance(value, ast.Attribute) and value.attr == "stores") or \
                (isinstance(value, ast.Name) and value.id == "stores")
        if isinstance(node, ast.Attribute) and node.attr in ("high", "low"):  # a TieredStore's tiers
            return True
        return False

    def reaches_store(self, node: ast.expr) -> bool:
        """`node` is a store's field or a view of one (what a write through it changes)."""
        while True:
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in VIEWS:
                node = node.func.value
            elif isinstance(node, ast.Subscript) and _basic_index(node.slice):
                node = node.value
            elif isinstance(node, ast.Attribute) and node.attr in VIEWS | {"T", "mT", "data"}:
                node = node.value
            else:
                break
        if isinstance(node, ast.Name):
            return node.id in self.views
        if isinstance(node, ast.Attribute):
            return self.is_store(node.value)
        return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
            and bool(node.args) and self.is_store(node.args[0])

    def written(self, target: ast.expr) -> bool:
        """An assignment to `target` writes a store: store.x = ..., store.x[...] = ..., view[...] = ..."""
        if isinstance(target, ast.Attribute):
            return self.is_store(target.value) or self.reaches_store(target.value)
        if isinstance(target, ast.Subscript):
            node = target.value
            while isinstance(node, ast.Subscript):
                node = node.value
            return self.reaches_store(node)
        if isinstance(target, ast.Starred):
            return self.written(target.value)
        return False

    def bind(self, target: ast.expr, value: ast.expr | None) -> None:
        """Track local names bound to stores and to views of their tensors."""
        if isinstance(target, (ast.Tuple, ast.List)):
            values = value.elts if isinstance(value, (ast.Tuple, ast.List)) and \
                len(value.elts) == len(target.elts) else [None] * len(target.elts)
            if value is not None and not isinstance(value, (ast.Tuple, ast.List)) and self.reaches_store(value):
                values = [value] * len(target.elts)  # a, b = store.k_pages.unbind(0)
            for t, v in zip(target.elts, values):
                self.bind(t, v)
            return
        if not isinstance(target, ast.Name) or value is None:
            return
        if self.is_store(value):
            self.stores.add(target.id)
        elif self.reaches_store(value):
            self.views.add(target.id)

    def report(self, node: ast.AST, why: str) -> None:
        self.found.append((node.lineno, f"{why}: {ast.unparse(node)[:100]}"))

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            for t in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                if self.written(t):
                    self.report(node, "assigns a store's field")
        self.generic_visit(node)
        for target in node.targets:
            self.bind(target, node.value)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None and self.written(node.target):
            self.report(node, "assigns a store's field")
        self.generic_visit(node)
        self.bind(node.target, node.value)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        target = node.target
        if self.written(target) or (isinstance(target, ast.Name) and target.id in self.views):
            self.report(node, "updates a store's field")
        self.generic_visit(node)

    def visit_For(self, node: ast.For | ast.comprehension) -> None:
        """`for s in cache.stores` (a loop or a comprehension) binds s to a store."""
        it = node.iter
        if isinstance(node.target, ast.Name) and getattr(it, "attr", getattr(it, "id", None)) == "stores":
            self.stores.add(node.target.id)
        self.generic_visit(node)

    visit_comprehension = visit_For

    def visit_ListComp(self, node: ast.ListComp) -> None:  # its loops first: they bind what the element uses
        for loop in node.generators:
            self.visit(loop)
        for part in (getattr(node, "elt", None), getattr(node, "key", None), getattr(node, "value", None)):
            if part is not None:
                self.visit(part)

    visit_SetComp = visit_GeneratorExp = visit_DictComp = visit_ListComp

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute):
            name = func.attr
            if name.endswith("_") and not name.startswith("_") and self.reaches_store(func.value):
                self.report(node, "runs an in-place op on a store's tensor")
            if name == "tensors" and self.is_store(func.value):
                self.report(node, "takes a store's tensors to update in place")
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args \
                and self.is_store(node.args[0]):
            self.report(node, "sets a store's attribute")
        called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if WRITERS.search(called) and any(self.reaches_store(x) for a in node.args
                                          for x in (a.elts if isinstance(a, ast.Tuple) else [a])):
            self.report(node, "hands a store's tensor to a kernel that writes into it")
        for kw in node.keywords:
            if kw.arg == "out" and self.reaches_store(kw.value):
                self.report(node, "writes a store's tensor as out=")
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:  # a nested function: its own names
        inner = _Function(self.found)
        inner.stores, inner.views = set(self.stores), set(self.views)
        for stmt in node.body:
            inner.visit(stmt)

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = ast.NodeVisitor.generic_visit


def store_writes(source: str) -> list[tuple[int, str]]:
    """(line, what) of every write into a store in `source`."""
    found: list[tuple[int, str]] = []
    _Function(found).visit(ast.parse(source))
    return sorted(found)


def outside_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if STORE_PACKAGE not in p.parents)


def test_the_store_package_exists_and_the_scan_reads_the_engine():
    assert (STORE_PACKAGE / "__init__.py").is_file()
    scanned = {p.relative_to(PACKAGE).as_posix() for p in outside_modules()}
    assert {"engine/decode.py", "engine/online.py", "cache.py", "integrations/batching.py"} <= scanned


@pytest.mark.parametrize("path", outside_modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_no_module_outside_the_store_writes_a_store(path):
    writes = store_writes(path.read_text())
    assert not writes, "\n".join(f"{path.relative_to(PACKAGE.parent)}:{line}: {what}" for line, what in writes)


# The check itself: each kind of write is found, and reads, method calls and other objects are not.
WRITES = {
    "attribute": "def f(store):\n    store.settled = True",
    "augmented": "def f(store):\n    store.slots += 1",
    "counter of an element": "def f(cache):\n    cache.stores[0].room = 3",
    "into a tensor": "def f(cache, k):\n    cache.stores[1].k_pages[0, 1] = k",
    "in place": "def f(store):\n    store.lengths.add_(1)",
    "in place on a slice": "def f(store):\n    store.lengths[0].sub_(1)",
    "through a view": "def f(store, e):\n    pf, sf = store.pos_pages.view(-1), store.score_pages.view(-1)\n"
                      "    pf[e] = -1",
    "in place through a view": "def f(store, x):\n    scores = store.score_pages.view(-1)\n    scores.scatter_add_(0, x, x)",
    "through an alias of a store": "def f(cache):\n    s = cache.stores[0]\n    s.owned = None",
    "a loop over the stores": "def f(cache):\n    for s in cache.stores:\n        s.room -= 1",
    "a comprehension over the stores": "def f(cache):\n    [s.lengths.add_(1) for s in cache.stores]",
    "a tier": "def f(store):\n    hi = store.high\n    hi.lengths[0] = 1",
    "a tier of self": "def f(self, full):\n    hi, lo = self.high, self.low\n    lo.lengths.add_(full)",
    "getattr": "def f(store, n, p):\n    getattr(store, n)[p] = 0",
    "setattr": "def f(store):\n    setattr(store, 'room', 0)",
    "out=": "def f(store, a, b):\n    torch.add(a, b, out=store.k_pages)",
    "a kernel on its tensors": "def f(store, step):\n    step(store.tensors())",
    "a kernel writing into them": "def f(store, k, p):\n    quantize_pages_into(k, store.k_pages, store.k_scale, p, 4)",
    "a kernel writing into a tuple": "def f(store, k, v, p):\n    q.quantize_pair_into_pages(k, v, (store.k_pages,), p, 8)",
}
READS = {
    "reads": "def f(store, flat):\n    pos = store.pos_pages.reshape(-1)[flat]\n    n = store.lengths.sum()",
    "a copy by advanced indexing": "def f(store, flat):\n    pos = store.pos_pages.reshape(-1)[flat]\n    pos[0] = 1",
    "methods": "def f(store, k, v, p):\n    store.append(k, v, p)\n    store.remove_where(k, v)",
    "the list of stores": "def f(cache, s):\n    cache.stores[0] = s\n    cache.stores = [None]",
    "other objects": "def f(args, prompt):\n    args.lengths = 1\n    prompt.lengths += 1\n"
                     "    prompt.held.append(1)",
    "out-of-place ops": "def f(store):\n    x = store.lengths + 1\n    y = store.k_pages.clone()\n    y[0] = 1",
    "a kernel reading them": "def f(store, q):\n    paged_attention(q, store.k_pages, store.v_pages)",
}


@pytest.mark.parametrize("source", WRITES.values(), ids=WRITES.keys())
def test_the_check_finds_each_kind_of_write(source):
    assert len(store_writes(textwrap.dedent(source))) == 1, store_writes(source)


@pytest.mark.parametrize("source", READS.values(), ids=READS.keys())
def test_the_check_lets_reads_and_methods_pass(source):
    assert store_writes(textwrap.dedent(source)) == []


SMALL = {"ranking": {"by_score": {"window": 2}}, "scoring": {"window_attention": {"window": 2}}}


@pytest.mark.parametrize("storage, kind, low", [
    ("model_dtype", LayerStore, None), ("int8", CodeStore, None), ({"int4": {"group": 8}}, CodeStore, None),
    ({"mixed": {"full": 0.5}}, TieredStore, CodeStore), ({"kivi": {"residual": 4, "tokens": 4}}, TieredStore,
                                                          ChannelCodeStore)], ids=str)
def test_the_plan_names_the_store_class_and_every_layer_is_built_with_it(storage, kind, low):
    policy = kvcompile.load_spec("snapkv", per_head=12, storage=storage, **SMALL)
    b, h, g, n, d = 2, 2, 2, 24, 16
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=h, num_attention_heads=h * g, head_dim=d,
                             hidden_size=h * g * d)
    cache = KVCompileCache(policy, config, page_size=4)
    assert cache.plan.store is kind and f"store: {kind.__name__}" in cache.plan.describe()
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(b, h * g, n, d, generator=gen), *(torch.randn(b, h, n, d, generator=gen) for _ in "kv")
    for x in (n, 1, 1):  # the prompt, then two decode steps
        torch.ops.kvcompile.attend(q[:, :, :x], k[:, :, :x], v[:, :, :x], None, 0, cache.ref, cache.token, d ** -0.5)
        store = cache.stores[0]
        assert type(store) is kind and (low is None or (type(store.low) is low and type(store.high) is LayerStore))
