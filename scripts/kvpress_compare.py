"""kvcompile against NVIDIA's kvpress: the same model, the same prompts, both tools' own code.

kvpress pins transformers < 5.3, so it cannot share kvcompile's environment: the steps marked
(.venv-kvpress) run in kvpress's virtual environment (`bash scripts/kvpress_env.sh setup`) and
never import kvcompile; the others run in kvcompile's and never import kvpress.

Needle comparison (`bash scripts/kvpress_env.sh needle`): kept tokens, bytes, memory and time.
  prompts    (kvcompile's env)  needle prompts as token ids + the specs' window/kernel -> JSON
  kvpress    (.venv-kvpress)    SnapKVPress, PyramidKVPress, AdaKVPress on every prompt and
                                budget, plus the full cache: answers, kept token indices per
                                layer/head, KV bytes held, peak memory, time -> JSON
  kvcompile  (kvcompile's env)  our same-named specs on the same prompts and budgets (set to
                                kvpress's average pooling unless --as-shipped); the comparison
                                table (accuracy, kept-token agreement, bytes, memory, time)
  Budgets: B tokens per KV head per layer.  kvpress takes a compression ratio of the prompt; we
  pass 1 - (B + 0.5)/N so that its int(N * (1 - ratio)) keeps exactly B tokens per head.  The
  whole prompt (question included) is compressed on both sides, so the observation window is
  the question's end, as in our runtime; decoding is greedy, as in kvpress's pipeline.

RULER comparison (`bash scripts/kvpress_env.sh ruler`): answer quality, both query modes.
  (kvcompile)  python3 -m kvcompile eval --suite ruler --samples 10 --dump-dataset S.jsonl
  ruler        (.venv-kvpress)    kvpress's "kv-press-text-generation" pipeline on every sample of
               S.jsonl (kvpress's evaluation columns) under each press and KV fraction kept f
               (compression_ratio = 1 - f), plus no press, in each mode:
                 agnostic  kvpress's default: the context is prefilled and compressed, then each
                           question (+ the chat template's end of turn + answer prefix) is fed
                           through the compressed cache; samples with the same context share
                           one call (one compression), as kvpress's evaluation groups them;
                 aware     kvpress's evaluation with query_aware: the question is appended to the
                           context before compression and the question asked is empty.
               Greedy, max_new_tokens and answer_prefix from the sample.  The presses are those
               of kvpress's leaderboard, named and built as its evaluation registry builds them
               (defaults; expected_attention = AdaKV(ExpectedAttention(epsilon=1e-2))), with
               eager attention for observed_attention, SDPA otherwise, fp32 on the CPU.
               -> OUT.jsonl: one record per (sample, mode, press, fraction): index, task, mode,
               method ("kvpress:NAME", "kvpress:full" without a press), fraction, prediction,
               press (its repr: every hyper-parameter), context/question tokens, prefill_s
               (prefill + compression, shared by a group), decode_s, peak_rss_bytes, call_cpu_s (the
               process's CPU seconds in the call: with wall seconds, shows a loaded machine); --resume
               continues an interrupted run.  OUT.meta.json: versions, presses, settings.
               OUT.tokens.json: the token ids the pipeline fed (context, questions) for the first
               calls of each mode.  A call that raises writes no record: it is listed in
               OUT.meta.json ("failures") and at the end, and the step exits 1.
  tokens       (kvcompile's env)  those ids against kvcompile's own RULER prompt
               (kvcompile.tools.ruler.mode_prompt); prints each mismatch, exit 1 if any.
  ruler-table  (kvcompile's env)  `python3 -m kvcompile eval --suite ruler --dataset S.jsonl
               --predictions OUT.jsonl --kv-fraction (the run's) --query both ...`: one table per
               mode, kvcompile's specs and kvpress's presses side by side per fraction and task;
               options it does not know go on to kvcompile eval (--specs, --out, --plot-dir, ...).
  Timings are only meaningful from a quiet machine.

Kept positions, entry for entry (issue 35; scripts/kvpress_kept.py):
  kept-kvpress (.venv-kvpress)     each press's kept positions per layer, KV head and fraction on the samples
  kept         (kvcompile's env)   kvcompile's specs on the same ids; per (layer, head) the share of kvpress's
                                   kept positions kvcompile keeps too; summary JSON and table

Equal bytes (issue 24; docs/EVAL.md, "Equal bytes"): `ruler --kv-bytes 1/16,1/32 --caches quanto4` runs each
press over transformers' QuantizedCache (optimum-quanto) keeping the share F * E / e of the entries (E, e: an
entry's key + value bytes in the full cache and in the QuantizedCache; the arithmetic is above
`parse_cache`), one sample per call, and records the bytes the cache holds right after compression
(byte_fraction, kv_bytes_target, kv_entries, kv_bytes_entries, kv_bytes_pages, ...);
`kvcompile eval --suite ruler --kv-bytes 1/16,1/32 --specs snapkv,snapkv@int4,...` does the same for
kvcompile's specs, and `ruler-table --kvcompile-results K.json` tables both.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

PRESSES = ("snapkv", "pyramidkv", "adakv")


def csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def release_freed_memory() -> None:
    """glibc: a heap trim, so that resident memory at entry is the live tensors; the allocator is
    left as it is (the same as kvcompile.tools.models.release_freed_memory, which this env cannot import:
    a fixed mmap threshold slows a cache that reallocates every step, kvpress's DynamicCache)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Peak resident memory above the level at entry (sampled from /proc every 2 ms)."""

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        release_freed_memory()
        self.base = self.peak = self.rss()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()
        return self

    def watch(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def bytes(self) -> int:
        return self.peak - self.base


# --- step 1: prompts (kvcompile's environment) ----------------------------------------

def cmd_prompts(args) -> None:
    from transformers import AutoTokenizer

    import kvcompile
    from kvcompile.tools.data import load_haystack, needle_suite
    from kvcompile.tools.models import default_model_dir, load_model

    model_dir = Path(args.model) if args.model else default_model_dir()
    if not (model_dir / "config.json").is_file():
        load_model(args.model)  # converts the embedded model on first use
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = needle_suite(tokenizer, load_haystack(), args.lengths, args.depths, seed=args.seed)
    scoring = {}
    for name in PRESSES:
        policy = kvcompile.load_spec(name)
        part = policy.scoring
        scoring[name] = {"window": part.window, "kernel": part.pooling.kernel, "pooling": part.pooling.kind}
    data = {"model": str(model_dir.resolve()), "budgets": args.budgets, "max_new_tokens": args.max_new_tokens,
            "scoring": scoring,
            "prompts": [{"input_ids": p.input_ids, "answer": p.answer, "length": p.target, "tokens": p.length, "depth": p.depth,
                         "needle_span": list(p.needle_span)} for p in prompts]}
    Path(args.out).write_text(json.dumps(data))
    print(f"{len(prompts)} prompts -> {args.out}")


# --- step 2: kvpress (its own environment) --------------------------------------------

def make_press(name: str, scoring: dict, budget: int, n: int):
    """kvpress's press for `name`, keeping `budget` tokens per head of an n-token prompt."""
    from kvpress import AdaKVPress, PyramidKVPress, SnapKVPress

    ratio = max(0.0, 1.0 - (budget + 0.5) / n)
    w, k = scoring["window"], scoring["kernel"]
    if name == "snapkv":
        return SnapKVPress(compression_ratio=ratio, window_size=w, kernel_size=k)
    if name == "pyramidkv":
        return PyramidKVPress(compression_ratio=ratio, window_size=w, kernel_size=k, beta=20)
    return AdaKVPress(SnapKVPress(compression_ratio=ratio, window_size=w, kernel_size=k), alpha_safeguard=0.2)


def record_kept(press, kept: dict):
    """Wrap the press's scorer so the indices it keeps per layer land in kept[layer] (H lists).

    SnapKV and PyramidKV keep the top-n of these scores (n from kvpress's own budget
    function); AdaKV's choice is read afterwards from the indices it masks."""
    from kvpress import AdaKVPress, PyramidKVPress
    from kvpress.utils import compute_n_kept

    scorer = press.press if isinstance(press, AdaKVPress) else press
    score = scorer.score

    def recorded(module, hidden_states, keys, values, attentions, kwargs):
        scores = score(module, hidden_states, keys, values, attentions, kwargs)
        if not isinstance(press, AdaKVPress):
            k_len = keys.shape[2]
            n = press.get_layer_budget(module, k_len) if isinstance(press, PyramidKVPress) \
                else compute_n_kept(k_len, press.compression_ratio)
            top = scores.topk(n, dim=-1).indices[0]
            kept[module.layer_idx] = [sorted(row) for row in top.tolist()]
        return scores

    scorer.score = recorded


def adakv_kept(model, n: int) -> dict:
    """Kept indices per layer and head: everything AdaKV did not mask."""
    import torch

    kept = {}
    for layer in model.model.layers:
        attn = layer.self_attn
        heads = model.config.num_key_value_heads
        keep = torch.ones(heads, n, dtype=torch.bool)
        _, h, s = attn.masked_key_indices
        keep[h, s] = False
        kept[attn.layer_idx] = [row.nonzero().flatten().tolist() for row in keep]
    return kept


def run_kvpress(model, tokenizer, ids: list[int], press, max_new_tokens: int) -> dict:
    """Prefill the whole prompt under `press` (None = full cache), then greedy decoding."""
    import torch
    from transformers import DynamicCache

    from kvpress import AdaKVPress

    input_ids = torch.tensor([ids])
    n = len(ids)
    cache = DynamicCache()
    kept: dict = {}
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    if press is not None:
        record_kept(press, kept)
    with PeakRSS() as mem, torch.inference_mode():
        start = time.perf_counter()
        if press is None:
            out = model(input_ids, past_key_values=cache, logits_to_keep=1)
        else:
            with press(model):
                out = model(input_ids, past_key_values=cache, logits_to_keep=1)
        prefill = time.perf_counter() - start
        kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        new = [int(out.logits[0, -1].argmax())]
        start = time.perf_counter()
        for i in range(max_new_tokens - 1):
            if new[-1] in eos:
                break
            out = model(torch.tensor([[new[-1]]]), past_key_values=cache, position_ids=torch.tensor([[n + i]]))
            new.append(int(out.logits[0, -1].argmax()))
        decode = time.perf_counter() - start
    kv_final = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    if isinstance(press, AdaKVPress):
        kept = adakv_kept(model, n)
    entries = sum(len(row) for rows in kept.values() for row in rows) if kept else None
    return {"answer": tokenizer.decode(new, skip_special_tokens=True).strip(), "new_tokens": len(new),
            "prefill_s": prefill, "decode_tok_s": (len(new) - 1) / decode if len(new) > 1 and decode else None,
            "kv_bytes": kv_final, "kv_bytes_prefill": kv_bytes, "kept_entries": entries, "peak_bytes": mem.bytes,
            "kept": {str(k): v for k, v in sorted(kept.items())} or None}


def cmd_kvpress(args) -> None:
    from importlib.metadata import version

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    data = json.loads(Path(args.prompts).read_text())
    model = AutoModelForCausalLM.from_pretrained(data["model"], attn_implementation="sdpa", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(data["model"])
    run_kvpress(model, tokenizer, data["prompts"][0]["input_ids"][:64], None, 2)  # warm-up
    results = []
    for i, prompt in enumerate(data["prompts"]):
        ids = prompt["input_ids"]
        runs = [(None, None)] + [(name, b) for name in PRESSES for b in data["budgets"]]
        for name, budget in runs:
            press = None if name is None else make_press(name, data["scoring"][name], budget, len(ids))
            row = run_kvpress(model, tokenizer, ids, press, data["max_new_tokens"])
            row.update(prompt=i, press=name or "full", per_head=budget,
                       correct=prompt["answer"].lower() in row["answer"].lower())
            results.append(row)
            print(f"kvpress  prompt {i} ({len(ids)} tok) {row['press']:<10} {budget or '-':>4}: "
                  f"{row['answer'][:40]!r} {'ok' if row['correct'] else 'miss'}", file=sys.stderr)
    versions = {"kvpress": version("kvpress"), "transformers": transformers.__version__, "torch": torch.__version__}
    Path(args.out).write_text(json.dumps({"versions": versions, "results": results}))
    print(f"{len(results)} kvpress runs -> {args.out}")


# --- step 3: ours, and the comparison (kvcompile's environment) -----------------------

def matched(scoring: dict) -> dict:
    """Overrides that set our spec to what kvpress runs: kvpress's SnapKV scorer pools by
    average only, so a spec that max-pools (pyramidkv, adakv) is compared with avg pooling of
    the same kernel; window and kernel are the spec's on both sides already."""
    return {"scoring": {"window_attention": {"pooling": {"kind": "avg", "kernel": scoring["kernel"]}}}}


def jaccard(ours: list[int], theirs: list[int]) -> float:
    a, b = set(ours), set(theirs)
    return len(a & b) / len(a | b) if a | b else 1.0


def cmd_kvcompile(args) -> None:
    import torch

    import kvcompile
    from kvcompile.tools.data import answer_found
    from kvcompile.tools.models import full_kv_bytes, generate, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    data = json.loads(Path(args.prompts).read_text())
    theirs = json.loads(Path(args.kvpress).read_text())
    model, tokenizer = load_model(data["model"])
    generate(model, tokenizer, data["prompts"][0]["input_ids"][:64], 2)  # warm-up
    ours = []
    for i, prompt in enumerate(data["prompts"]):
        ids = prompt["input_ids"]
        runs = [(None, None)] + [(name, b) for name in PRESSES for b in data["budgets"]]
        for name, budget in runs:
            if name is None:
                g = generate(model, tokenizer, ids, data["max_new_tokens"])
                kv, kept = full_kv_bytes(model, len(ids) + len(g.new_tokens) - 1), None
            else:
                overrides = {} if args.as_shipped else matched(data["scoring"][name])
                if args.uniform_layers:
                    overrides["budget"] = {"layers": "uniform"}
                kvcompile.compile(model, name, per_head=budget, **overrides)
                try:
                    g = generate(model, tokenizer, ids, data["max_new_tokens"])
                finally:
                    kvcompile.uncompile(model)
                kv = g.report["bytes_held"]
                kept = {str(layer): [row.nonzero().flatten().tolist() for row in g.cache.kept_positions(layer)[0]]
                        for layer in range(len(g.cache))}
            ours.append({"prompt": i, "press": name or "full", "per_head": budget, "answer": g.text,
                         "correct": answer_found(g.text, prompt["answer"]), "kv_bytes": kv,
                         "peak_bytes": g.peak_bytes, "prefill_s": g.prefill_seconds,
                         "decode_tok_s": g.decode_tokens_per_second, "kept": kept})
            print(f"kvcompile prompt {i} {name or 'full':<10} {budget or '-':>4}: {g.text[:40]!r}", file=sys.stderr)
    table = compare(ours, theirs["results"])
    Path(args.out).write_text(json.dumps({"versions": theirs["versions"], "table": table,
                                          "kvcompile": ours, "kvpress": theirs["results"]}))
    print(markdown(table, len(data["prompts"])))
    print(f"\nfull results -> {args.out}")


def compare(ours: list[dict], theirs: list[dict]) -> list[dict]:
    """One row per (press, budget): both sides' accuracy, kept agreement, bytes, memory, time."""
    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None

    rows = []
    for key in dict.fromkeys((r["press"], r["per_head"]) for r in ours):
        a = [r for r in ours if (r["press"], r["per_head"]) == key]
        b = {r["prompt"]: r for r in theirs if (r["press"], r["per_head"]) == key}
        pairs = [(r, b[r["prompt"]]) for r in a if r["prompt"] in b]
        agree = [jaccard(x["kept"][layer][h], y["kept"][layer][h]) for x, y in pairs
                 if x["kept"] and y["kept"] for layer in x["kept"] for h in range(len(x["kept"][layer]))]
        rows.append({"press": key[0], "per_head": key[1],
                     "ours_correct": sum(x["correct"] for x, _ in pairs), "kvpress_correct": sum(y["correct"] for _, y in pairs),
                     "same_answer": sum(x["answer"] == y["answer"] for x, y in pairs), "prompts": len(pairs),
                     "kept_jaccard": mean(agree),
                     "ours_kv_bytes": mean([x["kv_bytes"] for x, _ in pairs]),
                     "kvpress_kv_bytes": mean([y["kv_bytes"] for _, y in pairs]),
                     "ours_peak_bytes": mean([x["peak_bytes"] for x, _ in pairs]),
                     "kvpress_peak_bytes": mean([y["peak_bytes"] for _, y in pairs]),
                     "ours_prefill_s": mean([x["prefill_s"] for x, _ in pairs]),
                     "kvpress_prefill_s": mean([y["prefill_s"] for _, y in pairs]),
                     "ours_decode_tok_s": mean([x["decode_tok_s"] for x, _ in pairs]),
                     "kvpress_decode_tok_s": mean([y["decode_tok_s"] for _, y in pairs])})
    return rows


def markdown(rows: list[dict], n: int) -> str:
    mib = lambda x: "-" if x is None else f"{x / 2**20:.1f}"
    num = lambda x, f="{:.1f}": "-" if x is None else f.format(x)
    out = [f"| press | per head | correct ours / kvpress (of {n}) | same answer | kept-token Jaccard | "
           "KV MiB ours / kvpress | peak MiB ours / kvpress | prefill s ours / kvpress | decode tok/s ours / kvpress |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['press']} | {r['per_head'] or '-'} | {r['ours_correct']} / {r['kvpress_correct']} | "
                   f"{r['same_answer']} | {num(r['kept_jaccard'], '{:.3f}')} | "
                   f"{mib(r['ours_kv_bytes'])} / {mib(r['kvpress_kv_bytes'])} | "
                   f"{mib(r['ours_peak_bytes'])} / {mib(r['kvpress_peak_bytes'])} | "
                   f"{num(r['ours_prefill_s'])} / {num(r['kvpress_prefill_s'])} | "
                   f"{num(r['ours_decode_tok_s'])} / {num(r['kvpress_decode_tok_s'])} |")
    return "\n".join(out)


# --- RULER: kvpress's presses through its own pipeline, on kvcompile's samples --------------
#
# Steps `ruler` (.venv-kvpress), `tokens` and `ruler-table` (kvcompile's environment).  The
# samples are the JSONL `kvcompile eval --suite ruler --dump-dataset` writes (kvpress's
# evaluation columns); the predictions are the JSONL `kvcompile eval --predictions` reads.

# kvpress's leaderboard presses, by the names of its evaluation registry
# (evaluation/evaluate_registry.py, PRESS_REGISTRY), each built as that registry builds it: the
# hyper-parameters are kvpress's defaults except where the registry sets one (expected_attention:
# AdaKV over ExpectedAttention with epsilon 1e-2).  The compression ratio is set per run.
RULER_PRESSES = ("snapkv", "pyramidkv", "adakv_snapkv", "streaming_llm", "tova", "observed_attention",
                 "knorm", "expected_attention", "kvzip")
RULER_FRACTIONS = (0.1, 0.25, 0.5)
MODES = ("aware", "agnostic")
FULL = "full"  # the run without a press (method "kvpress:full")


def method_name(press: str) -> str:
    """The predictions' method label: kept apart from kvcompile's spec names by the prefix."""
    return f"kvpress:{press}"


def kept_fractions(text: str) -> list[float]:
    """--fractions: KV shares kept, each in (0, 1) (kvpress's compression_ratio = 1 - f)."""
    values = csv(float)(text)
    bad = [v for v in values if not 0 < v < 1]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"fractions kept must be in (0, 1), got {text!r}")
    return values


def choices(allowed):
    def parse(text: str) -> list[str]:
        values = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [v for v in values if v not in allowed]
        if unknown or not values:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown) or 'empty list'}: one of {', '.join(allowed)}")
        return values
    return parse


