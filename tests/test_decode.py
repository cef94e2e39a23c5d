"""Decode-time compression: the runtime equals reference.decode_step / decode_prune token by
token, memory stays bounded, and the schedules run inside generate()."""
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
from tiny import prompt, tiny_model

POLICIES = {
    "zsmerge": dict(name="zsmerge"),
    "zsmerge_no_slots": dict(name="zsmerge", budget={"split": {"proximity": 0.25, "context": 0.75, "residual": 0.0}},
                             merge="drop"),
    "snapkv_every": dict(name="snapkv", ranking={"by_score": {"window": 4}},
                         scoring={"window_attention": {"window": 4}}, schedule={"decode": {"every": {"n": 3}}}),
    "adakv_every": dict(name="adakv", ranking={"by_score": {"window": 4}},
                        scoring={"window_attention": {"window": 4}}, schedule={"decode": {"every": {"n": 2}}}),
    "h2o_every": dict(name="h2o", ranking={"by_score": {"window": 3}}, schedule={"decode": {"every": {"n": 4}}}),
    "lava_every": dict(name="lava", ranking={"by_score": {"window": 4}}, scoring={"lava": {"window": 4}},
                       schedule={"cascade": True, "decode": {"every": {"n": 3}}}),
    "dbudgetkv_every": dict(name="dbudgetkv", budget={"threshold": {"attention_norm": {"keep_layers": 0}}},
                            ranking={"by_position": {"window": 1}}, schedule={"decode": {"every": {"n": 2}}}),
}


def policy_for(key: str, per_head: int):
    spec = dict(POLICIES[key])
    name = spec.pop("name")
    if kvcompile.load_spec(name).budget.threshold is None:
        spec["per_head"] = per_head
    return kvcompile.load_spec(name, **spec)


def contents(heads):
    """Per head: tokens sorted by position (position, key, score) and slots by index (key, count)."""
    out = []
    for row in heads:
        for x in row:
            tok = (x.positions >= 0).nonzero().squeeze(1)
            tok = tok[x.positions[tok].argsort()]
            sl = (x.positions < 0).nonzero().squeeze(1)
            sl = sl[(-1 - x.positions[sl]).argsort()]
            out.append((x.positions[tok], x.keys[tok], x.scores[tok], x.positions[sl], x.keys[sl], x.values[sl],
                        x.counts[sl]))
    return out


def assert_same_cache(runtime_heads, reference_heads):
    for got, want in zip(contents(runtime_heads), contents(reference_heads)):
        assert torch.equal(got[0], want[0])  # the same tokens
        assert_close(got[1], want[1])
        assert_close(got[2], want[2], rtol=1e-4, atol=1e-6)  # running scores
        assert torch.equal(got[3], want[3])  # the same slots
        assert_close(got[4], want[4], rtol=1e-4, atol=1e-5)
        assert_close(got[5], want[5], rtol=1e-4, atol=1e-5)
        assert torch.equal(got[6], want[6])  # merge counts


@settings(max_examples=12, deadline=None)
@given(key=st.sampled_from(sorted(POLICIES)), b=st.integers(1, 2), h=st.integers(1, 2), g=st.integers(1, 2),
       n=st.integers(6, 24), steps=st.integers(1, 14), per_head=st.integers(8, 14), page=st.sampled_from([2, 4]),
       pad=st.integers(0, 3), seed=st.integers(0, 2 ** 16))
def test_runtime_equals_reference_token_by_token(key, b, h, g, n, steps, per_head, page, pad, seed):
    policy = policy_for(key, per_head)
    d = 8
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    q, k, v = rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :min(pad, n - 4)] = False
    cache, _, budgets = token_by_token(policy, q, k, v, mask if pad else None, steps, rand, page)
    assert torch.equal(cache.budgets, budgets)


