"""Selection (reference.select): protection, ranking, uniform / pooled heads, the DBudgetKV
threshold, the ZSMerge split, against brute-force sorts in plain Python."""
from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompile.policies.budgets import AttentionNorm, Budget, PooledHeads, Split, UniformHeads
from kvcompile.policies.ranking import ByPosition, ByScore, rank
from kvcompile.policy import Policy
from kvcompile.reference import select

FEW = settings(max_examples=50, deadline=None)


@st.composite
def prompts(draw, max_batch=2, max_heads=3, max_len=10, distinct=False):
    """A left-padded batch: scores (B, H, N) with ties (small integers) or distinct values,
    −inf at pads; positions 0 … n_b − 1 on the real tokens; lengths (B,)."""
    b = draw(st.integers(1, max_batch))
    h = draw(st.integers(1, max_heads))
    n = draw(st.integers(1, max_len))
    lengths = torch.tensor([draw(st.integers(1, n)) for _ in range(b)])
    if distinct:
        scores = torch.tensor(draw(st.permutations(range(b * h * n))), dtype=torch.float32).view(b, h, n)
        scores = scores / (b * h * n) + 0.01
    else:
        scores = torch.tensor(draw(st.lists(st.integers(0, 3), min_size=b * h * n, max_size=b * h * n)),
                              dtype=torch.float32).view(b, h, n)
    mask = torch.arange(n) >= (n - lengths)[:, None]  # (B, N), left padding
    positions = (mask.long().cumsum(-1) - 1)[:, None, :].expand(b, h, n)
    valid = mask[:, None, :].expand(b, h, n)
    scores = scores.masked_fill(~valid, float("-inf"))
    return scores, positions, valid, lengths


def policy_for(ranking=None, heads=None, split=None, threshold=None, per_head=1):
    budget = (Budget(threshold=threshold) if threshold is not None else
              Budget(per_head=per_head, heads=heads or UniformHeads(), split=split))
    return Policy(ranking=ranking or ByScore(), budget=budget)


def entries(scores, positions, valid, b, h):
    """[(score, position, index)] of the valid entries of one head."""
    return [(float(scores[b, h, m]), int(positions[b, h, m]), m)
            for m in range(scores.shape[-1]) if valid[b, h, m]]


def is_protected(pos, n, ranking):
    return pos < ranking.sinks or pos >= n - ranking.window


def uniform_share(total, num_heads, h, n):
    """Tokens of head h under uniform heads when every head holds n tokens (largest remainder,
    ties to the lower head, capped at n)."""
    if total >= num_heads * n:
        return n
    return total // num_heads + (1 if h < total % num_heads else 0)


def brute_uniform(scores, positions, valid, lengths, total, ranking):
    kept = torch.zeros_like(valid)
    b_, h_, _ = scores.shape
    for b in range(b_):
        n = int(lengths[b])
        for h in range(h_):
            ents = entries(scores, positions, valid, b, h)
            protected = [m for s, p, m in ents if is_protected(p, n, ranking)]
            if isinstance(ranking, ByScore):
                others = sorted((e for e in ents if e[2] not in protected), key=lambda e: (-e[0], -e[1]))
            else:  # by_position: sinks are protected, the rest most recent first
                others = sorted((e for e in ents if e[2] not in protected), key=lambda e: -e[1])
            take = uniform_share(int(total[b]), h_, h, n) - len(protected)
            for m in protected + [e[2] for e in others[:max(take, 0)]]:
                kept[b, h, m] = True
    return kept


# --------------------------------------------------------------------------- uniform heads


@FEW
@given(prompts(), st.integers(0, 20), st.integers(0, 3), st.integers(0, 3), st.booleans())
def test_uniform_heads_match_brute_force(prompt, per_seq, sinks, window, by_position):
    scores, positions, valid, lengths = prompt
    ranking = ByPosition(sinks=sinks, window=window) if by_position else ByScore(sinks=sinks, window=window)
    total = torch.full((len(lengths),), per_seq)
    kept = select(policy_for(ranking), scores, positions, valid, lengths, total, layer=0)
    assert torch.equal(kept, brute_uniform(scores, positions, valid, lengths, total, ranking))


