"""kvcompile and NVIDIA's kvpress side by side, interleaved, one fresh process each (docs/INTERNALS.md
"Measuring speed").

Every measurement runs in a FRESH subprocess: kvpress's in its own virtual environment's python
(kvpress 0.5.5 pins transformers < 5.3; see scripts/kvpress_env.sh), kvcompile's in this one.
All of them get the same prompt: a needle prompt of about `--length` tokens built from
data/haystack.txt (the demo's prompt maker, kvcompile.tools.cli.demo_prompt), greedy decoding of
exactly `--new-tokens` tokens (min_new_tokens = max_new_tokens), `--threads` torch threads.

Each library through its normal generate() path:
  kvpress    `with press(model): model.generate(...)`, the use kvpress's README documents for
             generate() ("Why not using model.generate?"); like ours it compresses the whole
             prompt, question included (its pipeline would leave the question uncompressed).
             Budgets: compression_ratio = 1 - (per_head + 0.5) / N keeps per_head tokens per
             head (as in scripts/kvpress_compare.py); window/kernel from our same-named spec.
             H2O is kvpress's ObservedAttentionPress, which needs attn_implementation="eager".
  kvcompile  `kvcompile.compile(model, spec, per_head=...)` (mode="eager" or "compiled") then
             `model.generate(...)`; "full" is the plain model, nothing compiled.

Every child first runs a warm-up generate on the prompt's first `--warmup-length` tokens
(4 new tokens; longer than the budget, so the compression path runs); for the compiled entry
this is where torch.compile compiles, and its seconds are the "first call s" column (the cold
cost: dynamo + Inductor; the first compiled child of a run starts from an empty Inductor cache
unless --inductor-cache names a warm one). The measured generate follows, so the compiled
rows' prefill excludes compilation; "recompiles" counts graphs dynamo made during it.

Measured per child: prefill s (generate() call to the first new token), decode tok/s (tokens
after the first, per second), peak RSS MiB (getrusage ru_maxrss of the child: weights, warm-up
and compile included), KV MiB (bytes the cache holds after generating: ours
memory_report()["bytes_held"], a DynamicCache the sum of its key/value tensors; AdaKVPress's
cache keeps every key, masked), and whether the answer contains the needle's number.
`--rounds` interleaved rounds (odd rounds in reverse order), medians over rounds. A child
that fails or runs past `--timeout` puts its error in its row; the run goes on.

    PYTHONPATH=. python3 benchmarks/side_by_side.py [--length 4000] [--new-tokens 32] [--rounds 2]
        [--specs full,snapkv,...] [--modes eager,compiled] [--presses full,snapkv,...]
        [--per-head 128] [--threads 2] [--timeout 900] [--out benchmarks/out/side_by_side.json]
        [--before DIR]  (rows of an earlier checkout beside ours: a version against the one before)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECS = ("full", "snapkv", "pyramidkv", "adakv", "lava", "dbudgetkv", "zsmerge", "streamingllm", "tova", "h2o")
# kvpress 0.5.5's presses for our specs (kvpress has no DBudgetKV, ZSMerge or LAVa press;
# its MergingPress is a different merge rule from ZSMerge's residual slots).
PRESSES = ("full", "snapkv", "pyramidkv", "adakv", "streamingllm", "tova", "h2o")
PRESS_CLASS = {"full": "-", "snapkv": "SnapKVPress", "pyramidkv": "PyramidKVPress", "adakv": "AdaKVPress(SnapKVPress)",
               "streamingllm": "StreamingLLMPress", "tova": "TOVAPress", "h2o": "ObservedAttentionPress"}
RESULT = "SIDE_BY_SIDE_RESULT "


def csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


# --- the child: one measurement, in either environment ------------------------------------
# Nothing here imports kvcompile unless the child runs kvcompile (kvpress's venv has none).

class Timer:
    """A generate() streamer that stamps each put: the prompt, then every new token."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def found(text: str, answer: str) -> bool:
    """kvcompile.tools.data.answer_found: the number as a whole number in the text."""
    if answer.isdigit():
        return re.search(rf"(?<!\d){answer}(?!\d)", text) is not None
    return answer.lower() in text.lower()


