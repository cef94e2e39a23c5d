"""What the vLLM plugin refuses, and why (kvcompile/integrations/vllm/settings.py, docs/VLLM.md "What it refuses"):
every shipped spec is either run by the plugin or refused with the reason of each family it belongs to (merges,
decode-time schedules, tiered storage, KVzip's reconstruction pass, rotary-reading scorers), and `register`
raises that reason before it patches anything, so vLLM never starts uncompressed. An engine's own settings
(vLLM's additional_config) are read and checked field by field. kvcompile's environment, no vLLM."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

import kvcompile
from kvcompile.integrations.vllm.settings import (PluginError, Settings, check_policy, check_storage, engine_settings,
                                                  refusal, refusals)

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted(p.stem for p in (ROOT / "specs").glob("*.yaml"))

MERGE = "folds evicted entries into merge slots that every later attention reads with a logit bias"
DECODE = "evicts while decoding"
TIERED = "keeps each head's entries in two tiers"
KVZIP = "scoring kvzip scores entries by a reconstruction pass"
ROTARY = "needs the model's rotary frequencies"
# every shipped spec: the reasons it is refused for (each family's phrase), or () where the plugin runs it
FAMILIES = {
    "adakv": (), "dbudget_lava": (), "dbudgetkv": (), "h2o": (), "knorm": (), "lava": (), "pyramid_pooled": (),
    "observed_attention": (), "pyramidkv": (), "snapkv": (), "snapkv_global": (), "streamingllm": (), "tova": (),
    "zsmerge": ("merge residual (budget.split", MERGE, "schedule.decode online " + DECODE),
    "lava_residual": ("merge residual (budget.split", MERGE),
    "expected_zsmerge": ("merge residual (budget.split", MERGE, "scoring expected_attention " + ROTARY),
    "kivi": ("storage kivi " + TIERED + " (each key channel quantized over groups of tokens",),
    "snapkv_int4": (),
    "lava_mixed": ("storage mixed " + TIERED + " (the best-scored entries in full precision",),
    "kvzip": (KVZIP,), "kvzip_adakv": (KVZIP,), "kvzip_uniform": (KVZIP,),
    "expected_attention": ("scoring expected_attention " + ROTARY,),
    "expected_adakv": ("scoring expected_attention " + ROTARY,),
}


def test_every_shipped_spec_is_classified():
    assert sorted(FAMILIES) == SPECS


@pytest.mark.parametrize("spec", SPECS)
def test_a_spec_runs_or_is_refused_with_the_reason_of_each_family_it_belongs_to(spec):
    policy = kvcompile.load_spec(spec)
    why, reasons = refusal(policy), refusals(policy)
    want = FAMILIES[spec]
    if not want:
        assert why is None and reasons == [], why
        return
    assert why == "; ".join(reasons) and all(reason in why for reason in want), why
    families = [r for r in want if r.startswith(("merge", "schedule", "storage", "scoring"))]  # a reason's start
    assert len(reasons) == len(families) and all(r.startswith(f) for r, f in zip(reasons, families)), reasons


def test_a_decode_time_schedule_alone_is_refused_for_that_reason(tmp_path):
    """snapkv re-scored every 8 decoded tokens (`decode: every`), nothing else changed: refused with the
    decode schedule's reason only."""
    text = (ROOT / "specs" / "snapkv.yaml").read_text().replace("schedule: prefill", "schedule: {decode: {every: 8}}")
    assert "every: 8" in text
    (tmp_path / "every.yaml").write_text(text.replace("name: snapkv", "name: snapkv_every"))
    [why] = refusals(kvcompile.load_spec(tmp_path / "every.yaml"))
    assert why.startswith("schedule.decode every " + DECODE) and "the blocks it returned to vLLM are fixed" in why


