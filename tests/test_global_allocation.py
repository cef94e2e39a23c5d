"""`layers: global` (KVzip, arXiv:2505.23416, §4.1 "Eviction Structure"; kvpress KVzipPress(layerwise=False)): one ranking of every
(layer, KV head, token) once the prompt is scored. The reference (reference.global_keep) is the ranking written
out; the runtime (a cascade during prefill: each layer's entries ranked with the best of the layers below,
allocation.global_totals) keeps exactly its entries, for every scorer, with padding, ties, floors, protected
sets, per_head and ratio budgets, and under tensor parallelism exactly what one process keeps."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig

import kvcompile
from kvcompile import reference
from kvcompile.policies.budgets import Budget, GlobalLayers, PooledHeads
from kvcompile.policies.ranking import ByScore
from kvcompile.policies.scoring import KeyNorm, Recency, WindowAttention
from kvcompile.policy import Policy
from kvcompile.spec import SpecError, load_spec
from kvcompile.tools.sweep import replay
from test_kvzip import REPEAT, run
from test_reference import random_states
from test_runtime import run_recorded
from tiny import prompt, tiny_model


def policy_of(scoring=None, floor=0.0, per_head=None, ratio=None, sinks=0, window=0):
    return Policy(scoring=scoring or WindowAttention(window=3), ranking=ByScore(sinks=sinks, window=window),
                  budget=Budget(per_head=per_head, ratio=ratio, layers=GlobalLayers(floor=floor), heads=PooledHeads()))


def config_of(layers, heads, d=8):
    return LlamaConfig(num_hidden_layers=layers, num_key_value_heads=heads, num_attention_heads=heads,
                       hidden_size=heads * d, head_dim=d, vocab_size=16)


def test_hand_example():
    """One sequence, 2 layers × 1 head × 4 tokens, per_head 2 (total 4), sink 1, floor 0.5 (1 entry a head):
    layer 0 scores [9, 1, 5, 3], layer 1 [9, 8, 2, 7]. Sinks: position 0 in both layers. Floors: layer 0's
    best other is 5 (pos 2), layer 1's is 8 (pos 1). That is 4 entries: nothing is left for the ranking, so
    layer 1's 7 is not kept although it beats layer 0's 5. With floor 0 the ranking's 2 entries are the
    best of {1, 5, 3, 8, 2, 7}: 8 and 7, both of layer 1."""
    scores = [torch.tensor([[[9.0, 1, 5, 3]]]), torch.tensor([[[9.0, 8, 2, 7]]])]
    positions = torch.arange(4).view(1, 1, 4)
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    lengths = torch.tensor([4])
    kept = reference.global_keep(policy_of(floor=0.5, per_head=2, sinks=1), scores, positions, valid, lengths)
    assert [k[0, 0].tolist() for k in kept] == [[True, False, True, False], [True, True, False, False]]
    kept = reference.global_keep(policy_of(per_head=2, sinks=1), scores, positions, valid, lengths)
    assert [k[0, 0].tolist() for k in kept] == [[True, False, False, False], [True, True, False, True]]


def test_ties_go_to_the_later_position_then_the_lower_layer_then_the_lower_head():
    scores = [torch.ones(1, 2, 3), torch.ones(1, 2, 3)]
    positions = torch.arange(3).view(1, 1, 3).expand(1, 2, 3)
    valid = torch.ones(1, 2, 3, dtype=torch.bool)
    policy = Policy(scoring=Recency(), budget=Budget(ratio=0.5, layers=GlobalLayers(), heads=PooledHeads()))
    # ratio 0.5 of 3 tokens: round_half_up(1.5) = 2 per head, total 2·2·2 = 8 of 12
    kept = reference.global_keep(policy, scores, positions, valid, torch.tensor([3]))
    assert [k[0].tolist() for k in kept] == [[[False, True, True], [False, True, True]],
                                             [[False, True, True], [False, True, True]]]
    kept = reference.global_keep(policy_of(scoring=Recency(), per_head=1), scores, positions, valid, torch.tensor([3]))
    # 4 entries: the 4 at position 2, then none of position 1
    assert [k[0].tolist() for k in kept] == [[[False, False, True]] * 2, [[False, False, True]] * 2]
    kept = reference.global_keep(policy_of(scoring=Recency(), ratio=0.5, floor=0.0), scores, positions, valid,
                                 torch.tensor([3]))
    assert sum(int(k.sum()) for k in kept) == 8


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10 ** 6), layers=st.integers(1, 4), heads=st.integers(1, 3),
       scorer=st.sampled_from([WindowAttention(window=3), Recency(), KeyNorm()]),
       floor=st.sampled_from([0.0, 0.3, 1.0]), per_head=st.one_of(st.none(), st.integers(1, 12)),
       ratio=st.sampled_from([0.1, 0.25, 0.5, 1.0]), sinks=st.integers(0, 2), window=st.integers(0, 3),
       lengths=st.sampled_from([[14], [14, 9], [5, 14]]))
def test_runtime_keeps_the_global_rankings_entries(seed, layers, heads, scorer, floor, per_head, ratio, sinks,
                                                    window, lengths):
    """The engine's prefill (sweep.replay: the code a compiled model's prompt runs, layer by layer, with its
    cascade) against reference.compress (every layer scored, then reference.global_keep)."""
    policy = policy_of(scorer, floor, per_head, None if per_head else ratio, sinks, window)
    states = random_states(seed, batch=len(lengths), heads=heads, n=14, layers=layers, lengths=lengths)
    if isinstance(scorer, Recency) or seed % 3 == 0:  # ties: keys rounded to a few values
        states = [type(s)(s.queries, s.keys.round(), s.values, s.mask, s.scale) for s in states]
    cache = replay(policy, config_of(layers, heads), states)
    expected = reference.compress(policy, states)
    total = 0
    for layer in range(layers):
        assert torch.equal(cache.kept_positions(layer), expected.kept[layer]), f"layer {layer}"
        total += expected.kept[layer].sum((1, 2))
    for b, n in enumerate(lengths):  # the whole budget, no more (protected entries and floors aside)
        budget = policy.budget.total(n, heads, layers)
        assert int(total[b]) == min(budget, heads * layers * n) or int(total[b]) > budget


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("spec", ["snapkv_global", "kvzip"])
def test_a_model_prefill_keeps_the_references_entries(seed, spec):
    """compile()'s eager entry on a tiny model (kvzip: its reconstruction pass, tests/test_kvzip.py's setup)."""
    model = tiny_model("llama")
    ids = prompt(60, batch=2, seed=seed)
    if spec == "kvzip":
        policy = load_spec(spec, per_head=10, scoring={"kvzip": {"chunk": 25}})
        cache = run(model, policy, ids)
        scores, states = reference.kvzip_scores(model, ids, REPEAT, policy.scoring)
        expected = reference.compress(policy, states, scores=scores)
    else:
        policy = load_spec(spec, per_head=40, scoring={"window_attention": {"window": 8}},
                           ranking={"by_score": {"window": 8}})
        cache = run_recorded(model, policy, ids)
        expected = reference.compress(policy, cache.states)
    kept = [cache.kept_positions(layer) for layer in range(model.config.num_hidden_layers)]
    assert all(torch.equal(k, e) for k, e in zip(kept, expected.kept))
    per_layer = torch.stack([k.sum((1, 2)) for k in kept], 1)
    assert not bool((per_layer == per_layer[:, :1]).all()), "layers keep what their scores earn"


def test_layer_totals_follow_the_scores_not_a_share():
    """A layer whose scores are all higher than another's takes the whole ranked budget."""
    states = random_states(3, heads=2, n=12, layers=2)
    low = type(states[0])(states[0].queries, states[0].keys * 0, states[0].values, None, None)
    policy = policy_of(KeyNorm(), per_head=3)  # key_norm: −‖k‖, so zero keys score highest
    cache = replay(policy, config_of(2, 2), [low, states[1]])
    assert cache.kept().sum(-1).tolist() == [[12, 0]]


