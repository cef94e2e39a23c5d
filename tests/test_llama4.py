"""Llama 4's text model (Llama4ForCausalLM), on tiny random models from transformers' own config class: most layers
attend in chunks (`chunked_attention`: a query sees the keys of its own chunk of `attention_chunk_size` positions,
counted from the row's first real token), the others to every token without RoPE (NoPE layers, whose queries
transformers scales by position: attn_temperature_tuning); the RoPE layers L2-normalise queries and keys
(use_qk_norm); the MLPs are experts. A policy compresses the full_attention layers and leaves each chunked layer to
its chunk, holding only the chunk's entries so far. At a budget that keeps everything a compiled model is the plain
model (logits and greedy tokens, prompts of several chunks, decoding across chunk boundaries, on every generate()
path it runs here); at a budget that evicts, the chunked layers still equal a chunked reference; what cannot run
exactly is refused up front, with the reason."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close
from transformers import DynamicCache, Llama4ForCausalLM, Llama4TextConfig

import kvcompile
from kvcompile import cache as cache_arg
from kvcompile.cache import KVCompileCache
from kvcompile.engine.window import WindowLayer
from test_runtime import full_budget
from tiny import left_pad, peaked, prompt

CHUNK = 16
LAYERS = 4  # a NoPE layer every 2: chunked, full, chunked, full (transformers derives layer_types from them)
NEW = 30  # decode steps: the prompts' chunks end and new ones begin while decoding


def tiny_llama4(seed: int = 0, **extra) -> Llama4ForCausalLM:
    """4 layers (2 chunked with 16-token chunks, 2 NoPE full ones), 4 query / 2 KV heads of dim 16, 2 experts (1 per
    token) on every layer; temperature tuning that changes the NoPE queries' scale every 8 positions."""
    torch.manual_seed(seed)
    options = dict(vocab_size=96, hidden_size=64, intermediate_size=64, intermediate_size_mlp=96,
                   num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   num_local_experts=2, num_experts_per_tok=1, attention_chunk_size=CHUNK, no_rope_layer_interval=2,
                   floor_scale=8, attn_scale=0.5, max_position_embeddings=1024, attn_implementation="sdpa",
                   pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = Llama4ForCausalLM(Llama4TextConfig(**{**options, **extra}))
    peaked(model)
    model.generation_config.pad_token_id = 0
    return model.eval()


KINDS = tiny_llama4().config.layer_types
LOCAL = [i for i, k in enumerate(KINDS) if k == "chunked_attention"]


@pytest.fixture(scope="module")
def model():
    return tiny_llama4()


def padded_batch():
    """Two rows of 50 and 37 tokens (13 left pads: the second row's chunks start at position 13)."""
    return left_pad([prompt(50, seed=3)[0], prompt(37, seed=4)[0]])


def test_the_tiny_model_is_llama4_with_its_attention_features(model):
    """The model has what these tests exercise, and its plan compresses the full_attention layers and leaves each
    chunked layer to its chunk."""
    kinds = KVCompileCache(kvcompile.load_spec("snapkv"), model.config).plan.layer_kinds
    assert kinds.windows == (CHUNK, None, CHUNK, None) and kinds.engine == (None, 0, None, 1)
    assert [kinds.chunked(i) for i in range(LAYERS)] == [True, False, True, False]
    config = model.config
    assert config.model_type == "llama4_text"
    assert KINDS == ["chunked_attention", "full_attention"] * 2 and config.no_rope_layers == [1, 0, 1, 0]
    attn = [layer.self_attn for layer in model.model.layers]
    assert [hasattr(a, "qk_norm") for a in attn] == [True, False, True, False]  # L2 norms on the RoPE layers
    assert config.attn_temperature_tuning and all(a.attn_temperature_tuning and not a.use_rope for a in attn[1::2])


@pytest.mark.parametrize("name", ["snapkv", "h2o", "streamingllm", "knorm"])
def test_full_budget_equals_the_plain_model(model, name):
    """Logits of a left-padded batch of several chunks, and greedy tokens across the next chunk boundaries."""
    ids, mask = padded_batch()
    with torch.no_grad():
        ref_logits = model(ids, attention_mask=mask).logits
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        with kvcompile.compiled(model, full_budget(name, ids.shape[1] + NEW, LAYERS)):
            logits = model(ids, attention_mask=mask).logits
            got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    real = mask.bool()
    assert_close(logits[real], ref_logits[real], rtol=1e-5, atol=1e-5)
    assert got.tolist() == ref.tolist()


def test_decode_logits_equal_the_plain_model_across_chunk_boundaries(model):
    """Step by step, a token at a time from a 40-token prompt (positions 40..79: chunks end at 48, 64 and 80), the
    compiled model's logits are the plain model's."""
    ids = prompt(40, batch=2, seed=5)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=40, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        with kvcompile.compiled(model, full_budget("snapkv", 80, LAYERS)):
            got = model.generate(ids, max_new_tokens=40, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    assert got.sequences.tolist() == ref.sequences.tolist()
    assert_close(torch.stack(got.logits), torch.stack(ref.logits), rtol=1e-5, atol=1e-5)


def test_every_generate_path_equals_the_plain_model(model):
    """Beam search (rows reordered), sampling, a cache continued by a second call, generate's chunked prefill and
    a forward without a cache (use_cache=False: the chunked attention without any cache)."""
    ids, mask = padded_batch()
    policy = full_budget("snapkv", 100, LAYERS)
    runs = {
        "beams": dict(num_beams=3, max_new_tokens=8, do_sample=False),
        "sample": dict(do_sample=True, top_k=10, max_new_tokens=10),
        "prefill chunks": dict(prefill_chunk_size=8, max_new_tokens=10, do_sample=False),
    }
    with torch.no_grad():
        for label, kwargs in runs.items():
            torch.manual_seed(5)
            ref = model.generate(ids, attention_mask=mask, **kwargs)
            with kvcompile.compiled(model, policy):
                torch.manual_seed(5)
                got = model.generate(ids, attention_mask=mask, **kwargs)
            assert got.tolist() == ref.tolist(), label
        first = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                               return_dict_in_generate=True)
        more = torch.cat([first.sequences, prompt(5, batch=2, seed=9)], dim=1)
        more_mask = torch.cat([mask, torch.ones(2, more.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
        ref = model.generate(more, attention_mask=more_mask, max_new_tokens=8, do_sample=False,
                             **cache_arg.given(first.past_key_values))
        ref_plain = model(ids, attention_mask=mask, use_cache=False).logits
        with kvcompile.compiled(model, policy):
            first = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                   return_dict_in_generate=True)
            got = model.generate(more, attention_mask=more_mask, max_new_tokens=8, do_sample=False,
                                 **cache_arg.given(first.past_key_values))
            plain = model(ids, attention_mask=mask, use_cache=False).logits
    assert got.tolist() == ref.tolist()
    real = mask.bool()
    assert_close(plain[real], ref_plain[real], rtol=1e-5, atol=1e-5)


def test_chunked_layers_hold_their_chunk_only(model):
    """After a prompt and decode steps, each chunked layer holds the positions of the chunk its next query falls in:
    transformers' own cache's latest entries there, in tensors of that size (what left is freed); none right
    after a chunk ends, at most chunk - 1 at any step."""
    ids = prompt(30, batch=2, seed=6)
    sizes = {}
    with torch.no_grad():
        for new in (3, 4, 18):  # the layer has seen 32 positions (two chunks ended), 33 and 47
            ref = model.generate(ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True)
            with kvcompile.compiled(model, full_budget("snapkv", 30 + new, LAYERS)):
                out = model.generate(ids, max_new_tokens=new, do_sample=False, return_dict_in_generate=True)
            theirs, ours = cache_arg.of(ref), cache_arg.of(out)
            assert ours.plan.num_layers == 2 and ours.plan.model_layers == LAYERS
            for layer in LOCAL:
                held = ours.windows[layer]
                n = held.seen % CHUNK
                sizes[held.seen] = n
                assert held.keys.shape[2] == n and held.keys.untyped_storage().nbytes() == held.keys.nbytes
                assert theirs.layers[layer].keys.shape[2] == CHUNK - 1  # transformers keeps chunk - 1 positions
                if n:
                    assert_close(held.keys, theirs.layers[layer].keys[:, :, -n:], rtol=1e-4, atol=1e-4)
                    assert_close(held.values, theirs.layers[layer].values[:, :, -n:], rtol=1e-4, atol=1e-4)
            assert all(ours.windows[i] is None for i, k in enumerate(KINDS) if k == "full_attention")
    assert sizes == {32: 0, 33: 1, 47: 15}  # (the last token generated has not run: seen = length - 1)


def test_a_padded_row_counts_its_chunks_from_its_first_real_token(model):
    """In a batch whose rows have different left pads, each row's chunks start at its first real token: the layer
    holds the longest of the rows' runs in the current chunk (the others' older entries masked)."""
    ids, mask = padded_batch()  # pads 0 and 13
    with torch.no_grad(), kvcompile.compiled(model, full_budget("snapkv", 100, LAYERS)):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             return_dict_in_generate=True)
    held = cache_arg.of(out).windows[LOCAL[0]]
    assert held.pads == (0, 13) and held.seen == 55
    assert held.keys.shape[2] == max(55 % CHUNK, (55 - 13) % CHUNK) == 10


def _chunked_reference(q, keys, values, valid, scale, offset, pads):
    """softmax(q·kᵀ·scale) over the real keys p <= i of query i's chunk, (p - pads) // CHUNK == (i - pads) //
    CHUNK, written out."""
    group = q.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    logits = (q @ k.transpose(-1, -2)) * scale
    i = torch.arange(q.shape[2])[:, None] + offset
    p = torch.arange(keys.shape[2])[None, :]
    pads = torch.tensor(pads)[:, None, None, None]
    sees = (p <= i) & ((p - pads) // CHUNK == (i - pads) // CHUNK) & valid[:, None, None, :]
    return torch.softmax(logits.masked_fill(~sees, float("-inf")), dim=-1) @ v


def test_an_evicting_policy_leaves_chunked_layers_to_their_chunk(model, monkeypatch):
    """snapkv at a budget that evicts most of the prompt: the full_attention layers keep the budget, and every
    call of every chunked layer equals chunked attention over all the keys the layer has seen (the reference,
    written out), pads masked."""
    calls = []
    attend_window = KVCompileCache.attend_window

    def record(cache, layer, q, k, v, mask, scale):
        out = attend_window(cache, layer, q, k, v, mask, scale)
        calls.append((layer, q.clone(), k.clone(), v.clone(), None if mask is None else mask.clone(), scale,
                      out.clone()))
        return out

    monkeypatch.setattr(KVCompileCache, "attend_window", record)
    ids, mask = left_pad([prompt(80, seed=7)[0], prompt(67, seed=8)[0]])
    with torch.no_grad(), kvcompile.compiled(model, kvcompile.load_spec("snapkv", per_head=40)):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             return_dict_in_generate=True)
    report = cache_arg.of(out).memory_report()
    assert report["kept"].max() < 80  # the full_attention layers evicted (40 kept + decoded ones)
    seen = {layer: [] for layer in LOCAL}
    for layer, q, k, v, m, scale, got in calls:
        assert scale == 16 ** -0.5
        seen[layer].append((k, v))
        keys = torch.cat([x for x, _ in seen[layer]], dim=2)
        values = torch.cat([y for _, y in seen[layer]], dim=2)
        valid = torch.ones(2, keys.shape[2], dtype=torch.bool) if m is None else m[:, -keys.shape[2]:].bool()
        want = _chunked_reference(q, keys, values, valid, scale, keys.shape[2] - q.shape[2], [0, 13])
        real = valid[:, -q.shape[2]:]  # a pad query's output is never read
        assert_close(got.transpose(1, 2)[real], want.transpose(1, 2)[real], rtol=1e-5, atol=1e-5)
    assert sorted(seen) == LOCAL and all(len(s) == NEW for s in seen.values())  # the prompt + NEW - 1 steps


def test_memory_report_by_layer_kind_against_transformers_hybrid_cache(model):
    """At a full budget (pages of one entry), the full_attention layers hold what transformers' own hybrid cache
    holds there, and a full cache of the chunked layers is transformers' (chunk - 1 positions); the chunked layers
    hold the current chunk's positions only, within that bound."""
    ids = prompt(30, batch=2, seed=10)
    with torch.no_grad():
        theirs = DynamicCache(config=model.config)
        model.generate(ids, max_new_tokens=8, do_sample=False, **cache_arg.given(theirs))
        with kvcompile.compiled(model, full_budget("snapkv", 38, LAYERS), page_size=1):
            out = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    report = cache_arg.of(out).memory_report()
    expected = {}
    for kind, layer in zip(KINDS, theirs.layers):
        expected[kind] = expected.get(kind, 0) + layer.keys.nbytes + layer.values.nbytes
    per_token = 2 * 2 * 2 * 16 * 4  # rows, KV heads, key and value, head dim, float32
    assert report["bytes_full_by_kind"] == expected
    assert expected["chunked_attention"] == len(LOCAL) * (CHUNK - 1) * per_token
    assert report["bytes_by_kind"]["full_attention"] == expected["full_attention"]
    assert report["bytes_by_kind"]["chunked_attention"] == len(LOCAL) * (37 % CHUNK) * per_token  # positions 32..36


def _kept_scores(model, policy, ids, mask, steps: int = 0):
    """The scores the compiled model's cache keeps, per compressed layer: (B, H, width) by each real token's
    index in the (padded) sequence, after the prompt and `steps` greedy decode steps."""
    with torch.no_grad(), kvcompile.compiled(model, policy):
        cache = KVCompileCache.from_plan(model.kvcompile_plan)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=steps + 1, do_sample=False,
                             **cache_arg.given(cache)) if steps else model(ids, attention_mask=mask,
                                                                         **cache_arg.given(cache))
    pad = (mask == 0).sum(-1)
    scores = []
    for store in cache.stores:
        layer = torch.zeros(ids.shape[0], store.lengths.shape[1], ids.shape[1] + steps)
        for b, row in enumerate(store.to_heads()):
            for h, head in enumerate(row):
                layer[b, h, head.positions + pad[b]] = head.scores.float()
        scores.append(layer)
    return scores, out


def _group_mean(a):
    return a.reshape(a.shape[0], 2, -1, *a.shape[2:]).mean(2)


def test_kept_scores_come_from_the_models_own_attention(model):
    """The scores each full_attention (NoPE, temperature-tuned) layer keeps are those of transformers' own
    attention weights (the eager model's output_attentions, after the chunked layers before it): TOVA's last row
    and H2O's accumulated attention after the prompt, and H2O's after decode steps across a chunk boundary."""
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    ids, mask = padded_batch()
    n, real = ids.shape[1], mask.bool()
    full = [i for i, kind in enumerate(KINDS) if kind == "full_attention"]
    with torch.no_grad():
        attentions = eager(ids, attention_mask=mask, output_attentions=True).attentions
    a = [torch.where(real[:, None, :, None], attentions[i], 0.0) for i in full]  # a pad query's row: 0
    specs = {"last row": (full_budget("tova", n, LAYERS), lambda x: x[:, :, -1].mean(1, keepdim=True).expand(-1, 2,
                                                                                                              -1)),
             "accumulated": (full_budget("h2o", n, LAYERS), lambda x: _group_mean(x.sum(2)))}
    for label, (policy, score) in specs.items():
        got, _ = _kept_scores(model, policy, ids, mask)
        for layer, weights in zip(got, a):
            assert_close(layer.transpose(1, 2)[real], score(weights).transpose(1, 2)[real], rtol=1e-4, atol=1e-6,
                         msg=label)
    got, out = _kept_scores(model, full_budget("h2o", n + NEW, LAYERS), ids, mask, steps=15)  # positions 50..64
    seq = out[:, :-1]
    seq_mask = torch.cat([mask, torch.ones(2, 15, dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        attentions = eager(seq, attention_mask=seq_mask, output_attentions=True).attentions
    seq_real = seq_mask.bool()
    for layer, i in zip(got, full):
        want = _group_mean(torch.where(seq_real[:, None, :, None], attentions[i], 0.0).sum(2))
        assert_close(layer.transpose(1, 2)[seq_real], want.transpose(1, 2)[seq_real], rtol=1e-4, atol=1e-5)


def test_assisted_and_prompt_lookup_decoding_crop_inside_the_chunks(model):
    """generate() records the chunked layers' past before it decodes with candidates and crops the rejected ones,
    across chunk boundaries: at a full budget the plain model's tokens; the layers end back at their chunk's
    positions. A crop without the recording that needs positions of an earlier chunk is refused."""
    ids = prompt(40, batch=1, seed=2)
    assistant = copy.deepcopy(model)
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        with kvcompile.compiled(model, full_budget("snapkv", 40 + NEW, LAYERS)):
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=2,
                                 return_dict_in_generate=True)
            assisted = model.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=assistant)
    assert out.sequences.tolist() == assisted.tolist() == ref.tolist()
    cache = cache_arg.of(out)
    for i in LOCAL:
        held = cache.windows[i]
        assert held.keys.shape[2] <= held.seen % CHUNK + 2  # (the last call's candidates)
    held = WindowLayer(CHUNK, torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16), torch.ones(1, 3, dtype=torch.bool),
                       51, (0,))  # positions 48..50 of the chunk from 48
    assert held.can_crop(3) and held.cropped(3).keys.shape[2] == 0
    assert not held.can_crop(4)  # position 47 (the chunk from 32) is gone
    with torch.no_grad(), kvcompile.compiled(model, full_budget("snapkv", 60, LAYERS)):
        plain = model.generate(ids, max_new_tokens=9, do_sample=False, return_dict_in_generate=True)
    with pytest.raises(NotImplementedError, match=r"call activate_past_recording\(\) before the tokens to crop"):
        cache_arg.of(plain).crop(-2)  # the next query at 48: a crop back to 46 needs 32..45


def test_a_prompt_compressed_chunk_by_chunk_leaves_chunked_layers_to_their_chunk(model):
    ids, mask = padded_batch()
    policy = kvcompile.load_spec("snapkv", per_head=120, schedule={"prefill": {"chunk": 8}})
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        with kvcompile.compiled(model, policy):
            got = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert got.tolist() == ref.tolist()


@pytest.mark.parametrize("spec", ["kvzip", "kvzip_adakv"])
def test_kvzip_reconstructs_through_the_chunks(model, spec):
    """KVzip's reconstruction forwards run through the chunked layers as the plain model runs the prompt followed
    by the repeat input (reference.kvzip_scores, whose capture attends in chunks), and leave them as the prompt
    left them: the kept entries and their scores are the reference's at a budget that evicts, and a full budget
    generates the plain model's tokens."""
    from kvcompile import reference
    from test_kvzip import REPEAT, kept_scores

    ids = prompt(40, batch=2, seed=11)
    policy = kvcompile.load_spec(spec, per_head=12, scoring={"kvzip": {"chunk": 16, "sinks": 2, "overlap": 3}})
    with torch.no_grad():
        with kvcompile.compiled(model, policy, repeat_prompt=REPEAT):
            cache = model(ids, use_cache=True).past_key_values
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        full = kvcompile.load_spec(spec, per_head=40 + NEW + 64)
        with kvcompile.compiled(model, full, repeat_prompt=REPEAT):
            got = model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
        with kvcompile.compiled(model, kvcompile.load_spec("snapkv")):
            plain = model(ids, use_cache=True).past_key_values
    scores, states = reference.kvzip_scores(model, ids, REPEAT, policy.scoring)
    expected = reference.compress(policy, states, scores=scores)
    assert cache.seq_length == 40
    for i in LOCAL:
        assert cache.windows[i].seen == 40 and torch.equal(cache.windows[i].keys, plain.windows[i].keys)
    for layer in range(cache.plan.num_layers):
        kept = cache.kept_positions(layer)
        assert torch.equal(kept, expected.kept[layer]), f"layer {layer}"
        assert_close(kept_scores(cache, layer), torch.where(kept, scores[layer], 0.0))
    assert got.sequences.tolist() == ref.tolist()


def test_the_reference_capture_attends_in_chunks(model):
    """reference.captured_states (what the reference scorers read) runs the chunked layers in chunks: its
    full_attention layers' states are those the plain model computes (transformers' own attention, eager)."""
    from kvcompile import reference

    ids = prompt(50, batch=2, seed=13)
    captured = reference.captured_states(model, ids)
    states = {}

    def hook(module, args, kwargs, out):
        states[module.layer_idx] = kwargs["hidden_states"]

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    full = [i for i, k in enumerate(KINDS) if k == "full_attention"]
    assert len(captured) == len(full)
    for state, layer in zip(captured, full):
        attn = model.model.layers[layer].self_attn
        keys = attn.k_proj(states[layer]).view(2, 50, 2, 16).transpose(1, 2)  # NoPE: no rotary, no norm
        assert_close(state.keys, keys, rtol=1e-5, atol=1e-5)


def test_prefill_once_compress_many_carries_the_chunked_layers(model):
    from kvcompile.tools.sweep import capture, greedy, replay

    ids = prompt(40, seed=12)
    policy = kvcompile.load_spec("snapkv", per_head=36)
    with torch.no_grad():
        states, logits = capture(model, ids)
        cache = replay(policy, model.config, states, headroom=NEW)
        tokens = greedy(model, cache, logits, NEW)
        with kvcompile.compiled(model, policy):
            own = model.generate(ids, max_new_tokens=NEW, do_sample=False)[:, ids.shape[1]:]
    assert own.shape[1] >= 5 and tokens[:, :own.shape[1]].tolist() == own.tolist()
    assert [w is not None for w in cache.windows] == [k == "chunked_attention" for k in KINDS]


def test_the_compiled_entry_equals_the_plain_model_without_temperature_tuning():
    """mode='compiled' (each chunked layer's captured attention becomes kvcompile.attend_window): at a budget that
    keeps everything, the plain model's logits and greedy tokens, on a model whose NoPE queries are not scaled by
    position. With temperature tuning it is refused: the traced forward sees a stand-in cache with no past, so
    transformers would scale the queries as if at the sequence's start."""
    tuned = tiny_llama4()
    with pytest.raises(kvcompile.CompileError, match="mode='compiled' traces the model over a stand-in cache .* "
                                                     "scales its NoPE layers' queries by the cache's length"):
        kvcompile.compile(tuned, "snapkv", mode="compiled")
    assert "forward" not in tuned.__dict__
    model = tiny_llama4(attn_temperature_tuning=False)
    ids, mask = padded_batch()
    with torch.no_grad():
        ref_logits = model(ids, attention_mask=mask).logits
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        with kvcompile.compiled(model, full_budget("snapkv", ids.shape[1] + NEW, LAYERS), mode="compiled"):
            logits = model(ids, attention_mask=mask).logits
            got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    real = mask.bool()
    assert_close(logits[real], ref_logits[real], rtol=1e-5, atol=1e-5)
    assert got.tolist() == ref.tolist()


# --- what is refused, and why -------------------------------------------------------------------------------------

def test_a_policy_for_chunked_layers_is_refused(model):
    chunked = {"budget": {"per_head": 64, "layers": {"uniform": {"kinds": ["full_attention", "chunked_attention"]}}}}
    with pytest.raises(kvcompile.CompileError, match="applies to chunked_attention layers .*window already bounds its "
                                                     "cache \\(a chunked layer's, its chunk\\)"):
        kvcompile.compile(model, "snapkv", **chunked)
    assert "forward" not in model.__dict__


# --- expected attention: the scorer's moved queries are the model's --------------------------------------------------

# a RoPE full_attention layer (1: rotary on interleaved pairs, qk norm) and a NoPE one (3: temperature tuning), both
# compressed
MIXED = dict(no_rope_layers=[1, 1, 1, 0],
             layer_types=["chunked_attention", "full_attention", "chunked_attention", "full_attention"])
EA_MODELS = {"nope_tuned": {}, "rope_and_nope": MIXED}


class _Past:
    """A stand-in cache that reports `length` positions before the call and holds nothing: what Llama 4's attention
    reads for its temperature tuning (get_seq_length), its keys and values handed through (update)."""

    def __init__(self, length: int):
        self.length = length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def update(self, key, value, layer_idx, *args, **kwargs):
        return key, value


def module_qkv(model, layer: int, x, past: int, positions, monkeypatch):
    """The queries, keys and values (B, heads, L, d) model layer `layer`'s attention module computes for hidden
    states x (B, L, hidden) after `past` positions of the padded sequence, its rotary at `positions` (B, L):
    transformers' own rotary, qk norm and temperature tuning, captured where it calls its attention function."""
    seen = {}

    def capture(module, query, key, value, *args, **kwargs):
        seen.update(q=query, k=key, v=value)
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None

    class Capture:
        def get_interface(self, name, default):
            return capture

    with monkeypatch.context() as patch, torch.no_grad():
        patch.setattr("transformers.models.llama4.modeling_llama4.ALL_ATTENTION_FUNCTIONS", Capture())
        model.model.layers[layer].self_attn(x, position_embeddings=model.model.rotary_emb(x, positions),
                                            attention_mask=None, **cache_arg.given(_Past(past)))
    return seen["q"].float(), seen["k"].float(), seen["v"].float()


def moved_by_module(model, layer: int, x, at: int, position, monkeypatch):
    """The query (B, Hq, L, d) the module computes from each input of x (B, L, hidden) at position `at` of the
    padded sequence (the same for every input), its rotary at `position` (B,) of its row."""
    b, length, hidden = x.shape
    q, _, _ = module_qkv(model, layer, x.reshape(b * length, 1, hidden), at,
                         position[:, None].expand(b, length).reshape(b * length, 1), monkeypatch)
    return q.view(b, length, q.shape[1], q.shape[-1]).transpose(1, 2)


def test_expected_attention_plans_each_layers_map_to_positions():
    """The plan gives each compressed layer its map from a query to its position: a NoPE layer zero frequencies and,
    under temperature tuning, its scale (attn_scale, floor_scale); a RoPE layer the model's frequencies on
    interleaved pairs, no scale. (These two were refused before: the scorer had neither.)"""
    from kvcompile.plan import build_plan

    policy = kvcompile.load_spec("expected_attention")
    nope = build_plan(policy, tiny_llama4().config)
    assert nope.rope == (0.0,) * 8 and nope.nope == (True, True) and nope.temperature == (0.5, 8.0)
    model = tiny_llama4(**MIXED)
    mixed = build_plan(policy, model.config)
    assert mixed.nope == (False, True) and mixed.temperature == (0.5, 8.0)
    assert_close(torch.tensor(mixed.rope), model.model.rotary_emb.inv_freq)
    q = torch.randn(1, 4, 5, 16)
    roped, plain = mixed.state(q, q[:, :2], q[:, :2], None, None, 0), mixed.state(q, q[:, :2], q[:, :2], None, None, 1)
    assert roped.interleaved and roped.temperature is None and bool(roped.rope.ne(0).all())
    assert not plain.interleaved and plain.temperature == (0.5, 8.0) and bool(plain.rope.eq(0).all())
    off = build_plan(policy, tiny_llama4(attn_temperature_tuning=False, **MIXED).config)
    assert off.nope == (False, True) and off.temperature is None


@pytest.mark.parametrize("config", EA_MODELS.values(), ids=EA_MODELS.keys())
def test_expected_attention_moves_queries_as_the_model_computes_them(config, monkeypatch):
    """The scorer's queries moved to the next positions are the model's: s(n + t)·R(t)·ẑ_p, with ẑ_p =
    R(n − p)·q_p / s(p) (scoring.moved_queries), equals the query transformers' attention module computes from the
    same input at position n + t, on a padded row too: the interleaved rotary and qk norm of a RoPE layer, the
    temperature tuning of a NoPE one (its scale changes every 8 positions), t inside and across those steps. A
    rotate-half rotation, or a query left unscaled, would not be."""
    from kvcompile.plan import build_plan
    from kvcompile.policies.scoring import moved_queries, rotate_pairs, temperature_scales

    model = tiny_llama4(**config)
    plan = build_plan(kvcompile.load_spec("expected_attention"), model.config)
    n, pads = 21, torch.tensor([0, 6])
    mask = torch.arange(n)[None, :] >= pads[:, None]
    positions = (torch.arange(n)[None, :] - pads[:, None]).clamp(min=0)  # generate()'s position ids
    x = torch.randn(2, n, 64, generator=torch.Generator().manual_seed(5))
    for engine, layer in enumerate(i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"):
        q, k, v = module_qkv(model, layer, x, 0, positions, monkeypatch)
        state = plan.state(q, k, v, mask, None, engine)
        z = moved_queries(state)
        for t in (0, 3, 11, 30):
            want = moved_by_module(model, layer, x, n + t, n - pads + t, monkeypatch)
            angle = t * state.rope
            got = temperature_scales(state.temperature, torch.tensor(n + t)) * rotate_pairs(
                z, angle.cos(), angle.sin(), state.interleaved)
            assert_close(got.transpose(1, 2)[mask], want.transpose(1, 2)[mask], rtol=1e-5, atol=1e-5,
                         msg=f"layer {layer}, t {t}")
            if state.interleaved and t:
                half = rotate_pairs(z, angle.cos(), angle.sin())
                assert not torch.allclose(half.transpose(1, 2)[mask], want.transpose(1, 2)[mask], atol=1e-3)
            if state.temperature is not None:
                assert not torch.allclose(q.transpose(1, 2)[mask], want.transpose(1, 2)[mask], atol=1e-3)


@pytest.mark.parametrize("config", EA_MODELS.values(), ids=EA_MODELS.keys())
def test_expected_attention_at_a_full_budget_equals_the_plain_model(config):
    """Under temperature tuning and on a RoPE compressed layer (both refused before), expected_attention compiles,
    and at a budget that keeps everything generate() is the plain model: tokens and logits, a padded batch."""
    model = tiny_llama4(**config)
    ids, mask = padded_batch()
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        with kvcompile.compiled(model, full_budget("expected_attention", 50 + NEW, LAYERS)):
            got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    assert got.sequences.tolist() == ref.sequences.tolist()
    assert_close(torch.stack(got.logits), torch.stack(ref.logits), rtol=1e-5, atol=1e-5)


def _expected_attention_plainly(model, layer, x, positions, mask, part, monkeypatch):
    """expected_attention's scores (B, H, N) of model layer `layer`, written out from the model's own attention
    module: each prompt input's mean query over the next T = part.future positions, Q̄_p = (1/T) Σ_t q(x_p at
    n + t) (the module's rotary, norm and temperature there: M q̃_p), their mean μ and biased covariance Σ over
    the real inputs past the first part.sinks (M μ̃ and M Σ̃ Mᵀ), softmax(c μᵀk + c² kᵀΣk / 2) over those keys,
    the group's mean, (s + ε)·‖v‖₂; the sinks score the head's max + 1; 0 at pads."""
    n = x.shape[1]
    q, k, v = module_qkv(model, layer, x, 0, positions, monkeypatch)
    future = sum(moved_by_module(model, layer, x, n + t, positions[:, -1] + 1 + t, monkeypatch)
                 for t in range(part.future)).double() / part.future
    hq, h = q.shape[1], k.shape[1]
    g, c = hq // h, q.shape[-1] ** -0.5
    out = torch.zeros(x.shape[0], h, n, dtype=torch.float64)
    for b in range(x.shape[0]):
        real = mask[b].nonzero().squeeze(1)
        sinks, counted = real[:part.sinks], real[part.sinks:]
        for kv in range(h):
            keys = k[b, kv, counted].double()
            for head in range(kv * g, (kv + 1) * g):
                rows = future[b, head, counted]
                mu = rows.mean(0)
                sigma = (rows - mu).T @ (rows - mu) / len(rows)
                logits = c * keys @ mu + c * c * ((keys @ sigma) * keys).sum(-1) / 2
                out[b, kv, counted] += torch.softmax(logits, 0) / g
            out[b, kv, counted] = (out[b, kv, counted] + part.epsilon) * v[b, kv, counted].double().norm(dim=-1)
            out[b, kv, sinks] = out[b, kv, counted].max() + 1
    return out


@pytest.mark.parametrize("config", EA_MODELS.values(), ids=EA_MODELS.keys())
def test_expected_attention_scores_equal_the_model_written_out(config, monkeypatch):
    """The scores the compiled model keeps for each compressed layer (a padded batch) equal expected attention
    written out from the model's own attention module at the next positions (_expected_attention_plainly)."""
    from test_query_agnostic import EA

    model = tiny_llama4(**config)
    ids, mask = padded_batch()
    policy = kvcompile.load_spec({"name": "ea_llama4", "scoring": EA, "budget": {"per_head": 64},
                                  "storage": "model_dtype"})
    inputs, positions = {}, {}  # each layer's attention input and the rotary's positions, in the prompt's forward

    def attention_input(module, args, kwargs):
        inputs[module.layer_idx] = kwargs["hidden_states"]

    def rotary_positions(module, args, out):
        positions["ids"] = args[1]

    handles = [layer.self_attn.register_forward_pre_hook(attention_input, with_kwargs=True)
               for layer in model.model.layers]
    handles.append(model.model.rotary_emb.register_forward_hook(rotary_positions))
    try:
        got, _ = _kept_scores(model, policy, ids, mask)
    finally:
        for handle in handles:
            handle.remove()
    real = mask.bool()
    full = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    assert len(got) == len(full) == 2
    for scores, layer in zip(got, full):
        want = _expected_attention_plainly(model, layer, inputs[layer], positions["ids"].expand(2, -1), real,
                                           policy.scoring, monkeypatch)
        assert_close(scores.transpose(1, 2)[real], want.float().transpose(1, 2)[real], rtol=1e-4, atol=1e-5,
                     msg=f"layer {layer}")


@pytest.mark.parametrize("config", EA_MODELS.values(), ids=EA_MODELS.keys())
def test_expected_attention_evicts_as_the_reference(config):
    """At a budget that evicts, the kept entries of each compressed layer are reference.compress's over the plain
    model's own states, each with its layer's map read off the config: a RoPE layer the model's frequencies on
    interleaved pairs, a NoPE layer none and its temperature (attn_scale, floor_scale)."""
    import dataclasses

    from kvcompile import reference
    from test_query_agnostic import EA

    model = tiny_llama4(**config)
    ids = prompt(40, batch=2, seed=11)
    policy = kvcompile.load_spec({"name": "ea_llama4", "scoring": EA, "budget": {"per_head": 10}})
    with torch.no_grad(), kvcompile.compiled(model, policy):
        cache = cache_arg.of(model(ids, use_cache=True))
    c = model.config
    full = [i for i, kind in enumerate(c.layer_types) if kind == "full_attention"]
    states = [dataclasses.replace(s, rope=model.model.rotary_emb.inv_freq, interleaved=True) if c.no_rope_layers[i]
              else dataclasses.replace(s, rope=torch.zeros(8), temperature=(c.attn_scale, c.floor_scale))
              for s, i in zip(reference.captured_states(model, ids), full)]
    expected = reference.compress(policy, states)
    for layer in range(cache.plan.num_layers):
        assert torch.equal(cache.kept_positions(layer), expected.kept[layer]), f"layer {layer}"
        assert int(expected.kept[layer].sum()) < expected.kept[layer].numel()  # evicted


@pytest.mark.parametrize("pad", [0, 3])
def test_expected_attention_in_chunks_scales_by_the_tokens_seen(pad):
    """A prompt compressed chunk by chunk (schedule.prefill) under temperature tuning: each chunk's queries are
    un-scaled at their positions in the padded sequence and the next ones scaled from the chunk's end (the tokens
    seen, not the entries held): the engine's outputs and kept entries equal reference.ChunkedPrefill's."""
    from types import SimpleNamespace

    from kvcompile import reference
    from test_query_agnostic import CHUNKED_EA, chunks_equal_the_reference

    policy = kvcompile.load_spec(CHUNKED_EA)
    config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, num_attention_heads=4, head_dim=8,
                             hidden_size=32, no_rope_layers=[0, 0], attn_temperature_tuning=True, attn_scale=0.5,
                             floor_scale=4)
    cache = KVCompileCache(policy, config, page_size=4)
    assert cache.plan.nope == (True, True) and cache.plan.temperature == (0.5, 4.0)
    chunks_equal_the_reference(cache, reference.ChunkedPrefill(policy, 2, rope=torch.zeros(4), temperature=(0.5, 4.0)),
                               pad)


def test_expected_attention_scores_the_nope_layers_as_the_reference():
    """Without temperature tuning the compressed layers are Llama 4's NoPE full_attention layers, whose map from a
    query to its position is the identity (R(t) = I): the plan gives the scorer zero rotary frequencies, and the
    kept entries are reference.compress's over the plain model's own states (transformers' attention, the chunked
    layers in chunks) scored without rotation, not those a rotary would give. At a budget that keeps everything,
    the plain model's tokens."""
    import dataclasses

    from kvcompile import reference
    from test_query_agnostic import EA, rope_of

    model = tiny_llama4(attn_temperature_tuning=False)
    ids = prompt(40, batch=2, seed=11)
    policy = kvcompile.load_spec({"name": "ea_llama4", "scoring": EA, "budget": {"per_head": 10}})
    with torch.no_grad():
        with kvcompile.compiled(model, policy):
            cache = cache_arg.of(model(ids, use_cache=True))
        ref = model.generate(ids, max_new_tokens=8, do_sample=False)
        with kvcompile.compiled(model, full_budget("expected_attention", 48, LAYERS)):
            got = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert cache.plan.rope == (0.0,) * 8
    states = reference.captured_states(model, ids)
    expected = reference.compress(policy, [dataclasses.replace(s, rope=torch.zeros(8)) for s in states])
    rotated = reference.compress(policy, [dataclasses.replace(s, rope=rope_of(16)) for s in states])
    assert len(states) == cache.plan.num_layers == 2
    for layer in range(cache.plan.num_layers):
        assert torch.equal(cache.kept_positions(layer), expected.kept[layer]), f"layer {layer}"
        assert int(expected.kept[layer].sum()) < expected.kept[layer].numel()  # evicted
    assert any(not torch.equal(expected.kept[i], rotated.kept[i]) for i in range(2))
    assert got.tolist() == ref.tolist()


def test_temperature_tuning_on_a_nope_chunked_layer_runs_before_the_last_full_layer_only():
    """A NoPE layer scales its queries by the cache's length before its attention; kvcompile's cache counts a
    forward's tokens after its last compressed layer (the last full_attention one), so a NoPE chunked layer before
    it runs exactly and one after it is refused (it runs with attn_temperature_tuning=False)."""
    ids = prompt(40, batch=2, seed=14)
    early = tiny_llama4(layer_types=["full_attention", "chunked_attention", "chunked_attention", "full_attention"],
                        no_rope_layers=[1, 0, 1, 0])
    late = dict(layer_types=["full_attention", "chunked_attention", "chunked_attention", "chunked_attention"],
                no_rope_layers=[1, 1, 1, 0])
    model = tiny_llama4(**late)
    with pytest.raises(kvcompile.CompileError, match=r"layers \[3\] are NoPE layers left to their window after its "
                                                     r"last full_attention layer \(0\)"):
        kvcompile.compile(model, "snapkv")
    assert "forward" not in model.__dict__
    for model in (early, tiny_llama4(attn_temperature_tuning=False, **late)):
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            with kvcompile.compiled(model, full_budget("snapkv", 40 + NEW, LAYERS)):
                got = model.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
        assert got.sequences.tolist() == ref.sequences.tolist()
        assert_close(torch.stack(got.logits), torch.stack(ref.logits), rtol=1e-5, atol=1e-5)


def test_chunked_attention_on_every_layer_is_refused():
    model = tiny_llama4()
    model.config.layer_types = None  # transformers then runs every layer chunked (attention_chunk_size)
    with pytest.raises(kvcompile.CompileError, match="attention_chunk_size without layer_types"):
        kvcompile.compile(model, "snapkv")


def test_continuous_batching_is_refused_as_transformers_refuses_it(model):
    """transformers' paged engine has no chunked layer (the plain model's generate_batch raises), so kvcompile's
    continuous batching on it is refused, with the reason."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=1, pad_token_id=0)
    inputs = [prompt(30, seed=3)[0].tolist()]
    with torch.no_grad():
        with pytest.raises(ValueError, match="chunked_attention"):
            model.generate_batch(inputs=inputs, generation_config=config)
        with kvcompile.compiled(model, "snapkv"):
            with pytest.raises(kvcompile.CompileError, match="continuous batching .* does not run model type "
                                                             "'llama4_text''s chunked_attention layers"):
                model.generate_batch(inputs=inputs, generation_config=config)


def test_a_dynamic_cache_on_a_chunked_model_is_refused(model):
    ids = prompt(20)
    with torch.no_grad(), kvcompile.compiled(model, "snapkv"):
        with pytest.raises(kvcompile.CompileError, match="DynamicCache\\) on a model with chunked_attention layers"):
            model(ids, **cache_arg.given(DynamicCache(config=model.config)))


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with the gloo backend is not available in this torch build")
def test_tensor_parallelism_equals_one_process(tmp_path):
    """transformers' tp_plan="auto" on 2 gloo processes, tiny Llama 4 in float64, at budgets that evict: each rank
    holds its own KV head's pages and chunks, and the kept entries, the chunked layers' keys and the generated
    tokens are a one-process run's."""
    from transformers import AutoModelForCausalLM
    from tp_run import run_specs, spawn

    names = ["snapkv", "h2o"]
    tiny_llama4().save_pretrained(tmp_path / "llama4")
    ranks = spawn(2, [("llama4", str(tmp_path / "llama4"), names)], tmp_path, 1800)  # (a hang guard only)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "llama4", dtype=torch.float64).eval()
    model.generation_config.pad_token_id = 0
    one = run_specs(model, names)
    for name in names:
        for rank, r in enumerate(ranks):
            got = r["llama4"][name]
            assert got["kv_heads"] == (rank,) and got["tokens"] == one[name]["tokens"], name
            assert {k: v[:2] for k, v in got["entries"].items()} == \
                {k: v[:2] for k, v in one[name]["entries"].items() if k[2] == rank}, name
            assert sorted(got["windows"]) == sorted(one[name]["windows"]) == LOCAL
            for field in ("bytes_by_kind", "bytes_full_by_kind"):
                assert got["gathered"][field] == one[name]["report"][field], (name, field)
            for layer, keys in got["windows"].items():
                assert keys.shape[1] == 1
                assert_close(keys, one[name]["windows"][layer][:, rank:rank + 1], rtol=1e-9, atol=1e-9)


def test_the_multimodal_wrapper_is_refused_with_its_text_model_named():
    """Llama4ForConditionalGeneration (model type llama4: a vision tower beside the language model) is not run; the
    refusal names its text model, which is."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    text = dict(vocab_size=96, hidden_size=64, intermediate_size=64, intermediate_size_mlp=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                attention_chunk_size=CHUNK)
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    model = Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=vision)).eval()
    with pytest.raises(kvcompile.CompileError, match="unsupported model type 'llama4'; .* its text model \\(model "
                                                     "type 'llama4_text'\\) is: load that alone"):
        kvcompile.compile(model, "snapkv")


def test_the_server_refuses_a_llama4_model_before_listening(tmp_path):
    """`kvcompile serve` on a Llama 4 checkpoint: the engine's refusal (its chunked layers) reaches the caller when
    the server is built, before it listens, and no engine thread is left running."""
    import threading

    pytest.importorskip("uvicorn")
    from test_serve_http import char_tokenizer

    from kvcompile.integrations.server import KVCompileServer, ServeOptions

    tokenizer = char_tokenizer()
    model = tiny_llama4(vocab_size=len(tokenizer))
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id, None
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    def engines():  # threads running an engine's generation loop (transformers names them by their target)
        return {t.ident for t in threading.enumerate() if t.is_alive() and "_run_generation_loop" in t.name}

    before = engines()
    with pytest.raises(kvcompile.CompileError, match="continuous batching .* does not run model type "
                                                     "'llama4_text''s chunked_attention layers"):
        KVCompileServer(ServeOptions(spec="snapkv", model=str(tmp_path), log_level="error", log_requests=False))
    assert engines() <= before
