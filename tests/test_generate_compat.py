"""Every generate() path a transformers user takes (docs/GENERATE.md, one test per row): exact,
or refused with a clear error before the prompt runs. Tiny Llama and Qwen2, snapkv, lava,
zsmerge and dbudgetkv, the eager and the compiled entry where the row applies.

`full` budgets cover the whole sequence, so the compressed model must equal the plain one;
`small` budgets evict, so the path must equal the same policy through the plain path
(one pass, greedy, no copy)."""
from __future__ import annotations

import copy

import pytest
import torch

import kvcompile
from kvcompile import CompileError, KVCompileCache
from tiny import left_pad, prompt, tiny_model

SPECS = ["snapkv", "lava", "zsmerge", "dbudgetkv"]
ENTRIES = ["eager", "compiled"]
N, NEW = 48, 5


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return tiny_model(request.param, layers=2)


def full(name: str, layers: int = 2):
    if kvcompile.load_spec(name).budget.threshold is not None:  # keep every layer whole
        return kvcompile.load_spec(name, budget={"threshold": {"attention_norm": {"keep_layers": layers}}},
                                   storage="model_dtype")
    # in the model's dtype: a quantizing storage part rounds entries by design (tests/test_storage*.py)
    return kvcompile.load_spec(name, per_head=400, storage="model_dtype")


def small(name: str):
    if kvcompile.load_spec(name).budget.threshold is not None:
        return kvcompile.load_spec(name, budget={"threshold": {"attention_norm": {"t": 0.05, "keep_layers": 0}}})
    return kvcompile.load_spec(name, per_head=36)  # of 48 prompt tokens; ranking windows are up to 32


def gen(model, ids, **kwargs):
    kwargs.setdefault("attention_mask", torch.ones_like(ids))
    kwargs.setdefault("max_new_tokens", NEW)
    kwargs.setdefault("do_sample", False)
    with torch.no_grad():
        return model.generate(ids, **kwargs)


def tokens(out):
    return (out.sequences if hasattr(out, "sequences") else out).tolist()


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", SPECS)
def test_sampling_and_num_return_sequences(model, name, entry):
    ids = prompt(N, seed=1)
    torch.manual_seed(5)
    plain = gen(model, ids, do_sample=True, top_k=20, num_return_sequences=3)
    with kvcompile.compiled(model, full(name), mode=entry):
        torch.manual_seed(5)
        got = gen(model, ids, do_sample=True, top_k=20, num_return_sequences=3)
    assert got.shape[0] == 3 and got.tolist() == plain.tolist()


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", SPECS)
def test_multi_turn_continuation(model, name, entry):
    """generate() again from the cache it returned, with more user tokens."""
    ids = prompt(N, seed=2)
    first = gen(model, ids, return_dict_in_generate=True)
    turn = torch.cat([first.sequences, prompt(7, seed=3)], dim=1)
    plain = gen(model, turn, past_key_values=first.past_key_values)
    with kvcompile.compiled(model, full(name), mode=entry):
        mine = gen(model, ids, return_dict_in_generate=True)
        assert isinstance(mine.past_key_values, KVCompileCache)
        got = gen(model, turn, past_key_values=mine.past_key_values)
    assert got.tolist() == plain.tolist()


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", SPECS)
def test_prefix_cache_deepcopy(model, name, entry):
    """transformers' prefix-caching recipe: prefill a prefix once, deep-copy the cache per
    question. The copies are independent: the original is untouched and each answer is the
    plain model's."""
    prefix = prompt(30, seed=4)
    questions = [torch.cat([prefix, prompt(12, seed=s)], dim=1) for s in (5, 6)]
    with kvcompile.compiled(model, full(name), mode=entry), torch.no_grad():
        cached = model(prefix, attention_mask=torch.ones_like(prefix)).past_key_values
        before = cached.memory_report()
        answers = [gen(model, q, past_key_values=copy.deepcopy(cached)) for q in questions]
        after = cached.memory_report()
    assert cached.seq_length == 30 and torch.equal(before["kept"], after["kept"])
    for q, answer in zip(questions, answers):
        assert answer.tolist() == gen(model, q).tolist()


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", SPECS)
def test_prefill_chunk_size_is_one_pass(model, name, entry):
    ids, mask = left_pad([prompt(N, seed=7)[0], prompt(N - 9, seed=8)[0]])
    with kvcompile.compiled(model, small(name), mode=entry):
        one = gen(model, ids, attention_mask=mask, return_dict_in_generate=True)
        chunked = gen(model, ids, attention_mask=mask, return_dict_in_generate=True, prefill_chunk_size=16)
    assert tokens(chunked) == tokens(one)
    a, b = one.past_key_values.memory_report(), chunked.past_key_values.memory_report()
    assert torch.equal(a["kept"], b["kept"]) and a["bytes_held"] == b["bytes_held"]
    if kvcompile.load_spec(name).budget.threshold is None:
        assert b["bytes_held"] < b["bytes_full"]


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", SPECS)
def test_beam_search(model, name, entry):
    """Each beam continues its parent's compressed cache: with a budget covering everything
    the beams are the plain model's; with compression both entries agree."""
    ids = prompt(N, seed=9)
    with kvcompile.compiled(model, full(name), mode=entry):
        got = gen(model, ids, num_beams=3)
    assert got.tolist() == gen(model, ids, num_beams=3).tolist()
    with kvcompile.compiled(model, small(name), mode="eager"):
        eager = gen(model, ids, num_beams=3, num_return_sequences=2)
    with kvcompile.compiled(model, small(name), mode=entry):
        assert gen(model, ids, num_beams=3, num_return_sequences=2).tolist() == eager.tolist()


