"""Compressing while prefilling in chunks (schedule: {prefill: {chunk: c}}, docs/SPECS.md
`prefill: chunk`): the runtime equals reference.ChunkedPrefill for every part family, chunk by
chunk and then token by token; a chunk covering the prompt is one-pass compression exactly (every
shipped spec); KV memory stays flat as the prompt grows; what cannot be exact is refused."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import kvcompile
import kvcompile.engine.op  # noqa: F401  registers torch.ops.kvcompile.attend, which run_both calls (run alone, nothing else imports it)
from kvcompile import reference
from kvcompile.cache import KVCompileCache
from kvcompile.spec import SpecError, available_specs, loads_spec
from test_decode import assert_same_cache
from tiny import left_pad, prompt, tiny_model

# one policy per part family (and their mixes): scorers, rankings, layer / head allocation, thresholds,
# merge rules, decode schedules after the chunked prompt
POLICIES = {
    "snapkv": dict(name="snapkv", scoring={"window_attention": {"window": 3}}, ranking={"by_score": {"window": 2}}),
    "pyramidkv": dict(name="pyramidkv", scoring={"window_attention": {"window": 3}},
                      ranking={"by_score": {"window": 2}}),
    "adakv": dict(name="adakv", scoring={"window_attention": {"window": 3}}, ranking={"by_score": {"window": 2}}),
    "lava": dict(name="lava", scoring={"lava": {"window": 3}}, ranking={"by_score": {"window": 2}}),
    "lava_residual": dict(name="lava_residual", scoring={"lava": {"window": 3}}),
    "pyramid_pooled": dict(name="pyramid_pooled", scoring={"window_attention": {"window": 3}},
                           ranking={"by_score": {"window": 2}}),
    "tova": dict(name="tova", scoring={"last_token": {"heads": "group"}}),  # heads: all is refused chunked
    "h2o": dict(name="h2o", ranking={"by_score": {"window": 2}}),
    "zsmerge": dict(name="zsmerge"),
    "streamingllm": dict(name="streamingllm", ranking={"by_position": {"sinks": 2}}),
    "key_norm": dict(name="snapkv", scoring="key_norm", ranking={"by_score": {"sinks": 1, "window": 1}}),
    "dbudgetkv": dict(name="dbudgetkv", budget={"threshold": {"attention_norm": {"keep_layers": 1}}},
                      ranking={"by_position": {"sinks": 2, "window": 1}}),
    "dbudget_lava": dict(name="dbudget_lava", scoring={"lava": {"window": 3}}, ranking={"by_score": {"window": 2}},
                         budget={"threshold": {"attention_norm": {"t": 0.05, "keep_layers": 0}}}),
    "snapkv_every": dict(name="snapkv", scoring={"window_attention": {"window": 3}},
                         ranking={"by_score": {"window": 3}}, schedule={"decode": {"every": {"n": 2}}}),
    "h2o_every": dict(name="h2o", ranking={"by_score": {"window": 2}}, schedule={"decode": {"every": {"n": 3}}}),
}


def chunked_policy(key: str, per_head: int, chunk: int):
    spec = dict(POLICIES[key])
    name = spec.pop("name")
    schedule = {**spec.pop("schedule", {}), "prefill": {"chunk": chunk}}
    if kvcompile.load_spec(name).budget.threshold is None:
        spec["per_head"] = per_head
    return kvcompile.load_spec(name, schedule=schedule, **spec)


def config_for(layers, h, g, d, softcap=None, sinks=None):
    return SimpleNamespace(num_hidden_layers=layers, num_key_value_heads=h, num_attention_heads=h * g, head_dim=d,
                           hidden_size=h * g * d, attn_logit_softcapping=softcap,
                           sinks=None if sinks is None else tuple(tuple(float(x) for x in s) for s in sinks))


def run_both(policy, layers, b, h, g, n, d, mask, page, rand, steps, softcap=None, sinks=None):
    """The prompt chunk by chunk, every layer through the op and through reference.ChunkedPrefill, then
    `steps` decode tokens through the op and reference.decode_step (and decode_prune); the attention
    outputs agree all along and every layer holds the same entries. Returns the cache. softcap, sinks (per
    layer (Hq,)): a model's logit soft-cap and learned sinks, given to the plan and to the reference."""
    c = policy.schedule.chunk_tokens
    scale = d ** -0.5
    cache = KVCompileCache(policy, config_for(layers, h, g, d, softcap, sinks), page_size=page)
    cache.expect_prompt(n)
    ref = reference.ChunkedPrefill(policy, layers, softcap=softcap, sinks=sinks)
    real = torch.ones(b, n, dtype=torch.bool) if mask is None else mask
    rows = policy.scoring.query_rows(2 ** 30)
    rings = [None] * layers
    for start in range(0, n, c):
        end = min(start + c, n)
        for layer in range(layers):
            q, k, v = rand(b, h * g, end - start, d), rand(b, h, end - start, d), rand(b, h, end - start, d)
            got = torch.ops.kvcompile.attend(q, k, v, None if mask is None else mask[:, :end], layer, cache.ref,
                                             cache.token, scale)
            want = ref.step(layer, q, k, v, None if mask is None else mask[:, start:end], scale)
            assert_close(got, want, rtol=1e-4, atol=1e-5)
            rings[layer] = q if rings[layer] is None else torch.cat([rings[layer], q], dim=2)
    assert cache.compressing is None
    for layer in range(layers):
        assert_same_cache(cache.stores[layer].to_heads(), ref.heads[layer])
    lengths = real.sum(-1)
    held = torch.tensor([[[len(x.positions) for x in row] for row in ref.heads[layer]] for layer in range(layers)])
    budgets = reference.decode_budgets(policy, lengths, layers, h, held.permute(1, 0, 2))
    decode = policy.schedule.decode
    every = decode.prune_every if decode is not None else 0
    rings = [None if not rows else r[:, :, -rows:] for r in rings]
    for step in range(steps):
        position = lengths + step
        for layer in range(layers):
            qn, kn, vn = rand(b, h * g, 1, d), rand(b, h, 1, d), rand(b, h, 1, d)
            got = torch.ops.kvcompile.attend(qn, kn, vn, None, layer, cache.ref, cache.token, scale)
            learned = None if sinks is None else sinks[layer]
            want = reference.decode_step(policy, ref.heads[layer], qn[:, :, 0], kn[:, :, 0], vn[:, :, 0], position,
                                         budgets[:, layer], scale, softcap, learned)
            if every:
                if rows:
                    rings[layer] = torch.cat([rings[layer], qn], dim=2)[:, :, -rows:]
                if (step + 1) % every == 0:
                    reference.decode_prune(policy, ref.heads[layer], rings[layer], position + 1, budgets[:, layer],
                                           layer, scale, softcap=softcap, sinks=learned)
            assert_close(got[:, :, 0], want, rtol=1e-4, atol=1e-5)
            assert_same_cache(cache.stores[layer].to_heads(), ref.heads[layer])
    if steps:
        assert torch.equal(cache.budgets, budgets)
    return cache