def token_by_token(policy, q, k, v, mask, steps, rand, page, softcap=None, sinks=None):
    """One layer through the op: the prompt (q, k, v; mask or None), then `steps` tokens drawn by
    `rand`. After the prompt and after every token the pages hold what reference.compress,
    decode_step and decode_prune hold, and the attention outputs agree. Returns the cache,
    the reference's prompt selection and the decode budgets. softcap, sinks (Hq,): a model's logit soft-cap
    (Gemma 2) and learned sinks (gpt-oss), given to the plan (as the config's) and to the reference."""
    b, hq, n, d = q.shape
    h = k.shape[1]
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=h, num_attention_heads=hq, head_dim=d,
                             hidden_size=hq * d, attn_logit_softcapping=softcap,
                             sinks=None if sinks is None else (tuple(float(x) for x in sinks),))
    cache = KVCompileCache(policy, config, page_size=page, record=True)
    scale = d ** -0.5
    torch.ops.kvcompile.attend(q, k, v, mask, 0, cache.ref, cache.token, scale)
    state = cache.states[0]
    selection = reference.compress(policy, [state])
    heads = reference.decode_heads(policy, state, selection.kept[0], selection.merged[0], selection.scores[0])
    assert_same_cache(cache.stores[0].to_heads(), heads)
    lengths = torch.full((b,), n) if mask is None else mask.sum(-1)
    held = torch.tensor([[[len(x.positions) for x in row] for row in heads]]).transpose(0, 1)
    budgets = reference.decode_budgets(policy, lengths, 1, h, held)
    decode = policy.schedule.decode
    every = decode.n if decode is not None and decode.name == "every" else 0
    ring = q[:, :, n - min(policy.scoring.query_rows(n), n):]
    for step in range(steps):
        qn, kn, vn = rand(b, hq, 1, d), rand(b, h, 1, d), rand(b, h, 1, d)
        got = torch.ops.kvcompile.attend(qn, kn, vn, None, 0, cache.ref, cache.token, scale)
        position = lengths + step
        want = reference.decode_step(policy, heads, qn[:, :, 0], kn[:, :, 0], vn[:, :, 0], position, budgets[:, 0],
                                     scale, softcap, sinks)
        if every:
            rows = policy.scoring.query_rows(2 ** 30)
            if rows:
                ring = torch.cat([ring, qn], dim=2)[:, :, -rows:]
            if (step + 1) % every == 0:
                reference.decode_prune(policy, heads, ring, position + 1, budgets[:, 0], 0, scale, softcap=softcap,
                                       sinks=sinks)
        assert_close(got[:, :, 0], want, rtol=1e-4, atol=1e-5)
        assert_same_cache(cache.stores[0].to_heads(), heads)
    return cache, selection, budgets


