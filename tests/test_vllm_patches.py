"""The vLLM plugin's patches (kvcompile/integrations/vllm/patches.py, docs/VLLM.md "Patches"): one test per
declared patch that fails when the installed vLLM changes under it (its target's source, or the source of the
vLLM code its replacement relies on, differs from the fingerprint taken on the vLLM it was checked against, or
the version leaves the patch's range); `apply` refuses such a vLLM before patching anything, patches exactly
the declared targets, once; no module of the plugin holds mutable state after it ran; an engine whose
additional_config names a refused policy or malformed settings is refused by create_engine_config, before the
engine starts. Each check runs in a subprocess of the vLLM environment, bounded in time; no engine starts."""
from __future__ import annotations

import pytest

from lane import Lane
from vllm_venv import MODEL, PYTHON, ROOT, in_vllm_env_job, needs_vllm, result

pytestmark = needs_vllm


DRIFT = """
import json
from kvcompile.integrations.vllm.patches import PATCHES, drift
print("RESULT" + json.dumps({p.target: drift(p) for p in PATCHES}))
"""


@pytest.fixture(scope="module")
def installed_drift(lane) -> dict:
    """Each declared patch's differences from the installed vLLM ([] where none), read in one subprocess."""
    return result(lane.result("patches:drift", in_vllm_env_job(DRIFT)))


def _targets() -> list[str]:
    """The declared patches' targets, read from the table without importing vLLM."""
    import ast

    tree = ast.parse((ROOT / "kvcompile" / "integrations" / "vllm" / "patches.py").read_text())
    table = next(n.value for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "PATCHES")
    names = {n.targets[0].id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
             and isinstance(n.targets[0], ast.Name) and n.targets[0].id.startswith("_")
             and isinstance(n.value, ast.Constant)}
    out = []
    for call in table.elts:
        first = call.args[0]
        out.append(eval(compile(ast.Expression(first), "patches", "eval"), {"__builtins__": {}}, names))
    return out


TARGETS = _targets()


def test_the_table_declares_every_patch_once():
    assert len(TARGETS) == len(set(TARGETS)) == 9, TARGETS


@pytest.mark.parametrize("target", TARGETS)
def test_patch_matches_the_installed_vllm(installed_drift, target):
    """Fails when vLLM changes under this patch: its version leaves the declared range, or the source of the
    patched code or of what the replacement relies on differs from the vLLM it was checked against."""
    assert installed_drift[target] == [], installed_drift[target]


APPLY = """
import json, os, vllm
from kvcompile.integrations.vllm import patches
from kvcompile.integrations.vllm.settings import PluginError
from vllm.v1.attention.backends.registry import AttentionBackendEnum
out = {"drifted": {}}

def targets_patched():
    return [p.target for p in patches.PATCHES if p.wrap is not None
            and getattr(patches.resolve(p.target)[2], "_kvcompile", None) == p.target]

from kvcompile.spec import load_spec
policy = load_spec("snapkv", per_head=64)
# a vLLM whose patched function changed: refused, naming it, and nothing is patched
from vllm.v1.core.sched.scheduler import Scheduler
original = Scheduler._preempt_request
import importlib.util, tempfile
with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:  # another body, as a new release might have
    f.write("def _preempt_request(self, request, timestamp):\\n    return ORIGINAL(self, request, timestamp)\\n")
spec = importlib.util.spec_from_file_location("changed_vllm", f.name)
changed = importlib.util.module_from_spec(spec)
spec.loader.exec_module(changed)
changed.ORIGINAL = original
Scheduler._preempt_request = changed._preempt_request
try:
    patches.apply(policy)
    out["drifted"]["source"] = None
except PluginError as exc:
    out["drifted"]["source"] = str(exc)
Scheduler._preempt_request = original
# a version outside the range, the code as checked: refused too
version = vllm.__version__
vllm.__version__ = "0.33.0"
try:
    patches.apply(policy)
    out["drifted"]["version"] = None
except PluginError as exc:
    out["drifted"]["version"] = str(exc)
vllm.__version__ = version
out["patched_after_refusals"] = targets_patched()
out["backend_after_refusals"] = AttentionBackendEnum.CPU_ATTN.get_path()
patches.apply(policy)
first = {p.target: id(patches.resolve(p.target)[2]) for p in patches.PATCHES if p.wrap is not None}
patches.apply(policy)  # again: nothing changes
again = {p.target: id(patches.resolve(p.target)[2]) for p in patches.PATCHES if p.wrap is not None}
out["patched"] = targets_patched()
out["declared"] = [p.target for p in patches.PATCHES if p.wrap is not None]
out["idempotent"] = first == again
out["backend"] = AttentionBackendEnum.CPU_ATTN.get_path()
out["drift_after_apply"] = [why for p in patches.PATCHES for why in patches.drift(p)]
# no mutable state at module level in the plugin's modules once it ran
import __future__, sys, types, dataclasses
from kvcompile.integrations.vllm import backend, codes, packed_attention, packing, settings, serve
import kvcompile.integrations.vllm as plugin
state = []
for module in (plugin, backend, codes, packed_attention, packing, patches, settings, serve):
    for name, value in vars(module).items():
        if name.startswith("__") or isinstance(value, (types.ModuleType, types.FunctionType, type, str, int, float,
                                                        bool, bytes, tuple, frozenset, type(None),
                                                        __future__._Feature)):
            continue
        if dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen:
            continue
        if callable(value):  # imported builtins and functools objects
            continue
        state.append(f"{module.__name__}.{name}: {type(value).__name__}")
out["module_state"] = state
# an engine's own settings (additional_config) are checked by create_engine_config, before the engine starts
from vllm.engine.arg_utils import EngineArgs
base = dict(model=MODEL, dtype="float32", enforce_eager=True, max_model_len=512, max_num_batched_tokens=512,
            enable_prefix_caching=False, enable_chunked_prefill=False)
out["engine"] = {}
for name, extra in (("own", {"spec": "lava", "per_head": 32}), ("kvzip", {"spec": "kvzip"}),
                    ("typo", {"spec": "snapkv", "per_heads": 32}), ("no_spec", {"per_head": 32}), ("default", None)):
    try:
        config = EngineArgs(**base, **({} if extra is None else {"additional_config": {"kvcompile": extra}})
                            ).create_engine_config()
        out["engine"][name] = config.additional_config["kvcompile"]
    except PluginError as exc:
        out["engine"][name] = str(exc)
print("RESULT" + json.dumps(out))
"""


