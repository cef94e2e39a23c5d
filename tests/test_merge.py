"""Residual merging (ZSMerge §3.4–3.5): slot filling and merging rule, counts, the log-count
bias, and Theorem 3.1 (an unmerged token's attention never decreases, for α ∈ [0, 1])."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from kvcompile.policies.budgets import Budget, Split
from kvcompile.policies.merge import Residual
from kvcompile.policy import Policy
from kvcompile.reference import LayerState, decode_attention as attend, compressed_cache, head_budgets, merge_evicted, select

FEW = settings(max_examples=40, deadline=None)


def merging_policy(alpha=0.6, residual=0.5, per_head=4):
    split = Split(proximity=0.0, context=1 - residual, residual=residual)
    merge = Residual()
    object.__setattr__(merge, "alpha", alpha)  # past the declared range α ∈ [0, 1], to show why it is there
    return Policy(budget=Budget(per_head=per_head, split=split), merge=merge)


def simulate(keys, scores, evicted, num_slots):
    """ZSMerge Alg. 1 lines 11–15 for one head, in plain Python: returns [(key, members)]."""
    order = sorted((i for i in range(len(keys)) if evicted[i]), key=lambda i: (scores[i], i))
    slots = []  # [key list, members]
    for i in order:
        if num_slots == 0:
            break
        if len(slots) < num_slots:
            slots.append([list(keys[i]), [i]])
            continue
        dots = [sum(a * b for a, b in zip(k, keys[i])) for k, _ in slots]
        r = dots.index(max(dots))
        w = len(slots[r][1])
        slots[r][0] = [(w * a + b) / (w + 1) for a, b in zip(slots[r][0], keys[i])]
        slots[r][1].append(i)
    return slots


def test_merge_hand_case():
    """Scores 0.3, 0.1, 0.2, 0.4 → merge order 1, 2, 0, 3 into 2 slots: 1 and 2 fill them;
    k_0 = (1, 0) has dot 0 with slot 0 = (0, 1) and 1 with slot 1 = (1, 1): slot 1 becomes
    (1, ½), w = 2; k_3 = (2, 0): dots 0 and 2 → slot 1 = (2·(1, ½) + (2, 0))/3 = (4/3, 1/3), w = 3."""
    keys = torch.tensor([[1.0, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 0], [2, 0, 0, 0]]).view(1, 1, 4, 4)
    values = torch.eye(4).view(1, 1, 4, 4)
    scores = torch.tensor([0.3, 0.1, 0.2, 0.4]).view(1, 1, 4)
    evicted = torch.ones(1, 1, 4, dtype=torch.bool)
    merged = merge_evicted(merging_policy(), keys, values, scores, evicted, None, torch.tensor([[2]]))
    assert merged.counts.tolist() == [[[1, 3]]]
    assert_close(merged.keys[0, 0], torch.tensor([[0, 1, 0, 0], [4 / 3, 1 / 3, 0, 0]]))
    assert_close(merged.values[0, 0], torch.tensor([[0, 1, 0, 0], [1 / 3, 0, 1 / 3, 1 / 3]]))


def test_merge_ties():
    """Equal scores merge the earlier position first; equal dot products pick the lowest slot."""
    keys = torch.tensor([[1.0, 0], [0, 1], [1, 1]]).view(1, 1, 3, 2)
    values = torch.eye(3)[:, :2].view(1, 1, 3, 2)
    scores = torch.zeros(1, 1, 3)
    merged = merge_evicted(merging_policy(), keys, values, scores, torch.ones(1, 1, 3, dtype=torch.bool),
                           None, torch.tensor([[2]]))
    # 0 and 1 fill the slots in position order; k_2 = (1, 1) has dot 1 with both → slot 0
    assert merged.counts.tolist() == [[[2, 1]]]
    assert_close(merged.keys[0, 0], torch.tensor([[1.0, 0.5], [0, 1]]))
    # positions decide the score tie, not the entry order: keys (1, 0), (0, 1), (0, 2) at
    # positions 2, 1, 0 merge as entries 2, 1, 0: (0, 2) and (0, 1) fill the slots, then
    # (1, 0) has dot 0 with both → slot 0 = (½, 1), w = 2. In entry order it would be
    # (1, 0), (0, 1), then (0, 2) → slot 1 = (0, 1.5).
    keys = torch.tensor([[1.0, 0], [0, 1], [0, 2]]).view(1, 1, 3, 2)
    evicted = torch.ones(1, 1, 3, dtype=torch.bool)
    merged = merge_evicted(merging_policy(), keys, values, scores, evicted, None, torch.tensor([[2]]),
                           torch.tensor([[[2, 1, 0]]]))
    assert merged.counts.tolist() == [[[2, 1]]]
    assert_close(merged.keys[0, 0], torch.tensor([[0.5, 1.0], [0, 1]]))
    merged = merge_evicted(merging_policy(), keys, values, scores, evicted, None, torch.tensor([[2]]))
    assert merged.counts.tolist() == [[[1, 2]]]
    assert_close(merged.keys[0, 0], torch.tensor([[1.0, 0], [0, 1.5]]))


def test_drop_policies_do_not_merge():
    keys = torch.randn(1, 1, 3, 2)
    assert merge_evicted(Policy(), keys, keys, torch.rand(1, 1, 3), torch.ones(1, 1, 3, dtype=torch.bool)) is None


def test_bias_is_alpha_log_count():
    counts = torch.tensor([0, 1, 2, 4])
    bias = Residual(alpha=0.6).bias(counts)
    assert bias[0] == float("-inf")
    assert_close(bias[1:], torch.tensor([0.0, 0.6 * math.log(2), 0.6 * math.log(4)]))
    assert Residual(alpha=0.0).bias(counts)[1:].tolist() == [0.0, 0.0, 0.0]


@st.composite
def eviction_cases(draw):
    h = draw(st.integers(1, 2))
    m = draw(st.integers(1, 8))
    keys = torch.tensor(draw(st.lists(st.integers(-2, 2), min_size=h * m * 2, max_size=h * m * 2)),
                        dtype=torch.float64).view(1, h, m, 2)
    scores = torch.tensor(draw(st.lists(st.integers(0, 3), min_size=h * m, max_size=h * m)),
                          dtype=torch.float64).view(1, h, m)
    evicted = torch.tensor(draw(st.lists(st.booleans(), min_size=h * m, max_size=h * m))).view(1, h, m)
    num_slots = torch.tensor(draw(st.lists(st.integers(0, 4), min_size=h, max_size=h))).view(1, h)
    return keys, scores, evicted, num_slots


@FEW
@given(eviction_cases())
def test_merge_matches_a_plain_python_simulation_and_counts_add_up(case):
    keys, scores, evicted, num_slots = case
    m = keys.shape[2]
    values = torch.eye(m, dtype=torch.float64).expand(1, keys.shape[1], m, m)  # value i = e_i: membership
    merged = merge_evicted(merging_policy(), keys, values, scores, evicted, None, num_slots)
    assert merged.counts.shape[-1] == int(num_slots.max())
    for h in range(keys.shape[1]):
        n = int(num_slots[0, h])
        expected = simulate(keys[0, h].tolist(), scores[0, h].tolist(), evicted[0, h].tolist(), n)
        counts = merged.counts[0, h]
        assert int(counts.sum()) == (int(evicted[0, h].sum()) if n > 0 else 0)  # counts = merged tokens
        assert counts.tolist() == [len(members) for _, members in expected] + [0] * (len(counts) - len(expected))
        for r, (key, members) in enumerate(expected):
            assert_close(merged.keys[0, h, r], torch.tensor(key, dtype=torch.float64))
            assert_close(merged.keys[0, h, r], keys[0, h, members].mean(0))  # a slot is the mean of its tokens
            membership = torch.zeros(m, dtype=torch.float64)
            membership[members] = 1 / len(members)
            assert_close(merged.values[0, h, r], membership)


@FEW
@given(eviction_cases(), st.integers(0, 3))
def test_shrinking_slots_keeps_every_slot_the_mean_of_its_tokens(case, smaller):
    """The cascade lowers a head's slot count: surplus slots fold into the others by count."""
    keys, scores, evicted, num_slots = case
    m = keys.shape[2]
    values = torch.eye(m, dtype=torch.float64).expand(1, keys.shape[1], m, m)
    merged = merge_evicted(merging_policy(), keys, values, scores, evicted, None, num_slots)
    fewer = torch.minimum(num_slots, torch.full_like(num_slots, smaller))
    shrunk = merge_evicted(merging_policy(), keys, values, scores, torch.zeros_like(evicted), merged, fewer)
    for h in range(keys.shape[1]):
        if int(fewer[0, h]) > 0:
            assert int(shrunk.counts[0, h].sum()) == int(merged.counts[0, h].sum())
        for r in range(int(fewer[0, h])):
            w = int(shrunk.counts[0, h, r])
            if w:
                members = (shrunk.values[0, h, r] > 0).nonzero().flatten()
                assert len(members) == w
                assert_close(shrunk.values[0, h, r, members], torch.full((w,), 1 / w, dtype=torch.float64))
                assert_close(shrunk.keys[0, h, r], keys[0, h, members].mean(0))


