"""kvpress's presses reproduced entry for entry (issue 35): which context positions each (layer, KV head)
keeps, kvpress against kvcompile's same-named spec, on the same token ids.

Two steps, run through scripts/kvpress_compare.py (`kept-kvpress`, `kept`):

  kept-kvpress  (.venv-kvpress; never imports kvcompile)  for every sample of a samples file (kvpress's
                evaluation columns, `kvcompile eval --suite ruler --dump-dataset`) and query mode, the
                context ids its pipeline feeds (`preprocess`; aware: context + question, as `ruler`),
                prefilled under each press; each press's `compress` is wrapped on that press object so
                that, per layer and KV fraction kept f (compression_ratio = 1 - f), the kept set is read
                the way kvpress decides it: ScorerPress and PyramidKVPress, the top n of `score` with n
                from kvpress's own count (compute_n_kept, get_layer_budget); AdaKVPress, everything its
                `compress` did not put in `masked_key_indices`; KVzipPress, its `compress_post` run once
                per fraction over the reconstruction's scores, both with layerwise=True (the press
                compared) and layerwise=False (kvpress's default: one ranking over all layers, recorded
                as "kvzip_global").  The cache is left whole by the wrapper: a layer's kept set is
                decided after its attention and later layers do not read it, so several presses share
                one prefill.  -> JSONL: one record per (sample, mode, press, fraction) with the kept
                positions packed as bits (L, H, N), then one "prompt" record with the ids (--resume
                skips the prompts that have it).
  kept          (kvcompile's env)  the same ids from kvcompile.tools.ruler.mode_prompt (any difference is an
                error), each spec of KEPT_SPECS at per_head = floor(f * n) (as `kvcompile eval --suite
                ruler`), kept positions from the cache the RULER eval decodes from (the engine's per-layer
                compression of one captured prefill, as sweep.replay; kvzip: the engine's reconstruction,
                once per prompt; each scorer's scores computed once per prompt and shared by the budgets and
                allocation parts: replay_scored), and per (layer, KV head) the agreement
                |kept_kvpress ∩ kept_kvcompile| / |kept_kvpress|.  -> a small summary JSON (mean and
                minimum per press, spec, mode and fraction) and a markdown table.
"""
from __future__ import annotations

import base64
import json
import math
import sys
import time
from pathlib import Path

# the presses compared: kvpress's evaluation-registry names (kvpress_compare.RULER_PRESSES) plus the plain
# ExpectedAttentionPress (no AdaKV), which the registry does not list but kvcompile's expected_attention spec is
KEPT_PRESSES = ("snapkv", "pyramidkv", "adakv_snapkv", "streaming_llm", "tova", "observed_attention", "knorm",
                "expected_attention_uniform", "expected_attention", "kvzip")
KVZIP_GLOBAL = "kvzip_global"  # KVzipPress(layerwise=False), recorded from the kvzip run
FRACTIONS = (0.1, 0.25, 0.5)
MODES = ("aware", "agnostic")


def _window(w: int) -> dict:
    return {"scoring": {"window_attention": {"window": w}}, "ranking": {"by_score": {"window": w}}}


def _snap(w: int, kind: str, kernel: int) -> dict:
    return {"scoring": {"window_attention": {"window": w, "pooling": {"kind": kind, "kernel": kernel}}},
            "ranking": {"by_score": {"window": w}}}


# press -> [(label, shipped spec, overrides)]: the shipped spec first, then the spec with the overrides that
# set it to the press's hyper-parameters (each a spec option), to show which difference accounts for what
_PROMPT = {"scoring": {"kvzip": {"reconstruct": "prompt"}}}  # the whole prompt from position 0 (before session 19's default)
KEPT_SPECS = {
    "snapkv": [("snapkv", "snapkv", {}), ("snapkv window 64", "snapkv", _window(64))],
    "pyramidkv": [("pyramidkv", "pyramidkv", {}),
                  ("pyramidkv window 64 avg 5", "pyramidkv", _snap(64, "avg", 5)),
                  ("pyramidkv window 64 avg 5 layers uniform", "pyramidkv",
                   {**_snap(64, "avg", 5), "budget": {"layers": "uniform"}})],
    "adakv_snapkv": [("adakv", "adakv", {}), ("adakv window 64 avg 5", "adakv", _snap(64, "avg", 5))],
    "streaming_llm": [("streamingllm", "streamingllm", {})],
    "tova": [("tova", "tova", {})],
    "observed_attention": [("observed_attention", "observed_attention", {}), ("h2o", "h2o", {}),
                           ("h2o window 0", "h2o", {"ranking": {"by_score": {"window": 0}}})],
    "knorm": [("knorm", "knorm", {})],
    "expected_attention_uniform": [("expected_attention", "expected_attention", {})],
    "expected_attention": [("expected_adakv", "expected_adakv", {})],
    "kvzip": [("kvzip", "kvzip", {}), ("kvzip_adakv floor 0", "kvzip_adakv", {"budget": {"heads": {"pooled": {"floor": 0.0}}}}),
              ("kvzip reconstruct prompt", "kvzip", _PROMPT),
              ("kvzip_adakv reconstruct prompt", "kvzip_adakv", _PROMPT),
              ("kvzip_adakv floor 0 reconstruct prompt", "kvzip_adakv",
               {"budget": {"heads": {"pooled": {"floor": 0.0}}}, **_PROMPT})],
}
KEPT_SPECS[KVZIP_GLOBAL] = KEPT_SPECS["kvzip"]  # KVzipPress(layerwise=False): the same specs (`kvzip` is global)

