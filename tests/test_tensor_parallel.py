"""Tensor parallelism (docs/INTERNALS.md, kvcompile/sharding.py): transformers' `tp_plan="auto"` on 2 gloo
processes (torch.multiprocessing), tiny Llama and Qwen2 models with 2 and 4 KV heads (8 query
heads), every spec in specs/ and decode-time pruning: each rank holds only its own KV heads'
pages, and the kept (layer, head, token) entries, the residual slots and the generated tokens
are exactly those of a one-process run of the same weights (float64, so that the model's own
tensor-parallel arithmetic, which sums o_proj and down_proj over ranks in another order, cannot
move a score across a selection boundary)."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import kvcompile
from kvcompile.plan import PlanError, build_plan
from kvcompile.sharding import HeadShard, ShardingError, model_shard
from tiny import prompt, tiny_model
from tp_run import PRUNING, inputs, run_specs, spawn, spec_names

if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("torch.distributed with the gloo backend is not available in this torch build",
                allow_module_level=True)

WORLD = 2
CONFIGS = {"llama-2kv": ("llama", 2), "llama-4kv": ("llama", 4), "qwen2-2kv": ("qwen2", 2), "qwen2-4kv": ("qwen2", 4)}
NAMES = spec_names() + sorted(PRUNING)
COMPILED = ("llama-2kv", ["adakv", "zsmerge"])  # the compiled entry (Inductor: ~15 s per graph), once
TIMEOUT = 1800  # only stops ranks that hang (all jobs together); no speed is checked: 257 s at nice 15 on a loaded
#   machine failed the 240 s this once was


def load(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    model.generation_config.pad_token_id = 0
    return model


# the specs whose collectives test_what_each_collective_exchanges reads (on llama-2kv)
EXCHANGED = ("snapkv", "zsmerge", "h2o", "adakv", "lava", "pyramid_pooled", "dbudgetkv", "dbudget_lava")


def selected(request) -> tuple[dict[str, list[str]], bool, bool]:
    """What the tests of this module that the session selected need: the specs each config runs, whether the
    compiled job and the refusal job run. The suite's own run selects every test (every config runs every
    spec); tests/test_transformers_range.py selects fewer on the lowest transformers."""
    names, compiled, refuse = {key: set() for key in CONFIGS}, False, False
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        test = getattr(item, "originalname", item.name)
        if test == "test_ranks_keep_what_one_process_keeps":
            names[item.callspec.params["config"]].add(item.callspec.params["name"])
        elif test == "test_what_each_collective_exchanges":
            names["llama-2kv"].update(EXCHANGED)
        compiled |= test == "test_compiled_entry_keeps_what_one_process_keeps"
        refuse |= test == "test_heads_that_do_not_divide_are_refused"
    return {key: [n for n in NAMES if n in chosen] for key, chosen in names.items() if chosen}, compiled, refuse


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """One spawn of WORLD ranks running every job the selected tests need (`selected`); the one-process runs of
    the same saved weights."""
    tmp = tmp_path_factory.mktemp("tp")
    names, compiled, refuse = selected(request)
    one_process = {key: list(chosen) for key, chosen in names.items()}
    if compiled:
        one_process.setdefault(COMPILED[0], [])
        one_process[COMPILED[0]] += [n for n in COMPILED[1] if n not in one_process[COMPILED[0]]]
    jobs = []
    for key in one_process:
        arch, kv_heads = CONFIGS[key]
        tiny_model(arch, heads=8, kv_heads=kv_heads).save_pretrained(tmp / key)
        if key in names:
            jobs.append((key, str(tmp / key), names[key]))
    if compiled:
        jobs.append(("compiled:" + COMPILED[0], str(tmp / COMPILED[0]), COMPILED[1]))
    if refuse:
        tiny_model("llama", heads=6, kv_heads=3).save_pretrained(tmp / "kv3")  # 3 KV heads over 2 ranks
        jobs.append(("refuse:kv3", str(tmp / "kv3"), "snapkv"))
    ranks = spawn(WORLD, jobs, tmp, TIMEOUT)
    one = {key: run_specs(load(tmp / key), chosen) for key, chosen in one_process.items()}
    return one, ranks


def check_equal(one: dict, ranks: list[dict], num_heads: int, key_tolerance: float = 1e-9):
    assert all(r["tokens"] == one["tokens"] for r in ranks)
    per_rank = num_heads // WORLD
    held = {}
    for rank, r in enumerate(ranks):
        heads = tuple(range(rank * per_rank, (rank + 1) * per_rank))
        assert r["kv_heads"] == heads and {key[2] for key in r["entries"]} == set(heads)  # only its own heads
        assert r["report"]["kept"].shape[-1] == per_rank
        held.update(r["entries"])
    assert held.keys() == one["entries"].keys()
    for key, (tokens, slots, slot_keys) in one["entries"].items():
        assert held[key][0] == tokens, key  # the kept prompt and generated positions
        assert held[key][1] == slots, key  # the residual slots and their counts
        assert_close(held[key][2], slot_keys, rtol=key_tolerance, atol=key_tolerance)  # means of the same keys
    gathered, report = ranks[0]["gathered"], one["report"]
    assert all(torch.equal(r["gathered"]["kept"], report["kept"]) for r in ranks)
    assert torch.equal(gathered["pages"], report["pages"])
    for name in ("bytes_held", "bytes_entries", "bytes_full"):
        assert gathered[name] == report[name] == sum(r["report"][name] for r in ranks), name


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_ranks_keep_what_one_process_keeps(runs, config, name):
    one, ranks = runs
    reference = one[config][name]
    prompt_tokens = [150, 97]
    evicted = any(len(tokens) < prompt_tokens[b] for (b, _, _), (tokens, _, _) in reference["entries"].items())
    assert evicted, "the budget should evict something"
    check_equal(reference, [r[config][name] for r in ranks], CONFIGS[config][1])


def test_compiled_entry_keeps_what_one_process_keeps(runs):
    one, ranks = runs
    config, names = COMPILED
    for name in names:  # decode attention computes in float32 (every kernel), the compiled entry's split
        #   over pages (flash-decoding) in another order than the eager one's: keys agree to float32 rounding
        check_equal(one[config][name], [r["compiled:" + config][name] for r in ranks], CONFIGS[config][1],
                    key_tolerance=1e-5)


def test_what_each_collective_exchanges(runs):
    """Selections that read only their own head gather counts, pooled and entropy ones scores,
    the per-head threshold nothing."""
    _, ranks = runs
    exchange = {name: ranks[0]["llama-2kv"][name]["exchange"] for name in EXCHANGED}
    assert exchange["snapkv"] == exchange["zsmerge"] == exchange["h2o"] == "counts"
    assert exchange["adakv"] == exchange["lava"] == exchange["pyramid_pooled"] == "scores"
    assert exchange["dbudgetkv"] == exchange["dbudget_lava"] == "none"


def test_heads_that_do_not_divide_are_refused(runs):
    _, ranks = runs
    for r in ranks:
        assert "3 KV heads (6 query heads) do not divide over 2 tensor-parallel ranks" in r["refuse:kv3"]


# --- without processes ----------------------------------------------------------------------------

def test_a_shard_is_checked():
    with pytest.raises(ShardingError, match="3 KV heads do not divide over 2"):
        HeadShard(None, 0, 2, 3)
    with pytest.raises(ShardingError, match="rank 2 of a group of 2"):
        HeadShard(None, 2, 2, 4)
    assert HeadShard(None, 1, 2, 4).heads == (2, 3)
    model = tiny_model("llama")  # 2 KV heads
    with pytest.raises(PlanError, match="shard is of 4 KV heads, the model has 2"):
        build_plan(kvcompile.load_spec("snapkv"), model.config, shard=HeadShard(None, 0, 2, 4))


def test_a_scorer_that_reads_other_heads_cannot_run_sharded():
    import dataclasses

    from kvcompile.policies.scoring import WindowAttention

    class AcrossHeads(WindowAttention):  # not registered: a part that would mix heads
        head_local = False

    policy = dataclasses.replace(kvcompile.load_spec("snapkv"), scoring=AcrossHeads())
    config = tiny_model("llama").config
    build_plan(policy, config)  # one process: every head is here
    with pytest.raises(PlanError, match="reads other KV heads than the one it scores"):
        build_plan(policy, config, shard=HeadShard(None, 0, 2, 2))


def test_tova_which_reads_every_head_cannot_run_sharded():
    """tova's `last_token: {heads: all}` averages the last row over every query head of the layer; a rank
    holds only its own. The grouped score runs sharded."""
    config = tiny_model("llama").config
    with pytest.raises(PlanError, match=r"reads other KV heads.*heads: group"):
        build_plan(kvcompile.load_spec("tova"), config, shard=HeadShard(None, 0, 2, 2))
    grouped = kvcompile.load_spec("tova", scoring={"last_token": {"heads": "group"}})
    assert build_plan(grouped, config, shard=HeadShard(None, 0, 2, 2)).kv_heads == (0,)
    assert "tova" not in NAMES


def test_a_sharded_model_without_a_process_group_is_refused():
    model = tiny_model("llama")
    model._tp_size = 2  # what transformers sets on a model it sharded
    with pytest.raises(kvcompile.CompileError, match="torch.distributed is not initialized"):
        kvcompile.compile(model, "snapkv")
    assert "forward" not in model.__dict__


def test_a_cache_for_other_heads_is_refused_before_anything_runs():
    """A cache planned for one rank's heads on a model that computes all of them (or the reverse)."""
    model = tiny_model("llama")
    policy = kvcompile.load_spec("snapkv", per_head=48)
    plan = build_plan(policy, model.config, shard=HeadShard(None, 0, 2, 2))
    cache = kvcompile.KVCompileCache(plan=plan)
    with kvcompile.compiled(model, policy), torch.no_grad():
        with pytest.raises(kvcompile.CompileError, match=r"computes KV heads \[0, 1\] of 2 but the KVCompileCache "
                                                         r"given to model\(\) holds KV heads \[0\]"):
            model(prompt(40), past_key_values=cache)
    assert cache.stores == [None] * model.config.num_hidden_layers