@FEW
@given(prompts(), st.integers(0, 40), st.integers(0, 3), st.integers(0, 3),
       st.sampled_from([UniformHeads(), PooledHeads(), PooledHeads(floor=0.5)]))
def test_protected_always_kept_pads_never_and_totals_add_up(prompt, per_seq, sinks, window, heads):
    scores, positions, valid, lengths = prompt
    ranking = ByScore(sinks=sinks, window=window)
    total = torch.full((len(lengths),), per_seq)
    kept = select(policy_for(ranking, heads), scores, positions, valid, lengths, total, layer=0)
    assert not bool((kept & ~valid).any())
    protected = ranking.protected(positions, lengths.view(-1, 1, 1)) & valid
    assert bool(kept[protected].all())
    for b in range(len(lengths)):
        expected = min(per_seq, int(valid[b].sum()))
        assert int(kept[b].sum()) == max(expected, int(protected[b].sum()))
        if int(protected[b].sum()) <= expected and isinstance(heads, UniformHeads):
            h_ = valid.shape[1]
            for h in range(h_):
                tokens = uniform_share(per_seq, h_, h, int(lengths[b]))
                assert int(kept[b, h].sum()) == max(tokens, int(protected[b, h].sum()))


@FEW
@given(prompts(), st.integers(0, 3))
def test_budget_covering_the_prompt_keeps_everything(prompt, extra):
    scores, positions, valid, lengths = prompt
    total = valid.shape[1] * lengths + extra
    for heads in (UniformHeads(), PooledHeads(floor=0.3)):
        kept = select(policy_for(ByScore(), heads), scores, positions, valid, lengths, total, layer=0)
        assert torch.equal(kept, valid)


def test_ties_keep_the_later_position_then_the_lower_head():
    scores = torch.ones(1, 2, 6)
    positions = torch.arange(6).expand(1, 2, 6)
    valid = torch.ones(1, 2, 6, dtype=torch.bool)
    lengths = torch.tensor([6])
    kept = select(policy_for(), scores, positions, valid, lengths, torch.tensor([4]), layer=0)
    assert kept[0].nonzero().tolist() == [[0, 4], [0, 5], [1, 4], [1, 5]]
    # pooled, 3 entries over 2 heads with equal scores: positions 5, 5 (head 0 first), 4 of head 0
    kept = select(policy_for(heads=PooledHeads()), scores, positions, valid, lengths, torch.tensor([3]), layer=0)
    assert kept[0].nonzero().tolist() == [[0, 4], [0, 5], [1, 5]]
    again = select(policy_for(heads=PooledHeads()), scores, positions, valid, lengths, torch.tensor([3]), layer=0)
    assert torch.equal(kept, again)


def test_by_position_keeps_sinks_then_the_most_recent():
    """DBudgetKV §3.2 order x_1 … x_m, x_n, x_{n−1}, …: with m = 2 and 5 tokens kept of 10."""
    scores = torch.rand(1, 1, 10)  # ignored by the ranking
    positions = torch.arange(10).view(1, 1, 10)
    valid = torch.ones(1, 1, 10, dtype=torch.bool)
    kept = select(policy_for(ByPosition(sinks=2)), scores, positions, valid, torch.tensor([10]),
                  torch.tensor([5]), layer=0)
    assert kept[0, 0].nonzero().flatten().tolist() == [0, 1, 7, 8, 9]
    ranks = rank(ByPosition(sinks=2), scores, positions, valid)
    assert ranks[0, 0].argsort().tolist() == [0, 1, 9, 8, 7, 6, 5, 4, 3, 2]


@FEW
@given(prompts(max_batch=1))
def test_left_padding_gives_the_kept_set_of_the_sequence_alone(prompt):
    scores, positions, valid, lengths = prompt
    n = scores.shape[-1]
    pad = n - int(lengths[0])
    # the same sequence with 3 more pads in front, pad scores garbage under the mask
    padded_scores = torch.cat([torch.full((1, scores.shape[1], 3), 7.0), scores], dim=-1)
    padded_valid = torch.cat([torch.zeros(1, scores.shape[1], 3, dtype=torch.bool), valid], dim=-1)
    padded_positions = torch.cat([torch.full((1, scores.shape[1], 3), -1), positions], dim=-1)
    for heads in (UniformHeads(), PooledHeads(floor=0.5)):
        policy = policy_for(ByScore(sinks=1, window=1), heads)
        total = torch.tensor([2 * scores.shape[1]])
        alone = select(policy, scores[..., pad:], positions[..., pad:], valid[..., pad:], lengths, total, 0)
        batched = select(policy, padded_scores, padded_positions, padded_valid, lengths, total, 0)
        assert torch.equal(batched[..., 3 + pad:], alone)
        assert not bool(batched[..., :3 + pad].any())