def make_press(name: str, job: dict, n: int):
    import kvpress

    ratio = max(0.0, 1.0 - (job["per_head"] + 0.5) / n)
    w, k = job["window"], job["kernel"]
    if name == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=ratio, window_size=w, kernel_size=k)
    if name == "pyramidkv":
        return kvpress.PyramidKVPress(compression_ratio=ratio, window_size=w, kernel_size=k, beta=20)
    if name == "adakv":
        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio, window_size=w, kernel_size=k),
                                  alpha_safeguard=0.2)
    if name == "streamingllm":
        return kvpress.StreamingLLMPress(compression_ratio=ratio, n_sink=4)
    if name == "tova":
        return kvpress.TOVAPress(compression_ratio=ratio)
    if name == "h2o":
        return kvpress.ObservedAttentionPress(compression_ratio=ratio)
    raise ValueError(f"no kvpress press for {name!r}")


def child(job: dict) -> dict:
    import contextlib
    import resource

    import torch

    torch.set_num_threads(job["threads"])
    prompt = json.loads(Path(job["prompt"]).read_text())
    ids = torch.tensor([prompt["input_ids"]])
    n = ids.shape[1]
    lib, method, mode = job["library"], job["method"], job["entry"]
    graphs = lambda: None  # noqa: E731
    if lib == "kvpress":
        import kvpress  # noqa: F401  (registers its pipeline, as a user's import does)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        attn = "eager" if method == "h2o" else "sdpa"
        model = AutoModelForCausalLM.from_pretrained(job["model"], attn_implementation=attn,
                                                     dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(job["model"])
        # a press for each prompt length (its ratio keeps per_head tokens of that prompt)
        around = (lambda m: contextlib.nullcontext()) if method == "full" else \
            (lambda m: make_press(method, job, m)(model))
    else:  # kvcompile, or kvcompile-before: an earlier checkout's (its folder first on PYTHONPATH)
        import kvcompile
        from kvcompile.tools.cli import policy_for
        from kvcompile.tools.models import load_model

        model, tokenizer = load_model(job["model"])
        if method != "full":
            kvcompile.compile(model, policy_for(method, job["per_head"], own_budget_wins=True), mode=mode)
        around = lambda m: contextlib.nullcontext()  # noqa: E731
        if mode == "compiled":
            from torch._dynamo.utils import counters

            graphs = lambda: counters["stats"]["unique_graphs"]  # noqa: E731
    load_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate(x, new):
        timer = Timer()
        with torch.no_grad(), around(x.shape[1]):
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, streamer=timer, return_dict_in_generate=True, pad_token_id=pad)
        return out, timer

    start = time.perf_counter()
    generate(ids[:, :job["warmup_length"]], 4)
    first_call = time.perf_counter() - start
    before = graphs()
    out, timer = generate(ids, job["new_tokens"])
    after = graphs()
    t = timer.times
    new = out.sequences[0, n:].tolist()
    cache = out.past_key_values
    if hasattr(cache, "memory_report"):
        kv = cache.memory_report()["bytes_held"]
    else:
        kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    text = tokenizer.decode(new, skip_special_tokens=True).strip()
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    if lib == "kvpress":
        from importlib.metadata import version

        versions["kvpress"] = version("kvpress")
    else:
        versions["kvcompile"] = str(Path(sys.modules["kvcompile"].__file__).parent.parent)
    return {"prefill_s": t[1] - timer.start, "decode_tok_s": (len(t) - 2) / (t[-1] - t[1]) if len(t) > 2 else None,
            "new_tokens": len(new), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "load_rss": load_rss, "kv_bytes": kv, "first_call_s": first_call,
            "recompiles": None if before is None else after - before,
            "answer": text, "correct": found(text, prompt["answer"]) if prompt.get("answer") else None,
            "prompt_tokens": n, "threads": torch.get_num_threads(), "versions": versions}