class SamplesError(ValueError):
    """A samples file that is not in kvpress's evaluation columns (file, line, column)."""


def read_samples(path) -> list[dict]:
    """Samples in kvpress's evaluation columns from JSONL (or Parquet): context, question,
    answers (a list) or answer, optional answer_prefix (default ""), max_new_tokens (default 128),
    task (default "dataset") and index (default the row's number from 0), as kvcompile's
    `eval --dataset` reads them, so both tools answer the same samples under the same indices."""
    path = Path(path)
    if not path.is_file():
        raise SamplesError(f"{path}: no such file")
    if path.suffix.lower() in (".parquet", ".pq"):
        import pandas  # kvpress depends on pandas (and datasets on pyarrow)

        rows = [(i + 1, row) for i, row in enumerate(pandas.read_parquet(path).to_dict("records"))]
        where = "row"
    else:
        rows, where = [], "line"
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as exc:
                    raise SamplesError(f"{path}, line {line_no}: not JSON ({exc})") from None
                if not isinstance(row, dict):
                    raise SamplesError(f"{path}, line {line_no}: expected a JSON object")
                rows.append((line_no, row))
    if not rows:
        raise SamplesError(f"{path}: no samples")
    samples, seen = [], set()
    for i, (line_no, row) in enumerate(rows):
        at = f"{path}, {where} {line_no}"
        for column in ("context", "question"):
            if not isinstance(row.get(column), str):
                raise SamplesError(f"{at}: column '{column}' missing or not text")
        gold = row.get("answers", row.get("answer"))
        if gold is None:
            raise SamplesError(f"{at}: column 'answers' (or 'answer') missing")
        gold = [gold] if isinstance(gold, str) else [str(a) for a in list(gold)]
        index = row.get("index", i)
        if not isinstance(index, int) or index in seen:
            raise SamplesError(f"{at}: 'index' must be a distinct integer, got {index!r}")
        seen.add(index)
        new = row.get("max_new_tokens") or 128
        if not isinstance(new, int) or new < 1:
            raise SamplesError(f"{at}: 'max_new_tokens' must be a positive integer, got {new!r}")
        samples.append({"index": index, "task": str(row.get("task") or "dataset"), "context": row["context"],
                        "question": row["question"], "answer_prefix": str(row.get("answer_prefix") or ""),
                        "answers": gold, "max_new_tokens": int(new)})
    return samples