# --------------------------------------------------------------------------- pooled heads


@FEW
@given(prompts(), st.integers(0, 40), st.integers(0, 2), st.integers(0, 2))
def test_pooled_is_one_top_k_over_the_layer(prompt, per_seq, sinks, window):
    """LAVa Alg. 1 / AdaKV: protected entries, then the best of all heads × entries together."""
    scores, positions, valid, lengths = prompt
    ranking = ByScore(sinks=sinks, window=window)
    total = torch.full((len(lengths),), per_seq)
    kept = select(policy_for(ranking, PooledHeads()), scores, positions, valid, lengths, total, layer=0)
    expected = torch.zeros_like(valid)
    for b in range(len(lengths)):
        n = int(lengths[b])
        pool = []
        for h in range(valid.shape[1]):
            for s, p, m in entries(scores, positions, valid, b, h):
                if is_protected(p, n, ranking):
                    expected[b, h, m] = True
                else:
                    pool.append((-s, -p, h, m))
        for _, _, h, m in sorted(pool)[:max(0, per_seq - int(expected[b].sum()))]:
            expected[b, h, m] = True
    assert torch.equal(kept, expected)


@FEW
@given(prompts(), st.integers(0, 40), st.sampled_from([0.2, 0.5, 1.0]))
def test_pooled_floor_is_respected(prompt, per_seq, floor):
    scores, positions, valid, lengths = prompt
    total = torch.full((len(lengths),), per_seq)
    kept = select(policy_for(heads=PooledHeads(floor=floor)), scores, positions, valid, lengths, total, layer=0)
    h_ = valid.shape[1]
    for b in range(len(lengths)):
        guaranteed = min(math.floor(floor * per_seq / h_ + 1e-9), int(lengths[b]))
        assert bool((kept[b].sum(-1) >= guaranteed).all())
        for h in range(h_):  # the guaranteed ones are the head's best
            ents = sorted(entries(scores, positions, valid, b, h), key=lambda e: (-e[0], -e[1]))
            assert all(kept[b, h, m] for _, _, m in ents[:guaranteed])
        assert int(kept[b].sum()) == min(per_seq, int(valid[b].sum()))


# --------------------------------------------------------------------------- nesting


@FEW
@given(prompts(), st.integers(0, 40), st.integers(0, 40), st.integers(0, 2), st.integers(0, 2),
       st.sampled_from([UniformHeads(), PooledHeads(), PooledHeads(floor=0.5)]))
def test_reselecting_with_a_smaller_total_equals_selecting_from_scratch(prompt, t1, t2, sinks, window, heads):
    scores, positions, valid, lengths = prompt
    big, small = torch.full((len(lengths),), max(t1, t2)), torch.full((len(lengths),), min(t1, t2))
    policy = policy_for(ByScore(sinks=sinks, window=window), heads)
    first = select(policy, scores, positions, valid, lengths, big, layer=0)
    again = select(policy, scores, positions, first, lengths, small, layer=0)
    assert torch.equal(again, select(policy, scores, positions, valid, lengths, small, layer=0))


# --------------------------------------------------------------------------- split


