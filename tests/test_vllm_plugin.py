"""kvcompile's vLLM plugin (kvcompile/integrations/vllm, docs/VLLM.md): refusals at load and at configuration; with a
budget covering the prompt vLLM's greedy tokens are plain vLLM's; with compression they are kvcompile's
own generate() under the same spec (kvcompile's environment), the kept (layer, head, position) entries are
kvcompile's reference selection on the same prompt, requests run together equal their runs alone, the
freed blocks are those the policy's counts say, and every block is back in the pool at the end.
Each vLLM run is a subprocess of the vLLM environment (tests/vllm_run.py), bounded in time; the long ones are
queued into the suite's background lane when the suite is collected (queue_runs, tests/lane.py), so that they run
beside the tests before these (a test whose run has not started runs it itself)."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from lane import Job, Lane
from vllm_venv import MODEL, PYTHON, ROOT, in_vllm_env_job, needs_vllm, result, vllm_env

pytestmark = needs_vllm
MAX_TOKENS = 8


def vllm_job(prompts: list[list[int]], timeout: int = 420, more: dict | None = None, **plugin) -> Job:
    """tests/vllm_run.py on `prompts` (`more`: its other arguments, "runs" or "options"); `plugin`: the
    KVCOMPILE_VLLM_* settings."""
    args = {"model": str(MODEL), "prompts": prompts, "max_tokens": MAX_TOKENS, **(more or {})}
    return Job([str(PYTHON), str(ROOT / "tests" / "vllm_run.py"), json.dumps(args)], vllm_env(**plugin), str(ROOT),
               timeout)


def chat_prompts(tokenizer) -> list[list[int]]:
    """Two chat prompts of a few hundred tokens over the haystack."""
    from kvcompile.tools.data import load_haystack, split_sentences, user_turn

    sentences = split_sentences(load_haystack())
    prompts = []
    for start, count in ((0, 14), (40, 11)):
        text = " ".join(sentences[start:start + count])
        prompts.append(tokenizer(user_turn(tokenizer, f"{text}\n\nSummarise the text in one sentence.")).input_ids)
    return prompts


@pytest.fixture(scope="module")
def model_and_prompts():
    """SmolLM2 in kvcompile's environment and the two chat prompts."""
    from kvcompile.tools.models import load_model

    model, tokenizer = load_model(MODEL)
    prompts = chat_prompts(tokenizer)
    assert all(200 <= len(p) <= 600 for p in prompts), [len(p) for p in prompts]
    return model, prompts


REFUSALS = """
import json, os
import vllm
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from kvcompile.integrations.vllm import register
from kvcompile.integrations.vllm.settings import PluginError
out = {"off_path": None, "refused": {}, "config": {}}
register()  # KVCOMPILE_VLLM_SPEC unset: nothing patched
out["off_path"] = AttentionBackendEnum.CPU_ATTN.get_path()
for spec in ("zsmerge", "kvzip", "kivi", "lava_mixed", "expected_attention"):
    os.environ["KVCOMPILE_VLLM_SPEC"] = spec
    try:
        register()
        out["refused"][spec] = None
    except PluginError as exc:
        out["refused"][spec] = str(exc)
out["off_after_refusals"] = AttentionBackendEnum.CPU_ATTN.get_path()
from kvcompile.spec import load_spec
from kvcompile.integrations.vllm.settings import refusal
out["accepted"] = {spec: refusal(load_spec(spec)) for spec in ("adakv", "lava", "pyramid_pooled", "dbudgetkv",
                                                               "snapkv_int4")}
from importlib.metadata import entry_points
out["entry_points"] = [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "kvcompile"]
os.environ["KVCOMPILE_VLLM_SPEC"] = "snapkv"
os.environ["KVCOMPILE_VLLM_PER_HEAD"] = "64"
import vllm.plugins
vllm.plugins.plugins_loaded = False  # an import above may have run the loader while the spec was unset
vllm.plugins.load_general_plugins()  # vLLM's own loader, through the entry point
out["on_path"] = AttentionBackendEnum.CPU_ATTN.get_path()
from vllm.engine.arg_utils import EngineArgs
base = dict(model=MODEL, dtype="float32", enforce_eager=True, max_model_len=512, max_num_batched_tokens=512,
            enable_prefix_caching=False, enable_chunked_prefill=False)
for name, change in (("accepted", {}), ("prefix_caching", {"enable_prefix_caching": True}),
                     ("chunked_prefill", {"enable_chunked_prefill": True}), ("fp8", {"kv_cache_dtype": "fp8"}),
                     ("speculative", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                                             "prompt_lookup_max": 2}})):
    try:
        EngineArgs(**{**base, **change}).create_engine_config()
        out["config"][name] = None
    except PluginError as exc:
        out["config"][name] = str(exc)
    except Exception as exc:  # vLLM itself refusing first
        out["config"][name] = "vllm: " + repr(exc)
from kvcompile.integrations.vllm import patches
vllm.__version__ = "0.33.0"
try:
    patches.check_version()
    out["version"] = None
except PluginError as exc:
    out["version"] = str(exc)
print("RESULT" + json.dumps(out))
"""


