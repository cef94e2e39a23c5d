"""Attention-reading scorers on models whose attention is not plain softmax(q·kᵀ·scale): Gemma 2's soft-capped
logits (cap·tanh(s/cap) before the softmax) and gpt-oss's learned sinks (one logit per query head in the softmax's
denominator). A scorer's attention weights must be the model's own: property tests of each scoring part against a
written-out reference, the scores a compiled model keeps against those computed from transformers' own attention
weights (output_attentions of the plain eager model, prompt and decode steps), and every shipped spec that reads
attention at a full budget against the plain model."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import kvcompile
from kvcompile import cache as cache_arg, reference
from kvcompile.cache import KVCompileCache
from kvcompile.layer_state import LayerState
from kvcompile.policies.scoring import (Accumulated, Decayed, ExpectedAttention, LastToken, Pooling, WindowAttention,
                                        decayed_scores_chunked)
from test_hybrid import NEW, check_full_budget, padded_batch, tiny_gemma2, tiny_gpt_oss
from test_runtime import full_budget
from tiny import prompt


def reference_attention(q, k, valid, scale, softcap=None, sinks=None):
    """A[b, hq, j, i] of the prompt's last R queries (B, Hq, R, d) over its N keys (B, H, N, d), written out:
    exp(logit) / (Σ over the keys the query sees of exp(logit) + exp(sink)), logit = cap·tanh(q·k·scale / cap)
    (s itself without a cap); a pad query's row 0."""
    b, hq, r, _ = q.shape
    n = k.shape[2]
    group = hq // k.shape[1]
    logits = (q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2)) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    rows = torch.arange(n - r, n)[:, None]
    sees = (torch.arange(n)[None, :] <= rows)[None, None] & valid[:, None, None, :]
    shift = logits.amax(-1, keepdim=True)  # (a constant per row, for exp's range)
    weights = torch.exp(logits - shift) * sees
    denominator = weights.sum(-1, keepdim=True)
    if sinks is not None:
        denominator = denominator + torch.exp(sinks.double().view(1, -1, 1, 1) - shift)
    return torch.where(valid[:, None, n - r:, None], weights / denominator, 0.0)


def group_mean(a, h):
    return a.reshape(a.shape[0], h, -1, *a.shape[2:]).mean(2)


def _state(seed, n, pads, softcap, sinks, rows=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, n if rows is None else rows, 8, generator=g) * 2
    k, v = torch.randn(2, 2, n, 8, generator=g) * 2, torch.randn(2, 2, n, 8, generator=g)
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, :min(pads, n - 1)] = False
    learned = torch.randn(4, generator=g) * 2 if sinks else None
    return LayerState(q, k, v, valid if pads else None, 0.4, None, softcap, learned), valid


FEATURES = st.sampled_from([(3.0, False), (50.0, False), (None, True), (3.0, True)])  # (cap, sinks)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 24), pads=st.integers(0, 5), features=FEATURES, window=st.integers(1, 10),
       decay=st.sampled_from([1.0, 0.9]), chunk=st.integers(1, 9), seed=st.integers(0, 2 ** 16))
def test_scoring_parts_read_the_models_attention(n, pads, features, window, decay, chunk, seed):
    """window_attention (SnapKV), last_token (TOVA), accumulated (H2O) and decayed (ZSMerge), their runtime paths
    too (the decayed sum computed `chunk` rows at a time), equal the written-out scores of the model's attention
    (soft-capped, sinks in the denominator), for any lengths and left pads."""
    cap, sinks = features
    state, valid = _state(seed, n, pads, cap, sinks)
    a = reference_attention(state.queries, state.keys, valid, 0.4, cap, state.sinks)  # (B, Hq, N, N)
    real = valid[:, None, :].expand(2, 2, n)

    def check(got, want):
        assert_close(got[real], want.float()[real], rtol=1e-5, atol=1e-6)

    rows = min(window, n)
    snap = a[:, :, n - rows:].sum(2) / valid[:, n - rows:].sum(-1).clamp(min=1).view(2, 1, 1)
    check(WindowAttention(window=window, pooling=Pooling(kind="none")).score(state), group_mean(snap, 2))
    check(LastToken().score(state), group_mean(a[:, :, -1], 2))
    age = decay ** torch.arange(n - 1, -1, -1, dtype=torch.float64)
    summed = group_mean(torch.einsum("bhji,j->bhi", a, age), 2)
    part = Accumulated() if decay == 1.0 else Decayed(decay=decay)
    check(part.score(state), summed)
    check(decayed_scores_chunked(state, decay, "mean", chunk), summed)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 14), pads=st.integers(0, 5), future=st.integers(1, 30), first=st.integers(0, 4),
       seed=st.integers(0, 999))