@settings(max_examples=40, deadline=None)
@given(key=st.sampled_from(sorted(POLICIES)), b=st.integers(1, 2), h=st.integers(1, 2), g=st.integers(1, 2),
       n=st.integers(5, 30), chunk=st.integers(2, 12), per_head=st.integers(4, 9), page=st.sampled_from([2, 4]),
       pad=st.integers(0, 14), steps=st.integers(0, 5), layers=st.integers(2, 3), d=st.sampled_from([8, 16]),
       seed=st.integers(0, 2 ** 16))
def test_runtime_equals_reference_chunk_by_chunk(key, b, h, g, n, chunk, per_head, page, pad, steps, layers, d, seed):
    """d = 16: a chunk's attention by the C++ column-sums kernel (plan.chunk_impl, where a compiler is); d = 8: SDPA."""
    policy = chunked_policy(key, per_head, chunk)
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    mask = None
    if pad:  # the first row left-padded, maybe over whole chunks
        mask = torch.ones(b, n, dtype=torch.bool)
        mask[0, :min(pad, n - 1)] = False
    run_both(policy, layers, b, h, g, n, d, mask, page, rand, steps)


@pytest.mark.parametrize("key", sorted(POLICIES))
def test_every_family_evicts_across_chunks(key):
    """Not vacuous: with a 40-token prompt in chunks of 8 every policy evicts tokens of earlier chunks
    (or merges them) and still equals the reference."""
    policy = chunked_policy(key, 6, 8)
    gen = torch.Generator().manual_seed(3)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :11] = False
    cache = run_both(policy, 2, 2, 2, 2, 40, 8, mask, 4, rand, 3)
    for layer in range(1, 2):  # layer 0 of dbudgetkv keeps everything (keep_layers)
        kept = cache.kept_positions(layer)
        assert int(kept[0].sum(-1).min()) < 40, "some prompt tokens were evicted"


