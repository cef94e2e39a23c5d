"""Budget allocation: apportioning, layer budgets (uniform, PyramidKV Eq. 1, LAVa Eq. 7–8 /
Alg. 2), head layouts (ZSMerge Eq. 3), totals. Hand-computed cases and properties."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompile.policies.budgets import (
    AttentionNorm, Budget, EntropyLayers, PyramidLayers, Split, UniformLayers, apportion, round_half_up,
)
from kvcompile.policies.merge import Residual
from kvcompile.policy import Policy
from kvcompile.reference import head_budgets, layer_totals

FEW = settings(max_examples=60, deadline=None)


def water_level_shares(total: int, weights: list[float], caps: list[int]) -> list[float]:
    """Real-valued water-filling by bisection on the level λ: x_i = min(cap_i, λ·w_i), Σ x = total.
    What the weighted entries cannot take (all at their caps) is water-filled equally over
    the zero-weight ones."""
    target = min(total, sum(caps))
    weighted = sum(c for w, c in zip(weights, caps) if w > 0)
    if target > weighted:
        rest = water_level_shares(target - weighted, [float(w == 0) for w in weights],
                                  [0 if w > 0 else c for w, c in zip(weights, caps)])
        return [c if w > 0 else x for w, c, x in zip(weights, caps, rest)]
    lo, hi = 0.0, 1.0
    while sum(min(c, hi * w) for w, c in zip(weights, caps)) < target and hi < 1e30:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(min(c, mid * w) for w, c in zip(weights, caps)) < target else (lo, mid)
    return [min(c, hi * w) for w, c in zip(weights, caps)]


# --------------------------------------------------------------------------- apportion


def test_apportion_largest_remainder_ties_to_lower_index():
    assert apportion(10, [1, 1, 1], [100] * 3) == [4, 3, 3]
    assert apportion(11, [1, 1, 1], [100] * 3) == [4, 4, 3]
    # shares 2.5, 5, 2.5: the half unit goes to the lower of the tied layers
    assert apportion(10, [1, 2, 1], [100] * 3) == [3, 5, 2]


def test_apportion_water_filling_hand_case():
    # 10/3 > 1 for the first: it takes its cap 1, the other two share 9 → 4.5 each → [5, 4]
    assert apportion(10, [1, 1, 1], [1, 100, 100]) == [1, 5, 4]
    # shares 60/9, 20/9, 10/9 with the first capped at 2: 8 left over weights 2:1 → 16/3, 8/3
    assert apportion(10, [6, 2, 1], [2, 100, 100]) == [2, 5, 3]
    # more than exists: everybody gets the cap
    assert apportion(50, [1, 2, 3], [3, 4, 5]) == [3, 4, 5]


def test_apportion_zero_weights_share_equally():
    assert apportion(9, [0, 0, 0], [100] * 3) == [3, 3, 3]
    # the weighted layer is capped: its excess goes equally to the zero-weight layers
    assert apportion(9, [1, 0, 0], [3, 100, 100]) == [3, 3, 3]


@FEW
@given(st.integers(0, 200), st.lists(st.tuples(st.integers(0, 9), st.integers(0, 40)), min_size=1, max_size=7))
def test_apportion_properties(total, weighted_caps):
    weights = [w for w, _ in weighted_caps]
    caps = [c for _, c in weighted_caps]
    counts = apportion(total, weights, caps)
    assert sum(counts) == min(total, sum(caps))
    assert all(0 <= n <= c for n, c in zip(counts, caps))
    for n, share in zip(counts, water_level_shares(total, [float(w) for w in weights], caps)):
        assert math.floor(share - 1e-9) <= n <= math.ceil(share + 1e-9)


# --------------------------------------------------------------------------- totals


def test_round_half_up():
    assert [round_half_up(x) for x in (0.5, 1.5, 2.5, 2.49, 0.29 * 100)] == [1, 2, 3, 2, 29]


def test_totals_per_head_and_ratio():
    assert Budget(per_head=16).total(100, num_heads=4, num_layers=3) == 16 * 4 * 3
    assert Budget(ratio=0.25).total(10, 4, 3) == 3 * 4 * 3  # round(2.5) = 3, halves up
    assert Budget(ratio=0.01).total(10, 4, 3) == 1 * 4 * 3  # at least one token per head
    assert Budget(threshold=AttentionNorm()).total(10, 4, 3) is None


# --------------------------------------------------------------------------- layers


def test_pyramid_eq1_hand_case():
    # B = 80, L = 4, β = 2: B_3 = 80/(2·4) = 10, B_0 = 2·80/4 − 10 = 30, linear: 30, 23⅓, 16⅔, 10
    shares = PyramidLayers(beta=2).shares(4)
    assert [s * 80 for s in shares] == [30, Fraction(70, 3), Fraction(50, 3), 10]
    # largest remainder: floors 30, 23, 16, 10 (79); the unit goes to 16⅔
    assert apportion(80, shares, [10**6] * 4) == [30, 23, 17, 10]


@FEW
@given(st.integers(1, 12), st.integers(0, 5000), st.sampled_from([1.0, 2.0, 5.0, 20.0]))
def test_pyramid_follows_eq1_and_decreases(num_layers, total, beta):
    shares = PyramidLayers(beta=beta).shares(num_layers)
    assert sum(shares) == 1
    if num_layers > 1:
        top = Fraction(1) / (Fraction(beta) * num_layers)
        assert shares[-1] == top and shares[0] == Fraction(2, num_layers) - top
        steps = {shares[l] - shares[l + 1] for l in range(num_layers - 1)}
        assert len(steps) == 1  # an arithmetic sequence
    counts = apportion(total, shares, [10**9] * num_layers)
    assert sum(counts) == total
    assert all(a >= b for a, b in zip(counts, counts[1:]))


def test_pyramid_rejects_a_negative_bottom_layer():
    with pytest.raises(ValueError, match="negative"):
        PyramidLayers(beta=0.25).shares(4)


def test_entropy_budgets_hand_case():
    assert apportion(8, EntropyLayers().shares(3, [1.0, 2.0, 1.0]), [100] * 3) == [2, 4, 2]
    assert apportion(9, EntropyLayers().shares(3, [0.0, 0.0, 0.0]), [100] * 3) == [3, 3, 3]  # all zeros → uniform


@FEW
@given(st.lists(st.floats(0.01, 1.0), min_size=1, max_size=8), st.integers(0, 1000))
def test_entropy_budgets_are_proportional_to_e(entropy, total):
    counts = apportion(total, EntropyLayers().shares(len(entropy), entropy), [10**9] * len(entropy))
    assert sum(counts) == total
    for n, e in zip(counts, entropy):
        assert abs(n - e / sum(entropy) * total) < 1 + 1e-9


@FEW
@given(st.lists(st.integers(1, 20), min_size=1, max_size=3), st.integers(1, 4), st.integers(1, 5),
       st.integers(1, 30), st.sampled_from(["uniform", "pyramid", "entropy"]), st.randoms())
def test_layer_totals_add_up_and_never_exceed_what_exists(lengths, num_heads, num_layers, per_head, kind, rnd):
    layers = {"uniform": UniformLayers(), "pyramid": PyramidLayers(beta=2.0), "entropy": EntropyLayers()}[kind]
    policy = Policy(budget=Budget(per_head=per_head, layers=layers))
    entropy = None
    if kind == "entropy":
        entropy = torch.tensor([[rnd.random() for _ in range(num_layers)] for _ in lengths], dtype=torch.float64)
    totals = layer_totals(policy, torch.tensor(lengths), num_layers, num_heads, entropy=entropy)
    assert totals.shape == (len(lengths), num_layers)
    for row, n in zip(totals.tolist(), lengths):
        assert sum(row) == min(per_head * num_heads * num_layers, num_layers * num_heads * n)
        assert all(0 <= t <= num_heads * n for t in row)


def test_cascade_step_spreads_the_full_total_over_the_layers_seen():
    policy = Policy(budget=Budget(per_head=10, layers=EntropyLayers()))
    # 4 layers, 2 heads → B = 80 entries; after 2 layers it is spread over those 2 (LAVa Alg. 2 line 10)
    step = layer_totals(policy, torch.tensor([100]), 4, 2, entropy=torch.tensor([[1.0, 3.0]]))
    assert step.tolist() == [[20, 60]]


def test_cascade_capacity_prevents_regrowth():
    """Largest remainder is not monotone when a layer joins (the new-states paradox): here
    layer 1 would go from 2 to 3 entries after it already evicted down to 2. With the
    held entries as capacity it keeps 2, and the unit goes to the others (water-filling)."""
    policy = Policy(budget=Budget(per_head=1, layers=EntropyLayers()))
    # B = 1 per head · 5 heads · 2 layers = 10 entries, prompts long enough not to cap
    before = layer_totals(policy, torch.tensor([100]), 2, 5, entropy=torch.tensor([[5.45, 2.40, 2.15]]))
    assert before.tolist() == [[6, 2, 2]]
    e = torch.tensor([[5.45, 2.40, 2.15, 0.2]])
    assert layer_totals(policy, torch.tensor([100]), 2, 5, entropy=e).tolist() == [[5, 3, 2, 0]]
    capped = layer_totals(policy, torch.tensor([100]), 2, 5, entropy=e, capacity=torch.tensor([[6, 2, 2, 500]]))
    assert capped.tolist() == [[6, 2, 2, 0]]


def test_threshold_has_no_layer_totals():
    policy = Policy(budget=Budget(threshold=AttentionNorm()))
    with pytest.raises(ValueError, match="threshold"):
        layer_totals(policy, torch.tensor([10]), 2, 2)


# --------------------------------------------------------------------------- heads


def test_head_layout_split_hand_case():
    """ZSMerge Eq. 3 with B_{l,h} = 10: residual round(3.0) = 3 slots, proximity 3, context 4."""
    budget = Budget(per_head=10, split=Split(proximity=0.3, context=0.4, residual=0.3))
    (head,) = budget.head_layout(10, [50], [0], merges=True)
    assert (head.entries, head.tokens, head.slots, head.proximity) == (10, 7, 3, 3)
    # the budget covers everything the head holds: it keeps it all, no slot needed
    (head,) = budget.head_layout(10, [8], [0], merges=True)
    assert (head.tokens, head.slots) == (8, 0)
    # cascade: 6 tokens + 3 used slots held, budget 8: slots round(2.4) = 2, tokens 6
    (head,) = budget.head_layout(8, [6], [3], merges=True)
    assert (head.entries, head.tokens, head.slots) == (8, 6, 2)
    # 7 tokens + 3 slots held, budget 9: round(2.7) = 3 slots, 6 tokens
    (head,) = budget.head_layout(9, [7], [3], merges=True)
    assert (head.tokens, head.slots) == (6, 3)


def test_uniform_heads_hand_case():
    budget = Budget(per_head=4)
    layout = budget.head_layout(10, [5, 5, 5], [0, 0, 0], merges=False)
    assert [h.tokens for h in layout] == [4, 3, 3]  # ties to the lower head
    layout = budget.head_layout(10, [2, 9, 9], [0, 0, 0], merges=False)
    assert [h.tokens for h in layout] == [2, 4, 4]  # head 0 holds 2: the rest water-fills


@FEW
@given(st.integers(0, 60), st.lists(st.integers(0, 12), min_size=1, max_size=5),
       st.sampled_from([None, (0.25, 0.5, 0.25), (0.0, 0.5, 0.5), (0.5, 0.5, 0.0)]))
def test_head_budgets_add_up(total, counts, split):
    split = None if split is None else Split(*split)
    merge = Residual() if split is not None and split.residual > 0 else None
    policy = Policy(budget=Budget(per_head=1, split=split), **({"merge": merge} if merge else {}))
    m = max(counts)
    valid = (torch.arange(m) < torch.tensor(counts)[:, None])[None]
    heads = head_budgets(policy, valid, torch.tensor([total]))
    assert int(heads.entries.sum()) == min(total, sum(counts))
    assert torch.equal(heads.tokens + heads.slots, heads.entries)
    assert bool((heads.tokens <= torch.tensor(counts)).all())
    assert bool((heads.proximity <= heads.tokens).all())