@FEW
@given(prompts(), st.integers(1, 12))
def test_split_proximity_keeps_the_latest_tokens(prompt, per_head):
    """ZSMerge Eq. 3, without merging: the latest round(p·B_h) tokens, then the top by score."""
    scores, positions, valid, lengths = prompt
    h_ = valid.shape[1]
    split = Split(proximity=0.5, context=0.5)
    total = torch.full((len(lengths),), per_head * h_)
    kept = select(policy_for(split=split), scores, positions, valid, lengths, total, layer=0)
    for b in range(len(lengths)):
        n = int(lengths[b])
        for h in range(h_):
            b_h = min(uniform_share(int(total[b]), h_, h, n), n)
            proximity = math.floor(0.5 * b_h + 0.5)
            recent = [m for _, p, m in entries(scores, positions, valid, b, h) if p >= n - proximity]
            assert all(kept[b, h, m] for m in recent)
            assert int(kept[b, h].sum()) == b_h
            rest = sorted((e for e in entries(scores, positions, valid, b, h) if e[2] not in recent),
                          key=lambda e: (-e[0], -e[1]))
            assert all(kept[b, h, m] for _, _, m in rest[:b_h - len(recent)])


# --------------------------------------------------------------------------- threshold


def norm_change(scores, keep):
    """1 − ‖s_kept‖₂ / ‖s_all‖₂ over the valid entries of one head (float64)."""
    s = scores.double()
    full = s.norm()
    return 0.0 if full == 0 else float(1 - s[keep].norm() / full)


@FEW
@given(prompts(distinct=True), st.sampled_from([0.0, 0.01, 0.05, 0.2, 0.5]), st.integers(0, 2), st.booleans(),
       st.booleans())
def test_dbudgetkv_cut_satisfies_the_norm_condition_and_one_more_breaks_it(prompt, t, sinks, by_position, ties):
    scores, positions, valid, lengths = prompt
    if ties:
        scores = scores.mul(4).floor().masked_fill(~valid, float("-inf"))
    ranking = ByPosition(sinks=sinks) if by_position else ByScore(sinks=sinks)
    policy = policy_for(ranking, threshold=AttentionNorm(t=t, keep_layers=2))
    kept = select(policy, scores, positions, valid, lengths, None, layer=2)
    assert not bool((kept & ~valid).any())
    for b in range(len(lengths)):
        n = int(lengths[b])
        for h in range(valid.shape[1]):
            ents = entries(scores, positions, valid, b, h)
            s = torch.tensor([e[0] for e in ents])
            keep = torch.tensor([bool(kept[b, h, m]) for _, _, m in ents])
            # least important first, among the unprotected
            key = (lambda e: (e[0], e[1])) if not by_position else (lambda e: e[1])
            order = [i for i in sorted(range(len(ents)), key=lambda i: key(ents[i]))
                     if not is_protected(ents[i][1], n, ranking)]
            evicted = [i for i in order if not keep[i]]
            assert evicted == order[:len(evicted)]  # a prefix of the order
            assert norm_change(s, keep) <= t + 1e-9
            if len(evicted) < len(order):
                one_more = keep.clone()
                one_more[order[len(evicted)]] = False
                assert norm_change(s, one_more) > t - 1e-9


def test_dbudgetkv_hand_case():
    """Scores 0.1, 0.2, 0.3, 0.4, 0.8 (‖s‖ = 1, by_score, no sinks). Evicting 0.1 leaves
    ‖s‖ = √0.99 (change 0.005); evicting 0.2 too: √0.95 (change 0.0253)."""
    scores = torch.tensor([[[0.3, 0.1, 0.8, 0.2, 0.4]]])
    positions = torch.arange(5).view(1, 1, 5)
    valid = torch.ones(1, 1, 5, dtype=torch.bool)
    for t, expected in ((0.01, [0, 2, 3, 4]), (0.03, [0, 2, 4]), (0.001, [0, 1, 2, 3, 4])):
        policy = policy_for(ByScore(), threshold=AttentionNorm(t=t, keep_layers=0))
        kept = select(policy, scores, positions, valid, torch.tensor([5]), None, layer=0)
        assert kept[0, 0].nonzero().flatten().tolist() == expected


@FEW
@given(prompts(), st.integers(0, 3))
def test_dbudgetkv_keeps_the_first_layers_whole(prompt, layer):
    scores, positions, valid, lengths = prompt
    policy = policy_for(ByPosition(sinks=1), threshold=AttentionNorm(t=0.9, keep_layers=2))
    kept = select(policy, scores.clamp(min=0), positions, valid, lengths, None, layer=layer)
    if layer < 2:
        assert torch.equal(kept, valid)
    else:  # protected sinks stay; with t = 0.9 much is evicted
        assert bool(kept[valid & (positions < 1)].all())