def refusals_job() -> Job:
    return in_vllm_env_job(f"MODEL = {str(MODEL)!r}\n" + REFUSALS)


def test_plugin_off_by_default_refuses_what_it_cannot_run(lane):
    """Unset, the plugin changes nothing; set, it loads through vLLM's entry point and replaces the CPU
    backend; decode-time, merging, tiered-storage, reconstruction and rotary-reading policies are refused with the
    reason (head-wise, layer-dynamic and threshold budgets and int4 codes load); so are prefix caching, an fp8 cache,
    speculative decoding and another vLLM version (chunked prefill is accepted)."""
    out = result(lane.result("refusals", refusals_job()))
    assert out["off_path"].startswith("vllm.") and out["off_after_refusals"] == out["off_path"]
    assert out["entry_points"] == ["kvcompile.integrations.vllm:register"]
    assert out["on_path"] == "kvcompile.integrations.vllm.backend.KVCompileCPUBackend"
    reasons = {"zsmerge": "split", "kvzip": "reconstruction", "kivi": "storage kivi", "lava_mixed": "storage mixed",
               "expected_attention": "rotary"}
    for spec, reason in reasons.items():
        assert out["refused"][spec] is not None and reason in out["refused"][spec], (spec, out["refused"][spec])
    assert out["accepted"] == dict.fromkeys(("adakv", "lava", "pyramid_pooled", "dbudgetkv", "snapkv_int4")), \
        out["accepted"]
    assert out["config"]["accepted"] is None
    assert "prefix caching" in out["config"]["prefix_caching"]
    assert out["config"]["chunked_prefill"] is None
    assert "kv_cache_dtype fp8" in out["config"]["fp8"]
    assert out["config"]["speculative"] is not None  # the plugin or vLLM refuses it; it never runs
    assert "0.33.0" in out["version"] and "0.32.0" in out["version"]


def blocks_held(n: int, block_size: int, first_kept: int) -> int:
    """Blocks a request of an n-token prompt holds after its first decode token is written."""
    return -(-(n + 1) // block_size) - first_kept // block_size


@pytest.mark.slow
def test_budget_covering_the_prompt_equals_plain_vllm(model_and_prompts, compressed_runs, lane):
    """per_head above the prompt length (snapkv at 2048, run by the plugin's engine): nothing evicted, vLLM's
    greedy tokens and blocks as without the plugin. Plain vLLM 0.32 (fp32, eager, its CPU attention) gives
    SmolLM2 transformers' generate() greedy tokens in kvcompile's own environment: the baseline a kvcompile policy
    inside vLLM must keep when it evicts nothing."""
    model, prompts = model_and_prompts
    plain = result(lane.result("plain", vllm_job(prompts)))
    with torch.no_grad():
        want = [model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids):].tolist()
                for ids in prompts]
    for got in (plain["together"], plain["alone"]):
        for tokens, generated in zip(got, want, strict=True):
            assert tokens[:len(generated)] == generated
            assert len(generated) == MAX_TOKENS or generated[-1] == model.generation_config.eos_token_id
    covered, _ = compressed_runs["covered"]
    assert covered["together"] == plain["together"] and covered["alone"] == plain["alone"]
    assert covered["blocks"] == plain["blocks"]
    bs = plain["block_size"]
    assert plain["blocks"]["total"] - plain["blocks"]["after_decode"] == blocks_held(len(prompts[0]), bs, 0)



BFLOAT16 = {"options": {"dtype": "bfloat16"}}  # vLLM's usual dtype on CPU