@pytest.mark.parametrize("name", SPECS)
def test_each_beam_is_its_own_sequence(model, name):
    """With compression, every returned beam scores what its own tokens score through a fresh
    compressed cache fed one token at a time (the policy applied to that beam alone): no beam
    continued another beam's cache."""
    ids = prompt(N, seed=21)
    policy = small(name)
    with kvcompile.compiled(model, policy), torch.no_grad():
        out = gen(model, ids, num_beams=3, num_return_sequences=3, length_penalty=0.0, bad_words_ids=[[1]],
                  return_dict_in_generate=True, output_scores=True)
        for sequence, score in zip(out.sequences, out.sequences_scores):
            new = sequence[N:]
            cache = KVCompileCache(policy, model.config)
            logits = model(ids, past_key_values=cache).logits[0, -1]
            total = 0.0
            for token in new:
                total += float(torch.log_softmax(logits.float(), -1)[token])
                logits = model(token.view(1, 1), past_key_values=cache).logits[0, -1]
            assert total == pytest.approx(float(score), rel=1e-4, abs=1e-4)


def test_reorder_copies_rows():
    """reorder_cache: row i becomes a copy of row beam_idx[i]; appending to one copy leaves
    the other and the parent's pages alone."""
    model = tiny_model("llama", layers=2)
    policy = small("zsmerge")
    ids = torch.cat([prompt(N, seed=10), prompt(N, seed=11)])
    cache = KVCompileCache(policy, model.config)
    with kvcompile.compiled(model, policy), torch.no_grad():
        model(ids, past_key_values=cache)
        model(prompt(1, batch=2, seed=12), past_key_values=cache)
        parent = [s.gather() for s in cache.stores]
        cache.reorder_cache(torch.tensor([1, 1]))
        for layer, store in enumerate(cache.stores):
            k, v, scores, pos, counts, stored = store.gather()
            pk, pv, ps, pp, pc, pst = parent[layer]
            for row in (0, 1):
                n = int(stored[row].sum(-1).max())
                assert torch.equal(stored[row, :, :n], pst[1, :, :n]) and torch.equal(pos[row, :, :n], pp[1, :, :n])
                assert torch.equal(k[row, :, :n], pk[1, :, :n]) and torch.equal(counts[row, :, :n], pc[1, :, :n])
        model(torch.tensor([[5], [6]]), past_key_values=cache)  # the two copies now differ
        a, b = (cache.stores[0].gather()[1][row] for row in (0, 1))
    assert not torch.equal(a, b)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", SPECS)
def test_prompt_lookup_decoding(model, name, entry):
    """Assisted decoding crops rejected candidates: exact for policies that evict nothing and
    update no score while decoding (the same tokens as greedy), refused up front otherwise."""
    ids = torch.cat([prompt(20, seed=13)] * 3, dim=1)  # repeats: lookup finds candidates
    policy = small(name)
    with kvcompile.compiled(model, policy, mode=entry):
        plan = model.kvcompile_plan
        if plan.running_scores or plan.online_eviction or plan.prune_every or plan.cascade:
            with pytest.raises(CompileError, match="crop|cascade"):
                gen(model, ids, prompt_lookup_num_tokens=3)
            return
        assert gen(model, ids, prompt_lookup_num_tokens=3).tolist() == gen(model, ids).tolist()


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", SPECS)
def test_cache_made_under_inference_mode(model, name, entry):
    ids = prompt(N, seed=14)
    more = prompt(6, seed=15)
    with kvcompile.compiled(model, small(name), mode=entry):
        with torch.inference_mode():
            a = model(ids, attention_mask=torch.ones_like(ids)).past_key_values
        with torch.no_grad():
            b = model(ids, attention_mask=torch.ones_like(ids)).past_key_values
            out_a = model(more, past_key_values=a).logits  # outside inference mode
            out_b = model(more, past_key_values=b).logits
    assert torch.equal(out_a, out_b)


