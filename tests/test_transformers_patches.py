"""kvcompile's table of transformers internals (kvcompile/integrations/transformers_patches.py): one test per
row that fails when the installed transformers changes under it (its version leaves the row's range, or the
source of the target or of what the row relies on matches no release it was checked on); the table covers
every override of a transformers method by a kvcompile class (by introspection), every `__class__` swap and
every registration in transformers' attention and mask interfaces (by reading the source), and nothing in
kvcompile assigns attributes of transformers' classes or modules; `check` refuses a changed transformers,
naming the target and the version, and compile() and the continuous batching manager run it before they
change anything. tests/test_transformers_range.py runs this file again on the lowest transformers."""
from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch
import transformers

import kvcompile
from kvcompile.errors import CompileError
from kvcompile.integrations import transformers_patches as tp
from kvcompile.integrations.transformers_patches import PATCHES

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvcompile"
TARGETS = [p.target for p in PATCHES]
# what a class statement puts in a class's namespace besides what its body defines
MACHINERY = {"__module__", "__doc__", "__dict__", "__weakref__", "__annotations__", "__qualname__",
             "__firstlineno__", "__static_attributes__", "__abstractmethods__", "_abc_impl", "__parameters__",
             "__orig_bases__", "__dataclass_fields__", "__dataclass_params__", "__match_args__"}


def test_every_row_is_declared_once_and_well_formed():
    assert len(TARGETS) == len(set(TARGETS)), [t for t in TARGETS if TARGETS.count(t) > 1]
    for p in PATCHES:
        assert p.kind in tp.KINDS and p.integration in ("generate", "batching"), p
        assert p.target.startswith("transformers.") and ":" in p.target, p.target
        assert p.changes and p.source, p.target
        for fingerprints in (p.source, *(want for _, want in p.relies_on)):
            releases = " ".join(fingerprints.values()).split()
            assert sorted(releases) == sorted(tp.CHECKED), (p.target, fingerprints)  # each checked release once
        assert bool(p.sites) == (p.kind in ("swap", "register")), p.target


def test_the_range_is_pyprojects():
    """The table's range is the one pyproject declares, and the releases checked span it from its lower bound."""
    from packaging.specifiers import SpecifierSet

    from test_transformers_range import lowest

    assert SpecifierSet(tp.RANGE) == lowest.requirement().specifier
    assert tp.CHECKED[0] == lowest.lowest_version()
    assert all(v in SpecifierSet(tp.RANGE) for v in tp.CHECKED)


@pytest.mark.parametrize("target", TARGETS)
def test_row_matches_the_installed_transformers(target):
    """Fails when transformers changes under this row: its version leaves the row's range, or the source of the
    target or of the code the row relies on is not that of a release it was checked on."""
    patch = next(p for p in PATCHES if p.target == target)
    assert tp.drift(patch) == [], tp.drift(patch)


def _kvcompile_modules():
    for info in pkgutil.walk_packages(kvcompile.__path__, "kvcompile."):
        if ".vllm" in info.name or info.name.endswith("__main__"):  # the vLLM plugin: its own table
            continue
        yield importlib.import_module(info.name)


def overrides() -> dict[str, set[str]]:
    """"module:Class.attr" of each transformers class attribute that a kvcompile class redefines, as a concrete
    class's method resolution finds it (the nearest transformers class defining it), -> the kvcompile classes."""
    out = {}
    for module in _kvcompile_modules():
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__:
                continue
            ours = [b for b in cls.__mro__ if b.__module__.startswith("kvcompile")]
            theirs = [b for b in cls.__mro__ if b.__module__.startswith("transformers")]
            for attr in {a for b in ours for a in vars(b)} - MACHINERY:
                owner = next((b for b in theirs if attr in vars(b)), None)
                if owner is not None:
                    out.setdefault(f"{owner.__module__}:{owner.__qualname__}.{attr}", set()).add(cls.__qualname__)
    return out