def bfloat16_job(prompts: list[list[int]]) -> Job:
    """One bfloat16 engine (the plugin on) under snapkv at 2048 per head (covering the prompts), then at 64."""
    runs = [{"spec": "snapkv", "overrides": {"per_head": 2048}}, {"spec": "snapkv", "overrides": {"per_head": 64}}]
    return vllm_job(prompts, more=BFLOAT16 | {"runs": runs}, spec="snapkv")


@pytest.mark.slow
def test_a_bfloat16_model_decodes_in_the_torch_backend(model_and_prompts, lane):
    """SmolLM2 in bfloat16: the C++ decode kernel reads float32 only, so the plugin chose its torch backend (no cache
    addresses) and runs instead of refusing. At a budget covering the prompts its greedy tokens are plain vLLM's in
    bfloat16; at 64 per head together = alone, the first request holds fewer blocks than plain vLLM's after its
    first decode step, and every block is back in the pool at the end."""
    _, prompts = model_and_prompts
    plain = result(lane.result("plain_bfloat16", vllm_job(prompts, more=BFLOAT16)))
    covered, kept = result(lane.result("bfloat16", bfloat16_job(prompts)))["runs"]
    assert not covered["decode_kernel"] and not kept["decode_kernel"]
    assert covered["together"] == plain["together"] and covered["alone"] == plain["alone"]
    assert kept["together"] == kept["alone"]
    assert kept["blocks"]["after_decode"] > plain["blocks"]["after_decode"]  # free blocks: the prompt's returned
    assert kept["blocks"]["end"] == kept["blocks"]["total"] == plain["blocks"]["total"]

# 64 entries per head (dbudgetkv: its threshold); knorm is left out: key norms are RoPE-invariant, so repeated
# tokens tie to within 1e-7 at the cut, and vLLM's and transformers' forwards round differently: its kept entries
# differ on ties (docs/VLLM.md)
COMPRESSED = {"snapkv": {"per_head": 64}, "pyramidkv": {"per_head": 64}, "streamingllm": {"per_head": 64},
              "h2o": {"per_head": 64}, "tova": {"per_head": 64}, "adakv": {"per_head": 64},
              "lava": {"per_head": 64}, "pyramid_pooled": {"per_head": 64}, "dbudgetkv": {},
              "snapkv_int8": {"per_head": 64}}
# run too, their greedy tokens not compared with kvcompile's (test_int4_codes_keep_kvcompiles_entries): int4 codes of
# one scale per entry flip at rounding boundaries under the 1e-6 differences between vLLM's and transformers' forwards
CODES_ONLY = {"snapkv_int4": {"per_head": 64}}
# specs not shipped, written as YAML for the run (int8 codes in groups of 32 channels: two scales an entry)
WRITTEN = {"snapkv_int8": ("snapkv_int4", "int4: {group: 0}", "int8: {group: 32}")}


def spec_source(spec: str, folder) -> str:
    """A spec's name, or the YAML file written for it in `folder` (WRITTEN: shipped spec, text, replacement)."""
    if spec not in WRITTEN:
        return spec
    shipped, old, new = WRITTEN[spec]
    text = (ROOT / "specs" / f"{shipped}.yaml").read_text()
    assert old in text
    path = folder / f"{spec}.yaml"
    path.write_text(text.replace(old, new).replace(f"name: {shipped}", f"name: {spec}"))
    return str(path)


def compressed_job(prompts: list[list[int]], folder) -> Job:
    """One vLLM engine (the plugin on) runs the prompts under each policy of COMPRESSED in turn
    (tests/vllm_run.py "runs"), recording each request's kept entries in `folder`."""
    runs = [{"spec": spec_source(spec, folder), "overrides": overrides, "record": str(folder / f"{spec}.jsonl")}
            for spec, overrides in {**COMPRESSED, **CODES_ONLY}.items()]
    runs.append({"spec": "snapkv", "overrides": {"per_head": 2048}})  # covers the prompts: nothing evicted
    return vllm_job(prompts, timeout=900, more={"runs": runs}, spec="snapkv", per_head=64)


@pytest.fixture(scope="module")
def compressed_runs(model_and_prompts, lane):
    """compressed_job's run: each policy's result and the file of its kept entries."""
    _, prompts = model_and_prompts
    folder = lane.folder("compressed")
    out = result(lane.result("compressed", compressed_job(prompts, folder)))
    names = [*COMPRESSED, *CODES_ONLY, "covered"]
    return {name: (got, folder / f"{name}.jsonl") for name, got in zip(names, out["runs"])}