# kvzip scores a prompt by reconstructing it with the model (a second, model-level forward per chunk), which
# ChunkedPrefill's per-layer steps cannot feed: its chunked prefill is tests/test_kvzip_chunked.py's. layers:
# global ranks the whole prompt's entries of every layer at once: a chunked prefill is refused for it
# (tests/test_global_allocation.py). A scorer that reads every head (tova's `last_token: {heads: all}`) is
# refused a chunked prefill: each head holds its own entries after a chunk (test below). A score of the whole
# prompt (observed_attention's `mean_attention`: a mean over each key's queries) is refused one by the spec
# (tests/test_spec.py)
SPECS = [name for name in available_specs()
         if not getattr(kvcompile.load_spec(name).scoring, "reconstructs", False)
         and not kvcompile.load_spec(name).budget.layers.ranks_entries
         and kvcompile.load_spec(name).scoring.head_local
         and not kvcompile.load_spec(name).scoring.whole_prompt]


def test_a_scorer_of_every_head_is_refused_a_chunked_prefill():
    from kvcompile.plan import PlanError, build_plan

    chunked = {"schedule": {"prefill": {"chunk": 16}}}
    tova = kvcompile.load_spec("tova", **chunked)
    assert not tova.scoring.head_local
    config = tiny_model("llama").config
    with pytest.raises(PlanError, match=r"reads every head's attention.*heads: group"):
        build_plan(tova, config)
    with pytest.raises(ValueError, match="reads every head's attention"):
        reference.ChunkedPrefill(tova, 2)
    grouped = kvcompile.load_spec("tova", scoring={"last_token": {"heads": "group"}}, **chunked)
    assert build_plan(grouped, config).prefill_chunk == 16
    assert "tova" not in SPECS and "observed_attention" not in SPECS and "snapkv" in SPECS


def test_chunk_at_least_the_prompt_is_reference_compress():
    """The reference: one chunk is `compress` exactly (every shipped spec, layer-dynamic ones included)."""
    from kvcompile.layer_state import LayerState

    gen = torch.Generator().manual_seed(0)
    b, h, g, n, d, layers = 2, 2, 2, 30, 8, 3
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, :7] = False
    rope = 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)  # for a scorer that reads the rotary (expected_attention)
    for name in SPECS:
        base = kvcompile.load_spec(name)
        over = {"schedule": {"prefill": {"chunk": n}}}
        if base.budget.threshold is None:
            over["per_head"] = 10
            over["ranking"] = {base.ranking.name: {"window": 0 if base.budget.split else 2, "sinks": 1}}
        policy = kvcompile.load_spec(name, **over)
        chunked = reference.ChunkedPrefill(policy, layers, rope=rope)
        states = []
        for layer in range(layers):
            q, k, v = (torch.randn(b, x, n, d, generator=gen) * 2 for x in (h * g, h, h))
            chunked.step(layer, q, k, v, mask, None)
            states.append(LayerState(q, k, v, mask, None, rope))
        selection = reference.compress(policy, states)
        for layer in range(layers):
            one = reference.decode_heads(policy, states[layer], selection.kept[layer], selection.merged[layer],
                                         selection.scores[layer])
            assert_same_cache(chunked.heads[layer], one)




def small(name: str, **schedule):
    policy = kvcompile.load_spec(name)
    over = {"schedule": schedule} if schedule else {}
    if policy.budget.threshold is None:
        over["per_head"] = max(24, policy.ranking.sinks + policy.ranking.window + 8)
    return kvcompile.load_spec(name, **over)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("name", SPECS)
def test_chunk_covering_the_prompt_is_one_pass_exactly(llama, name):
    """Every shipped spec: with c >= N, generate() and model() give one-pass compression's tokens, logits
    and cache (a left-padded batch)."""
    ids, mask = left_pad([prompt(70, seed=3)[0], prompt(52, seed=4)[0]])
    one = small(name)
    chunked = kvcompile.load_spec(one, schedule={"prefill": {"chunk": 70}})
    runs = []
    for policy in (one, chunked):
        with kvcompile.compiled(llama, policy), torch.no_grad():
            out = llama.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                 return_dict_in_generate=True)
            logits = llama(ids, attention_mask=mask).logits
        runs.append((out, logits))
    (a, la), (b, lb) = runs
    assert a.sequences.tolist() == b.sequences.tolist()
    assert torch.equal(la, lb)
    assert torch.equal(a.past_key_values.kept(), b.past_key_values.kept())
    assert int(a.past_key_values.kept().sum()) < 2 * 76 * 3 * 2 or one.budget.threshold is not None


