"""The compiled entry through the public API: kvcompile.compile(model, spec, mode="compiled")
gives the eager entry's greedy tokens for every spec on tiny GQA Llama, Mistral (with a
sliding window longer than every sequence here, as Mistral-7B-v0.1 configures one) and
Qwen2 (q/k/v biases), and generating more tokens adds no graph.

One set of Inductor graphs per architecture (prefill and decode) serves every spec:
the graph does not depend on the policy (docs/INTERNALS.md "The op and its two entries"), so the
specs run one after another on one model without recompiling."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch.testing import assert_close

import kvcompile
from kvcompile.passes.backend import COMPILES
from tiny import ARCHS, left_pad, prompt, tiny_model

# every shipped spec but the reconstruction scorers (kvzip), which compile() refuses in the compiled entry
# (its reconstruction pass runs eagerly; tests/test_kvzip.py tests the refusal)
SPECS = sorted(p.stem for p in (Path(__file__).parent.parent / "specs").glob("*.yaml")
               if not getattr(kvcompile.load_spec(p.stem).scoring, "reconstructs", False))
WINDOW = 256  # Mistral's sliding window: above the longest sequence generated here (150 + 64)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny shapes on one intra-op thread (as in test_passes.py): two threads on the shared
    2-core machine spin-wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small(name):
    policy = kvcompile.load_spec(name)
    if policy.budget.threshold is not None:
        return kvcompile.load_spec(name, budget={"threshold": {"attention_norm": {"t": 0.05}}})
    return kvcompile.load_spec(name, per_head=max(48, policy.ranking.sinks + policy.ranking.window + 16))


def model_of(arch: str):
    return tiny_model(arch, sliding_window=WINDOW) if arch == "mistral" else tiny_model(arch)


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_entry_equals_eager_for_every_spec(arch):
    model = model_of(arch)
    ids, mask = left_pad([prompt(150, seed=11)[0], prompt(120, seed=12)[0]])
    eager, compiled = {}, {}
    torch._dynamo.reset()  # graphs are shared by every model of a shape: none from an earlier test
    COMPILES.clear()
    with torch.no_grad():
        for name in SPECS:
            with kvcompile.compiled(model, small(name)):
                eager[name] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        for name in SPECS:
            with kvcompile.compiled(model, small(name), mode="compiled"):
                compiled[name] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        assert model.config._attn_implementation == "sdpa" and "forward" not in model.__dict__
        # the model's graphs: prefill (symbolic length) and decode, shared by every spec
        assert [c["inductor"] and c["layers"] for c in COMPILES] == [[0, 1, 2]] * 2
        # after warm-up, 64 more generated tokens add no graph
        with kvcompile.compiled(model, small("snapkv"), mode="compiled"):
            warm = graphs()
            model.generate(ids, attention_mask=mask, max_new_tokens=64, min_new_tokens=64, do_sample=False)
            assert graphs() == warm
    print(f"\n{arch}: graphs compiled in " + ", ".join(f"{c['seconds']:.1f} s" for c in COMPILES))
    for name in SPECS:
        assert compiled[name].tolist() == eager[name].tolist(), name
    # the policies disagree here, so equal tokens are evidence that each spec ran
    assert len({str(tokens.tolist()) for tokens in eager.values()}) > len(SPECS) // 2


def test_sliding_window_runs_up_to_the_window_and_refuses_longer_sequences():
    """kvcompile attends to every kept entry: under Mistral's sliding window that is the
    model's own attention for sequences of at most `window` tokens; a longer one is
    refused in both entries (before anything is compiled or generated)."""
    model = tiny_model("mistral", sliding_window=32)
    policy = kvcompile.load_spec("snapkv", per_head=64)  # keeps every token: the model's own logits
    ids = prompt(40, seed=3)
    with torch.no_grad():
        expected = model(ids[:, :32]).logits
        with kvcompile.compiled(model, policy):
            assert_close(model(ids[:, :32]).logits, expected)
            with pytest.raises(kvcompile.CompileError, match="sliding window \\(32 tokens\\)"):
                model(ids)
            with pytest.raises(kvcompile.CompileError, match="33 tokens"):
                model.generate(ids[:, :30], max_new_tokens=3, do_sample=False)
            cache = kvcompile.KVCompileCache(policy, model.config)
            model(ids[:, :31], past_key_values=cache)
            with pytest.raises(kvcompile.CompileError, match="33 tokens"):
                model(ids[:, 31:33], past_key_values=cache)
            assert model.generate(ids[:, :30], max_new_tokens=2, do_sample=False).shape == (1, 32)
        with kvcompile.compiled(model, policy, mode="compiled"):
            with pytest.raises(kvcompile.CompileError, match="40 tokens"):
                model(ids)


@pytest.mark.slow
def test_new_batch_sizes_and_prompt_lengths_compile_nothing_new(capsys):
    """generate() at batch 1 (no mask), then 2 and 3 (left padding, attention_mask), each with
    new prompt lengths: the first prefill + decode pair serves them all (the batch is
    symbolic from the first call, size 1 included: backend.py "Shapes"), the tokens are the
    eager entry's, and each Inductor compile printed one line before and one after on
    stderr, none for a reused graph. Batch 3's tensors are made under inference_mode and
    used under no_grad (dynamo guards on dispatch keys: the wrapper clones them)."""
    from kvcompile.passes.backend import SERIAL_WORK

    model = tiny_model("llama")
    policy = kvcompile.load_spec("snapkv", per_head=40)
    with torch.inference_mode():
        third = left_pad([prompt(70, seed=24)[0], prompt(31, seed=25)[0], prompt(95, seed=26)[0]])
    batches = [(prompt(57, seed=21), None),
               left_pad([prompt(83, seed=22)[0], prompt(46, seed=23)[0]]),
               third]
    torch._dynamo.reset()
    COMPILES.clear()
    counts, lines = [], []
    with torch.no_grad():
        for ids, mask in batches:
            kw = {} if mask is None else {"attention_mask": mask}
            with kvcompile.compiled(model, policy):
                eager = model.generate(ids, max_new_tokens=6, do_sample=False, **kw)
            capsys.readouterr()
            with kvcompile.compiled(model, policy, mode="compiled"):
                compiled = model.generate(ids, max_new_tokens=6, do_sample=False, **kw)
            lines.append([line for line in capsys.readouterr().err.splitlines() if line.startswith("kvcompile:")])
            counts.append(len(COMPILES))
            assert compiled.tolist() == eager.tolist(), ids.shape
    assert counts == [2, 2, 2]
    assert [c["kind"] for c in COMPILES] == ["prefill", "decode"]
    # decode (static query length) keeps small loops serial though its batch is symbolic
    assert [c["options"] for c in COMPILES] == [{}, {"cpp.min_chunk_size": SERIAL_WORK}]
    first, *rest = lines
    assert first[0] == "kvcompile: compiling the prefill graph (3 layers) with Inductor …"
    assert first[1].startswith("kvcompile: compiled the prefill graph in ")
    assert first[2] == "kvcompile: compiling the decode graph (3 layers) with Inductor …"
    assert first[3].startswith("kvcompile: compiled the decode graph in ") and len(first) == 4
    assert rest == [[], []]


WARM_START = """
import json, sys
import torch
sys.path[:0] = [{root!r}, {tests!r}]
import kvcompile
from torch._dynamo.utils import counters
from kvcompile.passes.backend import COMPILES
from tiny import left_pad, prompt, tiny_model
torch.set_num_threads(1)
model = tiny_model("llama", layers=1)
ids, mask = left_pad([prompt(40, seed=1)[0], prompt(25, seed=2)[0]])
with torch.no_grad(), kvcompile.compiled(model, kvcompile.load_spec("snapkv", per_head=36), mode="compiled"):
    logits = model(ids, attention_mask=mask).logits