@pytest.mark.slow
@pytest.mark.parametrize("spec", list(COMPRESSED))
def test_compressed_vllm_equals_kvcompile(model_and_prompts, compressed_runs, spec, tmp_path):
    """vLLM's greedy tokens are kvcompile's generate() under the same spec; each request's kept (layer,
    head, position) entries are kvcompile's reference selection on the same prompt (head-wise budgets, LAVa's
    cascade and DBudgetKV's threshold included); together = alone; after the prompt the request holds the
    blocks from N − S on, S = ⌈Σ K_{l,h} / (L·H)⌉ (its entries packed across heads and layers; under int8/int4
    storage S = ⌈Σ_l ⌈E_l·B / slot⌉ / (L·H)⌉, its entries packed as codes of B bytes), and every block is back in
    the pool at the end. Decode attention ran in the C++ kernel, over float32 entries or codes (head dim 64;
    tests/test_vllm_packed_attention.py and tests/test_vllm_codes.py hold it to kvcompile.reference)."""
    import kvcompile
    from kvcompile.reference import compress
    from kvcompile.tools.sweep import capture
    from kvcompile.integrations.vllm.codes import Codes
    from kvcompile.integrations.vllm.packing import region

    model, prompts = model_and_prompts
    policy = kvcompile.load_spec(spec_source(spec, tmp_path), **COMPRESSED[spec])
    out, record = compressed_runs[spec]
    assert out["decode_kernel"], "the worker's decode attention ran in the torch backend, not the C++ kernel"
    codes = Codes.of(policy.storage, 64)

    want_tokens, want_kept = [], []
    for ids in prompts:
        x = torch.tensor([ids])
        states, _ = capture(model, x)
        kept = compress(policy, states).kept
        want_kept.append([[k[0, h].nonzero().flatten().tolist() for h in range(k.shape[1])] for k in kept])
        with kvcompile.compiled(model, policy), torch.no_grad():
            want_tokens.append(model.generate(x, max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(ids):].tolist())
    for got in (out["alone"], out["together"]):
        for tokens, want in zip(got, want_tokens):
            assert tokens[:len(want)] == want
            assert len(want) == MAX_TOKENS or want[-1] == model.generation_config.eos_token_id
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(lines) == 1 + 2 * len(prompts)  # stepped, together, alone
    for line in lines:
        assert line["kept"] in want_kept, f"request {line['request']}: kept entries differ from kvcompile's"
    assert {json.dumps(line["kept"]) for line in lines} == {json.dumps(k) for k in want_kept}
    n, bs = len(prompts[0]), out["block_size"]
    counts = torch.tensor([[len(h) for h in layer] for layer in want_kept[0]])
    skipped = n - region(counts, codes, 2 * 64 * 4)  # slots of a key and a value, head dim 64, float32
    if codes is not None:
        assert skipped > n - region(counts) + 32, "codes free no block more than the same budget in float32"
    assert skipped // bs >= 1, "the test prompt frees no whole block"
    blocks = out["blocks"]
    assert blocks["total"] - blocks["after_decode"] == blocks_held(n, bs, skipped)
    assert blocks["end"] == blocks["total"]