# why a reproduction's agreement is not 1.0: benchmarks/RESULTS.md's last column, by (press, kvcompile spec label)
KEPT_WHY = {
    ("snapkv", "snapkv"): "window: kvpress's SnapKVPress() observes the last 64 queries, the shipped spec 32 (the "
                          "SnapKV authors' code, init_snapkv). Kept: the paper leaves the window a hyper-parameter.",
    ("snapkv", "snapkv window 64"): "exact up to float near-ties at the cut: the kvpress reproduction is `snapkv` "
                                    "with window 64 (scoring and ranking)",
    ("pyramidkv", "pyramidkv"): "window 8 / max-pool 7 (the shipped spec, the authors' LongBench runs) against "
                                "kvpress's 64 / avg 5, and kvpress's fallback below",
    ("pyramidkv", "pyramidkv window 64 avg 5"): "50 %: exact up to each layer's count (kvpress rounds every layer's "
        "budget, kvcompile water-fills integers). 10 %, 25 %: kvpress falls back to SnapKV's uniform layers whenever "
        "the pyramid's smallest layer budget (B/β) is under its window (64), i.e. f·n/20 < 64, below 1,280/n ≈ 32 % "
        "kept of a 4k prompt; PyramidKV Eq. 1 (§4.2) and the authors' code keep the pyramid there, so kvcompile "
        "keeps it",
    ("pyramidkv", "pyramidkv window 64 avg 5 layers uniform"): "10 %, 25 %: kvpress's fallback reproduced; the rest "
        "is its count, round(f·n) against kvcompile's floor(f·n) (one entry per head). 50 %: kvpress keeps the "
        "pyramid there",
    ("adakv_snapkv", "adakv"): "window 32 / max-pool 7 (the AdaKV authors' runs) against AdaKVPress(SnapKVPress())'s "
                               "64 / avg 5",
    ("adakv_snapkv", "adakv window 64 avg 5"): "exact up to float near-ties at the cut; safeguard 0.2 and the pooled "
        "top-k agree: the kvpress reproduction is `adakv` with window 64, avg pooling 5",
    ("streaming_llm", "streamingllm"): "exact",
    ("tova", "tova"): "exact (`last_token: {heads: all}`: TOVA's own code and TOVAPress average the last row over "
                      "every head)",
    ("knorm", "knorm"): "exact but for ties: at layer 0 repeated tokens have equal key norms, and which tied copies "
                        "survive the cut is top-k's order in kvpress, later-first in kvcompile",
    ("expected_attention_uniform", "expected_attention"): "exact (ExpectedAttentionPress(epsilon=1e-2), the spec's "
                                                          "epsilon)",
    ("expected_attention", "expected_adakv"): "exact up to float near-ties at the cut",
    ("observed_attention", "observed_attention"): "exact: scoring mean_attention is ObservedAttentionPress's mean "
        "attention, Σ_j A[j,i] / (N − i), no window, the same count per head",
    ("observed_attention", "h2o"): "a different score: kvpress's ObservedAttentionPress ranks by the mean attention a "
        "key receives, Σ_j A[j,i] / (N − i), with no recent window; H2O (arXiv:2306.14048, §4, Alg. 1: accumulated "
        "attention, heavy hitters + recent window) sums and keeps a recent half. kvcompile's h2o is the paper's",
    ("observed_attention", "h2o window 0"): "the window removed: what is left is the sum against kvpress's mean",
    ("kvzip", "kvzip"): "the global allocation (KVzip §4.1, kvpress's default layerwise=False) against "
                        "KVzipPress(layerwise=True)'s per-layer count, with kvpress's reconstruction (reconstruct: "
                        "context, the default since session 19)",
    ("kvzip", "kvzip_adakv floor 0"): "kvpress's allocation and reconstruction (reconstruct: context, KVzip's "
        "Algorithm 1); what is left: float near-ties at the cut",
    ("kvzip", "kvzip reconstruct prompt"): "both: the global allocation against the per-layer count, and "
        "reconstruct: prompt (the default before session 19: the whole prompt from position 0) against kvpress's "
        "context after the chat template's prefix (24 tokens with SmolLM2), the prefix's scores 0",
    ("kvzip", "kvzip_adakv reconstruct prompt"): "pooled heads with floor 0.2 (kvpress: none); plus reconstruct: "
        "prompt",
    ("kvzip", "kvzip_adakv floor 0 reconstruct prompt"): "the allocation is kvpress's; the reconstruction is not: "
        "reconstruct: prompt reconstructs and scores the whole prompt from position 0, kvpress only the context "
        "after the chat template's prefix (24 tokens with SmolLM2), the prefix's scores 0",
    ("kvzip_global", "kvzip"): "KVzipPress's default layerwise=False reproduced by the shipped spec (global "
                               "allocation, no floor, reconstruct: context); what is left: float near-ties at the cut",
    ("kvzip_global", "kvzip_adakv floor 0"): "per-layer budgets against one global ranking",
    ("kvzip_global", "kvzip reconstruct prompt"): "the allocation is the press's; the reconstruction is "
        "reconstruct: prompt (the whole prompt) against kvpress's context after the template's prefix",
    ("kvzip_global", "kvzip_adakv reconstruct prompt"): "per-layer budgets against one global ranking; plus the "
        "reconstruction",
    ("kvzip_global", "kvzip_adakv floor 0 reconstruct prompt"): "per-layer budgets against one global ranking; plus "
        "the reconstruction",
}
TABLE_START, TABLE_END = "<!-- kept-table: start (scripts/kvpress_compare.py kept-table) -->", "<!-- kept-table: end -->"


