"""ZSMerge's fast paths against the eager reference: the decayed score in query chunks
(scoring.decayed_scores_chunked, what the runtime calls), online eviction vectorised over
(sequence, head) (engine.online.evict_online / merge_victims) and the batched LayerStore.remove."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import kvcompile
import kvcompile.engine.op  # noqa: F401  (registers torch.ops.kvcompile.attend: the file runs alone)
from kvcompile import reference
from kvcompile.cache import KVCompileCache
from kvcompile.store import Entries, LayerStore
from kvcompile.plan import build_plan
from kvcompile.policies.scoring import Accumulated, Decayed, decayed_scores_chunked
from kvcompile.reference import LayerState
from test_decode import assert_same_cache


def padded_state(b, h, g, n, d, lengths, scale, seed, dtype=torch.float32) -> LayerState:
    """A left-padded batch with all N queries; pads hold large garbage that must not leak in."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(b, h * g, n, d, generator=gen), torch.randn(b, h, n, d, generator=gen), \
        torch.randn(b, h, n, d, generator=gen)
    mask = torch.arange(n)[None, :] >= n - torch.tensor(lengths)[:, None]
    for i, length in enumerate(lengths):
        q[i, :, :n - length] *= 100
        k[i, :, :n - length] *= 100
    return LayerState(q.to(dtype), k.to(dtype), v.to(dtype), None if bool(mask.all()) else mask, scale)


@st.composite
def states(draw, dtype=torch.float32):
    b, h, g = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    n, d = draw(st.integers(1, 40)), draw(st.integers(1, 8))
    lengths = [draw(st.integers(0, n)) for _ in range(b)]  # 0: a sequence of pads only
    scale = draw(st.one_of(st.none(), st.floats(0.1, 2.0)))
    return padded_state(b, h, g, n, d, lengths, scale, draw(st.integers(0, 2 ** 16)), dtype)


@settings(max_examples=40, deadline=None)
@given(states(), st.floats(0.0, 1.0, exclude_min=True), st.sampled_from(["mean", "max"]), st.integers(1, 9))
def test_chunked_decayed_equals_reference(state, decay, gqa, chunk):
    want = Decayed(decay=decay, gqa=gqa).score(state)
    got = decayed_scores_chunked(state, decay, gqa, chunk)
    assert_close(got, want)
    assert torch.equal(got.isneginf(), want.isneginf())  # −inf exactly at the pads


@settings(max_examples=10, deadline=None)
@given(states(dtype=torch.float16), st.sampled_from(["mean", "max"]), st.integers(1, 9))
def test_chunked_decayed_fp16_and_decay_one_is_accumulated(state, gqa, chunk):
    assert_close(Decayed(gqa=gqa).score_chunked(state, chunk), Decayed(gqa=gqa).score(state))
    assert_close(decayed_scores_chunked(state, 1.0, gqa, chunk), Accumulated(gqa=gqa).score(state))


def test_chunked_decayed_needs_every_query_row():
    state = padded_state(1, 1, 1, 6, 4, [6], None, 0)
    state.queries = state.queries[:, :, 1:]
    try:
        decayed_scores_chunked(state, 0.9, "mean")
    except ValueError as err:
        assert "query rows" in str(err)
    else:
        raise AssertionError("expected a ValueError")


def test_runtime_prompt_scores_use_the_chunked_path(monkeypatch):
    """The runtime's prefill scores come from score_chunked (never the N×N reference)."""
    policy = kvcompile.load_spec("zsmerge", per_head=8)
    state = padded_state(2, 2, 2, 30, 8, [30, 21], 0.4, 1)

    def forbidden(self, state):
        raise AssertionError("the runtime built the N×N attention")

    want = Decayed(decay=0.98).score(state)
    monkeypatch.setattr(Decayed, "score", forbidden)
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=2, head_dim=8)
    plan = build_plan(policy, config, device="cpu", dtype=torch.float32)
    assert_close(plan.score(state), want)


def one_layer_cache(policy, b, h, g, d, page):
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=h, num_attention_heads=h * g, head_dim=d,
                             hidden_size=h * g * d)
    return KVCompileCache(policy, config, page_size=page, record=True)


def zsmerge(per_head: int, residual: float):
    split = {"proximity": 0.2, "context": round(0.8 - residual, 2), "residual": residual}
    return kvcompile.load_spec("zsmerge", per_head=per_head, budget={"split": split},
                               **({} if residual else {"merge": "drop"}))


@settings(max_examples=8, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 4), g=st.integers(1, 2), extra=st.integers(-3, 1),
       per_head=st.integers(10, 20), slots=st.sampled_from([0.0, 0.09, 0.3]), page=st.sampled_from([2, 4, 16]),
       seed=st.integers(0, 2 ** 16))