def test_the_table_declares_every_override():
    """A kvcompile class that redefines a method (or property) of its transformers base needs a row: a new
    override without one fails here, and so does a row whose override is gone."""
    found = overrides()
    declared = {p.target for p in PATCHES if p.kind == "override"}
    assert set(found) - declared == set(), {t: found[t] for t in set(found) - declared}
    gone = {t for t in declared - set(found) if not _absent_here(t)}  # Cache.is_dummy: none before 5.23
    assert gone == set(), gone
    assert "transformers.generation.continuous_batching.scheduler:FIFOScheduler.schedule_batch" in found


def _absent_here(target: str) -> bool:
    """The installed transformers has no `target`, and a release the table was checked on had none either."""
    patch = next(p for p in PATCHES if p.target == target)
    try:
        tp.resolve(target)
    except AttributeError:
        return tp.ABSENT in patch.source
    return False


class _Sites(ast.NodeVisitor):
    """`__class__` assignments, registrations in AttentionInterface / AttentionMaskInterface, and assignments to
    attributes of names imported from transformers, each as "module:function expression"."""

    def __init__(self, module: str):
        self.module, self.scope = module, []
        self.swaps, self.registers, self.assigned = set(), set(), set()
        self.theirs = set()  # names bound by `from transformers... import`

    def _site(self, what: str) -> str:
        return f"{self.module}:{'.'.join(self.scope)} {what}"

    def _nest(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _nest

    def visit_ImportFrom(self, node):
        if node.module and node.module.split(".")[0] == "transformers":
            self.theirs |= {alias.asname or alias.name for alias in node.names}

    def visit_Import(self, node):
        self.theirs |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "transformers"}

    def _target(self, target):
        if isinstance(target, ast.Attribute):
            if target.attr == "__class__":
                self.swaps.add(self._site(ast.unparse(target.value)))
            elif isinstance(target.value, ast.Name) and target.value.id in self.theirs:
                self.assigned.add(self._site(ast.unparse(target)))

    def visit_Assign(self, node):
        for target in node.targets:
            self._target(target)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._target(node.target)
        self.generic_visit(node)

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "register" and isinstance(func.value, ast.Name) and \
                func.value.id in ("AttentionInterface", "AttentionMaskInterface"):
            self.registers.add(self._site(func.value.id))
        if isinstance(func, ast.Name) and func.id == "setattr" and isinstance(node.args[0], ast.Name) and \
                node.args[0].id in self.theirs:
            self.assigned.add(self._site(f"setattr({node.args[0].id}, ...)"))
        self.generic_visit(node)


def sites() -> _Sites:
    found = _Sites("")
    for path in sorted(PACKAGE.rglob("*.py")):
        if "vllm" in path.relative_to(PACKAGE).parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        visitor = _Sites(module)
        visitor.visit(ast.parse(path.read_text()))
        found.swaps |= visitor.swaps
        found.registers |= visitor.registers
        found.assigned |= visitor.assigned
    return found


def test_every_swap_and_registration_is_declared_and_nothing_patches_transformers():
    """Each `obj.__class__ = ...` and each AttentionInterface / AttentionMaskInterface registration in kvcompile is
    a declared site of a row; nothing assigns an attribute of a transformers class or module."""
    found = sites()
    declared = {kind: {s for p in PATCHES if p.kind == kind for s in p.sites} for kind in ("swap", "register")}
    assert found.swaps == declared["swap"], (found.swaps ^ declared["swap"])
    assert found.registers == declared["register"], (found.registers ^ declared["register"])
    assert len(found.swaps) == 5 and len(found.registers) == 10  # (sweep._stepped: the tools' batched answers)
    assert found.assigned == set(), found.assigned


def test_the_source_scan_finds_what_it_looks_for():
    """The scan above, on planted code: a swap, a registration and a monkeypatch are each found."""
    visitor = _Sites("planted")
    visitor.visit(ast.parse("from transformers.generation.continuous_batching.scheduler import Scheduler\n"
                            "from transformers import AttentionInterface\n"
                            "def install(obj, fn):\n"
                            "    obj.scheduler.__class__ = Mine\n"
                            "    AttentionInterface.register('x', fn)\n"
                            "    Scheduler.schedule_batch = fn\n"
                            "    setattr(Scheduler, 'reset', fn)\n"))
    assert visitor.swaps == {"planted:install obj.scheduler"}
    assert visitor.registers == {"planted:install AttentionInterface"}
    assert visitor.assigned == {"planted:install Scheduler.schedule_batch", "planted:install setattr(Scheduler, ...)"}


