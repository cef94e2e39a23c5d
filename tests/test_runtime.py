"""The runtime on tiny random-weight Llama / Mistral / Qwen2 models (GQA), eager entry."""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import kvcompile
from kvcompile import reference
from kvcompile.cache import KVCompileCache
from tiny import ARCHS, left_pad, prompt, tiny_model

SPECS = sorted(p.stem for p in (Path(__file__).parent.parent / "specs").glob("*.yaml"))
# kvzip scores by a reconstruction pass over the whole model, not from one layer's recorded state: its
# kept entries against the reference are tested in tests/test_kvzip.py (reference.kvzip_scores)
PER_LAYER_SPECS = [name for name in SPECS if not getattr(kvcompile.load_spec(name).scoring, "reconstructs", False)]


@contextlib.contextmanager
def fresh_graphs_on_one_thread():
    """For a compiled-entry test on tiny shapes: one torch thread (two on a shared 2-core machine spin-wait on each
    other), no graph of an earlier test (dynamo's graphs are shared by every model of a shape), and
    passes.backend.COMPILES emptied, so that it records this test's compilations only; the threads restored."""
    from kvcompile.passes.backend import COMPILES

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    COMPILES.clear()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def compile_options(policy) -> dict:
    """A reconstruction scorer's repeat prompt, as token ids of the tiny vocabulary (kvzip)."""
    from kvcompile.kvzip import RepeatPrompt

    if getattr(policy.scoring, "reconstructs", False):
        return {"repeat_prompt": RepeatPrompt(first=(5, 6, 7), later=(8, 9), suffix=(10,))}
    return {}


def full_budget(name: str, n: int, layers: int):
    """The spec with a budget that covers the whole prompt (nothing may be evicted), its entries in the model's
    dtype (a quantizing storage part rounds them by design: tests/test_storage*.py check it against the
    reference, and a tiered part with every entry in full precision against the plain model)."""
    policy = kvcompile.load_spec(name, storage="model_dtype")
    if policy.budget.threshold is not None:
        return kvcompile.load_spec(name, budget={"threshold": {"attention_norm": {"keep_layers": layers}}},
                                   storage="model_dtype")
    return kvcompile.load_spec(name, per_head=n + 64, storage="model_dtype") if policy.budget.per_head else \
        kvcompile.load_spec(name, ratio=1.0, storage="model_dtype")


def small_budget(name: str):
    """The spec with a budget that evicts most of a 160-token prompt."""
    policy = kvcompile.load_spec(name)
    if policy.budget.threshold is not None:
        return kvcompile.load_spec(name, budget={"threshold": {"attention_norm": {"t": 0.05}}})
    protected = policy.ranking.sinks + policy.ranking.window
    return kvcompile.load_spec(name, per_head=max(48, protected + 16))


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_specs_exist():
    for name in ("snapkv", "pyramidkv", "adakv", "lava", "dbudgetkv", "zsmerge", "streamingllm", "tova", "h2o"):
        assert name in SPECS


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", SPECS)
def test_full_budget_is_exact(arch, name):
    """A budget covering the prompt gives the uncompressed model's logits and tokens."""
    model = tiny_model(arch)
    ids = prompt(40, batch=2)
    with torch.no_grad():
        ref_logits = model(ids).logits
        ref_tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
        policy = full_budget(name, 40 + 6, model.config.num_hidden_layers)
        with kvcompile.compiled(model, policy, **compile_options(policy)):
            logits = model(ids).logits
            tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert tokens.tolist() == ref_tokens.tolist()


def run_recorded(model, policy, ids, mask=None) -> KVCompileCache:
    cache = KVCompileCache(policy, model.config, record=True)
    with kvcompile.compiled(model, policy), torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    return cache


@pytest.mark.parametrize("name", PER_LAYER_SPECS)
def test_kept_equals_reference(llama, name):
    """With real budgets, the tokens the runtime keeps are the reference's, layer by layer."""
    policy = small_budget(name)
    ids = prompt(160, batch=2, seed=5)
    cache = run_recorded(llama, policy, ids)
    selection = reference.compress(policy, cache.states)
    evicted = 0
    for layer in range(llama.config.num_hidden_layers):
        kept = cache.kept_positions(layer)
        assert torch.equal(kept, selection.kept[layer]), f"layer {layer}"
        evicted += int((~kept).sum())
        if policy.merges:  # the occupied residual slots, in order, with their counts
            merged = selection.merged[layer]
            store = cache.stores[layer]
            k, v, _, _, counts, _ = store.gather()
            occupied = merged.counts > 0
            assert torch.equal(store.slots, occupied.sum(-1))
            for b in range(k.shape[0]):
                for h in range(k.shape[1]):
                    n = int(store.slots[b, h])
                    assert torch.equal(counts[b, h, :n].long(), merged.counts[b, h][occupied[b, h]])
                    assert_close(k[b, h, :n], merged.keys[b, h][occupied[b, h]])
                    assert_close(v[b, h, :n], merged.values[b, h][occupied[b, h]])
    assert evicted > 0, "the budget should evict something"