def results_table(lines: list[dict]) -> str:
    """summarize()'s lines as RESULTS' table: per (press, spec) the prompts, the mean and minimum over every
    prompt, layer and head, the mean per fraction over both modes, and why it is not 1.0 (KEPT_WHY)."""
    fractions = sorted({x["fraction"] for x in lines})
    out = ["| kvpress press (as its registry builds it) | kvcompile spec | prompts | mean | min | "
           + " | ".join(f"{f:.0%}" for f in fractions) + " | why not 1.0 |",
           "|" + "---|" * (6 + len(fractions))]
    for line in overall(lines):
        mine = [x for x in lines if (x["press"], x["spec"]) == (line["press"], line["spec"])]
        prompts = max(sum(x["samples"] for x in mine if x["fraction"] == f) for f in fractions)
        cells = []
        for f in fractions:
            at = [x for x in mine if x["fraction"] == f]
            n = sum(x["samples"] for x in at)
            cells.append(f"{sum(x['mean'] * x['samples'] for x in at) / n:.3f}" if n else "-")
        why = KEPT_WHY.get((line["press"], line["spec"]), "")
        out.append(f"| {line['press']} | {line['spec']} | {prompts} | {line['mean']:.4f} | {line['min']:.3f} | "
                   + " | ".join(cells) + f" | {why} |")
    return "\n".join(out)


def replace_table(text: str, table: str) -> str:
    """`text` (RESULTS.md) with the block between TABLE_START and TABLE_END replaced by `table`."""
    if text.count(TABLE_START) != 1 or text.count(TABLE_END) != 1 or text.index(TABLE_START) > text.index(TABLE_END):
        raise ValueError(f"the results file must hold one {TABLE_START!r} line before one {TABLE_END!r} line")
    head, rest = text.split(TABLE_START)
    _, tail = rest.split(TABLE_END)
    return f"{head}{TABLE_START}\n{table}\n{TABLE_END}{tail}"


def cmd_kept_table(args) -> None:
    lines = json.loads(Path(args.summary).read_text())["lines"]
    table = results_table(lines)
    if args.results:
        path = Path(args.results)
        path.write_text(replace_table(path.read_text(), table))
        print(f"table -> {path}", file=sys.stderr)
    else:
        print(table)



# --- packing and the agreement (both environments; numpy and torch only) -------------------------

def pack(kept) -> str:
    """(L, H, N) bool (torch or numpy) -> base64 of its bits (row-major)."""
    import numpy as np

    bits = np.packbits(np.asarray(kept, dtype=bool).reshape(-1))
    return base64.b64encode(bits.tobytes()).decode("ascii")


def unpack(text: str, shape) -> "np.ndarray":
    import numpy as np

    count = int(np.prod(shape))
    bits = np.frombuffer(base64.b64decode(text), dtype=np.uint8)
    if bits.size != (count + 7) // 8:
        raise ValueError(f"packed kept set of {bits.size} bytes, expected {(count + 7) // 8} for shape {tuple(shape)}")
    return np.unpackbits(bits, count=count).astype(bool).reshape(shape)


def agreement(theirs, ours) -> "np.ndarray":
    """Per (layer, head): |theirs ∩ ours| / |theirs| over the context positions (the share of kvpress's kept
    positions that kvcompile keeps too); 1.0 where theirs keeps nothing.  theirs, ours: (L, H, N) bool."""
    import numpy as np

    a, b = np.asarray(theirs, dtype=bool), np.asarray(ours, dtype=bool)
    if a.shape != b.shape:
        raise ValueError(f"kept sets of different shapes: kvpress {a.shape}, kvcompile {b.shape}")
    both = (a & b).sum(-1)
    count = a.sum(-1)
    return np.where(count > 0, both / np.maximum(count, 1), 1.0)


