"""The reference engine end to end (reference.compress): per-layer compression, the LAVa
cascade (Alg. 2), residual merging across the cascade, padding, full budgets."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from kvcompile.policies.budgets import (
    AttentionNorm, Budget, EntropyLayers, PooledHeads, PyramidLayers, Split, UniformHeads, UniformLayers,
)
from kvcompile.policies.merge import Residual
from kvcompile.policies.ranking import ByPosition, ByScore
from kvcompile.policies.schedule import Schedule
from kvcompile.policies.scoring import Decayed, KeyNorm, LastToken, Lava, WindowAttention
from kvcompile.policy import Policy
from kvcompile.reference import (
    LayerState, decode_attention as attend, compress, compressed_cache, layer_entropy, layer_totals, query_rows, score_layer, select,
)

FEW = settings(max_examples=25, deadline=None)


def random_states(seed, batch=1, heads=2, groups=1, n=10, d=8, layers=3, lengths=None, rows=None,
                  dtype=torch.float32):
    """Random prefill states of a left-padded batch (pads hold garbage)."""
    g = torch.Generator().manual_seed(seed)
    rows = n if rows is None else rows
    mask = None
    if lengths is not None:
        mask = torch.arange(n) >= (n - torch.tensor(lengths))[:, None]
    return [LayerState(torch.randn(batch, heads * groups, rows, d, generator=g, dtype=dtype) * 2,
                       torch.randn(batch, heads, n, d, generator=g, dtype=dtype),
                       torch.randn(batch, heads, n, d, generator=g, dtype=dtype), mask)
            for _ in range(layers)]


def positions_of(mask, heads, n):
    mask = torch.ones(1, n, dtype=torch.bool) if mask is None else mask
    return (mask.long().cumsum(-1) - 1)[:, None, :].expand(mask.shape[0], heads, n)


def valid_of(state):
    b, h, n, _ = state.keys.shape
    mask = torch.ones(b, n, dtype=torch.bool) if state.mask is None else state.mask
    return mask[:, None, :].expand(b, h, n)


def test_scoring_goes_through_the_policy_part():
    policy = Policy(scoring=WindowAttention(window=4))
    (state,) = random_states(0, layers=1)
    assert query_rows(policy, 10) == 4
    assert torch.equal(score_layer(policy, state), WindowAttention(window=4).score(state))


@FEW
@given(st.integers(0, 10**6), st.sampled_from([UniformLayers(), PyramidLayers(beta=2.0)]),
       st.sampled_from([UniformHeads(), PooledHeads(floor=0.3)]), st.integers(1, 6))
def test_compress_per_layer(seed, layers, heads, per_head):
    """Each layer: its scores, its share of the total (layer_totals), select; pads never kept."""
    states = random_states(seed, batch=2, lengths=[10, 7])
    policy = Policy(scoring=WindowAttention(window=3), ranking=ByScore(sinks=1, window=1),
                    budget=Budget(per_head=per_head, layers=layers, heads=heads))
    sel = compress(policy, states)
    lengths = torch.tensor([10, 7])
    totals = layer_totals(policy, lengths, len(states), 2)
    for l, state in enumerate(states):
        valid = valid_of(state)
        assert torch.equal(sel.scores[l], score_layer(policy, state))
        assert bool(sel.scores[l][~valid].eq(float("-inf")).all())
        assert not bool((sel.kept[l] & ~valid).any())
        assert torch.equal(sel.kept[l], select(policy, sel.scores[l], positions_of(state.mask, 2, 10), valid,
                                               lengths, totals[:, l], l))
        assert torch.equal(sel.budgets[:, l], sel.kept[l].sum(-1))
        assert sel.merged[l] is None
    # when every layer's share covers its protected tokens (2 per head), kept = the totals
    if bool((totals >= 2 * 2).all()):
        assert torch.equal(sel.budgets.sum(-1), totals)
        assert sel.budgets.sum((1, 2)).tolist() == [per_head * 2 * 3] * 2


@FEW
@given(st.integers(0, 10**6), st.sampled_from([UniformHeads(), PooledHeads(), PooledHeads(floor=0.5)]),
       st.integers(1, 8), st.integers(2, 5))
def test_cascade_final_state_equals_the_one_shot_entropy_allocation(seed, heads, per_head, num_layers):
    """LAVa Alg. 2 run as prefill goes, without merging, ends where the one-shot allocation
    (every layer's entropy known, one select per layer) does: selection nests. The only
    difference allowed is the new-states paradox of largest remainder (a layer's integer
    total rising after it already shrank): then the cascade holds the layer at what it has,
    and its final state is still the one-shot selection at its own final totals."""
    states = random_states(seed, batch=2, lengths=[12, 9], n=12, layers=num_layers)
    policy = Policy(scoring=Lava(window=3), ranking=ByScore(window=1),
                    budget=Budget(per_head=per_head, layers=EntropyLayers(), heads=heads))
    assert policy.layer_dynamic
    sel = compress(policy, states)
    lengths = torch.tensor([12, 9])
    valid = valid_of(states[0])
    positions = positions_of(states[0].mask, 2, 12)
    entropy = torch.stack([layer_entropy(s, valid) for s in sel.scores], dim=1)
    one_shot = layer_totals(policy, lengths, num_layers, 2, entropy=entropy)
    steps = [layer_totals(policy, lengths, num_layers, 2, entropy=entropy[:, :l + 1]) for l in range(num_layers)]
    # the new-states paradox: some layer's total rises after it already shrank
    monotone = all(bool((steps[l][:, :l] <= steps[l - 1]).all()) for l in range(1, num_layers))
    final = sel.budgets.sum(-1)
    if monotone:
        assert torch.equal(final, one_shot)
    for l in range(num_layers):
        assert torch.equal(sel.kept[l], select(policy, sel.scores[l], positions, valid, lengths, final[:, l], l))


def test_cascade_shrinks_lower_layers_as_layers_are_seen():
    """After layer 0 alone it holds min(B, H·n_b); at the end only its entropy share."""
    states = random_states(3, n=10, layers=3)
    policy = Policy(scoring=Lava(window=3), budget=Budget(per_head=2, layers=EntropyLayers()))
    first = compress(policy, states[:1])
    assert first.budgets.sum().item() == 2 * 2 * 1  # B = 2·H·L with L = 1
    sel = compress(policy, states)
    assert sel.budgets.sum().item() == 2 * 2 * 3
    entropy = torch.stack([layer_entropy(s, valid_of(states[0])) for s in sel.scores], dim=1)
    assert_close(sel.budgets.sum(-1).double(), entropy.double() / entropy.sum() * 12, atol=1.0, rtol=0)


@FEW
@given(st.integers(0, 10**6), st.booleans(), st.integers(2, 6))
def test_residual_merging_through_the_cascade(seed, cascade, per_head):
    """ZSMerge with LAVa layers: entries (tokens + occupied slots) add up to the total; every
    evicted token sits in exactly one slot (counts add up to the merged tokens)."""
    states = random_states(seed, batch=2, lengths=[10, 8], layers=3)
    split = Split(proximity=0.0, context=0.5, residual=0.5)
    policy = Policy(scoring=Lava(window=3), budget=Budget(per_head=per_head, layers=EntropyLayers(), split=split),
                    merge=Residual(alpha=0.6), schedule=Schedule(cascade=cascade))
    sel = compress(policy, states)
    valid = valid_of(states[0])
    entries = torch.zeros(2, dtype=torch.long)
    for kept, merged in zip(sel.kept, sel.merged):
        counts = merged.counts.sum(-1)
        tokens = kept.sum(-1)
        has_slots = merged.counts.gt(0).any(-1)
        assert torch.equal((tokens + counts)[has_slots], valid.sum(-1)[has_slots])
        entries += tokens.sum(-1) + merged.counts.gt(0).sum((1, 2))
    lengths = torch.tensor([10, 8])
    assert entries.tolist() == [min(per_head * 2 * 3, 2 * 3 * int(n)) for n in lengths]


@FEW
@given(st.integers(0, 10**6), st.sampled_from(["snapkv", "adakv", "streaming", "zsmerge", "lava"]))
def test_left_padding_gives_each_sequence_its_own_kept_set(seed, kind):
    lengths = [9, 6]
    states = random_states(seed, batch=2, lengths=lengths, n=9, rows=9)
    policy = {
        "snapkv": Policy(scoring=WindowAttention(window=3), ranking=ByScore(window=2), budget=Budget(per_head=4)),
        "adakv": Policy(scoring=WindowAttention(window=3), budget=Budget(per_head=3, heads=PooledHeads(floor=0.2))),
        "streaming": Policy(scoring=KeyNorm(), ranking=ByPosition(sinks=2), budget=Budget(ratio=0.5)),
        "zsmerge": Policy(scoring=Decayed(), budget=Budget(per_head=4, split=Split(0.25, 0.5, 0.25)),
                          merge=Residual()),
        "lava": Policy(scoring=Lava(window=3), budget=Budget(per_head=3, layers=EntropyLayers(),
                                                               heads=PooledHeads())),
    }[kind]
    sel = compress(policy, states)
    for b, n in enumerate(lengths):
        alone = [LayerState(s.queries[b:b + 1, :, 9 - n:], s.keys[b:b + 1, :, 9 - n:], s.values[b:b + 1, :, 9 - n:])
                 for s in states]
        own = compress(policy, alone)
        for l in range(len(states)):
            assert torch.equal(sel.kept[l][b, :, 9 - n:], own.kept[l][0])
            if policy.merges:
                assert torch.equal(sel.merged[l].counts[b, :, :own.merged[l].counts.shape[-1]], own.merged[l].counts[0])


@FEW
@given(st.integers(0, 10**6), st.booleans())
def test_budget_covering_the_prompt_keeps_everything_and_the_same_attention(seed, merges):
    states = random_states(seed, batch=2, lengths=[8, 5], n=8, groups=2)
    split = Split(0.25, 0.5, 0.25) if merges else None
    policy = Policy(scoring=WindowAttention(window=2), budget=Budget(per_head=8, split=split, heads=PooledHeads()),
                    merge=Residual() if merges else Policy().merge)
    sel = compress(policy, states)
    g = torch.Generator().manual_seed(seed)
    for state, kept, merged in zip(states, sel.kept, sel.merged):
        assert torch.equal(kept, valid_of(state))
        keys, values, bias, lengths = compressed_cache(policy, state, kept, merged)
        if merges:
            assert int(merged.counts.sum()) == 0  # nothing evicted, no slot used
        q = torch.randn(2, 4, 1, 8, generator=g)
        for b, n in enumerate([8, 5]):  # the full cache of each sequence: its real tokens
            ref = attend(q[b:b + 1], state.keys[b:b + 1, :, 8 - n:], state.values[b:b + 1, :, 8 - n:])
            assert_close(attend(q[b:b + 1], keys[b:b + 1], values[b:b + 1],
                                None if bias is None else bias[b:b + 1], lengths[b:b + 1]), ref)


def test_dbudgetkv_policy_keeps_the_first_layers_whole():
    states = random_states(5, batch=2, lengths=[10, 6], layers=4)
    policy = Policy(scoring=LastToken(), ranking=ByPosition(sinks=2),
                    budget=Budget(threshold=AttentionNorm(t=0.05, keep_layers=2)))
    sel = compress(policy, states)
    valid = valid_of(states[0])
    for l in range(4):
        if l < 2:
            assert torch.equal(sel.kept[l], valid)
        assert bool(sel.kept[l][valid & (positions_of(states[0].mask, 2, 10) < 2)].all())
        assert not bool((sel.kept[l] & ~valid).any())
    assert int(sel.budgets[:, 2:].sum()) < int(valid.sum()) * 2  # something was evicted


@FEW
@given(st.integers(0, 10**6), st.floats(0.0, 1.0), st.integers(2, 5))
def test_theorem_3_1_on_a_compressed_prompt(seed, alpha, per_head):
    """ZSMerge Theorem 3.1 through compress: every unmerged kept token's attention in the
    compressed cache (bias α·log w) ≥ its attention in the full cache, α ∈ [0, 1]."""
    states = random_states(seed, n=10, layers=2, groups=2, dtype=torch.float64)
    policy = Policy(scoring=Decayed(), budget=Budget(per_head=per_head, split=Split(0.2, 0.4, 0.4)),
                    merge=Residual(alpha=alpha))
    sel = compress(policy, states)
    g = torch.Generator().manual_seed(seed)
    for state, kept, merged in zip(states, sel.kept, sel.merged):
        assert int(merged.counts.sum()) > 0
        keys, _, bias, lengths = compressed_cache(policy, state, kept, merged)
        q = torch.randn(1, 4, 2, 8, generator=g, dtype=torch.float64) * 2
        s = keys.shape[2]
        compressed = attend(q, keys, torch.eye(s, dtype=torch.float64).expand(1, 2, s, s), bias, lengths)
        full = attend(q, state.keys, torch.eye(10, dtype=torch.float64).expand(1, 2, 10, 10))
        for hq in range(4):
            idx = kept[0, hq // 2].nonzero().flatten()
            assert bool((compressed[0, hq, :, :len(idx)] >= full[0, hq][:, idx] * (1 - 1e-5)).all())