@pytest.mark.parametrize("name", ["snapkv", "lava", "zsmerge", "h2o", "dbudgetkv"])
def test_generate_and_forward_run_the_prompt_chunk_by_chunk(llama, name):
    """generate() feeds the prompt c tokens per call; model() on the whole prompt does the same: its last
    logits are the ones generate() continues from, and its cache is the generated one's prompt. The prompt is
    long enough that every spec evicts before the last chunk (h2o holds 72 per head: 75 tokens evicted
    nothing a later chunk could miss, so only float noise between kernels told the two apart)."""
    policy = small(name, prefill={"chunk": 16})
    ids, mask = left_pad([prompt(120, seed=5)[0], prompt(100, seed=6)[0]])
    with kvcompile.compiled(llama, policy), torch.no_grad():
        out = llama.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        cache = KVCompileCache(policy, llama.config)
        forward = llama(ids, attention_mask=mask, past_key_values=cache)
    assert forward.logits.shape == (2, 120, llama.config.vocab_size)
    assert_close(forward.logits[:, -1], out.logits[0])
    assert cache.compressing is None and cache.seq_length == 120
    one = small(name)
    with kvcompile.compiled(llama, one), torch.no_grad():
        whole = llama(ids, attention_mask=mask).logits
    assert_close(forward.logits[:, :16], whole[:, :16])  # the first chunk sees the same as one pass
    assert not torch.allclose(forward.logits[:, -1], whole[:, -1])  # later ones see the compressed chunks


def test_peak_kv_memory_is_flat_from_4k_to_32k_tokens():
    """A 1-layer model with long positions: the KV bytes the cache holds after any chunk (its pages, spares
    included) and the largest layer step (held + one chunk) are the same for 4k and 32k-token prompts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         max_position_embeddings=40000, attn_implementation="sdpa")).eval()
    policy = kvcompile.load_spec("snapkv", per_head=64, schedule={"prefill": {"chunk": 512}})
    peaks = {}
    for n in (4096, 32768):
        cache = KVCompileCache(policy, model.config)
        held = []
        ids = torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(n))
        with kvcompile.compiled(model, policy), torch.no_grad():
            cache.expect_prompt(n)
            for start in range(0, n, 512):
                model(ids[:, start:start + 512], past_key_values=cache, logits_to_keep=1)
                held.append(cache.memory_report()["bytes_allocated"])
        assert cache.seq_length == n and int(cache.kept().sum()) == 64
        peaks[n] = max(held)
    assert peaks[4096] == peaks[32768]
    full = 2 * 32768 * 16 * 4
    assert peaks[32768] * 100 < full


def test_lava_cascade_peak_is_the_budget_plus_one_chunk_from_4k_to_32k_tokens():
    """LAVa's cascade (layer budgets from every layer's entropy, lower layers re-selected as later ones run):
    the layers above the one that runs still hold their previous chunk's entries, so the layers seen share
    only the rest of the total (reference.ChunkedPrefill, step 4). The KV bytes the cache's pages hold,
    measured after every layer of every chunk (4 layers, pages of one entry, each head's spare page
    included), never exceed the budget's; the chunk being compressed at one layer is the "+ one chunk".
    Before, a layer kept all of its previous entries plus the chunk until the cascade reached it: 1.75x the
    budget here. The same peak for 4k and 32k-token prompts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, heads, d, per_head, c = 4, 2, 16, 64, 512
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
                                         num_hidden_layers=layers, num_attention_heads=2 * heads,
                                         num_key_value_heads=heads, head_dim=d, max_position_embeddings=40000,
                                         attn_implementation="sdpa")).eval()
    with torch.no_grad():  # sharper attention in higher layers: layer budgets that differ
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.q_proj.weight.mul_(4 ** i)
            layer.self_attn.k_proj.weight.mul_(4 ** i)
    policy = kvcompile.load_spec("lava", per_head=per_head, schedule={"prefill": {"chunk": c}})
    assert policy.layer_dynamic
    entry = 2 * d * 4  # K and V, fp32
    budget = per_head * layers * heads
    peaks = {}
    for n in (4096, 32768):
        cache = KVCompileCache(policy, model.config, page_size=1)
        held = []

        def measure(module, args, out):  # the pages of every layer compressed so far
            held.append(sum(s.k_pages.nbytes + s.v_pages.nbytes for s in cache.stores if s is not None))

        hooks = [layer.self_attn.register_forward_hook(measure) for layer in model.model.layers]
        ids = torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(n))
        try:
            with kvcompile.compiled(model, policy), torch.no_grad():
                cache.expect_prompt(n)
                for start in range(0, n, c):
                    model(ids[:, start:start + c], past_key_values=cache, logits_to_keep=1)
        finally:
            for hook in hooks:
                hook.remove()
        assert len(held) == layers * n // c and cache.seq_length == n
        kept = cache.kept().sum(-1)[0]
        assert int(kept.sum()) == budget and len(set(kept.tolist())) > 1  # layer budgets that moved
        peaks[n] = max(held)
        spares = layers * heads * cache.plan.spare_pages  # one spare page per head
        assert peaks[n] <= (budget + spares) * entry
    assert peaks[4096] == peaks[32768]