@pytest.mark.slow
def test_int4_codes_keep_kvcompiles_entries_and_free_their_blocks(model_and_prompts, compressed_runs):
    """snapkv_int4 at 64 per head: each request keeps kvcompile's reference selection, packed as int4 codes of 80
    bytes (10 slots a request where float32 takes 64, so more blocks go back to the pool), together = alone, and
    every block is back at the end. Its greedy tokens are not compared with kvcompile's generate(): on the second
    prompt, scaling kvcompile's own weights by 1 + 1e-6·N(0, 1) turns its int4 tokens into vLLM's from the 6th on
    (a code flips where a value sits at a rounding boundary), so equality with transformers' forward is not a
    property int4 storage has; snapkv_int8 is held to it (test_compressed_vllm_equals_kvcompile)."""
    import kvcompile
    from kvcompile.integrations.vllm.codes import Codes
    from kvcompile.integrations.vllm.packing import region
    from kvcompile.reference import compress
    from kvcompile.tools.sweep import capture

    model, prompts = model_and_prompts
    policy = kvcompile.load_spec("snapkv_int4", **CODES_ONLY["snapkv_int4"])
    out, record = compressed_runs["snapkv_int4"]
    assert out["together"] == out["alone"]
    want_kept = []
    for ids in prompts:
        states, _ = capture(model, torch.tensor([ids]))
        kept = compress(policy, states).kept
        want_kept.append([[k[0, h].nonzero().flatten().tolist() for h in range(k.shape[1])] for k in kept])
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(lines) == 1 + 2 * len(prompts)
    assert {json.dumps(line["kept"]) for line in lines} == {json.dumps(k) for k in want_kept}
    n, bs = len(prompts[0]), out["block_size"]
    counts = torch.tensor([[len(h) for h in layer] for layer in want_kept[0]])
    assert region(counts, Codes.of(policy.storage, 64), 512) == 10 and region(counts) == 64
    blocks = out["blocks"]
    assert blocks["total"] - blocks["after_decode"] == blocks_held(n, bs, n - 10)
    fp32, _ = compressed_runs["snapkv"]
    assert blocks["after_decode"] > fp32["blocks"]["after_decode"]  # int4 holds fewer blocks than float32
    assert blocks["end"] == blocks["total"]


def worker_job(prompts: list[list[int]]) -> Job:
    """lava with the worker in a process of its own."""
    return vllm_job(prompts, more={"options": {"distributed_executor_backend": "mp"}}, spec="lava", per_head=64)


@pytest.mark.slow
def test_worker_process_reports_what_it_freed(model_and_prompts, compressed_runs, lane):
    """The executor `vllm serve` uses on CPU runs the worker in a process of its own
    (distributed_executor_backend "mp"): N − S reaches the scheduler with the step's output. lava (its
    budgets depend on the scores) gives the same tokens and frees the same blocks as with the worker
    in-process."""
    _, prompts = model_and_prompts
    out = result(lane.result("worker_mp", worker_job(prompts)))
    want, _ = compressed_runs["lava"]
    assert out["together"] == want["together"] and out["alone"] == want["alone"]
    assert out["blocks"] == want["blocks"] and out["blocks"]["after_decode"] > want["blocks"]["after_prefill"]


CHUNKED = ("snapkv_int8", "h2o", "lava")


def chunked_job(prompts: list[list[int]], folder) -> Job:
    """CHUNKED's policies in one engine with chunked prefill of 128-token chunks, kept entries recorded in
    `folder`."""
    runs = [{"spec": spec_source(spec, folder), "overrides": COMPRESSED[spec], "record": str(folder / f"{spec}.jsonl")}
            for spec in CHUNKED]
    return vllm_job(prompts, timeout=600, spec="snapkv", per_head=64,
                    more={"runs": runs, "options": {"enable_chunked_prefill": True, "max_num_batched_tokens": 128}})


@pytest.mark.slow
def test_chunked_prefill_compresses_as_one_pass(model_and_prompts, compressed_runs, lane):
    """Chunked prefill (128-token chunks: each prompt in 3 or 4 steps, the two prompts' chunks sharing steps
    when run together): the worker keeps each layer's last queries across chunks and compresses in the
    step that ends the prompt, so the kept entries, the greedy tokens and the blocks held equal the
    one-pass runs', for a window scorer stored as int8 codes (snapkv_int8: snapkv's selection), one reading every
    query (h2o) and LAVa's cascade."""
    _, prompts = model_and_prompts
    folder = lane.folder("chunked")
    out = result(lane.result("chunked", chunked_job(prompts, folder)))
    assert max(map(len, prompts)) > 2 * 128  # every prompt is chunked
    for spec, got in zip(CHUNKED, out["runs"]):
        want, record = compressed_runs[spec]
        assert got["together"] == want["together"] and got["alone"] == want["alone"], spec
        assert got["blocks"] == want["blocks"], spec
        kept = {line["request"]: line["kept"] for line in map(json.loads, (folder / f"{spec}.jsonl").read_text().splitlines())}
        kept_one_pass = {line["request"]: line["kept"] for line in map(json.loads, record.read_text().splitlines())}
        assert sorted(map(json.dumps, kept.values())) == sorted(map(json.dumps, kept_one_pass.values())), spec