def test_expected_attention_counts_the_learned_sinks(n, pads, future, first, seed):
    """Expected attention's softmax (Eq. 11) over the future queries' expected logits has the model's learned
    sinks in its denominator: the part equals the written-out reference (kvcompile.reference), and the sinks
    change the scores."""
    state, _ = _state(seed, n, pads, None, True)
    state.rope = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    part = ExpectedAttention(future=future, sinks=first, epsilon=0.01)
    assert_close(part.score(state), reference.expected_attention(part, state), rtol=1e-4, atol=1e-5)
    state.sinks = state.sinks + 30  # sinks that take most of the mass
    got = part.score(state)
    assert_close(got, reference.expected_attention(part, state), rtol=1e-4, atol=1e-5)
    state.sinks = None
    assert not torch.allclose(got, part.score(state))


def test_expected_attention_refuses_a_soft_capped_state():
    state, _ = _state(0, 6, 0, 5.0, False)
    state.rope = torch.ones(4)
    with pytest.raises(ValueError, match="no closed form for soft-capped logits"):
        ExpectedAttention().score(state)


def _model_scores(model, policy, ids, mask, steps: int = 0):
    """The scores the compiled model's cache keeps, per compressed layer: (B, H, width) by each real token's
    index in the (padded) sequence, after the prompt and `steps` greedy decode steps."""
    with torch.no_grad(), kvcompile.compiled(model, policy):
        cache = KVCompileCache.from_plan(model.kvcompile_plan)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps + 1, do_sample=False,
                             **cache_arg.given(cache)) if steps else model(ids, attention_mask=mask,
                                                                                   **cache_arg.given(cache))
    pad = (mask == 0).sum(-1)
    width = ids.shape[1] + steps
    scores = []
    for store in cache.stores:
        layer = torch.zeros(ids.shape[0], store.lengths.shape[1], width)
        for b, row in enumerate(store.to_heads()):
            for h, head in enumerate(row):
                layer[b, h, head.positions + pad[b]] = head.scores.float()
        scores.append(layer)
    return scores, out