def test_spec_errors_name_file_and_line():
    text = "scoring: last_token\nbudget: {per_head: 8}\nschedule:\n  prefill: {chunk: 0}\n"
    with pytest.raises(SpecError, match=r"<string>:4: schedule.prefill.chunk.size: 0 is out of range"):
        loads_spec(text)
    with pytest.raises(SpecError, match=r"<string>:4: schedule.prefill: unknown prefill part 'chunks'"):
        loads_spec(text.replace("chunk: 0", "chunks: 8"))
    policy = loads_spec(text.replace("chunk: 0", "chunk: 256"))
    assert policy.schedule.chunk_tokens == 256 and loads_spec(policy.to_yaml()) == policy
    assert kvcompile.load_spec(policy, schedule={"prefill": {"chunk": {"size": 64}}}).schedule.chunk_tokens == 64


def test_what_cannot_be_exact_is_refused_before_it_runs(llama):
    ids = prompt(40)
    lava = small("lava", prefill={"chunk": 16})
    with kvcompile.compiled(llama, lava), torch.no_grad():
        with pytest.raises(kvcompile.CompileError, match="prefill_chunk_size=8"):
            llama.generate(ids, max_new_tokens=2, prefill_chunk_size=8)
        with pytest.raises(kvcompile.CompileError, match="assisted"):
            llama.generate(ids, max_new_tokens=2, prompt_lookup_num_tokens=3)
        # the op given a cascade's prompt in one call (no compile() wrapper): refused before any layer runs
        cache = KVCompileCache(lava, llama.config)
        q, k = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16)
        with pytest.raises(RuntimeError, match="16 tokens per forward call"):
            torch.ops.kvcompile.attend(q, k, k, None, 0, cache.ref, cache.token, 0.25)
        assert cache.stores[0] is None
        cache = KVCompileCache(lava, llama.config)
        cache.expect_prompt(40)
        with pytest.raises(RuntimeError, match="multiple of 16"):
            llama(ids[:, :10], past_key_values=cache)
        assert all(s is None for s in cache.stores)


def test_op_given_several_chunks_in_one_call_equals_chunk_by_chunk():
    """Without a cascade a call with several chunks runs them layer after layer: the same as one per call."""
    policy = chunked_policy("zsmerge", 8, 8)
    gen = torch.Generator().manual_seed(2)
    data = [tuple(torch.randn(2, x, 30, 8, generator=gen) for x in (4, 2, 2)) for _ in range(2)]
    caches = []
    for per_call in (30, 8):
        cache = KVCompileCache(policy, config_for(2, 2, 2, 8), page_size=4)
        cache.expect_prompt(30)
        for start in range(0, 30, per_call):
            for layer, (q, k, v) in enumerate(data):
                s = slice(start, start + per_call)
                torch.ops.kvcompile.attend(q[:, :, s], k[:, :, s], v[:, :, s], None, layer, cache.ref, cache.token, 0.3)
        caches.append(cache)
    for layer in range(2):
        assert_same_cache(caches[0].stores[layer].to_heads(), caches[1].stores[layer].to_heads())