def summarize(rows: list[dict]) -> list[dict]:
    """rows: one per (sample, mode, press, label, fraction) with `agreement` (L, H) and `ratio` (|ours| / |theirs|
    over the whole cache) -> one line per (press, label, mode, fraction): mean and minimum over every sample,
    layer and head, the mean size ratio, and where the minimum is."""
    import numpy as np

    groups: dict = {}
    for r in rows:
        groups.setdefault((r["press"], r["label"], r["mode"], r["fraction"]), []).append(r)
    out = []
    for (press, label, mode, fraction), rs in groups.items():
        values = np.stack([r["agreement"] for r in rs])  # (S, L, H)
        s, layer, head = np.unravel_index(int(values.argmin()), values.shape)
        out.append({"press": press, "spec": label, "mode": mode, "fraction": fraction, "samples": len(rs),
                    "mean": float(values.mean()), "min": float(values.min()),
                    "exact_heads": float((values == 1.0).mean()),
                    "size_ratio": float(np.mean([r["ratio"] for r in rs])),
                    "min_at": {"index": rs[s]["index"], "layer": int(layer), "head": int(head)}})
    return out


def merge_lines(base: list[dict], lines: list[dict]) -> list[dict]:
    """summarize()'s lines of two runs over different prompts, pooled per (press, spec, mode, fraction): samples
    added, means weighted by samples, the smaller minimum (and where it is)."""
    out: dict = {}
    for line in list(base) + list(lines):
        key = (line["press"], line["spec"], line["mode"], line["fraction"])
        if key not in out:
            out[key] = dict(line)
            continue
        a, n = out[key], line["samples"]
        total = a["samples"] + n
        merged = {k: (a[k] * a["samples"] + line[k] * n) / total for k in ("mean", "exact_heads", "size_ratio")}
        low = line if line["min"] < a["min"] else a
        out[key] = {**a, **merged, "samples": total, "min": low["min"], "min_at": low["min_at"]}
    return list(out.values())


def rows_beside(rows: list[dict], base_prompts, skip_presses=()) -> list[dict]:
    """The rows a base summary does not already count: those of other prompts, and every row of the presses
    whose base lines are left out (skip_presses)."""
    covered = set(map(tuple, base_prompts))
    return [r for r in rows if (r["index"], r["mode"]) not in covered or r["press"] in skip_presses]


def base_lines(path, skip_presses=()) -> tuple[list[dict], list]:
    """An earlier run's summary (kept --out): its lines but those of `skip_presses`, and its prompts."""
    data = json.loads(Path(path).read_text())
    return ([x for x in data["lines"] if x["press"] not in skip_presses],
            [tuple(p) for p in data["prompts"]])


def overall(lines: list[dict]) -> list[dict]:
    """summarize()'s lines pooled over modes and fractions: one per (press, spec) (means weighted by samples)."""
    groups: dict = {}
    for line in lines:
        groups.setdefault((line["press"], line["spec"]), []).append(line)
    out = []
    for (press, spec), ls in groups.items():
        n = sum(x["samples"] for x in ls)
        out.append({"press": press, "spec": spec, "samples": n,
                    "mean": sum(x["mean"] * x["samples"] for x in ls) / n, "min": min(x["min"] for x in ls),
                    "by": {f"{x['mode']} {x['fraction']:g}": round(x["mean"], 4) for x in ls}})
    return out


def markdown(lines: list[dict]) -> str:
    fractions = sorted({x["fraction"] for x in lines})
    modes = [m for m in MODES if any(x["mode"] == m for x in lines)]
    cols = [(m, f) for m in modes for f in fractions]
    head = "| press | kvcompile spec | mean | min | " + " | ".join(f"{m} {f:.0%}" for m, f in cols) + " |"
    out = [head, "|" + "---|" * (4 + len(cols))]
    for line in overall(lines):
        cells = [f"{line['by'][f'{m} {f:g}']:.3f}" if f"{m} {f:g}" in line["by"] else "-" for m, f in cols]
        out.append(f"| {line['press']} | {line['spec']} | {line['mean']:.4f} | {line['min']:.3f} | "
                   + " | ".join(cells) + " |")
    return "\n".join(out)


# --- kvpress's side (.venv-kvpress) ----------------------------------------------------------------

def kept_press(name: str):
    """kvpress's press `name` as its evaluation registry builds it (kvpress_compare.ruler_press), the ratio
    set per fraction later; kvzip with layerwise=True (the per-layer count kvcompile's kvzip specs keep);
    expected_attention_uniform: ExpectedAttentionPress with the registry's epsilon 1e-2, no AdaKV."""
    import kvpress as kp

    if name == "kvzip":
        return kp.KVzipPress(layerwise=True)
    if name == "expected_attention_uniform":
        return kp.ExpectedAttentionPress(epsilon=1e-2)
    from kvpress_compare import ruler_press

    return ruler_press(name, 0.5)