def _changed(monkeypatch):
    """Replace the scheduler's _schedule_request by a function of another source, as a new release might."""
    from transformers.generation.continuous_batching.scheduler import Scheduler

    original = Scheduler._schedule_request

    def _schedule_request(self, state, request_tokens, token_budget, request_ids_to_remove_from_waiting):
        return original(self, state, request_tokens, token_budget, request_ids_to_remove_from_waiting)

    monkeypatch.setattr(Scheduler, "_schedule_request", _schedule_request)


def test_check_refuses_a_transformers_changed_under_a_row(monkeypatch):
    from kvcompile.integrations.batching import BatchingError

    tp.check("batching", BatchingError)  # the installed one passes
    _changed(monkeypatch)
    with pytest.raises(BatchingError) as refused:
        tp.check("batching", BatchingError)
    message = str(refused.value)
    assert "scheduler:Scheduler._schedule_request (override)" in message and "differs from every release" in message
    assert f"transformers {transformers.__version__} differs" in message
    tp.check("generate", CompileError)  # not a row compile() relies on


def test_check_refuses_a_version_outside_the_range(monkeypatch):
    # by its dotted name, which resolves `sys.modules["transformers"]` now, as `check` does: under transformers
    # 5.21.0 the first access to a model class (tests/tiny.py's imports) puts a new lazy module object there,
    # so this module's own `transformers`, bound at its import, may no longer be the one `check` reads
    monkeypatch.setattr("transformers.__version__", "5.25.0")
    with pytest.raises(CompileError) as refused:
        tp.check("generate", CompileError)
    assert "transformers 5.25.0 is outside >=5.21.0,<5.25" in str(refused.value)
    assert "transformers.cache_utils:Cache.crop (override)" in str(refused.value)


def test_an_absent_target_is_accepted_only_where_a_checked_release_lacked_it(monkeypatch):
    """Cache.is_dummy came in 5.23 (kvcompile's cache defines it on every release); Cache.crop was always there."""
    from transformers.cache_utils import Cache

    dummy = next(p for p in PATCHES if p.target.endswith("Cache.is_dummy"))
    crop = next(p for p in PATCHES if p.target.endswith("Cache.crop"))
    assert tp.ABSENT in dummy.source and tp.ABSENT not in crop.source
    if "is_dummy" in vars(Cache):
        monkeypatch.delattr(Cache, "is_dummy")
    monkeypatch.delattr(Cache, "crop")
    assert tp.drift(dummy) == []
    assert len(tp.drift(crop)) == 1 and "Cache.crop is not there as checked" in tp.drift(crop)[0]


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        attn_implementation="sdpa")).eval()


def test_compile_and_the_engine_check_before_they_change_anything(monkeypatch):
    """compile() refuses a transformers changed under a "generate" row with the model untouched; the continuous
    batching manager refuses one changed under a "batching" row before the engine is built."""
    from transformers.cache_utils import Cache

    from kvcompile.integrations.batching import BatchingError

    model = _tiny_llama()
    original = Cache.crop
    monkeypatch.setattr(Cache, "crop", lambda self, max_length: original(self, max_length))
    with pytest.raises(CompileError, match=r"Cache\.crop \(override\)"):
        kvcompile.compile(model, "snapkv", per_head=64)
    assert not hasattr(model, "kvcompile_plan") and model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(Cache, "crop", original)
    kvcompile.compile(model, "snapkv", per_head=64)
    _changed(monkeypatch)
    with pytest.raises(BatchingError, match=r"Scheduler\._schedule_request \(override\)"):
        model.init_continuous_batching()
    assert getattr(model, "_cached_continuous_batching_manager", None) is None
    assert model.config._attn_implementation == "kvcompile"