@pytest.fixture
def register_without_vllm(monkeypatch):
    """register() with vLLM's patching replaced by a recorder: a refusal must come before it."""
    applied = []
    monkeypatch.setitem(sys.modules, "kvcompile.integrations.vllm.patches", types.SimpleNamespace(apply=applied.append))
    for name in ("PER_HEAD", "RATIO", "RECORD"):
        monkeypatch.delenv(f"KVCOMPILE_VLLM_{name}", raising=False)
    from kvcompile.integrations.vllm import register

    return register, applied


@pytest.mark.parametrize("spec, reason", [("lava_residual", MERGE), ("zsmerge", DECODE), ("kivi", TIERED),
                                          ("lava_mixed", TIERED), ("kvzip", KVZIP)])
def test_register_refuses_before_patching_vllm(register_without_vllm, monkeypatch, spec, reason):
    register, applied = register_without_vllm
    monkeypatch.setenv("KVCOMPILE_VLLM_SPEC", spec)
    with pytest.raises(PluginError, match=f"the vLLM plugin cannot run {spec}: ") as refused:
        register()
    assert reason in str(refused.value) and applied == []
    monkeypatch.setenv("KVCOMPILE_VLLM_SPEC", "snapkv")
    register()
    assert [p.name for p in applied] == ["snapkv"]


def test_an_engines_own_settings_come_from_its_additional_config():
    env = {"KVCOMPILE_VLLM_SPEC": "snapkv", "KVCOMPILE_VLLM_PER_HEAD": "64"}
    own = types.SimpleNamespace(additional_config={"kvcompile": {"spec": "lava", "ratio": 0.25, "record": "k.jsonl"}})
    assert engine_settings(own, env) == Settings("lava", (("ratio", 0.25),), "k.jsonl")
    assert engine_settings(types.SimpleNamespace(additional_config={}), env) == Settings("snapkv", (("per_head", 64),))
    assert engine_settings(types.SimpleNamespace(additional_config={}), {}) is None  # the plugin is off
    settings = Settings("lava", (("per_head", 32),), "k.jsonl")
    assert Settings.from_config(settings.as_config()) == settings
    for given, message in (({"spec": "snapkv", "budget": 3}, r"unknown field\(s\) \['budget'\]"),
                           ({"per_head": 3}, 'must be a mapping with "spec"'), ("snapkv", 'must be a mapping'),
                           ({"spec": "snapkv", "per_head": 3, "ratio": 0.1}, "one of per_head and ratio")):
        with pytest.raises(PluginError, match=message):
            engine_settings(types.SimpleNamespace(additional_config={"kvcompile": given}), env)
    check_policy(Settings.from_config(own.additional_config["kvcompile"]).policy())  # lava runs


def test_per_entry_codes_run_where_the_cache_holds_them(tmp_path):
    """int8 and int4 (every entry as codes) run; the model's head dim and dtype are checked before vLLM sizes
    its cache (create_engine_config, the engine core, the metadata builder): a group that does not divide the
    head dim, and a cache not in float32, are refused with the reason."""
    text = (ROOT / "specs" / "snapkv_int4.yaml").read_text().replace("int4: {group: 0}", "int8: {group: 48}")
    (tmp_path / "int8.yaml").write_text(text.replace("name: snapkv_int4", "name: snapkv_int8"))
    int8 = kvcompile.load_spec(tmp_path / "int8.yaml")
    assert refusals(int8) == [] and refusals(kvcompile.load_spec("snapkv_int4")) == []
    check_storage(int8, 96, "torch.float32")
    check_storage(kvcompile.load_spec("snapkv"), 50, "torch.bfloat16")  # the model's dtype: nothing to check
    with pytest.raises(PluginError, match=r"cannot run snapkv_int8 \(storage int8\) on this model: group 48 does "
                                          "not divide the head dim 64"):
        check_storage(int8, 64, "torch.float32")
    with pytest.raises(PluginError, match=r"snapkv_int4 \(storage int4\) on this model: the model runs in "
                                          "torch.bfloat16"):
        check_storage(kvcompile.load_spec("snapkv_int4"), 64, "torch.bfloat16")
