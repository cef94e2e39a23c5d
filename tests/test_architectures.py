"""Qwen3-MoE, Mixtral, Phi-3 and OLMo 2 (tiny random models from transformers' own config classes): at a budget
that keeps every entry a compiled model gives the plain model's logits and tokens, in the eager and the compiled
entry, and every shipped spec runs at a budget that evicts. An attention feature kvcompile's op does not compute
(MLA, cross-attention, ALiBi) is refused by name, before anything changes."""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

import kvcompile
from kvcompile import cache as cache_arg
from kvcompile.passes.backend import COMPILES
from test_runtime import SPECS, compile_options, fresh_graphs_on_one_thread, full_budget, small_budget
from tiny import MORE_ARCHS, left_pad, prompt, tiny_model

N, NEW = 40, 6


@pytest.fixture(scope="module", params=MORE_ARCHS)
def model(request):
    return tiny_model(request.param)


@pytest.mark.parametrize("name", SPECS)
def test_full_budget_is_exact(model, name):
    ids = prompt(N, batch=2)
    with torch.no_grad():
        ref_logits = model(ids).logits
        ref_tokens = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        policy = full_budget(name, N + NEW, model.config.num_hidden_layers)
        with kvcompile.compiled(model, policy, **compile_options(policy)):
            logits = model(ids).logits
            out = model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert out.sequences.tolist() == ref_tokens.tolist()
    report = cache_arg.of(out).memory_report()
    assert report["bytes_entries"] == report["bytes_full"]  # every entry kept


def test_every_spec_runs_at_a_budget_that_evicts(model):
    ids = prompt(160, batch=2, seed=11)  # one length: kvzip's reconstruction runs unpadded batches only
    tokens, kept = {}, {}
    with torch.no_grad():
        for name in SPECS:
            policy = small_budget(name)
            with kvcompile.compiled(model, policy, **compile_options(policy)):
                out = model.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW,
                                     do_sample=False, return_dict_in_generate=True)
            tokens[name] = out.sequences[:, ids.shape[1]:].tolist()
            report = cache_arg.of(out).memory_report()
            kept[name] = (report["bytes_entries"], report["bytes_full"])
    for name, (held, full) in kept.items():
        assert 0 < held < full, (name, held, full)
    # the policies disagree here, so tokens that differ are evidence that each spec ran its own selection
    assert len({str(t) for t in tokens.values()}) > len(SPECS) // 3


@pytest.mark.slow
@pytest.mark.parametrize("arch", MORE_ARCHS)
def test_compiled_entry_at_a_full_budget_equals_the_plain_model(arch):
    model = tiny_model(arch, layers=2)
    ids, mask = left_pad([prompt(30, seed=3)[0], prompt(24, seed=4)[0]])
    with fresh_graphs_on_one_thread(), torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        for name in ("snapkv", "h2o"):
            with kvcompile.compiled(model, full_budget(name, 30 + NEW, 2), mode="compiled"):
                got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
            assert got.tolist() == ref.tolist(), name
    # Inductor compiled graphs in which kvcompile's passes found every layer's attention (prefill and decode)
    assert COMPILES and all(c["inductor"] for c in COMPILES), COMPILES
    assert sorted({layer for c in COMPILES for layer in c["layers"]}) == [0, 1], COMPILES


def _mla():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=4, n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1,
        first_k_dense_replace=1))


def _cross():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, add_cross_attention=True))


def _encoder_decoder():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=16, num_layers=1,
                                               num_decoder_layers=1, num_heads=2))


def _bloom():
    from transformers import BloomConfig, BloomForCausalLM

    return BloomForCausalLM(BloomConfig(vocab_size=50, hidden_size=16, n_layer=1, n_head=2))


def _falcon_alibi():
    from transformers import FalconConfig, FalconForCausalLM

    return FalconForCausalLM(FalconConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                          alibi=True))


@pytest.mark.parametrize("make, feature", [(_mla, "multi-head latent attention"), (_cross, "cross-attention"),
                                           (_encoder_decoder, "cross-attention"), (_bloom, "ALiBi"),
                                           (_falcon_alibi, "ALiBi")])
def test_an_unusual_attention_is_refused_by_name_before_any_change(make, feature):
    model = make()
    before = model.config._attn_implementation
    with pytest.raises(kvcompile.CompileError, match=f"uses {feature}.*tested model types: llama, "):
        kvcompile.compile(model, "snapkv")
    assert model.config._attn_implementation == before and "forward" not in model.__dict__


def test_an_untested_model_type_is_refused_with_the_tested_ones():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=16))
    with pytest.raises(kvcompile.CompileError, match="unsupported model type 'gpt_neox'; supported \\(tested\\): "
                                                     "llama, mistral, qwen2, qwen3, qwen3_moe, mixtral, phi3, olmo2"):
        kvcompile.compile(model, "snapkv")


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(vocab_size=50, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                          sliding_window=8, attn_implementation="eager"))


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM(GptOssConfig(vocab_size=50, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                          num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
                                          attn_implementation="eager"))


def _gemma3_bidirectional():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=50, hidden_size=32, intermediate_size=32,
                                              num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                                              head_dim=16, sliding_window=8, attn_implementation="sdpa",
                                              use_bidirectional_attention=True))


@pytest.mark.parametrize("make, spec, says", [
    (_gemma2, "expected_attention", "soft-caps its attention logits \\(attn_logit_softcapping=50.0: "
                                    "cap·tanh\\(s/cap\\).*expected_attention .*has none under the cap"),
    (_gemma3_bidirectional, "snapkv", "'gemma3_text' with use_bidirectional_attention=True attends to later tokens too")])
def test_what_the_op_does_not_compute_is_refused_by_name_before_any_change(make, spec, says):
    """Gemma 3's bidirectional mode attends to later tokens, and expected attention's closed form has no counterpart
    under Gemma 2's soft-capped logits: neither is computed by kvcompile, so each is refused, named, not
    approximated (a hybrid model's local layers run their window, and Gemma 2 and gpt-oss run the scorers, merges,
    quantized pages and chunked prefill with the cap and the sinks: tests/test_hybrid.py,
    tests/test_hybrid_scorers.py, tests/test_hybrid_capped_paths.py)."""
    model = make()
    before = model.config._attn_implementation
    with pytest.raises(kvcompile.CompileError, match=f"kvcompile: model type .*{says}"):
        kvcompile.compile(model, spec)
    assert model.config._attn_implementation == before and "forward" not in model.__dict__