@pytest.mark.parametrize("entry", ENTRIES)
def test_cache_implementation(model, entry):
    ids = prompt(N, seed=16)
    with kvcompile.compiled(model, small("snapkv"), mode=entry):
        want = gen(model, ids)
        with pytest.raises(CompileError, match="cache_implementation"):
            gen(model, ids, cache_implementation="static")
        config = copy.deepcopy(model.generation_config)
        config.cache_implementation = "static"  # as a checkpoint's generation_config may say
        with pytest.warns(UserWarning, match="generation_config=...\\) sets cache_implementation='static'; ignored"):
            got = gen(model, ids, generation_config=config, max_new_tokens=NEW)
        assert got.tolist() == want.tolist()


@pytest.mark.parametrize("entry", ENTRIES)
def test_refused_before_the_prompt_runs(model, entry):
    """output_attentions, right padding: a clear error, and the model never ran."""
    ids = prompt(N, seed=17)
    calls = []
    hook = model.model.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with kvcompile.compiled(model, small("lava"), mode=entry):
            with pytest.raises(CompileError, match="output_attentions"):
                gen(model, ids, output_attentions=True, return_dict_in_generate=True)
            with pytest.raises(CompileError, match="output_attentions"):
                model(ids, output_attentions=True)
            right = torch.ones(2, N, dtype=torch.long)
            right[1, -5:] = 0
            with pytest.raises(CompileError, match="right-padded"):
                gen(model, torch.cat([ids, ids]), attention_mask=right)
    finally:
        hook.remove()
    assert not calls


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype, entry):
    """fp16 / bf16 models: with a budget covering everything, the logits of the prompt and of
    every generated step are the plain model's up to half-precision rounding."""
    model = tiny_model("llama", layers=2).to(dtype)
    ids = prompt(N, seed=22)
    plain = gen(model, ids, return_dict_in_generate=True, output_logits=True)
    with kvcompile.compiled(model, full("zsmerge"), mode=entry):
        got = gen(model, ids, return_dict_in_generate=True, output_logits=True)
        assert model.kvcompile_plan.decode_impl != "cpp"  # the C++ kernel is fp32 only
    for a, b in zip(plain.logits, got.logits):
        torch.testing.assert_close(b.float(), a.float(), atol=0.05, rtol=0.05)
    assert got.past_key_values.stores[0].k_pages.dtype == dtype


def test_unknown_kernel_is_refused_at_compile(model):
    with pytest.raises(CompileError, match="cuda"):
        kvcompile.compile(model, "snapkv", kernels="cuda")
    assert "forward" not in model.__dict__


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", SPECS)
def test_training_makes_no_cache(model, name, entry):
    ids = prompt(N, seed=18)
    with kvcompile.compiled(model, small(name), mode=entry):
        model.train()
        try:
            out = model(ids, labels=ids)
            out.loss.backward()
        finally:
            model.eval()
            model.zero_grad()
    assert not isinstance(out.past_key_values, KVCompileCache)
    assert torch.isfinite(out.loss)


def test_accelerate_hook_survives_compile_and_uncompile():
    accelerate = pytest.importorskip("accelerate.hooks", reason="accelerate is a test dependency")
    model = tiny_model("llama", layers=2)
    calls = []

    class Counting(accelerate.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(1)
            return args, kwargs

    accelerate.add_hook_to_module(model, Counting())
    ids = prompt(N, seed=19)
    with kvcompile.compiled(model, small("snapkv")):
        gen(model, ids)
        assert calls, "the hook runs while compiled"
    with pytest.raises(CompileError, match="accelerate"):
        kvcompile.compile(model, "snapkv", mode="compiled")
    calls.clear()
    with torch.no_grad():
        model(ids)
    assert calls, "the hook is back after uncompile()"


@pytest.mark.parametrize("entry", ENTRIES)
def test_pipeline(model, entry):
    """transformers' text-generation pipeline reaches the compiled generate()."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast, pipeline

    vocab = {f"w{i}": i for i in range(96)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w3"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="w0", eos_token="w1", bos_token="w2")
    text = " ".join(f"w{int(i)}" for i in prompt(N, seed=20)[0])
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    want = pipe(text, max_new_tokens=NEW, do_sample=False)[0]["generated_text"]
    with kvcompile.compiled(model, full("lava"), mode=entry):
        got = pipe(text, max_new_tokens=NEW, do_sample=False)[0]["generated_text"]
    assert got == want