@pytest.mark.parametrize("override, problem", [
    ({"budget": {"heads": "uniform"}}, "heads is uniform"),
    ({"budget": {"heads": {"pooled": {"floor": 0.2}}}}, "with a floor"),
    ({"merge": {"residual": {}}, "ranking": {"by_score": {"window": 0}}, "budget": {"split": {"proximity": 0.1, "context": 0.8, "residual": 0.1}}},
     "merge slots"),
    ({"schedule": {"prefill": {"chunk": 64}}}, "chunk by chunk"),
    ({"budget": {"threshold": "attention_norm"}}, "threshold"),
])
def test_refused_with_the_field(override, problem):
    with pytest.raises(SpecError, match=problem):
        load_spec("snapkv_global", **override)


def test_kvzip_spec_is_the_papers_allocation():
    kvzip, uniform = load_spec("kvzip"), load_spec("kvzip_uniform")
    assert kvzip.budget.layers == GlobalLayers(floor=0.0) and kvzip.budget.heads == PooledHeads()
    assert uniform.budget.layers.name == "uniform" and uniform.budget.heads.name == "uniform"
    assert kvzip.scoring == uniform.scoring and kvzip.ranking == uniform.ranking


def test_tensor_parallel_ranks_keep_what_one_process_keeps(tmp_path):
    """2 gloo ranks (tests/test_tensor_parallel.py's setup, 4 KV heads): every rank ranks the gathered scores of
    every head, so the kept (layer, head, token) entries and the generated tokens are one process's."""
    pytest.importorskip("torch.distributed")
    from test_tensor_parallel import WORLD, check_equal, load
    from tp_run import run_specs, spawn

    tiny_model("llama", heads=8, kv_heads=4).save_pretrained(tmp_path / "model")
    ranks = spawn(WORLD, [("global", str(tmp_path / "model"), ["snapkv_global"])], tmp_path, 240)
    one = run_specs(load(tmp_path / "model"), ["snapkv_global"])["snapkv_global"]
    assert all(r["global"]["snapkv_global"]["exchange"] == "scores" for r in ranks)
    held = {}
    for (b, layer, head), (tokens, _, _) in one["entries"].items():
        held.setdefault((b, layer), 0)
        held[b, layer] += len(tokens)
    assert len({held[0, layer] for layer in range(3)}) > 1, "layers keep what their scores earn"
    check_equal(one, [r["global"]["snapkv_global"] for r in ranks], 4)


def test_a_policy_built_in_python_is_refused_by_the_plan():
    """The spec refuses a chunked prefill; a Policy made without the spec is refused when it is planned."""
    import dataclasses

    from kvcompile.plan import PlanError, build_plan
    from kvcompile.policies.schedule import Chunk

    policy = load_spec("snapkv_global")
    chunked = dataclasses.replace(policy, schedule=dataclasses.replace(policy.schedule, prefill=Chunk(64)))
    with pytest.raises(PlanError, match="chunk by chunk"):
        build_plan(chunked, config_of(2, 2))