@pytest.mark.parametrize("name", ["snapkv", "adakv", "lava", "zsmerge", "dbudgetkv"])
def test_memory_report_matches_budgets(llama, name):
    policy = small_budget(name)
    ids = prompt(160, batch=2, seed=6)
    cache = run_recorded(llama, policy, ids)
    selection = reference.compress(policy, cache.states)
    report = cache.memory_report()
    slots = [torch.zeros_like(selection.budgets[:, 0]) if m is None else (m.counts > 0).sum(-1)
             for m in selection.merged]
    assert torch.equal(report["kept"], selection.budgets + torch.stack(slots, dim=1))
    pages = (report["kept"] + cache.page_size - 1) // cache.page_size
    assert torch.equal(report["pages"], pages)
    entry = 2 * llama.config.head_dim * 4
    assert report["bytes_held"] == int(pages.sum()) * cache.page_size * entry
    assert report["bytes_full"] == 2 * 160 * llama.config.num_hidden_layers * llama.config.num_key_value_heads * entry
    assert report["bytes_held"] < report["bytes_full"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["snapkv", "lava", "zsmerge", "streamingllm"])
def test_padded_batch_equals_single_runs(arch, name):
    """Left padding: each sequence of a batch gives what it gives alone (budgets per sequence)."""
    model = tiny_model(arch)
    policy = small_budget(name)
    seqs = [prompt(150, seed=7)[0], prompt(97, seed=8)[0]]
    ids, mask = left_pad(seqs)
    with kvcompile.compiled(model, policy), torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                               return_dict_in_generate=True)
        alone = [model.generate(s[None], max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
                 for s in seqs]
    kept = batch.past_key_values.kept()
    for i, run in enumerate(alone):
        assert batch.sequences[i, -8:].tolist() == run.sequences[0, -8:].tolist()
        assert torch.equal(kept[i], run.past_key_values.kept()[0])
    # pad tokens are never stored
    first = batch.past_key_values
    for layer in range(model.config.num_hidden_layers):
        _, _, _, pos, _, stored = first.stores[layer].gather()
        assert int((stored & (pos >= 0)).sum(-1).max()) <= 150 + 8


def test_policies_one_after_another_leave_no_state(llama):
    ids = prompt(120, seed=9)
    with torch.no_grad():
        for name in ("snapkv", "h2o", "lava"):
            kvcompile.compile(llama, small_budget(name))
            llama.generate(ids, max_new_tokens=4, do_sample=False)
        second = llama.generate(ids, max_new_tokens=6, do_sample=False)
        kvcompile.uncompile(llama)
        fresh = tiny_model("llama")
        kvcompile.compile(fresh, small_budget("lava"))
        expected = fresh.generate(ids, max_new_tokens=6, do_sample=False)
    assert second.tolist() == expected.tolist()
    assert llama.config._attn_implementation == "sdpa"
    assert "forward" not in llama.__dict__


def test_compressed_generation_differs_but_runs(llama):
    """Sanity: a small budget changes the computation (the policy is really applied)."""
    ids = prompt(160, seed=10)
    with torch.no_grad():
        full = llama(ids).logits[:, -1]
        with kvcompile.compiled(llama, small_budget("snapkv")):
            out = llama.generate(ids, max_new_tokens=2, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    assert_close(out.logits[0], full)  # the prompt's own forward pass is unchanged
    assert out.past_key_values.memory_report()["bytes_held"] < out.past_key_values.memory_report()["bytes_full"]


def test_unsupported_model_is_refused_before_any_change():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    before = model.config._attn_implementation
    with pytest.raises(kvcompile.CompileError, match="unsupported model type 'gpt2'"):
        kvcompile.compile(model, "snapkv")
    assert model.config._attn_implementation == before and "forward" not in model.__dict__


def test_bad_spec_changes_nothing(llama):
    with pytest.raises(kvcompile.SpecError):
        kvcompile.compile(llama, {"scoring": "no_such_scorer", "budget": {"per_head": 8}})
    assert llama.config._attn_implementation == "sdpa" and "forward" not in llama.__dict__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn runs only on a CUDA GPU; none here")
def test_flash_attn_prefill_matches_sdpa():
    pytest.importorskip("flash_attn", reason="flash-attn is an optional extra (pip install kvcompile[flash])")
    from kvcompile.engine.prefill import prompt_attention

    q = torch.randn(2, 8, 64, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.float16)
    v = torch.randn(2, 4, 64, 64, device="cuda", dtype=torch.float16)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_close(prompt_attention(q, k, v, None, 64 ** -0.5), expected, rtol=2e-3, atol=2e-3)