print("RESULT", json.dumps({{"cache": [c["cache"] for c in COMPILES], "hit": counters["inductor"]["fxgraph_cache_hit"],
                            "logits": logits[:, -1].tolist()}}))
"""


@pytest.mark.slow
def test_a_second_process_reuses_the_inductor_cache(tmp_path):
    """Two fresh processes compile the same tiny model (one prefill graph) into one Inductor
    cache directory: the first misses, the second hits Inductor's FX graph cache (the
    kvcompile.attend op and the backend's settings hash the same) and computes the same."""
    import json
    import os
    import subprocess
    import sys

    tests = Path(__file__).parent
    script = WARM_START.format(root=str(tests.parent), tests=str(tests))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    results = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(proc.stdout.split("RESULT", 1)[1]))
        assert "kvcompile: compiling the prefill graph (1 layer) with Inductor …" in proc.stderr
    cold, warm = results
    assert cold["cache"] == ["miss"] and cold["hit"] == 0
    assert warm["cache"] == ["hit"] and warm["hit"] == 1
    assert warm["logits"] == cold["logits"]


@pytest.mark.slow
def test_a_policy_that_compresses_while_prefilling_in_chunks():
    """kvcompile.compile(model, spec, mode="compiled") with `schedule: {prefill: {chunk: c}}` (a drop, a cascade,
    a merge and a threshold policy; a left-padded batch; tests/test_chunked.py is the eager entry against the
    specification): generate() gives the eager entry's tokens and keeps the same entries of every layer, and
    model() on the whole prompt (fed c tokens per compiled call) gives its logits. One set of graphs serves
    every policy: the prefill graph of a first chunk, one of the later chunks (their padding mask is longer
    than their ids: a guard of transformers' mask code), the decode graph; a prompt of other lengths compiles
    nothing new. (Last in this file: the tests above count the graphs a fresh process compiles.)"""
    from test_decode import assert_same_cache

    llama = tiny_model("llama")

    def small(name, **schedule):  # a budget above the chunk's window, so that chunks evict
        policy = kvcompile.load_spec(name, schedule=schedule)
        if policy.budget.threshold is not None:
            return policy
        return kvcompile.load_spec(policy, per_head=max(24, policy.ranking.sinks + policy.ranking.window + 8))

    ids, mask = left_pad([prompt(75, seed=5)[0], prompt(60, seed=6)[0]])
    for name in ("snapkv", "lava", "zsmerge", "dbudgetkv"):
        policy = small(name, prefill={"chunk": 16})
        runs = {}
        for mode in ("eager", "compiled"):
            with kvcompile.compiled(llama, policy, mode=mode), torch.no_grad():
                out = llama.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                     return_dict_in_generate=True)
                logits = llama(ids, attention_mask=mask).logits
            runs[mode] = out, logits
        (eager, eager_logits), (comp, comp_logits) = runs["eager"], runs["compiled"]
        assert comp.sequences.tolist() == eager.sequences.tolist(), name
        a, b = eager.past_key_values, comp.past_key_values
        assert torch.equal(a.kept(), b.kept()), name
        for layer in range(llama.config.num_hidden_layers):
            assert torch.equal(a.kept_positions(layer), b.kept_positions(layer)), name
            assert_same_cache(b.stores[layer].to_heads(), a.stores[layer].to_heads())
        assert_close(comp_logits, eager_logits, rtol=1e-4, atol=1e-4)
        # it evicted: fewer entries than the 75 prompt tokens + 5 appended of 2 rows x 3 layers x 2 heads
        assert int(a.kept().sum()) < 2 * 3 * 2 * 80 or policy.budget.threshold is not None, name
    with kvcompile.compiled(llama, small("lava", prefill={"chunk": 16}), mode="compiled"), torch.no_grad():
        warm = graphs()
        other, other_mask = left_pad([prompt(50, seed=7)[0], prompt(41, seed=8)[0], prompt(33, seed=9)[0]])
        llama.generate(other, attention_mask=other_mask, max_new_tokens=3, do_sample=False)
        assert graphs() == warm