def record_compress(press, fractions, out: dict) -> None:
    """Wrap this press object's `compress`: per layer and fraction f, out[f][layer] = (H, N) bool of what
    kvpress keeps at compression_ratio = 1 - f; the keys and values are returned whole."""
    import torch
    from kvpress import AdaKVPress, PyramidKVPress
    from kvpress.utils import compute_n_kept

    ada = isinstance(press, AdaKVPress)
    compress = press.compress

    def recorded(module, hidden_states, keys, values, attentions, kwargs):
        saved = press.compression_ratio
        heads, n = keys.shape[1], keys.shape[2]
        try:
            for f in fractions:
                press.compression_ratio = 1.0 - f
                if ada:  # its own compress: a fresh score, the safeguard, the bottom-k over heads
                    compress(module, hidden_states, keys, values, attentions, kwargs)
                    _, h, s = module.masked_key_indices
                    keep = torch.ones(heads, n, dtype=torch.bool)
                    keep[h.cpu(), s.cpu()] = False
                else:  # ScorerPress.compress / PyramidKVPress.compress: the top n_kept of the scores
                    scores = press.score(module, hidden_states, keys, values, attentions, kwargs)
                    count = press.get_layer_budget(module, n) if isinstance(press, PyramidKVPress) \
                        else compute_n_kept(n, press.compression_ratio)
                    keep = torch.zeros(heads, n, dtype=torch.bool)
                    keep.scatter_(1, scores.topk(count, dim=-1).indices[0].cpu(), True)
                out.setdefault(f, {})[module.layer_idx] = keep
        finally:
            press.compression_ratio = saved
        return keys, values

    press.compress = recorded


def record_kvzip(press, fractions, out: dict) -> None:
    """Wrap this KVzipPress's `compress_post` (its selection over the reconstruction's scores): run it once per
    fraction with layerwise=True (out["kvzip"]) and False (out["kvzip_global"]), reading masked_key_indices."""
    import torch

    post = press.compress_post

    def recorded(model):
        saved = press.compression_ratio, press.layerwise
        try:
            for name, layerwise in (("kvzip", True), (KVZIP_GLOBAL, False)):
                for f in fractions:
                    press.compression_ratio, press.layerwise = 1.0 - f, layerwise
                    post(model)
                    for layer in model.model.layers:
                        attn = layer.self_attn
                        _, heads, n = press.score_val[attn.layer_idx].shape
                        keep = torch.ones(heads, n, dtype=torch.bool)
                        _, h, s = attn.masked_key_indices
                        keep[h.cpu(), s.cpu()] = False
                        out.setdefault(name, {}).setdefault(f, {})[attn.layer_idx] = keep
        finally:
            press.compression_ratio, press.layerwise = saved

    press.compress_post = recorded


def round_robin(samples: list[dict]) -> list[dict]:
    """The samples in rounds: the first of every task, then the second of every task, ... (file order within a
    task), so that a run cut short has covered every task."""
    seen: dict = {}
    ranked = []
    for i, s in enumerate(samples):
        ranked.append((seen.get(s["task"], 0), i, s))
        seen[s["task"]] = seen.get(s["task"], 0) + 1
    return [s for _, _, s in sorted(ranked, key=lambda x: x[:2])]


def prompts_done(path: Path) -> set:
    done = set()
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                if r.get("kind") == "prompt":
                    done.add((r["index"], r["mode"]))
    return done


def prompts_todo(samples: list[dict], modes, done: set, most: int | None = None) -> list[tuple[dict, str]]:
    """The (sample, mode) prompts still to run, round-robin over the tasks (round_robin), both modes of a sample
    together, those in `done` left out; at most `most` of them (None: all), so that a driver can alternate one
    prompt of kvpress's side with kvcompile's side on it."""
    todo = [(s, mode) for s in round_robin(samples) for mode in modes if (s["index"], mode) not in done]
    return todo if most is None else todo[:most]