# --- the parent: prompt, jobs, interleaving, table ----------------------------------------

def make_prompt(args, path: Path) -> dict:
    from transformers import AutoTokenizer

    from kvcompile.tools.cli import demo_prompt
    from kvcompile.tools.data import load_haystack

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    p = demo_prompt(tokenizer, load_haystack(), args.length, args.depth, args.seed)
    data = {"input_ids": p.input_ids, "answer": p.answer, "question": p.needle.question, "depth": p.depth,
            "needle_span": list(p.needle_span)}
    path.write_text(json.dumps(data))
    return data


def scoring_of(name: str) -> dict:
    """Window and pooling kernel of our spec, for kvpress's presses that take them."""
    import kvcompile

    if name in ("full", "streamingllm", "tova", "h2o"):
        return {"window": None, "kernel": None}
    part = kvcompile.load_spec(name).scoring
    return {"window": part.window, "kernel": part.pooling.kernel}


def jobs_for(args) -> list[dict]:
    """kvpress's press, then our eager and compiled entries, method by method."""
    jobs = []
    for method in dict.fromkeys(["full", *args.presses, *args.specs]):
        if method in args.presses:
            jobs.append({"library": "kvpress", "entry": "-", "method": method, **scoring_of(method)})
        if method in args.specs:
            for mode in (["eager"] if method == "full" else args.modes):
                jobs.append({"library": "kvcompile", "entry": "-" if method == "full" else mode, "method": method})
    return jobs


def run_child(job: dict, python: str, env: dict, timeout: float) -> dict:
    cmd = [python, str(Path(__file__).resolve()), "--child", json.dumps(job)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s", "wall_s": time.perf_counter() - start}
    except OSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "wall_s": time.perf_counter() - start}
    wall = time.perf_counter() - start
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT):
            return {**json.loads(line[len(RESULT):]), "wall_s": wall}
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    error = next((x for x in reversed(lines) if re.match(r"^\w*(Error|Exception)\b", x)), lines[-1] if lines else "")
    return {"error": f"exit {proc.returncode}: {error.strip()[:300]}", "stderr_tail": "\n".join(lines[-30:]),
            "wall_s": wall}


def median(rows: list[dict], key: str):
    xs = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(xs) if xs else None


def summarise(job: dict, runs: list[dict]) -> dict:
    ok = [r for r in runs if "error" not in r]
    row = {k: job[k] for k in ("library", "entry", "method")}
    row["press"] = PRESS_CLASS.get(job["method"]) if job["library"] == "kvpress" else None
    for key in ("prefill_s", "decode_tok_s", "peak_rss", "kv_bytes", "first_call_s", "recompiles"):
        row[key] = median(ok, key)
    row["correct"] = [r["correct"] for r in ok]
    row["answers"] = sorted({r["answer"] for r in ok})
    row["rounds_ok"], row["rounds"] = len(ok), len(runs)
    row["errors"] = [r["error"] for r in runs if "error" in r]
    return row