@pytest.mark.parametrize("build", [tiny_gemma2, tiny_gpt_oss], ids=["gemma2 (soft-cap)", "gpt-oss (sinks)"])
def test_kept_scores_come_from_the_models_own_attention(build):
    """At a budget that keeps everything, the scores each compressed layer keeps equal those computed from the
    plain model's own attention weights (transformers' eager attention, output_attentions: soft-capped, sinks in
    the denominator): SnapKV's window (no pooling), TOVA's last row, and H2O's accumulated attention after the
    prompt and after decode steps (its running score adds each step's attention)."""
    model = build()
    ids, mask = padded_batch()
    n, real = ids.shape[1], mask.bool()
    full = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    with torch.no_grad():
        attentions = model(ids, attention_mask=mask, output_attentions=True).attentions
    a = [torch.where(real[:, None, :, None], attentions[i], 0.0) for i in full]  # a pad query's row: 0
    window = kvcompile.load_spec({"name": "window", "scoring": {"window_attention": {
        "window": 6, "pooling": {"kind": "none", "kernel": 1}}}, "ranking": {"by_score": {"sinks": 0, "window": 0}},
        "budget": {"per_head": n + 64}})
    specs = {  # label: (policy, the score from the model's attention weights (B, Hq, N, N))
        "window": (window, lambda x: group_mean(x[:, :, -6:].mean(2), 2)),
        "last row, every head": (full_budget("tova", n, 4), lambda x: x[:, :, -1].mean(1, keepdim=True).expand(
            -1, 2, -1)),
        "accumulated": (full_budget("h2o", n, 4), lambda x: group_mean(x.sum(2), 2)),
    }
    for label, (policy, score) in specs.items():
        got, _ = _model_scores(model, policy, ids, mask)
        for layer, weights in zip(got, a):
            assert_close(layer[:, :, :n].transpose(1, 2)[real], score(weights).transpose(1, 2)[real],
                         rtol=1e-4, atol=1e-6, msg=label)
    # H2O while decoding: every step's attention added, the model's own over the whole sequence
    got, out = _model_scores(model, full_budget("h2o", n + NEW, 4), ids, mask, steps=6)
    seq = out[:, :-1]
    seq_mask = torch.cat([mask, torch.ones(2, 6, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        attentions = model(seq, attention_mask=seq_mask, output_attentions=True).attentions
    seq_real = seq_mask.bool()
    for layer, i in zip(got, full):
        want = group_mean(torch.where(seq_real[:, None, :, None], attentions[i], 0.0).sum(2), 2)
        assert_close(layer.transpose(1, 2)[seq_real], want.transpose(1, 2)[seq_real], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("build", [tiny_gemma2, tiny_gpt_oss], ids=["gemma2 (soft-cap)", "gpt-oss (sinks)"])
def test_an_evicting_budget_keeps_the_best_by_the_models_attention(build):
    """SnapKV's window score (no pooling, nothing protected) at 10 entries per head: each head of each compressed
    layer keeps the 10 tokens whose scores from the model's own attention weights are highest."""
    model = build()
    ids, mask = padded_batch()
    real = mask.bool()
    full = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    with torch.no_grad():
        attentions = model(ids, attention_mask=mask, output_attentions=True).attentions
    policy = kvcompile.load_spec({"name": "window", "scoring": {"window_attention": {
        "window": 6, "pooling": {"kind": "none", "kernel": 1}}}, "ranking": {"by_score": {"sinks": 0, "window": 0}},
        "budget": {"per_head": 10}})
    with torch.no_grad(), kvcompile.compiled(model, policy):
        cache = KVCompileCache.from_plan(model.kvcompile_plan)
        model(ids, attention_mask=mask, **cache_arg.given(cache))
    pad = (mask == 0).sum(-1)
    for store, i in zip(cache.stores, full):
        want = group_mean(attentions[i][:, :, -6:].mean(2), 2).masked_fill(~real[:, None], float("-inf"))
        for b, row in enumerate(store.to_heads()):
            for h, head in enumerate(row):
                assert sorted((head.positions + pad[b]).tolist()) == sorted(want[b, h].topk(10).indices.tolist())


ATTENTION_SPECS = ["snapkv", "pyramidkv", "lava", "tova", "h2o", "dbudgetkv"]


@pytest.mark.parametrize("name", ATTENTION_SPECS + ["expected_attention"])
def test_gpt_oss_attention_scorers_at_a_full_budget_equal_the_plain_model(name):
    model = tiny_gpt_oss()

    def zero_sinks():
        for layer in model.model.layers:
            layer.self_attn.sinks.zero_()

    check_full_budget(model, name, zero_sinks)


@pytest.mark.parametrize("name", ATTENTION_SPECS)
def test_gemma2_attention_scorers_at_a_full_budget_equal_the_plain_model(name):
    model = tiny_gemma2()

    def uncap():
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None

    check_full_budget(model, name, uncap)


def test_prefill_once_compress_many_keeps_the_sinks():
    """kvcompile.tools.sweep on gpt-oss: the captured states and the replayed caches carry the model's learned sinks
    (a config alone has none), so a replayed SnapKV cache at a budget that evicts keeps and decodes what the
    compiled model's own prefill does."""
    from kvcompile.tools.sweep import capture, greedy, replay

    model = tiny_gpt_oss()
    ids = prompt(40, seed=12)
    policy = kvcompile.load_spec("snapkv", per_head=36)
    with torch.no_grad():
        states, logits = capture(model, ids)
        cache = replay(policy, model.config, states, headroom=NEW)
        kept = [store.to_heads() for store in cache.stores]
        tokens = greedy(model, cache, logits, NEW)
        with kvcompile.compiled(model, policy):
            own_cache = KVCompileCache.from_plan(model.kvcompile_plan)
            model(ids, **cache_arg.given(own_cache))
            own = model.generate(ids, max_new_tokens=NEW, do_sample=False)[:, ids.shape[1]:]
    assert states.sinks is not None and cache.plan.sinks == states.sinks
    for ours, theirs in zip(kept, [store.to_heads() for store in own_cache.stores]):
        assert [[h.positions.tolist() for h in row] for row in ours] == \
            [[h.positions.tolist() for h in row] for row in theirs]
    assert own.shape[1] >= 5 and tokens[:, :own.shape[1]].tolist() == own.tolist()


@pytest.mark.parametrize("build", [tiny_gemma2, tiny_gpt_oss], ids=["gemma2 (soft-cap)", "gpt-oss (sinks)"])
def test_kvzip_reads_the_models_attention(build):
    """KVzip's reconstruction forwards attend as the model does (soft-capped, sinks in the denominator) and its
    score's softmax over KVzip's keys applies the cap and counts the sinks: the kept entries and their scores are
    the reference's (reference.kvzip_scores, from the model's queries and keys over the prompt and the repeat
    input), at a budget that evicts; a full budget generates the plain model's tokens."""
    from test_kvzip import REPEAT, kept_scores

    model = build()
    ids = prompt(40, batch=2, seed=11)
    policy = kvcompile.load_spec("kvzip", per_head=12, scoring={"kvzip": {"chunk": 16, "sinks": 2, "overlap": 3}})
    with torch.no_grad():
        with kvcompile.compiled(model, policy, repeat_prompt=REPEAT):
            cache = model(ids, use_cache=True).past_key_values
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        with kvcompile.compiled(model, kvcompile.load_spec("kvzip", per_head=40 + NEW + 64), repeat_prompt=REPEAT):
            got = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    scores, states = reference.kvzip_scores(model, ids, REPEAT, policy.scoring)
    expected = reference.compress(policy, states, scores=scores)
    for layer in range(cache.plan.num_layers):
        kept = cache.kept_positions(layer)
        assert torch.equal(kept, expected.kept[layer]), f"layer {layer}"
        assert_close(kept_scores(cache, layer), torch.where(kept, scores[layer], 0.0))
    assert got.tolist() == ref.tolist()