def applied_job():
    return in_vllm_env_job(f"MODEL = {str(MODEL)!r}\n" + APPLY, spec="snapkv", per_head=64)


@pytest.fixture(scope="module")
def applied(lane) -> dict:
    return result(lane.result("patches:applied", applied_job()))


def test_apply_refuses_a_vllm_that_changed_under_a_patch_and_patches_nothing(applied):
    source, version = applied["drifted"]["source"], applied["drifted"]["version"]
    assert source is not None and "Scheduler._preempt_request" in source and "source changed" in source, source
    assert version is not None and "0.33.0" in version and ">=0.32.0,<0.33" in version, version
    assert applied["patched_after_refusals"] == []
    assert applied["backend_after_refusals"].startswith("vllm."), applied["backend_after_refusals"]


def test_apply_patches_exactly_the_declared_targets_once(applied):
    assert applied["patched"] == applied["declared"] and len(applied["declared"]) == 8
    assert applied["idempotent"]
    assert applied["backend"] == "kvcompile.integrations.vllm.backend.KVCompileCPUBackend"
    assert applied["drift_after_apply"] == []  # fingerprints read the originals behind the replacements


def test_the_plugin_modules_hold_no_mutable_state(applied):
    """State lives on each engine's objects (scheduler, metadata builder), none at module level."""
    assert applied["module_state"] == [], applied["module_state"]


def test_each_engine_carries_its_own_settings_and_a_refused_one_stops_before_it_starts(applied):
    engine = applied["engine"]
    assert engine["own"] == {"spec": "lava", "per_head": 32}
    assert engine["default"] == {"spec": "snapkv", "per_head": 64}  # the environment's
    assert "cannot run kvzip" in engine["kvzip"] and "reconstruction pass" in engine["kvzip"]
    assert "unknown field(s) ['per_heads']" in engine["typo"]
    assert 'must be a mapping with "spec"' in engine["no_spec"]


def queue_runs(lane: Lane, selected: set[str]) -> None:
    """The two subprocess runs, into the suite's background lane (tests/conftest.py, tests/lane.py)."""
    if not PYTHON.exists():
        return
    if "test_patch_matches_the_installed_vllm" in selected:
        lane.queue("patches:drift", in_vllm_env_job(DRIFT))
    if selected & {"test_apply_refuses_a_vllm_that_changed_under_a_patch_and_patches_nothing",
                   "test_apply_patches_exactly_the_declared_targets_once", "test_the_plugin_modules_hold_no_mutable_state",
                   "test_each_engine_carries_its_own_settings_and_a_refused_one_stops_before_it_starts"}:
        lane.queue("patches:applied", applied_job())