def mode_inputs(sample: dict, mode: str) -> tuple[str, str]:
    """(context, question) handed to kvpress's pipeline: agnostic as they are (the context is
    compressed, then the question is fed); aware as kvpress's evaluation does with query_aware
    (evaluate.py: the question is appended to the context and the question is empty)."""
    if mode == "agnostic":
        return sample["context"], sample["question"]
    if mode == "aware":
        return sample["context"] + sample["question"], ""
    raise ValueError(f"mode is 'aware' or 'agnostic', got {mode!r}")


def context_groups(samples: list[dict], mode: str) -> list[list[dict]]:
    """Samples that share one pipeline call: kvpress's evaluation groups rows by context (its
    pipeline prefills and compresses a context once and answers each question from it); here
    the answer prefix and max_new_tokens must agree too, which evaluate.py assumes of a group."""
    groups: dict = {}
    for s in samples:
        context, _ = mode_inputs(s, mode)
        groups.setdefault((context, s["answer_prefix"], s["max_new_tokens"]), []).append(s)
    return list(groups.values())


def run_key(index: int, mode: str, method: str, fraction) -> tuple:
    return (index, mode, method, None if fraction is None else round(float(fraction), 6))


def done_runs(path: Path) -> set:
    """Keys of the prediction records already in `path` (for --resume)."""
    if not path.is_file():
        return set()
    done = set()
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                budget = r["byte_fraction"] if r.get("byte_fraction") is not None else r["fraction"]
                done.add(run_key(r["index"], r["mode"], r["method"], budget))
    return done


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first position where two token id lists differ (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def side_path(out: Path, what: str) -> Path:
    """kvpress_ruler.jsonl -> kvpress_ruler.{what}.json (the run's metadata, the fed token ids)."""
    return out.with_name(f"{out.stem}.{what}.json")


# --- equal bytes: a press over transformers' QuantizedCache (issue 24) ---------------------------
#
# transformers' QuantizedCache with optimum-quanto ("quanto" backend; transformers 5.2's
# QuantoQuantizedLayer, axis 0 for keys and values) quantizes each key and value tensor (B, H, T, d)
# in groups of `q_group_size` consecutive elements of the flattened tensor, so with a group that divides
# the head dim d, per token and head: g channels share one scale and one shift, both in the model's dtype
# (optimum-quanto's MaxOptimizer: scale = (max - min) / (2^bits - 1), shift = -min; WeightQBitsTensor
# keeps codes packed two (4 bits) or four (2 bits) a byte in a PackedTensor, `_scale` and `_shift`
# beside them).  One entry (key + value) of such a cache therefore takes
#     e = 2 * (d * bits / 8 + (d / g) * 2 * element_size)   bytes
# (d = 64, fp32: 4 bits, g = 64: 2 * (32 + 8) = 80; g = 32: 96; 2 bits, g = 64: 48), the same as
# kvcompile's `storage: int4` (g = 0 or 64: 80, g = 32: 96) -- and E = 2 * d * element_size = 512 for
# an entry of the full (DynamicCache) cache.  Its full-precision residual (`residual_length`, 128 by
# default) holds the tokens appended after the prefill until it fills, then everything is quantized
# again; kvpress's presses compress at the prefill and leave the residual empty (base_press.py /
# kvzip_press.py set `keys` to an empty tensor), so right after compression the cache holds
# kept * e bytes and no residual.  A byte fraction F of the full cache's bytes (n context tokens)
# is held by keeping the share F * E / e of the entries: compression_ratio = 1 - F * E / e (80 bytes:
# 1/16 -> keep 0.4, 1/32 -> 0.2).  What is counted: codes, scales and shifts (and a residual, were
# there one), measured from the cache's tensors right after compression (before the first question is
# fed) and checked against e; the question and answer tokens that follow go to the residual in full
# precision.  AdaKVPress (expected_attention here) and KVzipPress do not evict: they keep every entry
# and mask the pruned ones in attention (masked_key_indices), so their cache stores every entry; the
# equal-bytes target counts the entries they keep unmasked (as kvpress states its compression ratio),
# and `kv_bytes_pages` records the bytes their tensors really hold.

CACHE_FORM = re.compile(r"^quanto([24])(?:g(\d+))?$")
QUANTO_GROUP = 64  # transformers' QuantizedCache default q_group_size
RESIDUAL_LENGTH = 128  # transformers' QuantizedCache default residual_length


def parse_cache(text: str) -> dict | None:
    """--caches item: `dynamic` (transformers' DynamicCache, kvpress's default) -> None, or
    `quanto4`, `quanto2`, `quanto4g32` -> QuantizedCache with optimum-quanto, that many bits, g channels a scale."""
    if text == "dynamic":
        return None
    m = CACHE_FORM.match(text)
    if m is None:
        raise ValueError(f"unknown cache {text!r}: dynamic, quanto4, quanto2 or quantoBgG (e.g. quanto4g32)")
    return {"backend": "quanto", "bits": int(m.group(1)), "group": int(m.group(2) or QUANTO_GROUP)}


def cache_label(cache: dict | None) -> str:
    return "dynamic" if cache is None else f"quanto{cache['bits']}g{cache['group']}"


def caches(text: str) -> list:
    try:
        return [parse_cache(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def byte_fractions(text: str) -> list:
    """--kv-bytes: byte fractions of the full cache, 1/16 or 0.0625, each in (0, 1]."""
    out = []
    for x in text.split(","):
        if not x.strip():
            continue
        try:
            f = Fraction(x.strip())
        except (ValueError, ZeroDivisionError):
            raise argparse.ArgumentTypeError(f"a byte fraction is written 1/16 or 0.0625, got {x!r}") from None
        if not 0 < f <= 1:
            raise argparse.ArgumentTypeError(f"a byte fraction is in (0, 1], got {x!r}")
        out.append(f)
    if not out:
        raise argparse.ArgumentTypeError("no byte fraction given")
    return out


def entry_bytes(cache: dict | None, head_dim: int, element_size: int) -> int:
    """Key + value bytes of one entry: the full cache's 2 d s, or the QuantizedCache's
    2 (d bits / 8 + (d / g) 2 s) (codes, one scale and one shift per g channels, in the model's dtype)."""
    if cache is None:
        return 2 * head_dim * element_size
    if head_dim % cache["group"] or (head_dim * cache["bits"]) % 8:
        raise ValueError(f"{cache_label(cache)}: the group {cache['group']} does not divide the head dim {head_dim}")
    return 2 * (head_dim * cache["bits"] // 8 + (head_dim // cache["group"]) * 2 * element_size)


def kept_share(cache: dict | None, byte_fraction, head_dim: int, element_size: int) -> Fraction:
    """F * E / e: the share of entries kept so that the keys and values take `byte_fraction` of the
    full cache's bytes; ValueError where it is above 1 (the fraction cannot be held)."""
    full, e = entry_bytes(None, head_dim, element_size), entry_bytes(cache, head_dim, element_size)
    share = Fraction(byte_fraction) * full / e
    if share > 1:
        raise ValueError(f"{cache_label(cache)} cannot hold {Fraction(byte_fraction)} of the full cache's bytes: an "
                         f"entry takes {e} bytes against {full}, so keeping every entry holds {e / full:.2%} of them; "
                         f"give at most {Fraction(e, full)}")
    return share


def tensor_bytes(t) -> int:
    """Bytes a tensor stores; a tensor subclass (optimum-quanto's WeightQBitsTensor, PackedTensor) by its
    inner tensors (packed codes, scales, shifts)."""
    if hasattr(t, "__tensor_flatten__") and type(t).__name__ != "Tensor":
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def cache_held(cache, model) -> dict:
    """What a kvpress cache holds now: entries stored (per layer, batch and KV head), the bytes of their
    tensors (quantized part + full-precision residual), and the entries masked by a press that masks
    instead of evicting (module.masked_key_indices)."""
    from transformers import QuantizedCache

    stored = stored_bytes = masked = residual = expected = 0
    for i, layer in enumerate(cache.layers):
        if isinstance(cache, QuantizedCache):
            qk, qv = layer._quantized_keys, layer._quantized_values
            stored += qk.shape[0] * qk.shape[1] * qk.shape[2]
            stored_bytes += tensor_bytes(qk) + tensor_bytes(qv)
            for q in (qk, qv):  # the arithmetic, with quanto's packing of whole rows of g codes
                rows = q.numel() // layer.q_group_size
                expected += quanto_tensor_bytes(rows, layer.nbits, layer.q_group_size, q._scale.element_size())
            if layer.keys.dim() == 4:
                residual += layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2]
                stored += layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2]
            stored_bytes += tensor_bytes(layer.keys) + tensor_bytes(layer.values)
        else:
            stored += layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2]
            stored_bytes += tensor_bytes(layer.keys) + tensor_bytes(layer.values)
        indices = getattr(model.model.layers[i].self_attn, "masked_key_indices", None)
        masked += 0 if indices is None else len(indices[0])
    if isinstance(cache, QuantizedCache):
        expected += sum(tensor_bytes(layer.keys) + tensor_bytes(layer.values) for layer in cache.layers)
        if expected != stored_bytes:
            raise RuntimeError(f"the QuantizedCache's tensors hold {stored_bytes} bytes, the arithmetic says {expected}")
    return {"stored": stored, "stored_bytes": stored_bytes, "masked": masked, "residual": residual}


def quanto_tensor_bytes(rows: int, bits: int, group: int, element_size: int) -> int:
    """Bytes of one optimum-quanto WeightQBitsTensor of `rows` groups of `group` codes (axis 0): the codes
    packed 8 / bits rows a byte along the rows (PackedTensor; an odd row count is padded to a whole byte,
    at most `group` bytes), and one scale and one shift per row in the model's dtype."""
    per_byte = 8 // bits
    return -(-rows // per_byte) * group + rows * 2 * element_size


def ruler_press(name: str, fraction: float):
    """kvpress's press `name` as its evaluation registry builds it, keeping `fraction` of the KV
    (compression_ratio = 1 - fraction, set on the press as evaluate.py sets it; AdaKVPress passes
    it on to the press it wraps)."""
    import kvpress as kp

    build = {
        "snapkv": lambda: kp.SnapKVPress(),
        "pyramidkv": lambda: kp.PyramidKVPress(),
        "adakv_snapkv": lambda: kp.AdaKVPress(kp.SnapKVPress()),
        "streaming_llm": lambda: kp.StreamingLLMPress(),
        "tova": lambda: kp.TOVAPress(),
        "observed_attention": lambda: kp.ObservedAttentionPress(),
        "knorm": lambda: kp.KnormPress(),
        "expected_attention": lambda: kp.AdaKVPress(kp.ExpectedAttentionPress(epsilon=1e-2)),
        "kvzip": lambda: kp.KVzipPress(),
    }
    press = build[name]()
    press.compression_ratio = 1.0 - fraction
    return press


def kvpress_pipeline(model_dir: str, eager: bool):
    """kvpress's "kv-press-text-generation" pipeline on the CPU in fp32; attention as kvpress's
    evaluation chooses it without flash-attn: eager for ObservedAttentionPress (it reads the
    attention weights), transformers' default (SDPA) otherwise."""
    import torch
    from transformers import pipeline

    import kvpress  # noqa: F401  (registers the pipeline)

    kwargs = {"dtype": torch.float32, **({"attn_implementation": "eager"} if eager else {})}
    pipe = pipeline("kv-press-text-generation", model=model_dir, device="cpu", model_kwargs=kwargs)
    pipe.model.eval()
    return pipe


class PipelineClock:
    """Seconds kvpress's pipeline spends per call, and the token ids it feeds, read by wrapping
    this pipeline object's own methods while the `with` block lasts (the class is untouched):
    preprocess (chat template + tokenization; its output is what the model is fed), _forward
    (prefill + compression, then each question's answer) and generate_answer (one question:
    its forward pass and the greedy decode).  prefill_s = _forward - the answers."""

    def __init__(self, pipe, probe=None, keep_answer: bool = False):
        self.pipe = pipe
        # keep_answer: skip kvpress's _remove_answer_from_cache (a QuantizedCache, one question per call): it
        # slices the full-precision residual as a 4-d tensor, which fails (IndexError) once the question and
        # answer filled the residual (residual_length) and transformers re-quantized everything and left an
        # empty 1-d residual; the removal only serves a next question on the same cache, and there is none
        self.keep_answer = keep_answer
        self.probe = probe  # probe(cache): read at the first question, before it is fed (the compressed cache)
        self.held = None

    def __enter__(self):
        pipe = self.pipe
        self.preprocess_s, self.forward_s, self.answer_s, self.fed = 0.0, 0.0, [], None
        preprocess, forward, answer = pipe.preprocess, pipe._forward, pipe.generate_answer

        def timed_preprocess(*a, **k):
            start = time.perf_counter()
            self.fed = preprocess(*a, **k)
            self.preprocess_s += time.perf_counter() - start
            return self.fed

        def timed_forward(*a, **k):
            start = time.perf_counter()
            out = forward(*a, **k)
            self.forward_s += time.perf_counter() - start
            return out

        def timed_answer(*a, **k):
            if self.probe is not None and self.held is None:
                self.held = self.probe(k["cache"])
            start = time.perf_counter()
            out = answer(*a, **k)
            self.answer_s.append(time.perf_counter() - start)
            return out

        pipe.preprocess, pipe._forward, pipe.generate_answer = timed_preprocess, timed_forward, timed_answer
        if self.keep_answer:
            pipe._remove_answer_from_cache = lambda cache, lengths: None
        return self

    def __exit__(self, *exc):
        for name in ("preprocess", "_forward", "generate_answer") + (("_remove_answer_from_cache",) if self.keep_answer else ()):
            delattr(self.pipe, name)  # back to the class's methods

    @property
    def prefill_s(self) -> float:
        return self.forward_s - sum(self.answer_s)

    def fed_ids(self) -> tuple[list[int], list[list[int]]]:
        return self.fed["context_ids"][0].tolist(), [q[0].tolist() for q in self.fed["questions_ids"]]


def bytes_record(held: dict, cache: dict | None, byte_fraction, context_tokens: int, model) -> dict:
    """The equal-bytes fields of a prediction record from `cache_held` (read right after compression):
    the target F * (full cache bytes of the context), the entries kept (unmasked), their bytes at the
    arithmetic's e per entry (checked against the tensors' own bytes), and the bytes the tensors hold."""
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    size = next(model.parameters()).element_size()
    e = entry_bytes(cache, head_dim, size)
    # e per entry, up to quanto's padding of each tensor's codes to a whole byte (< group bytes a tensor)
    slack = 0 if cache is None else 2 * layers * cache["group"]
    if held["residual"] == 0 and not 0 <= held["stored_bytes"] - held["stored"] * e < max(slack, 1):
        raise RuntimeError(f"{cache_label(cache)}: the cache's tensors hold {held['stored_bytes']} bytes for "
                           f"{held['stored']} entries, not {e} an entry: the byte arithmetic is wrong here")
    kept = held["stored"] - held["masked"]
    return {"byte_fraction": float(byte_fraction), "storage": cache_label(cache),
            "kv_bytes_target": float(Fraction(byte_fraction) * context_tokens * layers * heads * 2 * head_dim * size),
            "kv_entries": kept, "kv_entry_bytes": e, "kv_bytes_entries": kept * e,
            "kv_bytes_pages": held["stored_bytes"], "kv_masked_entries": held["masked"],
            "kv_residual_entries": held["residual"], "kept_share": kept / (context_tokens * layers * heads)}


def cmd_ruler(args) -> None:
    from importlib.metadata import version

    import torch
    import transformers
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    if args.quiet:
        transformers.utils.logging.disable_progress_bar()
    samples = read_samples(args.samples)
    if args.limit:
        samples = samples[:args.limit]
    model_dir = str(Path(args.model).resolve())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = done_runs(out) if args.resume else set()
    if not args.resume:
        out.write_text("")
    # a run: (press, KV share kept, cache (None: DynamicCache), byte fraction (None: a --fractions run))
    full_runs = [(FULL, None, None, None)] if args.full else []
    if args.kv_bytes:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        try:
            shares = {(cache_label(c), f): kept_share(c, f, head_dim, 4) for c in args.caches for f in args.kv_bytes}
        except ValueError as exc:
            sys.exit(f"ruler --kv-bytes: {exc}")
        runs = full_runs + [(p, float(shares[(cache_label(c), f)]), c, f) for p in args.presses for c in args.caches
                            for f in args.kv_bytes]
    else:
        runs = full_runs + [(p, f, None, None) for p in args.presses for f in args.fractions]
    groups = {mode: context_groups(samples, mode) for mode in args.modes}
    singles = {mode: [[s] for g in groups[mode] for s in g] for mode in args.modes}
    pipes: dict = {}
    presses_meta = {p: {str(fr): repr(ruler_press(p, fr)) for fr in sorted({r[1] for r in runs if r[0] == p})}
                    for p in args.presses}
    meta = {"model": model_dir, "samples_file": str(Path(args.samples).resolve()), "samples": len(samples),
            "modes": args.modes, "fractions": args.fractions, "presses": presses_meta, "full": args.full,
            "threads": torch.get_num_threads(), "dtype": "float32", "device": "cpu",
            "attention": {p: "eager" if p == "observed_attention" else "sdpa" for p in args.presses},
            "versions": {"kvpress": version("kvpress"), "transformers": transformers.__version__,
                         "torch": torch.__version__},
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            **({"kv_bytes": [str(f) for f in args.kv_bytes], "caches": [cache_label(c) for c in args.caches],
                "residual_length": args.residual_length,
                "kept_shares": {f"{cache_label(c)} {f}": float(shares[(cache_label(c), f)])
                                for c in args.caches for f in args.kv_bytes}} if args.kv_bytes else {}),
            "timings": "prefill_s (prefill + compression, shared by a group's questions), decode_s (the "
                       "question's forward pass + greedy decode), peak_rss_bytes (the pipeline call, above its start), "
                       "call_cpu_s (the process's CPU seconds in the whole call, all threads)"}
    side_path(out, "meta").write_text(json.dumps(meta, indent=1))
    tokens_file = side_path(out, "tokens")
    failures: list[dict] = []
    token_groups = json.loads(tokens_file.read_text())["groups"] if args.resume and tokens_file.is_file() else []
    def label(press, cache):
        return method_name(press if cache is None else f"{press}@{cache_label(cache)}")

    # a QuantizedCache answers one question per call: kvpress's _remove_answer_from_cache slices the
    # quantized tensors (optimum-quanto returns them dequantized), so a second question would not see
    # the quantized context
    todo = [(mode, press, fraction, cache, bf, group) for mode in args.modes for press, fraction, cache, bf in runs
            for group in (groups if cache is None else singles)[mode]
            if any(run_key(s["index"], mode, label(press, cache), bf if bf is not None else fraction) not in done
                   for s in group)]
    bar = tqdm(todo, desc="kvpress ruler", unit="call", disable=args.quiet)
    with open(out, "a", encoding="utf-8") as f:
        for mode, press_name, fraction, cache, bf, group in bar:
            eager = press_name == "observed_attention"
            if eager not in pipes:
                pipes[eager] = kvpress_pipeline(model_dir, eager)
                with torch.inference_mode():
                    pipes[eager]("A short warm-up text. " * 8, question="What is it?", max_new_tokens=2)
            pipe = pipes[eager]
            bar.set_postfix_str(f"{mode} {label(press_name, cache)} {bf or fraction or ''}".strip())
            press = None if press_name == FULL else ruler_press(press_name, fraction)
            kv_cache = None
            if cache is not None:
                from transformers import QuantizedCache

                kv_cache = QuantizedCache(backend=cache["backend"], config=pipe.model.config, nbits=cache["bits"],
                                          q_group_size=cache["group"], residual_length=args.residual_length)
            probe = None if bf is None else (lambda c, model=pipe.model: cache_held(c, model))
            context, _ = mode_inputs(group[0], mode)
            questions = [mode_inputs(s, mode)[1] for s in group]
            cpu = time.process_time()
            try:
                with PipelineClock(pipe, probe, keep_answer=cache is not None) as clock, PeakRSS() as mem, \
                        torch.inference_mode():
                    answers = pipe(context, questions=questions, answer_prefix=group[0]["answer_prefix"], press=press,
                                   max_new_tokens=group[0]["max_new_tokens"], cache=kv_cache)["answers"]
            except Exception as exc:  # a press that fails on a sample: no prediction, named at the end
                failures.append({"mode": mode, "method": label(press_name, cache), "fraction": fraction,
                                 "byte_fraction": None if bf is None else str(bf),
                                 "indices": [s["index"] for s in group], "error": f"{type(exc).__name__}: {exc}"})
                side_path(out, "meta").write_text(json.dumps({**meta, "failures": failures}, indent=1))
                continue
            cpu = time.process_time() - cpu
            context_ids, questions_ids = clock.fed_ids()
            if sum(g["mode"] == mode for g in token_groups) < args.token_samples and \
                    not any(g["mode"] == mode and g["indices"] == [s["index"] for s in group] for g in token_groups):
                token_groups.append({"mode": mode, "indices": [s["index"] for s in group],
                                     "context_ids": context_ids, "questions_ids": questions_ids})
                tokens_file.write_text(json.dumps({"model": model_dir, "groups": token_groups}))
            held = {}
            if bf is not None:
                held = bytes_record(clock.held, cache, bf, len(context_ids), pipe.model)
            for s, answer, decode_s, q_ids in zip(group, answers, clock.answer_s, questions_ids):
                record = {"index": s["index"], "task": s["task"], "mode": mode, "method": label(press_name, cache),
                          "fraction": fraction, "prediction": answer,
                          "press": None if press is None else repr(press),
                          "compression_ratio": 0.0 if press is None else press.compression_ratio,
                          "context_tokens": len(context_ids), "question_tokens": len(q_ids), "group_size": len(group),
                          "prefill_s": clock.prefill_s, "decode_s": decode_s, "preprocess_s": clock.preprocess_s,
                          "peak_rss_bytes": mem.bytes, "call_cpu_s": cpu, **held}
                f.write(json.dumps(record) + "\n")
            f.flush()
    for fail in failures:
        print(f"FAILED {fail['mode']} {fail['method']} {fail['fraction']} samples {fail['indices']}: {fail['error']}",
              file=sys.stderr)
    if failures:
        sys.exit(f"{len(failures)} of {len(todo)} pipeline calls failed (no prediction written; listed in "
                 f"{side_path(out, 'meta')})")
    print(f"{len(todo)} pipeline calls ({len(samples)} samples, modes {','.join(args.modes)}) -> {out} "
          f"(+ {side_path(out, 'meta').name}, {side_path(out, 'tokens').name})")


def cmd_tokens(args) -> None:
    """kvcompile's prompt ids (kvcompile.tools.ruler.mode_prompt) against the ids kvpress's pipeline fed."""
    from transformers import AutoTokenizer

    try:
        from kvcompile.tools import ruler
    except ImportError:
        sys.exit("tokens: this kvcompile has no RULER suite (kvcompile.tools.ruler); run it where "
                 "`kvcompile eval --suite ruler` exists")
    fed = json.loads(Path(args.tokens).read_text())
    samples = {s["index"]: s for s in ruler.load_dataset(args.samples)}
    tokenizer = AutoTokenizer.from_pretrained(args.model or fed["model"])
    checked, mismatches = 0, []
    for g in fed["groups"]:
        for i, index in enumerate(g["indices"]):
            ours_context, ours_question = ruler.mode_prompt(tokenizer, samples[index], g["mode"])
            for part, ours, theirs in (("context", ours_context, g["context_ids"]),
                                       ("question", ours_question, g["questions_ids"][i])):
                at = first_difference(ours, theirs)
                if at is not None:
                    mismatches.append(f"sample {index} ({g['mode']}) {part}: {len(ours)} ids (kvcompile) vs "
                                      f"{len(theirs)} (kvpress), first difference at {at}: kvcompile "
                                      f"{tokenizer.decode(ours[max(0, at - 5):at + 5])!r} vs kvpress "
                                      f"{tokenizer.decode(theirs[max(0, at - 5):at + 5])!r}")
            checked += 1
    for line in mismatches:
        print(line)
    print(f"tokens: {checked} sample prompts compared, {len(mismatches)} mismatching part(s)")
    if mismatches:
        sys.exit(1)


def samples_subset(samples: Path, predictions: Path):
    """When the predictions cover only some samples (ruler --limit), (a file of those rows, their
    count), written beside the predictions so that kvcompile's rows average the same samples;
    None when they cover them all.  The rows are copied unchanged (an index is added where the
    file relied on the row number)."""
    answered = {json.loads(line)["index"] for line in predictions.read_text(encoding="utf-8").splitlines() if line.strip()}
    rows = [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [{**row, "index": row.get("index", i)} for i, row in enumerate(rows)]
    kept = [row for row in rows if row["index"] in answered]
    if len(kept) == len(rows):
        return None
    path = predictions.with_name(f"{predictions.stem}.samples.jsonl")
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in kept), encoding="utf-8")
    return path, len(kept)


def ruler_table_from_results(args) -> None:
    """The table from a finished `kvcompile eval --suite ruler --out JSON` on the same samples file and
    kvpress's predictions, without running kvcompile again (kvcompile's environment)."""
    from kvcompile.tools import ruler

    results = [json.loads(Path(path).read_text()) for path in args.kvcompile_results.split(",") if path.strip()]
    result = {**results[0], "results_files": args.kvcompile_results.split(",")}
    ours = [r for res in results for r in res["ruler"]]
    samples = ruler.load_dataset(args.samples)
    theirs = ruler.load_predictions(args.predictions, samples, {r["spec"] for r in ours})
    answered = {(r["index"], r["mode"]) for r in theirs}
    mine = [r for r in ours if (r["index"], r["mode"]) in answered]  # the samples and modes both ran
    if len(mine) < len(ours):
        print(f"ruler-table: {len(ours) - len(mine)} kvcompile records of samples or modes kvpress did not answer "
              "are left out", file=sys.stderr)
    records = mine + theirs
    print(ruler.format_summary(records))
    if args.out:
        Path(args.out).write_text(json.dumps({**result, "ruler": records, "predictions": args.predictions}, indent=1))
        print(f"\nresults  {args.out}")


def cmd_ruler_table(args, rest: list[str]) -> None:
    """`kvcompile eval --suite ruler` on the same samples, kvpress's predictions scored into its
    table: kvcompile's specs and kvpress's presses side by side per mode, fraction and task."""
    import subprocess

    if args.kvcompile_results:
        return ruler_table_from_results(args)
    meta_file = side_path(Path(args.predictions), "meta")
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    fractions = args.fractions or meta.get("fractions") or list(RULER_FRACTIONS)
    modes = args.modes or meta.get("modes") or list(MODES)
    query = "both" if set(modes) == set(MODES) else modes[0]
    samples = args.samples
    subset = samples_subset(Path(samples), Path(args.predictions))
    if subset is not None:
        print(f"ruler-table: kvpress answered {subset[1]} of the file's samples; kvcompile runs those ({subset[0]})",
              file=sys.stderr)
        samples = str(subset[0])
    kv_bytes = [x.strip() for x in args.kv_bytes.split(",") if x.strip()] if args.kv_bytes else meta.get("kv_bytes")
    budget = ["--kv-bytes", ",".join(kv_bytes)] if kv_bytes else ["--kv-fraction", ",".join(map(str, fractions))]
    cmd = [sys.executable, "-m", "kvcompile", "eval", "--suite", "ruler", "--dataset", samples,
           "--predictions", args.predictions, *budget, "--query", query]
    cmd += ["--specs", args.specs] if args.specs else []
    cmd += ["--out", args.out] if args.out else []
    cmd += ["--plot-dir", args.plot_dir] if args.plot_dir else []
    cmd += rest
    print("+ " + " ".join(cmd), file=sys.stderr)
    sys.exit(subprocess.run(cmd).returncode)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prompts", help="write the needle prompts (kvcompile's environment)")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the converted SmolLM2)")
    p.add_argument("--lengths", type=csv(int), default=[1000, 2000])
    p.add_argument("--depths", type=csv(float), default=[0.1, 0.5, 0.9])
    p.add_argument("--budgets", type=csv(int), default=[64, 128])
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.set_defaults(func=cmd_prompts)
    for step, func, help_text in (("kvpress", cmd_kvpress, "run kvpress's presses (its own venv)"),
                                  ("kvcompile", cmd_kvcompile, "run our specs and compare")):
        q = sub.add_parser(step, help=help_text)
        q.add_argument("--prompts", required=True)
        q.add_argument("--out", required=True)
        q.add_argument("--threads", type=int, default=None)
        if step == "kvcompile":
            q.add_argument("--kvpress", required=True, help="the kvpress step's JSON")
            q.add_argument("--as-shipped", action="store_true",
                           help="run our specs as shipped (max pooling where they say so), not matched to kvpress")
            q.add_argument("--uniform-layers", action="store_true",
                           help="give every layer the same budget (layers: uniform): what kvpress's "
                                "PyramidKVPress does when a layer's budget / beta is below its window")
        q.set_defaults(func=func)

    home = Path(os.environ.get("KVCOMPILE_HOME") or Path(__file__).resolve().parents[1])
    r = sub.add_parser("ruler", help="kvpress's presses on RULER samples through its pipeline, both query "
                                     "modes (its own venv): prediction records as JSONL")
    r.add_argument("--samples", required=True, help="JSONL (or Parquet) in kvpress's evaluation columns, "
                                                    "e.g. from `kvcompile eval --suite ruler --dump-dataset`")
    r.add_argument("--out", required=True, help="prediction records (JSONL); beside it OUT-stem.meta.json "
                                                "(presses, versions) and OUT-stem.tokens.json (the fed token ids)")
    r.add_argument("--presses", type=choices(RULER_PRESSES), default=list(RULER_PRESSES),
                   help=f"comma-separated, kvpress's registry names (default {','.join(RULER_PRESSES)})")
    r.add_argument("--fractions", type=kept_fractions, default=list(RULER_FRACTIONS),
                   help="KV shares kept, comma-separated (default 0.1,0.25,0.5); compression_ratio = 1 - f")
    r.add_argument("--modes", type=choices(MODES), default=list(MODES),
                   help="aware, agnostic or both comma-separated (default aware,agnostic)")
    r.add_argument("--kv-bytes", type=byte_fractions, default=None, metavar="F,F",
                   help="equal bytes instead of --fractions: each press keeps the share F * E / e of the entries, "
                        "E the full cache's and e the --caches cache's bytes per entry (e.g. 1/16,1/32)")
    r.add_argument("--caches", type=caches, default=[parse_cache("quanto4")], metavar="C,C",
                   help="with --kv-bytes: the cache under each press: quanto4 (default; transformers' QuantizedCache, "
                        "optimum-quanto, 4 bits, 64 channels a scale), quanto2, quanto4g32, or dynamic (no quantization)")
    r.add_argument("--residual-length", type=int, default=RESIDUAL_LENGTH,
                   help=f"QuantizedCache's full-precision residual (default {RESIDUAL_LENGTH}, transformers')")
    r.add_argument("--limit", type=int, default=None, help="only the first N samples of the file")
    r.add_argument("--no-full", dest="full", action="store_false", help="skip the run without a press")
    r.add_argument("--model", default=str(home / "models" / "smollm2-135m"),
                   help="checkpoint folder (default $KVCOMPILE_HOME/models/smollm2-135m, else the checkout's)")
    r.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    r.add_argument("--token-samples", type=int, default=3,
                   help="write the token ids fed for the first N pipeline calls of each mode (default 3)")
    r.add_argument("--resume", action="store_true", help="keep --out's records and run only the missing ones")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_ruler)

    t = sub.add_parser("tokens", help="compare kvcompile's RULER prompt ids with those kvpress's pipeline fed "
                                      "(kvcompile's environment); exit 1 on a mismatch")
    t.add_argument("--samples", required=True, help="the samples file the ruler step read")
    t.add_argument("--tokens", required=True, help="the ruler step's OUT-stem.tokens.json")
    t.add_argument("--model", default=None, help="tokenizer folder (default the one kvpress used)")
    t.set_defaults(func=cmd_tokens)

    tab = sub.add_parser("ruler-table", help="one table: `kvcompile eval --suite ruler` on the samples with "
                                             "kvpress's predictions (kvcompile's environment); other options "
                                             "go to kvcompile eval")
    tab.add_argument("--samples", required=True, help="the samples file the ruler step read")
    tab.add_argument("--predictions", required=True, help="the ruler step's JSONL")
    tab.add_argument("--fractions", type=kept_fractions, default=None,
                     help="KV shares kept for kvcompile's specs (default: those of the kvpress run)")
    tab.add_argument("--modes", type=choices(MODES), default=None, help="default: those of the kvpress run")
    tab.add_argument("--kv-bytes", default=None, metavar="F,F",
                     help="byte fractions for kvcompile's specs (default: those of an equal-bytes kvpress run, whose "
                          "meta has them); then --specs may name NAME@int4 / NAME@int8 / NAME@int4g32")
    tab.add_argument("--specs", default=None, help="kvcompile's specs, comma-separated (default kvcompile eval's)")
    tab.add_argument("--kvcompile-results", default=None, metavar="JSON",
                     help="finished `kvcompile eval --suite ruler --dataset SAMPLES --out JSON` runs on the same samples "
                          "(comma-separated files, e.g. one per byte fraction): table them with kvpress's predictions "
                          "instead of running kvcompile again")
    tab.add_argument("--out", default=None, help="kvcompile eval's --out JSON")
    tab.add_argument("--plot-dir", default=None, help="kvcompile eval's --plot-dir")
    tab.set_defaults(func=cmd_ruler_table)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import kvpress_kept  # the kept positions, entry for entry (issue 35)

    kvpress_kept.add_parsers(sub, csv, choices, kept_fractions, home)

    args, rest = parser.parse_known_args(argv)
    if args.func is cmd_ruler_table:
        return cmd_ruler_table(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.func(args)


if __name__ == "__main__":
    main()
