"""kvcompile against NVIDIA's kvpress on the same model, needle prompts and budgets.

Three steps (scripts/kvpress_env.sh runs them in order):
  prompts    (kvcompile's env)  needle prompts as token ids + the specs' window/kernel -> JSON
  kvpress    (.venv-kvpress)    SnapKVPress, PyramidKVPress, AdaKVPress on every prompt and
                                budget, plus the full cache: answers, kept token indices per
                                layer/head, KV bytes held, peak memory, time -> JSON
  kvcompile  (kvcompile's env)  our same-named specs on the same prompts and budgets (set to
                                kvpress's average pooling unless --as-shipped); the comparison
                                table (accuracy, kept-token agreement, bytes, memory, time)

kvpress pins transformers < 5.3, so it cannot share kvcompile's environment; this file never
imports kvcompile in the kvpress step (and kvpress nowhere else).

Budgets: B tokens per KV head per layer.  kvpress takes a compression ratio of the prompt; we
pass 1 - (B + 0.5)/N so that its int(N * (1 - ratio)) keeps exactly B tokens per head.  The
whole prompt (question included) is compressed on both sides, so the observation window is
the question's end, as in our runtime; decoding is greedy, as in kvpress's pipeline.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

PRESSES = ("snapkv", "pyramidkv", "adakv")


def csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def release_freed_memory() -> None:
    """glibc: fixed 128 KiB mmap threshold and a heap trim, so resident memory follows live
    tensors (the same as kvcompile.models.release_freed_memory, which this env cannot import)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)
        libc.malloc_trim(0)
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
    from kvcompile.data import load_haystack, needle_suite
    from kvcompile.models import default_model_dir, load_model

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
    from kvcompile.data import answer_found
    from kvcompile.models import full_kv_bytes, generate, load_model

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
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