def test_online_eviction_equals_reference_token_by_token(b, h, g, extra, per_head, slots, page, seed):
    """Many heads at once, padded sequences, prompts around the budget: a head may evict several
    tokens in one step, fill a free slot, fold into a slot or drop, while its neighbours do
    something else; the cache equals reference.decode_step. The prompt leaves at most one token
    to merge (see test_prefill_slots_are_labelled_by_index), decoding fills the other slots."""
    policy = zsmerge(per_head, slots)
    d, n = 8, per_head - reference.head_split(policy, per_head)[2] + extra
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    q, k, v = rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[-1, :min(3, n - 4)] = False
    scale = d ** -0.5
    cache = one_layer_cache(policy, b, h, g, d, page)
    torch.ops.kvcompile.attend(q, k, v, None if bool(mask.all()) else mask, 0, cache.ref, cache.token, scale)
    state = cache.states[0]
    selection = reference.compress(policy, [state])
    heads = reference.decode_heads(policy, state, selection.kept[0], selection.merged[0], selection.scores[0])
    lengths = mask.sum(-1)
    held = torch.tensor([[[len(x.positions) for x in row] for row in heads]]).transpose(0, 1)
    budgets = reference.decode_budgets(policy, lengths, 1, h, held)
    for step in range(12):
        qn, kn, vn = rand(b, h * g, 1, d), rand(b, h, 1, d), rand(b, h, 1, d)
        got = torch.ops.kvcompile.attend(qn, kn, vn, None, 0, cache.ref, cache.token, scale)
        want = reference.decode_step(policy, heads, qn[:, :, 0], kn[:, :, 0], vn[:, :, 0], lengths + step,
                                     budgets[:, 0], scale)
        assert_close(got[:, :, 0], want, rtol=1e-4, atol=1e-5)
        assert_same_cache(cache.stores[0].to_heads(), heads)
        assert torch.equal(cache.stores[0].slots, (cache.stores[0].gather()[3] < 0).logical_and(
            cache.stores[0].gather()[5]).sum(-1))  # the slot counter follows the slots held


def test_prefill_slots_are_labelled_by_index():
    """Slot r of a head is its entry at position −1 − r, also for the slots the prompt filled."""
    policy = zsmerge(20, 0.3)
    b, h, g, d, n = 1, 2, 1, 8, 40
    gen = torch.Generator().manual_seed(2)
    cache = one_layer_cache(policy, b, h, g, d, 4)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    torch.ops.kvcompile.attend(rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d), None, 0, cache.ref,
                               cache.token, 0.5)
    state = cache.states[0]
    selection = reference.compress(policy, [state])
    heads = reference.decode_heads(policy, state, selection.kept[0], selection.merged[0], selection.scores[0])
    assert_same_cache(cache.stores[0].to_heads(), heads)


def test_several_victims_in_one_step():
    """A prompt exactly at the budget: the first decode step evicts B_r + 1 tokens per head."""
    policy = kvcompile.load_spec("zsmerge", per_head=20, budget={"split": {"proximity": 0.2, "context": 0.5,
                                                                            "residual": 0.3}})
    b, h, g, d, n = 2, 3, 1, 8, 20
    gen = torch.Generator().manual_seed(5)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    cache = one_layer_cache(policy, b, h, g, d, 4)
    torch.ops.kvcompile.attend(rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d), None, 0, cache.ref,
                               cache.token, 0.5)
    state = cache.states[0]
    selection = reference.compress(policy, [state])
    heads = reference.decode_heads(policy, state, selection.kept[0], selection.merged[0], selection.scores[0])
    budgets = reference.decode_budgets(policy, torch.full((b,), n), 1, h, torch.full((b, 1, h), n))
    qn, kn, vn = rand(b, h * g, 1, d), rand(b, h, 1, d), rand(b, h, 1, d)
    torch.ops.kvcompile.attend(qn, kn, vn, None, 0, cache.ref, cache.token, 0.5)
    reference.decode_step(policy, heads, qn[:, :, 0], kn[:, :, 0], vn[:, :, 0], torch.full((b,), n), budgets[:, 0],
                          0.5)
    assert_same_cache(cache.stores[0].to_heads(), heads)
    tokens = [int((x.positions >= 0).sum()) for row in heads for x in row]
    assert tokens == [14] * (b * h)  # 21 tokens, 7 of them evicted in one step: 6 into free slots, 1 folded


@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 3), page=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2 ** 16))
def test_batched_remove_equals_one_at_a_time(b, h, page, seed):
    gen = torch.Generator().manual_seed(seed)
    m, d = 9, 3
    take = torch.rand(b, h, m, generator=gen) < 0.7
    take[..., 0] = True
    entries = Entries(torch.randn(b, h, m, d, generator=gen), torch.randn(b, h, m, d, generator=gen),
                      torch.rand(b, h, m, generator=gen), torch.arange(m).expand(b, h, m).clone(),
                      torch.ones(b, h, m), take)
    one, many = (LayerStore.build([entries], torch.zeros(b, h, dtype=torch.long), page, 0) for _ in range(2))
    heads = (torch.rand(b, h, generator=gen) < 0.6).nonzero(as_tuple=True)
    victims = (torch.rand(b, h, generator=gen) * one.lengths).long()[heads]
    for bi, hi, e in zip(*heads, victims):
        one.remove(int(bi), int(hi), int(e))
    many.remove(heads[0], heads[1], victims)
    for x, y in zip(one.gather(), many.gather()):
        assert torch.equal(torch.where(one.gather()[5].view(*x.shape[:3], *[1] * (x.dim() - 3)), x, 0),
                           torch.where(many.gather()[5].view(*y.shape[:3], *[1] * (y.dim() - 3)), y, 0))
    assert torch.equal(one.lengths, many.lengths)
    assert torch.equal(one.owned, many.owned) and torch.equal(one.block_table, many.block_table)