def table(rows: list[dict], needle: bool) -> str:
    f = lambda x, spec="{:.2f}": "-" if x is None else spec.format(x)  # noqa: E731
    mib = lambda x: "-" if x is None else f"{x / 2**20:.1f}"  # noqa: E731
    head = ["library", "entry", "method", "runs", "prefill s", "decode tok/s", "peak RSS MiB", "KV MiB", "first call s"]
    if needle:
        head.append("correct?")
    head.append("notes")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        method = r["method"] + (f" ({r['press']})" if r.get("press") not in (None, "-") else "")
        notes = []
        if r["errors"]:
            notes.append(f"{len(r['errors'])}/{r['rounds']} failed: {r['errors'][0]}")
        if r.get("recompiles"):
            notes.append(f"{r['recompiles']:.0f} graphs made during the measured generate")
        cells = [r["library"], r["entry"], method, str(r["rounds_ok"]), f(r["prefill_s"]), f(r["decode_tok_s"], "{:.1f}"),
                 f(r["peak_rss"] and r["peak_rss"] / 2**20, "{:.0f}"), mib(r["kv_bytes"]), f(r["first_call_s"], "{:.1f}")]
        if needle:
            c = r["correct"]
            cells.append("-" if not c else "yes" if all(c) else "no" if not any(c) else f"{sum(c)}/{len(c)}")
        cells.append("; ".join(notes).replace("|", "/"))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def parent(args) -> None:
    from kvcompile.spec import available_specs

    for name in args.specs:
        if name not in ("full", *available_specs()) and not Path(name).is_file():
            sys.exit(f"--specs: unknown spec {name!r} (choose from full, {', '.join(available_specs())} or a YAML "
                     "path)")
    for name in args.presses:
        if name not in PRESSES:
            sys.exit(f"--presses: no kvpress press for {name!r} (choose from {', '.join(PRESSES)})")
    python = args.kvpress_python or str(Path(os.environ.get("KVPRESS_VENV", ROOT / ".venv-kvpress")) / "bin" / "python")
    if args.presses and not Path(python).is_file():
        sys.exit(f"no kvpress python at {python}: run `bash scripts/kvpress_env.sh` first (it creates .venv-kvpress), "
                 "set KVPRESS_VENV or pass --kvpress-python, or --presses ''")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="side-by-side-"))
    prompt = make_prompt(args, work / "prompt.json")
    inductor = args.inductor_cache or str(work / "inductor")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "TORCHINDUCTOR_CACHE_DIR": inductor, "TOKENIZERS_PARALLELISM": "false",
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)}
    kv_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}  # kvpress's venv never sees kvcompile
    common = {"prompt": str(work / "prompt.json"), "model": str(Path(args.model).resolve()), "threads": args.threads,
              "per_head": args.per_head, "new_tokens": args.new_tokens, "warmup_length": args.warmup_length}
    jobs = jobs_for(args)
    if args.before:  # each of our compressing jobs again right after itself, from the earlier checkout
        jobs = [x for j in jobs for x in ([j, {**j, "library": "kvcompile-before"}]
                                          if j["library"] == "kvcompile" and j["method"] != "full" else [j])]
    before_env = {**env, "PYTHONPATH": os.pathsep.join(x for x in (str(Path(args.before or ".").resolve()),
                                                                   os.environ.get("PYTHONPATH")) if x)}
    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    meta = {"date": args.date or time.strftime("%Y-%m-%d"), "command": " ".join(shlex.quote(a) for a in sys.argv),
            "uptime_start": uptime(), "prompt_tokens": len(prompt["input_ids"]), "answer": prompt["answer"],
            "per_head": args.per_head, "new_tokens": args.new_tokens, "threads": args.threads, "rounds": args.rounds,
            "warmup_length": args.warmup_length, "inductor_cache": inductor, "kvpress_python": python}
    print(f"{len(prompt['input_ids'])}-token needle prompt (answer {prompt['answer']}), {args.per_head} per KV head, "
          f"{args.new_tokens} new tokens, {args.threads} threads, {len(jobs)} children x {args.rounds} rounds; "
          f"{meta['uptime_start']}", file=sys.stderr, flush=True)
    runs: list[list[dict]] = [[] for _ in jobs]
    log = []
    for r in range(args.rounds):
        order = list(range(len(jobs)))[:: -1 if r % 2 else 1]
        for i in order:
            job = {**common, **jobs[i]}
            lib = job["library"]
            res = run_child(job, python if lib == "kvpress" else sys.executable,
                            {"kvpress": kv_env, "kvcompile-before": before_env}.get(lib, env), args.timeout)
            res.update(round=r, order=len(log))
            runs[i].append(res)
            log.append({**jobs[i], **res})
            label = f"{job['library']} {job['entry']} {job['method']}"
            if "error" in res:
                print(f"[round {r + 1}] {label:<32} FAILED ({res['wall_s']:.0f} s): {res['error']}",
                      file=sys.stderr, flush=True)
            else:
                print(f"[round {r + 1}] {label:<32} prefill {res['prefill_s']:6.2f} s  decode "
                      f"{res['decode_tok_s'] or 0:5.1f} tok/s  RSS {res['peak_rss'] / 2**20:5.0f} MiB  KV "
                      f"{res['kv_bytes'] / 2**20:6.1f} MiB  first call {res['first_call_s']:5.1f} s  "
                      f"{res['answer'][:30]!r}  ({res['wall_s']:.0f} s)", file=sys.stderr, flush=True)
            out.write_text(json.dumps({"meta": meta, "rows": [summarise(j, x) for j, x in zip(jobs, runs) if x],
                                       "runs": log}, indent=1))
    meta["uptime_end"] = uptime()
    versions = {}
    for res in log:
        if "versions" in res:
            versions[res["library"]] = res["versions"]
    meta["versions"] = versions
    rows = [summarise(j, x) for j, x in zip(jobs, runs)]
    out.write_text(json.dumps({"meta": meta, "rows": rows, "runs": log}, indent=1))
    print(table(rows, needle=bool(prompt.get("answer"))))
    print(f"\n{meta['date']}; {meta['prompt_tokens']}-token prompt, {args.per_head} per KV head, {args.new_tokens} "
          f"new tokens, {args.threads} threads, medians of {args.rounds} interleaved round(s); first call s = "
          f"warm-up generate on the first {args.warmup_length} tokens (the compiled entry compiles there; "
          f"excluded from prefill); versions {versions}\nstart: {meta['uptime_start']}\nend:   {meta['uptime_end']}\n"
          f"JSON -> {out}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=4000, help="prompt tokens, about (needle prompt; default 4000)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated (default 32)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; medians over them (default 2)")
    parser.add_argument("--specs", type=csv, default=list(SPECS),
                        help=f"our specs, comma-separated ('full' = no compression; default {','.join(SPECS)})")
    parser.add_argument("--modes", type=csv, default=["eager", "compiled"], help="our entries (default eager,compiled)")
    parser.add_argument("--presses", type=csv, default=list(PRESSES),
                        help=f"kvpress presses by our spec's name (default {','.join(PRESSES)}; '' = none)")
    parser.add_argument("--per-head", type=int, default=128, help="tokens kept per KV head (default 128)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every child (default 2)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per child before it is killed (default 900)")
    parser.add_argument("--warmup-length", type=int, default=300,
                        help="prompt tokens of each child's warm-up generate (default 300)")
    parser.add_argument("--depth", type=float, default=0.5, help="needle depth in the filler (default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="needle and filler start (default 0)")
    parser.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m"), help="checkpoint folder")
    parser.add_argument("--kvpress-python", default=None,
                        help="python of kvpress's venv (default $KVPRESS_VENV/bin/python or .venv-kvpress/bin/python)")
    parser.add_argument("--inductor-cache", default=None,
                        help="TORCHINDUCTOR_CACHE_DIR for the children (default: a fresh one per run, so the "
                             "first compiled child compiles cold)")
    parser.add_argument("--before", default=None, metavar="DIR",
                        help="an earlier checkout of kvcompile (e.g. a git worktree): each of our compressing rows "
                             "runs again from it, right after ours (library kvcompile-before), to compare two "
                             "versions in one run")
    parser.add_argument("--date", default=None, help="date recorded in the JSON (default today)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "side_by_side.json"))
    parser.add_argument("--table-from", default=None, metavar="JSON",
                        help="print the table of a run's JSON (a finished or an interrupted run) and exit")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.table_from:
        data = json.loads(Path(args.table_from).read_text())
        print(table(data["rows"], needle=bool(data["meta"].get("answer"))))
        return
    if args.child is not None:
        print(RESULT + json.dumps(child(json.loads(args.child))), flush=True)
        return
    for mode in args.modes:
        if mode not in ("eager", "compiled"):
            parser.error(f"--modes: {mode!r} is not eager or compiled")
    parent(args)


if __name__ == "__main__":
    main()