# --------------------------------------------------------------------------- Theorem 3.1


def attention_weights(q, keys, bias, lengths):
    """Softmax weights of `attend` (values = one-hot of the entry)."""
    s = keys.shape[2]
    eye = torch.eye(s, dtype=keys.dtype).expand(*keys.shape[:2], s, s)
    return attend(q, keys, eye, bias, lengths)


@FEW
@given(st.integers(0, 2**31 - 1), st.floats(0.0, 1.0), st.integers(1, 2), st.integers(1, 2), st.integers(2, 12),
       st.integers(1, 6), st.sampled_from([0.25, 0.5, 0.75]))
def test_theorem_3_1_unmerged_attention_never_decreases(seed, alpha, heads, groups, n, per_head, residual):
    """ZSMerge Theorem 3.1: for any query and any uncompressed token i ∉ B_r, the revised
    attention (Eq. 8, bias α·log w, α ≤ 1) â_i ≥ a_i, its attention in the full cache."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, heads, n, 4, generator=g, dtype=torch.float64) * 2
    values = torch.randn(1, heads, n, 4, generator=g, dtype=torch.float64)
    scores = torch.rand(1, heads, n, generator=g, dtype=torch.float64)
    q = torch.randn(1, heads * groups, 3, 4, generator=g, dtype=torch.float64) * 2
    policy = merging_policy(alpha=alpha, residual=residual, per_head=per_head)
    positions = torch.arange(n).expand(1, heads, n)
    valid = torch.ones(1, heads, n, dtype=torch.bool)
    total = torch.tensor([per_head * heads])
    kept = select(policy, scores, positions, valid, torch.tensor([n]), total, layer=0)
    num_slots = head_budgets(policy, valid, total).slots
    merged = merge_evicted(policy, keys, values, scores, valid & ~kept, None, num_slots)
    k_c, _, bias, lengths = compressed_cache(policy, LayerState(q, keys, values), kept, merged)
    compressed = attention_weights(q, k_c, bias, lengths)  # (1, Hq, 3, S)
    full = attention_weights(q, keys, None, None)  # (1, Hq, 3, n)
    for hq in range(heads * groups):
        h = hq // groups
        kept_idx = kept[0, h].nonzero().flatten()
        a_hat = compressed[0, hq, :, :len(kept_idx)]  # kept tokens come first, in position order
        a = full[0, hq][:, kept_idx]
        # attend computes in float32: a slot of one token equals it exactly, and the sums
        # then differ only in rounding; violations (α > 1) are of order 1, not 1e-5
        assert bool((a_hat >= a * (1 - 1e-5)).all()), (a_hat, a)


def test_theorem_3_1_needs_alpha_at_most_one():
    """One kept token and two equal evicted keys in one slot (w = 2), all logits 0:
    full attention 1/3; compressed 1/(1 + 2^α): = 1/3 at α = 1, 1/5 < 1/3 at α = 2."""
    keys = torch.zeros(1, 1, 3, 2)
    values = torch.zeros(1, 1, 3, 2)
    q = torch.zeros(1, 1, 1, 2)
    kept = torch.tensor([[[False, False, True]]])
    for alpha, expected in ((1.0, 1 / 3), (0.0, 1 / 2), (2.0, 1 / 5)):
        policy = merging_policy(alpha=alpha)
        merged = merge_evicted(policy, keys, values, torch.zeros(1, 1, 3), ~kept, None, torch.tensor([[1]]))
        k_c, _, bias, lengths = compressed_cache(policy, LayerState(q, keys, values), kept, merged)
        assert merged.counts.tolist() == [[[2]]]
        assert attention_weights(q, k_c, bias, lengths)[0, 0, 0, 0].item() == pytest.approx(expected)