def test_serve_engine_vllm_refuses_before_starting():
    """`kvcompile serve --engine vllm` checks the spec before vLLM starts: a refused policy and a
    transformers-only option exit with code 2 and the reason."""
    cmd = [str(PYTHON), "-m", "kvcompile", "serve", "--engine", "vllm", "--model", str(MODEL)]
    refused = subprocess.run(cmd + ["--spec", "zsmerge"], cwd=ROOT, env=vllm_env(), capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and "split" in refused.stderr, refused.stderr[-2000:]
    reuse = subprocess.run(cmd + ["--spec", "snapkv", "--reuse-context"], cwd=ROOT, env=vllm_env(),
                           capture_output=True, text=True, timeout=120)
    assert reuse.returncode == 2 and "--reuse-context" in reuse.stderr, reuse.stderr[-2000:]


@pytest.mark.slow
def test_serve_engine_vllm_answers_as_kvcompile(model_and_prompts):
    """`kvcompile serve --engine vllm --spec snapkv --per-head 64` starts vLLM's OpenAI server with the plugin;
    a greedy completion of a prompt (token ids) is kvcompile's own generate() under that spec. The server's
    process group is stopped at the end."""
    import signal
    import socket
    import time
    import urllib.request

    import kvcompile

    model, prompts = model_and_prompts
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(PYTHON), "-m", "kvcompile", "serve", "--engine", "vllm", "--model", str(MODEL), "--spec", "snapkv",
           "--per-head", "64", "--port", str(port), "--max-model-len", "1024", "--kv-tokens", "8192"]
    log = open(ROOT / ".pytest_cache" / "vllm_serve.log", "w") if (ROOT / ".pytest_cache").is_dir() else subprocess.DEVNULL
    server = subprocess.Popen(cmd, cwd=ROOT, env=vllm_env(), stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        deadline = time.time() + 300
        while True:
            assert server.poll() is None, "the server exited"
            assert time.time() < deadline, "the server did not answer /health in 300 s"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        body = json.dumps({"model": str(MODEL), "prompt": prompts[0], "max_tokens": MAX_TOKENS, "temperature": 0})
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body.encode(),
                                         headers={"Content-Type": "application/json"})
        text = json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["text"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
    from transformers import AutoTokenizer

    x = torch.tensor([prompts[0]])
    with kvcompile.compiled(model, kvcompile.load_spec("snapkv", per_head=64)), torch.no_grad():
        want = model.generate(x, max_new_tokens=MAX_TOKENS, do_sample=False)[0, x.shape[1]:]
    assert text == AutoTokenizer.from_pretrained(MODEL).decode(want, skip_special_tokens=True)


def preempt_job(prompts: list[list[int]]) -> Job:
    """Two requests of 600 new tokens in a pool too small for both (test_preempting_a_compressed_request_is_refused)."""
    args = {"model": str(MODEL), "prompts": prompts, "max_tokens": 600, "max_model_len": 800,
            "options": {"num_gpu_blocks_override": 26}}
    return Job([str(PYTHON), str(ROOT / "tests" / "vllm_run.py"), json.dumps(args)],
               vllm_env(spec="snapkv", per_head=320), str(ROOT), 420)


@pytest.mark.slow
def test_preempting_a_compressed_request_is_refused(model_and_prompts, lane):
    """A pool too small for two compressed requests to finish (26 blocks of 32 tokens, the least vLLM accepts
    for max_model_len 800; one is vLLM's null block, and the other 25 hold exactly the two prompts' 12 + 13 blocks,
    so both are admitted; 600 new tokens each): vLLM preempts one after its prompt was compressed, and the
    plugin raises instead of recomputing it over its whole prompt. 320 entries per head (below both prompts'
    lengths, so both are compressed) free 1 + 2 blocks for the two requests to grow into: vLLM preempts after
    about 70 decode steps (with max_model_len 1024 and 33 blocks: about 180; at 64 per head: about 330)."""
    _, prompts = model_and_prompts
    proc = lane.result("preempt", preempt_job(prompts))
    assert all(320 < len(p) for p in prompts)
    assert proc.returncode != 0 and "RESULT" not in proc.stdout
    assert "preempted request" in proc.stderr and "after its prompt was compressed" in proc.stderr, proc.stderr[-3000:]


ENGINES = ("snapkv", "lava")


def engines_job(prompts: list[list[int]], folder) -> Job:
    """Two engines in one process, each naming one of ENGINES in its additional_config, recording in `folder`."""
    settings = [{"spec": spec, "overrides": COMPRESSED[spec], "record": str(folder / f"{spec}.jsonl")}
                for spec in ENGINES]
    return vllm_job(prompts, timeout=600, more={"engines": settings}, spec="h2o", per_head=128)


@pytest.mark.slow
def test_two_engines_in_one_process_keep_their_own_state(model_and_prompts, compressed_runs, lane):
    """Two engines alive together in one process (engine cores in-process), each naming its own policy in
    vLLM's additional_config (snapkv and lava, the environment naming neither), stepped in turn with both
    engines' requests in flight: each engine's tokens, kept entries and freed blocks are those of its policy
    run alone in an engine of its own (compressed_runs); each has its own worker state, and records only its
    own requests."""
    _, prompts = model_and_prompts
    folder = lane.folder("engines")
    out = result(lane.result("engines", engines_job(prompts, folder)))
    assert len({engine["worker"] for engine in out["engines"]}) == 2
    for i, (spec, got) in enumerate(zip(ENGINES, out["engines"])):
        want, record = compressed_runs[spec]
        assert got["together"] == want["together"] and got["alone"] == want["alone"], spec
        assert got["blocks_end"] == got["blocks_total"] == want["blocks"]["total"], spec
        lines = [json.loads(line) for line in (folder / f"{spec}.jsonl").read_text().splitlines()]
        assert len(lines) == 2 * len(prompts)  # together, alone: this engine's requests only
        assert all(line["request"].startswith(f"e{i}p") for line in lines[:len(prompts)]), spec
        kept_alone = {json.dumps(line["kept"]) for line in map(json.loads, record.read_text().splitlines())}
        assert {json.dumps(line["kept"]) for line in lines} == kept_alone, spec


# the runs of the tests that read them, in the order the background lane runs them (tests/lane.py)
RUNS = {"refusals": ({"test_plugin_off_by_default_refuses_what_it_cannot_run"}, lambda prompts, lane: refusals_job()),
        "compressed": ({"test_budget_covering_the_prompt_equals_plain_vllm", "test_compressed_vllm_equals_kvcompile",
                        "test_int4_codes_keep_kvcompiles_entries_and_free_their_blocks",
                        "test_worker_process_reports_what_it_freed", "test_chunked_prefill_compresses_as_one_pass",
                        "test_two_engines_in_one_process_keep_their_own_state"},
                       lambda prompts, lane: compressed_job(prompts, lane.folder("compressed"))),
        "plain": ({"test_budget_covering_the_prompt_equals_plain_vllm"}, lambda prompts, lane: vllm_job(prompts)),
        "plain_bfloat16": ({"test_a_bfloat16_model_decodes_in_the_torch_backend"},
                           lambda prompts, lane: vllm_job(prompts, more=BFLOAT16)),
        "bfloat16": ({"test_a_bfloat16_model_decodes_in_the_torch_backend"}, lambda prompts, lane: bfloat16_job(prompts)),
        "worker_mp": ({"test_worker_process_reports_what_it_freed"}, lambda prompts, lane: worker_job(prompts)),
        "chunked": ({"test_chunked_prefill_compresses_as_one_pass"},
                    lambda prompts, lane: chunked_job(prompts, lane.folder("chunked"))),
        "preempt": ({"test_preempting_a_compressed_request_is_refused"}, lambda prompts, lane: preempt_job(prompts)),
        "engines": ({"test_two_engines_in_one_process_keep_their_own_state"},
                    lambda prompts, lane: engines_job(prompts, lane.folder("engines")))}


def queue_runs(lane: Lane, selected: set[str]) -> None:
    """The vLLM runs the selected tests read, into the suite's background lane (tests/conftest.py), where the
    vLLM environment, the model and the haystack are there (else the tests skip or fail as they would)."""
    if not PYTHON.exists() or not (MODEL / "config.json").is_file():
        return
    from transformers import AutoTokenizer

    try:
        prompts = chat_prompts(AutoTokenizer.from_pretrained(MODEL))
    except FileNotFoundError:  # no haystack
        return
    for key, (tests, job) in RUNS.items():
        if tests & selected:
            lane.queue(key, job(prompts, lane))