@pytest.mark.parametrize("key", ["zsmerge", "zsmerge_no_slots"])
def test_online_counts_and_bounded_memory_over_500_tokens(key):
    """ZSMerge online: counts add up to the merged tokens, and a head never holds more than
    its budget plus one page."""
    policy = policy_for(key, 16)
    b, h, g, d, n, page = 2, 2, 2, 8, 40, 4
    gen = torch.Generator().manual_seed(0)
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=h, num_attention_heads=h * g, head_dim=d,
                             hidden_size=h * g * d)
    cache = KVCompileCache(policy, config, page_size=page)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    torch.ops.kvcompile.attend(rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d), None, 0, cache.ref,
                               cache.token, 1.0)
    for step in range(500):
        torch.ops.kvcompile.attend(rand(b, h * g, 1, d), rand(b, h, 1, d), rand(b, h, 1, d), None, 0, cache.ref,
                                   cache.token, 1.0)
        store = cache.stores[0]
        assert bool((store.lengths <= cache.budgets[:, 0]).all())
        pages = (store.lengths + page - 1) // page
        assert bool((pages <= (cache.budgets[:, 0] + page - 1) // page + 1).all())
        # Pages a head owns (its entries' and its spares): never more than its budget's and one spare.
        assert store.next_page == int(store.owned.sum())
        assert bool((store.owned <= (cache.budgets[:, 0] + page - 1) // page + 1).all())
        assert bool((store.owned <= pages + 1).all())  # at most one page beyond what it holds
    heads = cache.stores[0].to_heads()
    for row in heads:
        for x in row:
            tokens = int((x.positions >= 0).sum())
            merged = int(x.counts[x.positions < 0].sum())
            if key == "zsmerge":
                assert tokens + merged == n + 500  # every token is kept or merged into a slot
            else:
                assert merged == 0


def test_every_n_with_budget_above_length_changes_nothing():
    model = tiny_model("llama")
    ids = prompt(30, batch=2)
    policy = kvcompile.load_spec("snapkv", per_head=200, schedule={"decode": {"every": {"n": 5}}})
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=24, do_sample=False)
        with kvcompile.compiled(model, policy):
            got = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert got.tolist() == expected.tolist()


class MemoryCeiling:
    """A logits processor that records the cache's pages after every generated token."""

    def __init__(self, cache):
        self.cache, self.pages = cache, []

    def __call__(self, input_ids, scores):
        if self.cache.budgets is not None:
            self.pages.append(self.cache.memory_report()["pages"].clone())
        return scores


@pytest.mark.parametrize("spec", ["zsmerge", "snapkv_every"])
def test_generate_few_hundred_tokens_with_fixed_memory_ceiling(spec):
    model = tiny_model("llama")  # GQA: 4 query heads, 2 KV heads
    policy = policy_for(spec, 24) if spec != "zsmerge" else kvcompile.load_spec("zsmerge", per_head=24)
    ids = prompt(64, batch=2)
    cache = KVCompileCache(policy, model.config, headroom=300)  # what generate() announces
    watch = MemoryCeiling(cache)
    with kvcompile.compiled(model, policy), torch.no_grad():
        out = model.generate(ids, max_new_tokens=300, min_new_tokens=300, do_sample=False, past_key_values=cache,
                             logits_processor=[watch])
    assert out.shape[1] == 64 + 300
    ceiling = (cache.budgets + cache.page_size - 1) // cache.page_size + 1
    assert len(watch.pages) >= 299
    for pages in watch.pages:
        assert bool((pages <= ceiling).all())
    report = cache.memory_report()
    assert report["bytes_held"] < report["bytes_full"] / 4
    # Allocated, spares included: the schedule bounds a head's growth, not the 300-token headroom.
    assert report["bytes_allocated"] <= int((ceiling + 1).sum()) * cache.page_size * 2 * cache.head_dim * 4


@pytest.mark.parametrize("headroom", [50, 0])
def test_decode_appends_stay_in_order_within_the_headroom(headroom):
    """Each head's spare pages follow its prompt pages, so the tokens generated within the
    headroom keep every head's pages consecutive in the pool: the layout the decode kernel
    streams without jumps (benchmarks/bench_decode.py, "pages in head order"). A fresh cache
    given without headroom gets generate()'s max_new_tokens."""
    model = tiny_model("llama")
    policy = kvcompile.load_spec("snapkv", per_head=40)
    cache = KVCompileCache(policy, model.config, headroom=headroom)
    with kvcompile.compiled(model, policy), torch.no_grad():
        model.generate(prompt(64, batch=2), max_new_tokens=50, min_new_tokens=50, do_sample=False,
                       past_key_values=cache)
    for store in cache.stores:
        assert int(store.lengths.min()) >= 40 + 49  # the prompt's entries and the generated ones
        cols = torch.arange(store.block_table.shape[-1])
        live = cols < store.pages_per_head()[..., None]
        assert torch.equal(store.block_table[live], (store.block_table[..., :1] + cols)[live])
        assert store.next_page == store.k_pages.shape[0]  # the pool never grew


@settings(max_examples=15, deadline=None)
@given(alpha=st.floats(0.0, 1.0), steps=st.integers(1, 30), seed=st.integers(0, 2 ** 16))
def test_theorem_3_1_while_decoding(alpha, steps, seed):
    """ZSMerge Theorem 3.1: with α ≤ 1, the attention of every unmerged cached token is at least
    its attention over the full cache (every token ever seen), at every step of online decoding."""
    policy = kvcompile.load_spec("zsmerge", per_head=10, merge={"residual": {"alpha": alpha}})
    b, h, g, d, n = 1, 2, 2, 8, 12
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    state = reference.LayerState(rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d))
    selection = reference.compress(policy, [state])
    heads = reference.decode_heads(policy, state, selection.kept[0], selection.merged[0], selection.scores[0])
    held = torch.tensor([[[len(x.positions) for x in row] for row in heads]]).transpose(0, 1)
    budgets = reference.decode_budgets(policy, torch.tensor([n]), 1, h, held)
    all_keys = state.keys[0]  # (H, T, d): every token seen so far
    for step in range(steps):
        q, k, v = rand(b, h * g, d), rand(b, h, d), rand(b, h, d)
        all_keys = torch.cat([all_keys, k[0, :, None]], dim=1)
        reference.decode_step(policy, heads, q, k, v, torch.tensor([n + step]), budgets[:, 0])
        probe = rand(h * g, d)  # a later query
        for hh in range(h):
            x = heads[0][hh]
            bias = torch.where(x.positions >= 0, 0.0, policy.merge.bias(x.counts))
            compressed = torch.softmax(probe[hh * g:(hh + 1) * g] @ x.keys.T * d ** -0.5 + bias, dim=-1)
            full = torch.softmax(probe[hh * g:(hh + 1) * g] @ all_keys[hh].T * d ** -0.5, dim=-1)
            tok = x.positions >= 0
            assert bool((compressed[:, tok] >= full[:, x.positions[tok]] * (1 - 1e-5)).all())


def test_alpha_zero_bias_path_is_exactly_the_plain_attention():
    """α = 0: the merge-bias path adds exactly nothing (0·log w is 0, never NaN, for every entry),
    so decoding attends exactly as the drop path over the same entries."""
    policy = kvcompile.load_spec("zsmerge", per_head=12, merge={"residual": {"alpha": 0.0}})
    b, h, g, d, n = 2, 2, 2, 8, 30
    gen = torch.Generator().manual_seed(3)
    config = SimpleNamespace(num_hidden_layers=1, num_key_value_heads=h, num_attention_heads=h * g, head_dim=d,
                             hidden_size=h * g * d)
    cache = KVCompileCache(policy, config, page_size=4)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    torch.ops.kvcompile.attend(rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d), None, 0, cache.ref,
                               cache.token, 0.3)
    from kvcompile.kernels.paged_attention import paged_attention

    for _ in range(20):
        torch.ops.kvcompile.attend(rand(b, h * g, 1, d), rand(b, h, 1, d), rand(b, h, 1, d), None, 0, cache.ref,
                                   cache.token, 0.3)
    store = cache.stores[0]
    assert int(store.slots.sum()) > 0 and float(store.count_pages.max()) > 1  # slots hold merged tokens
    q = rand(b, h * g, d)
    bias = policy.merge.bias(store.count_pages)
    with_bias = paged_attention(q, store.k_pages, store.v_pages, store.block_table, store.lengths, bias, 0.3)
    plain = paged_attention(q, store.k_pages, store.v_pages, store.block_table, store.lengths, None, 0.3)
    assert torch.equal(with_bias, plain)