def cmd_kept_kvpress(args) -> None:
    import contextlib

    import torch
    from transformers import DynamicCache

    from kvpress_compare import kvpress_pipeline, mode_inputs, read_samples

    torch.set_num_threads(args.threads)
    samples = read_samples(args.samples)
    if args.limit:
        samples = samples[:args.limit]
    if args.tasks:
        samples = [s for s in samples if s["task"] in args.tasks]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = prompts_done(out) if args.resume else set()
    if not args.resume:
        out.write_text("")
    for path in args.skip_prompts_of or []:  # prompts an earlier run's summary covers
        done |= set(base_lines(path)[1])
    todo = prompts_todo(samples, args.modes, done, args.max_prompts)
    print(f"kept-kvpress: {len(todo)} prompts to run", file=sys.stderr)
    model_dir = str(Path(args.model).resolve())
    pipes: dict = {}

    def pipe_for(eager: bool):
        if eager not in pipes:
            pipes[eager] = kvpress_pipeline(model_dir, eager)
        return pipes[eager]

    groups = [("sdpa", [p for p in args.presses if p not in ("observed_attention", "kvzip")]),
              ("eager", [p for p in args.presses if p == "observed_attention"]),
              ("kvzip", [p for p in args.presses if p == "kvzip"])]
    with open(out, "a", encoding="utf-8") as f:
        for s, mode in todo:
            # one prompt: every press group, then its "prompt" record (a cut run loses only this prompt)
            context, question = mode_inputs(s, mode)
            pipe = pipe_for(False)
            fed = pipe.preprocess(context, questions=[question], answer_prefix=s["answer_prefix"],
                                  max_context_length=min(pipe.tokenizer.model_max_length, int(1e10)))
            ids = fed["context_ids"]
            start = time.perf_counter()
            for kind, names in groups:
                if not names:
                    continue
                model = pipe_for(kind == "eager").model
                kept: dict = {}
                presses = []
                for name in names:
                    press = kept_press(name)
                    if kind == "kvzip":
                        press.compression_ratio = 0.5  # > 0, so that it scores; the fractions come after
                        record_kvzip(press, args.fractions, kept)
                    else:
                        kept[name] = {}
                        record_compress(press, args.fractions, kept[name])
                    presses.append(press)
                # inference_mode outermost: KVzipPress scores in its context's exit (the reconstruction), which
                # must run without autograd too (kvpress's pipeline runs the whole `with press(model)` under it)
                with torch.inference_mode(), contextlib.ExitStack() as stack:
                    for press in presses:
                        stack.enter_context(press(model))
                    model.model(input_ids=ids, past_key_values=DynamicCache())
                for name, by_fraction in kept.items():
                    for fraction, layers in by_fraction.items():
                        grid = torch.stack([layers[i] for i in range(len(layers))])  # (L, H, N)
                        f.write(json.dumps({"kind": "kept", "index": s["index"], "task": s["task"], "mode": mode,
                                            "press": name, "fraction": fraction, "shape": list(grid.shape),
                                            "kept": pack(grid.numpy())}) + "\n")
            f.write(json.dumps({"kind": "prompt", "index": s["index"], "task": s["task"], "mode": mode,
                                "ids": ids[0].tolist(), "seconds": time.perf_counter() - start}) + "\n")
            f.flush()
            print(f"kept-kvpress {s['task']} #{s['index']} {mode}: {ids.shape[1]} tokens, "
                  f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(f"-> {out}")


# --- kvcompile's side ----------------------------------------------------------------------------

def kvcompile_kept(cache) -> "torch.Tensor":
    """(L, H, N) bool: the context positions each layer and KV head of a kvcompile cache keeps (batch row 0)."""
    import torch

    return torch.stack([cache.kept_positions(layer)[0] for layer in range(cache.num_layers)]).cpu()


def spec_policy(spec: str, overrides: dict, n: int, fraction: float):
    """The spec (with `overrides`) at the RULER eval's budget for a KV fraction of an n-token prompt:
    per_head = floor(f * n), at least 1 (kvcompile.tools.ruler.policies_for's arithmetic)."""
    import kvcompile

    return kvcompile.load_spec(kvcompile.load_spec(spec, **overrides), per_head=max(1, math.floor(fraction * n + 1e-9)))


def replay_scored(policy, config, states, memo: dict):
    """kvcompile.tools.sweep.replay (the engine's per-layer compression of a captured prefill, what the RULER eval
    decodes from), with each layer's scores computed by the engine's scorer once per scoring part and layer
    (`memo`) and given to compress_prompt_layer(..., scores=): the budgets and allocation parts that share a
    scorer share its scores (compress_prompt_layer computes the same `plan.score(plan.state(...))` itself when
    none are given).  `memo` may hold scores already (KVzip's, from its reconstruction)."""
    from kvcompile.cache import KVCompileCache
    from kvcompile.engine.prefill import compress_prompt_layer, start_prompt

    cache = KVCompileCache(policy, config)
    first = states[0]
    b, _, n, _ = first.keys.shape
    start_prompt(cache, first.mask, b, n, first.keys)
    for layer, st in enumerate(states):
        key = (policy.scoring, layer)
        if key not in memo:
            r, rows = st.queries.shape[2], policy.scoring.query_rows(n)
            memo[key] = cache.plan.score(cache.plan.state(st.queries[:, :, r - rows:], st.keys, st.values, st.mask,
                                                          st.scale))
        compress_prompt_layer(cache, st.queries, st.keys, st.values, layer, st.scale, scores=memo[key])
    cache.seq_length = n
    return cache


def kvzip_scored(model, policy, ids: list[int], **options) -> tuple[list, dict]:
    """KVzip's scores of a prompt as the engine computes them (kvcompile.kvzip.prefill: the prompt's forward and
    the reconstruction), with every layer's full keys and values: ([LayerState], {(scoring, layer): scores}).
    Read by wrapping engine.prefill.compress_prompt_layer, which kvzip.prefill hands each layer's scores to, for
    the length of one compiled forward (restored after it).  options: compile()'s (tokenizer= or repeat_prompt=)."""
    import torch

    from kvcompile.engine import prefill as engine_prefill
    from kvcompile.layer_state import LayerState
    from kvcompile.tools.sweep import prefilled

    original = engine_prefill.compress_prompt_layer
    states, memo = {}, {}

    def recorded(cache, q, k, v, layer, scale, scores=None):
        states[layer] = LayerState(q, k.clone(), v.clone(), None, scale)
        memo[(policy.scoring, layer)] = scores.clone()
        return original(cache, q, k, v, layer, scale, scores=scores)

    engine_prefill.compress_prompt_layer = recorded
    try:
        prefilled(model, policy, torch.tensor([ids]), **options)
    finally:
        engine_prefill.compress_prompt_layer = original
    return [states[i] for i in range(len(states))], memo


class Prompt:
    """One prompt's kvcompile side: the captured prefill (every scorer but KVzip) and KVzip's reconstruction,
    each run once, and each scorer's scores once, shared by every spec and fraction."""

    def __init__(self, model, ids: list[int], **options):
        self.model, self.options = model, options  # options: compile()'s for KVzip (tokenizer=, repeat_prompt=)
        self.ids = ids
        self.states = None
        self.kvzip: dict = {}
        self.memo: dict = {}

    def kept(self, policy) -> "torch.Tensor":
        import torch

        from kvcompile.tools.sweep import capture, not_replayable

        if getattr(policy.scoring, "reconstructs", False) or not_replayable(policy):  # (kvzip: its own path here)
            if policy.schedule.prefill is not None or not getattr(policy.scoring, "reconstructs", False):
                raise ValueError(f"{policy.name}: only one-pass prefill policies are compared")
            if policy.scoring not in self.kvzip:
                self.kvzip[policy.scoring], memo = kvzip_scored(self.model, policy, self.ids, **self.options)
                self.memo.update(memo)
            states = self.kvzip[policy.scoring]
        else:
            if self.states is None:
                self.states, _ = capture(self.model, torch.tensor([self.ids]))
            states = self.states
        return kvcompile_kept(replay_scored(policy, self.model.config, states, self.memo))


def read_kvpress(paths) -> tuple[dict, dict]:
    """(prompts {(index, mode): record}, kept {(index, mode): [records]}) of kept-kvpress files (a path or a
    list: e.g. one run of the cheap presses over many prompts, one of observed_attention and kvzip over fewer);
    only prompts a file finished count, and the same prompt in two files must have the same ids."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    prompts, kept = {}, {}
    for path in paths:
        mine, records = {}, {}
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            key = (r["index"], r["mode"])
            if r["kind"] == "prompt":
                mine[key] = r
            else:  # a prompt cut short and run again (--resume) wrote its first records twice: the last ones count
                records.setdefault(key, {})[(r["press"], r["fraction"])] = r
        for key, r in mine.items():
            if key in prompts and prompts[key]["ids"] != r["ids"]:
                raise ValueError(f"{path}: sample {key[0]} ({key[1]}) was fed other ids than in an earlier file")
            prompts.setdefault(key, r)
            kept.setdefault(key, {}).update(records.get(key, {}))
    return prompts, {key: list(records.values()) for key, records in kept.items()}


def row_key(r: dict) -> tuple:
    return (r["index"], r["mode"], r["press"], r["label"], round(float(r["fraction"]), 6))


def read_rows(path: Path) -> list[dict]:
    """The agreement rows a `kept --rows` file holds (agreement back as an (L, H) array)."""
    import numpy as np

    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{**r, "agreement": np.asarray(r["agreement"], dtype=float)} for r in rows]


def cmd_kept(args) -> None:
    import numpy as np
    import torch

    from kvcompile.tools import ruler
    from kvcompile.tools.models import load_model

    torch.set_num_threads(args.threads)
    prompts, kept = read_kvpress(args.kvpress)
    rows_path = Path(args.rows) if args.rows else None
    rows = read_rows(rows_path) if rows_path else []
    done = {row_key(r) for r in rows}
    model = tokenizer = None  # loaded for the first prompt with rows to compute
    for key, prompt in ({} if args.summarize_only else prompts).items():
        index, mode = key
        todo = [(record, label, spec, overrides) for record in kept.get(key, [])
                if not args.presses or record["press"] in args.presses
                for label, spec, overrides in KEPT_SPECS[record["press"]]
                if (not args.specs or label in args.specs)
                and row_key({**record, "label": label}) not in done]
        if not todo:
            continue
        if model is None:
            model, tokenizer = load_model(args.model)
            samples = {s["index"]: s for s in ruler.load_dataset(args.samples)}
        ids, _ = ruler.mode_prompt(tokenizer, samples[index], mode)
        if ids != prompt["ids"]:
            from kvpress_compare import first_difference

            sys.exit(f"kept: sample {index} ({mode}): kvcompile's prompt ids differ from those kvpress was fed "
                     f"(first difference at {first_difference(ids, prompt['ids'])}); nothing compared")
        n = len(ids)
        here = Prompt(model, ids, tokenizer=tokenizer)
        start = time.perf_counter()
        for record, label, spec, overrides in todo:
            theirs = unpack(record["kept"], record["shape"])
            ours = here.kept(spec_policy(spec, overrides, n, record["fraction"])).numpy()
            row = {"index": index, "task": record["task"], "mode": mode, "press": record["press"], "label": label,
                   "fraction": record["fraction"], "agreement": agreement(theirs, ours),
                   "ratio": float(ours.sum() / max(1, theirs.sum()))}
            rows.append(row)
            if rows_path:
                with open(rows_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps({**row, "agreement": np.round(row["agreement"], 6).tolist()}) + "\n")
        print(f"kept {prompt['task']} #{index} {mode}: {n} tokens, {time.perf_counter() - start:.1f} s",
              file=sys.stderr)
    lines = summarize(rows)
    prompts = sorted({(r["index"], r["mode"]) for r in rows})
    if args.base:  # an earlier run's summary, pooled in (its lines of --base-skip left out)
        earlier, theirs = base_lines(args.base, args.base_skip or ())
        lines = merge_lines(earlier, summarize(rows_beside(rows, theirs, args.base_skip or ())))
        prompts = sorted(set(prompts) | set(theirs))
    table = markdown(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "kvpress_files": args.kvpress,
            "samples_file": str(args.samples), "prompts": prompts, "base": args.base, "base_skip": args.base_skip,
            "definition": "agreement = |kept_kvpress ∩ kept_kvcompile| / |kept_kvpress| per (layer, KV head) over "
                          "the context positions; mean and min over samples x layers x heads; size_ratio = "
                          "|kept_kvcompile| / |kept_kvpress| over the cache",
            "overall": overall(lines), "lines": lines}, indent=1) + "\n")
        print(f"\nsummary -> {args.out}", file=sys.stderr)


def add_parsers(sub, csv, choices, kept_fractions, home: Path) -> None:
    """The two steps' options (kvpress_compare.main)."""
    p = sub.add_parser("kept-kvpress", help="kvpress's kept positions per press, layer, head and fraction on RULER "
                                            "samples (its own venv): JSONL")
    p.add_argument("--samples", required=True, help="JSONL in kvpress's evaluation columns (kvcompile eval --suite "
                                                    "ruler --dump-dataset)")
    p.add_argument("--out", required=True)
    p.add_argument("--presses", type=choices(KEPT_PRESSES), default=list(KEPT_PRESSES))
    p.add_argument("--fractions", type=kept_fractions, default=list(FRACTIONS))
    p.add_argument("--modes", type=choices(MODES), default=list(MODES))
    p.add_argument("--tasks", type=csv(str), default=None, help="only these tasks")
    p.add_argument("--limit", type=int, default=None, help="only the first N samples")
    p.add_argument("--model", default=str(home / "models" / "smollm2-135m"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="keep --out's prompts and run only the missing ones")
    p.add_argument("--skip-prompts-of", type=csv(str), default=None, metavar="SUMMARY",
                   help="leave out the prompts these summaries (kept --out) cover (an earlier run's)")
    p.add_argument("--max-prompts", type=int, default=None, metavar="N",
                   help="run at most N of the missing prompts, then stop (scripts/kvpress_env.sh kept alternates "
                        "kvpress's side and kvcompile's one prompt at a time)")
    p.set_defaults(func=cmd_kept_kvpress)

    q = sub.add_parser("kept", help="kvcompile's specs on the same ids: agreement with kvpress's kept positions "
                                    "(kvcompile's env)")
    q.add_argument("--samples", required=True, help="the samples file kept-kvpress read")
    q.add_argument("--kvpress", required=True, type=csv(str), help="kept-kvpress's JSONL (comma-separated: several runs)")
    q.add_argument("--out", default=None, help="summary JSON")
    q.add_argument("--rows", default=None, help="JSONL of the per-(layer, head) agreements, appended as they are "
                                                "computed; the rows it holds are not computed again (resume)")
    q.add_argument("--presses", type=choices(KEPT_PRESSES + (KVZIP_GLOBAL,)), default=None)
    q.add_argument("--specs", type=csv(str), default=None, help="only these labels of KEPT_SPECS")
    q.add_argument("--summarize-only", action="store_true",
                   help="compute nothing: the summary and table of the rows --rows holds (while a run goes on)")
    q.add_argument("--base", default=None, help="an earlier run's summary JSON over other prompts, pooled into the "
                                                "table (its per-head rows were not kept)")
    q.add_argument("--base-skip", type=csv(str), default=None,
                   help="presses whose --base lines are left out (their spec changed since that run)")
    q.add_argument("--model", default=str(home / "models" / "smollm2-135m"))
    q.add_argument("--threads", type=int, default=2)
    q.set_defaults(func=cmd_kept)

    t = sub.add_parser("kept-table", help="RESULTS' table of the kept comparison from its summary JSON")
    t.add_argument("--summary", required=True, help="kept's --out (benchmarks/kvpress_kept.json)")
    t.add_argument("--results", default=None, help="rewrite the marked table block of this file (RESULTS.md)")
    t.set_defaults(func=cmd_kept_table)
