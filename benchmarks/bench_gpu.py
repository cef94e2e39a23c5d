"""GPU benchmarks (issue 15): the kernels against the copy bandwidth, and end to end on an 8B-shaped model.

Three subcommands, each printing Markdown tables (paste them into RESULTS.md with the GPU's name):

- `bandwidth`: the device's measured copy bandwidth (bytes read + written per second by a
  device-to-device copy), the bound every "× bound" column divides by (docs/INTERNALS.md "Measuring speed",
  "Running on a GPU").
- `kernels`: one layer of an 8B GQA model (8 KV heads × 4 query heads each, head dim 128, bf16).
  (1) Paged decode attention (kvcompile.kernels.paged_attention, impl "triton" on a GPU) over each
  head's pages, every head holding `tokens` entries (pages in head order, as a compressed prompt is
  laid out) and the same total split raggedly over the heads (AdaKV-like budgets), against
  F.scaled_dot_product_attention on a dense cache of the same tokens (the same bytes: the paged
  pool viewed as (B, H, T, d)) and FlashAttention's decode (flash_attn_with_kvcache) where flash_attn
  imports; batch 1 and 32, 8k-128k tokens per head; µs per call with the L2 flushed before each
  call, GB/s of retained K+V and × bound (time ÷ (bytes ÷ copy bandwidth)). (2) What compressing
  one layer's prompt adds (window scores, selection, gather into pages) against that layer's prefill
  attention (kvcompile.engine.prefill.prompt_attention: flash-attn or SDPA).
- `e2e`: generate() on a random-weight model of Llama-3-8B's shapes (32 layers, hidden 4096, 32
  query / 8 KV heads, head dim 128, bf16, built on the device, nothing downloaded): the full cache
  against snapkv, adakv, lava and zsmerge at 128 and 512 tokens per KV head, batch 8, 1 and 32,
  32k and 8k random-token prompts, in kvcompile's eager and compiled entries, and the decode step in
  a CUDA graph (mode "reduce-overhead": kvcompile.compile(model, spec, mode="reduce-overhead"), kvcompile.graphs;
  its refusal is printed off CUDA; for the full cache, transformers' static
  cache, which generate() compiles with CUDA graphs on a GPU). Columns: prefill s, the first decode
  step (compiles land there), median ms per decode step, tok/s (batch ÷ step), KV GiB held, peak
  GiB (torch.cuda.max_memory_allocated) and the run's own peak above what was allocated before it,
  GB/s of the bytes a step reads (weights without the embedding table, plus the K+V entries) and
  × bound, and the speed-up over the full cache's eager run of the same prompt and batch.

A case that fails prints its reason in the table ("OOM", the error, "skipped: --max-seconds") and
the run goes on; `--max-seconds` stops starting new cases, so a run ends inside a 10-minute command
(a case already started finishes). The targets of issue 15 are printed after the tables, next to the
numbers. On a CPU the same code runs (perf_counter timing, fp32, peak memory not measured);
`--small` shrinks every shape so that a CPU run takes seconds (tests/test_bench_gpu_smoke.py).

    python3 benchmarks/bench_gpu.py bandwidth
    python3 benchmarks/bench_gpu.py kernels [--small] [--max-seconds 300] [--tokens 8192 ...] [--batches 1 32]
    python3 benchmarks/bench_gpu.py e2e [--small] [--max-seconds 420] [--lengths 32768 8192] [--batches 8 1 32]
        [--budgets 128 512] [--specs snapkv adakv lava zsmerge] [--modes eager compiled reduce-overhead]
"""
from __future__ import annotations

import argparse
import gc
import importlib
import statistics
import time

import torch
import torch.nn.functional as F

GiB, MiB = 2**30, 2**20


# --------------------------------------------------------------------------- common

def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(name: str, dev: torch.device) -> torch.dtype:
    """"auto": bf16 on a GPU (how 8B models run), fp32 on a CPU (the C++ kernels' dtype)."""
    if name == "auto":
        return torch.bfloat16 if dev.type == "cuda" else torch.float32
    return getattr(torch, name)


def device_line(dev: torch.device, dtype: torch.dtype) -> str:
    import transformers

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    try:
        import triton

        versions += f", triton {triton.__version__}"
    except ImportError:
        versions += ", no triton"
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        l2 = getattr(p, "L2_cache_size", 0)
        return (f"device: {p.name}, {p.total_memory / GiB:.0f} GiB, {p.multi_processor_count} SMs, "
                f"L2 {l2 / MiB:.0f} MiB; {str(dtype).replace('torch.', '')}; {versions}")
    return f"device: CPU, {torch.get_num_threads()} threads; {str(dtype).replace('torch.', '')}; {versions}"


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn, dev: torch.device, repeat: int, before=None) -> float:
    """Median seconds per call of `fn` over `repeat` calls after one warm-up call (a Triton
    kernel compiles there); `before()` runs untimed ahead of each call (the L2 flush). CUDA
    events on a GPU, perf_counter on a CPU."""
    fn()
    sync(dev)
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def flusher(dev: torch.device, mebibytes: int):
    """A callable that writes `mebibytes` (several times the last-level cache: H100's L2 is
    50 MB), so that each timed call reads its K and V from memory, as in a decode step where the
    weights and the other layers pass in between."""
    buffer = torch.empty(mebibytes * MiB // 4, device=dev)
    return lambda: buffer.fill_(1.0)


def copy_bandwidth(dev: torch.device, mebibytes: int, repeat: int) -> float:
    """Bytes read + written per second by a device-to-device copy of `mebibytes`."""
    src = torch.ones(mebibytes * MiB // 4, device=dev)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), dev, repeat)
    return 2 * mebibytes * MiB / seconds


class Budget:
    """--max-seconds: no case starts after that many seconds from the start of the run."""

    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.seconds = seconds
        self.broken = None  # a CUDA error that left the context unusable: every later case is skipped

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def skip_reason(self) -> str | None:
        if self.broken:
            return f"skipped: an earlier CUDA error ({self.broken})"
        if self.elapsed() > self.seconds:
            return f"skipped: --max-seconds {self.seconds:.0f} spent"
        return None


def attempt(fn, budget: Budget, dev: torch.device):
    """(fn(), None), or (None, reason) when it fails: "OOM", or the error's type and first line.
    Memory is freed after a failure; a CUDA error (the context may be lost) skips the rest."""
    reason = None
    try:
        return fn(), None
    except torch.OutOfMemoryError:
        reason = "OOM"
    except Exception as exc:  # a case that fails is reported, not fatal
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = f"error: {type(exc).__name__}: {text[:160]}"
        if "CUDA error" in text or "illegal memory access" in text or "AcceleratorError" in type(exc).__name__:
            budget.broken = text[:80]
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return None, reason


class Table:
    """A Markdown table printed row by row (a run killed at its time limit keeps what it printed)."""

    def __init__(self, title: str, columns: list[str]):
        self.columns = columns
        self.rows: list[list[str]] = []
        print(f"\n### {title}\n", flush=True)
        print("| " + " | ".join(columns) + " |")
        print("|" + "|".join("---" for _ in columns) + "|", flush=True)

    def add(self, *cells) -> None:
        cells = [fmt(c) for c in cells]
        assert len(cells) == len(self.columns), (cells, self.columns)
        self.rows.append(cells)
        print("| " + " | ".join(cells) + " |", flush=True)


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0 or abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


# ------------------------------------------------------------------------- bandwidth

def run_bandwidth(args, dev: torch.device) -> float:
    sizes = [16, 64] if args.small else [256, 1024, 4096]
    table = Table("copy bandwidth (device to device, bytes read + written)", ["MiB copied", "GB/s"])
    best = 0.0
    for mib in sizes:
        bw = copy_bandwidth(dev, mib, args.repeat)
        best = max(best, bw)
        table.add(mib, bw / 1e9)
    print(f"\ncopy bandwidth used as the bound: {best / 1e9:.0f} GB/s (the highest above)", flush=True)
    return best


# --------------------------------------------------------------------------- kernels

def head_order_table(lengths: torch.Tensor, page: int, pool: int, dev: torch.device) -> torch.Tensor:
    """Block table (B, H, ·) int64 (as the cache keeps it) laying out heads of `lengths` (B, H)
    entries in head order, each head's pages consecutive (the page store's layout)."""
    from kvcompile.store import page_table

    table, owned = page_table(lengths, page)
    assert int(owned.sum()) <= pool
    return table.to(dev)


def ragged_lengths(batch: int, heads: int, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Per-head lengths from about 0.5× to 1.5× the mean, `heads × tokens` entries per sequence."""
    share = torch.rand(batch, heads, generator=gen) + 0.5
    lengths = (share / share.sum(-1, keepdim=True) * heads * tokens).long()
    lengths[:, 0] += heads * tokens - lengths.sum(-1)
    return lengths


def flash_decode():
    """(flash_attn's decode function, None), or (None, the reason it is not there)."""
    try:
        module = importlib.import_module("flash_attn")
        return module.flash_attn_with_kvcache, None
    except Exception as exc:  # ImportError, or an ABI error of a wheel built for another torch
        return None, f"flash_attn not importable ({type(exc).__name__})"


def decode_methods(args, dev, dtype, batch: int, tokens: int, gen: torch.Generator):
    """One layer's decode attention for `batch` sequences of `tokens` entries per KV head:
    ({name: (fn returning (B, Hq, d), or None; the reason when None)}, K+V bytes retained)."""
    from kvcompile.kernels.paged_attention import paged_attention

    h, g, d, s = args.kv_heads, args.group, args.head_dim, args.page
    pages = batch * h * tokens // s
    pool = pages + batch * h  # the ragged layout rounds each head up to a whole page
    k_pages = torch.randn(pool, s, d, device=dev, dtype=dtype)
    v_pages = torch.randn(pool, s, d, device=dev, dtype=dtype)
    q = torch.randn(batch, h * g, d, device=dev, dtype=dtype)
    equal = torch.full((batch, h), tokens, dtype=torch.long)
    ragged = ragged_lengths(batch, h, tokens, gen)
    table, table_r = head_order_table(equal, s, pool, dev), head_order_table(ragged, s, pool, dev)
    equal, ragged = equal.to(dev), ragged.to(dev)
    dense_k = k_pages[:pages].view(batch, h, tokens, d)  # the very bytes of the paged layout
    dense_v = v_pages[:pages].view(batch, h, tokens, d)
    scale = d ** -0.5
    q4 = q[:, :, None]
    methods = {}
    for impl in args.impls:
        label = impl or "default impl"
        methods[f"paged, {label}"] = (lambda impl=impl: paged_attention(
            q, k_pages, v_pages, table, equal, None, scale, impl=impl), None)
        methods[f"paged, {label}, ragged heads"] = (lambda impl=impl: paged_attention(
            q, k_pages, v_pages, table_r, ragged, None, scale, impl=impl), None)
    methods["dense SDPA"] = (lambda: F.scaled_dot_product_attention(
        q4, dense_k, dense_v, scale=scale, enable_gqa=True)[:, :, 0], None)
    if dev.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa_flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q4, dense_k, dense_v, scale=scale, enable_gqa=True)[:, :, 0]

        methods["dense SDPA, flash backend only"] = (sdpa_flash, None)
    fa, why = flash_decode()
    methods["flash-attn decode (dense)"] = (None, why) if fa is None else (lambda: fa(
        q[:, None], dense_k.transpose(1, 2), dense_v.transpose(1, 2), softmax_scale=scale)[:, 0], None)
    return methods, 2 * batch * h * tokens * d * k_pages.element_size()


def run_kernels(args, dev: torch.device, dtype: torch.dtype, budget: Budget) -> None:
    bandwidth = run_bandwidth(args, dev)
    flush = flusher(dev, args.flush_mb)
    gen = torch.Generator().manual_seed(0)
    print(f"\nlayer: {args.kv_heads} KV heads × {args.group} query heads, head dim {args.head_dim}, "
          f"page {args.page}, {str(dtype).replace('torch.', '')}; {args.flush_mb} MiB written before each "
          f"timed call (K and V come from memory); median of {args.repeat} calls. Every method reads the same "
          f"retained K+V; the outputs are checked against dense SDPA's", flush=True)
    table = Table("decode attention, one layer (bound: retained K+V bytes ÷ copy bandwidth)",
                  ["batch", "tokens/head", "method", "K+V MiB", "µs", "GB/s", "× bound", "note"])
    results = {}  # (batch, tokens, method) -> seconds
    for batch in args.batches:
        for tokens in args.tokens:
            tokens = -(-tokens // args.page) * args.page
            skip = budget.skip_reason()
            if skip:
                table.add(batch, tokens, "all", None, None, None, None, skip)
                continue
            built, reason = attempt(lambda: decode_methods(args, dev, dtype, batch, tokens, gen), budget, dev)
            if built is None:
                table.add(batch, tokens, "all", None, None, None, None, reason)
                continue
            methods, nbytes = built
            expected, _ = attempt(methods["dense SDPA"][0], budget, dev)
            for name, (fn, why) in methods.items():
                skip = why or budget.skip_reason()
                if fn is None or skip:
                    table.add(batch, tokens, name, nbytes / MiB, None, None, None, skip)
                    continue
                note = ""
                if "ragged" not in name and expected is not None:
                    out, reason = attempt(fn, budget, dev)
                    if out is None:
                        table.add(batch, tokens, name, nbytes / MiB, None, None, None, reason)
                        continue
                    # relative to the output's scale (a mean over many values is small: an absolute
                    # tolerance would pass zeros); bf16 rounding is ~0.4 %
                    error = ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
                    if not error <= 2e-2:  # NaN too
                        note = f"differs from dense SDPA: max error {error:.3g} of its largest value"
                    del out
                seconds, reason = attempt(lambda: timed(fn, dev, args.repeat, flush), budget, dev)
                if seconds is None:
                    table.add(batch, tokens, name, nbytes / MiB, None, None, None, reason)
                    continue
                results[batch, tokens, name] = seconds
                table.add(batch, tokens, name, nbytes / MiB, seconds * 1e6, nbytes / seconds / 1e9,
                          seconds / (nbytes / bandwidth), note)
            del methods, built, expected
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    compression(args, dev, dtype, budget)
    print("\ntargets (issue 15): paged decode within 1.5× of the bound at 32k+ tokens per head, and faster than "
          "dense SDPA at equal retained tokens:", flush=True)
    paged = f"paged, {args.impls[0] or 'default impl'}"
    for (batch, tokens, name), seconds in sorted(results.items()):
        if name != paged:
            continue
        ratio = seconds / (2 * batch * args.kv_heads * tokens * args.head_dim * dtype.itemsize / bandwidth)
        sdpa = results.get((batch, tokens, "dense SDPA"))
        versus = "no dense SDPA time" if sdpa is None else \
            f"{sdpa / seconds:.2f}× dense SDPA's speed: {'faster' if seconds < sdpa else 'NOT faster'}"
        wanted = "" if tokens >= 32768 else " (below 32k: not a target)"
        print(f"  batch {batch}, {tokens} tokens/head: {ratio:.2f}× bound: "
              f"{'met' if ratio <= 1.5 else 'missed'}{wanted}; {versus}", flush=True)


def compression(args, dev: torch.device, dtype: torch.dtype, budget: Budget) -> None:
    """One layer's prompt: the model's attention against scoring, selection and the gather into pages."""
    from kvcompile.store import Entries, LayerStore
    from kvcompile.kernels import select as ks
    from kvcompile.selection import select_with
    from kvcompile.kernels.window_scores import score_fused
    from kvcompile.layer_state import LayerState
    from kvcompile.engine.prefill import _flash_attn, prompt_attention
    from kvcompile.spec import load_spec

    h, g, d = args.kv_heads, args.group, args.head_dim
    per_head = args.select_budget
    specs = {name: load_spec(name, per_head=per_head) for name in ("snapkv", "adakv", "lava")}
    attention = "flash-attn" if dev.type == "cuda" and _flash_attn() is not None and dtype != torch.float32 \
        else "SDPA"
    table = Table(f"compressing one layer's prompt (batch 1, {per_head} per KV head; the device's default kernels: "
                  f"Triton on a GPU) against its prefill attention",
                  ["prompt", "step", "ms", "% of attention", "note"])
    for n in args.prompts:
        skip = budget.skip_reason()
        if skip:
            table.add(n, "all", None, None, skip)
            continue

        def build():
            q = torch.randn(1, h * g, n, d, device=dev, dtype=dtype)
            k = torch.randn(1, h, n, d, device=dev, dtype=dtype)
            v = torch.randn(1, h, n, d, device=dev, dtype=dtype)
            return q, k, v

        tensors, reason = attempt(build, budget, dev)
        if tensors is None:
            table.add(n, "all", None, None, reason)
            continue
        q, k, v = tensors
        state = LayerState(queries=q[:, :, -32:], keys=k, values=v)
        positions = torch.arange(n, device=dev).expand(1, h, n)
        valid = torch.ones(1, h, n, dtype=torch.bool, device=dev)
        lengths, total = torch.tensor([n], device=dev), torch.tensor([per_head * h], device=dev)
        scores = {}

        def score(name):
            scores[name] = score_fused(specs[name].scoring, state)
            return scores[name]

        def select(name):
            kept = select_with(ks.backend_for(None, scores[name]), specs[name], scores[name], positions, valid,
                               lengths, total, 1)
            return kept

        def gather():
            kept = select("snapkv")
            rows = Entries(k, v, scores["snapkv"], positions, torch.ones_like(scores["snapkv"]), kept)
            return LayerStore.build([rows], torch.zeros(1, h, dtype=torch.long, device=dev), args.page, 4,
                                    gather=ks.backend_for(None, k).gather_pages)

        steps = {
            f"prefill attention ({attention}, causal)": lambda: prompt_attention(q, k, v, None, d ** -0.5),
            "window scores: snapkv (avg pool 5, mean over group)": lambda: score("snapkv"),
            "window scores: adakv (max pool 7)": lambda: score("adakv"),
            "window scores: lava (max pool 7, max over group, value norm)": lambda: score("lava"),
            f"select: snapkv (top {per_head} per head)": lambda: select("snapkv"),
            f"select: adakv (pooled top {per_head * h} per layer)": lambda: select("adakv"),
            "select: lava (pooled)": lambda: select("lava"),
            "select + gather into pages: snapkv": gather,
        }
        base = None
        for name, fn in steps.items():
            skip = budget.skip_reason()
            if skip:
                table.add(n, name, None, None, skip)
                continue
            seconds, reason = attempt(lambda: timed(fn, dev, args.repeat), budget, dev)
            if seconds is None:
                table.add(n, name, None, None, reason)
                continue
            if name.startswith("prefill"):
                base = seconds
            table.add(n, name, seconds * 1e3, None if base is None else 100 * seconds / base,
                      "" if base is not None else "no attention time to compare with")


# ------------------------------------------------------------------------------ e2e

def build_model(args, dev: torch.device, dtype: torch.dtype):
    """A random-weight Llama of the configured shapes, made directly on the device (no download)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                         max_position_embeddings=max(args.lengths) + args.new_tokens + 64,
                         tie_word_embeddings=False, attn_implementation="sdpa",
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = 0
    return model.eval()


class Clock:
    """A logits processor that marks every generation step (CUDA events on a GPU: no sync)."""

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"
        self.marks = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def __call__(self, input_ids, scores):
        self.mark()
        return scores

    def intervals(self) -> list[float]:
        """Seconds from the start mark to the first step, then between steps."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def generate_once(model, ids, new_tokens: int, dev: torch.device, **kwargs) -> dict:
    """Greedy generation of exactly `new_tokens`; timings, peak memory and the cache."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    clock = Clock(dev)
    clock.mark()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, logits_processor=[clock],
                             return_dict_in_generate=True, **kwargs)
    times = clock.intervals()
    result = {"prefill": times[0], "first": times[1] if len(times) > 1 else None,
              "step": statistics.median(times[2:]) if len(times) > 2 else None,
              "tokens": out.sequences[:, ids.shape[1]:], "cache": out.past_key_values}
    if dev.type == "cuda":
        torch.cuda.synchronize()
        result["peak"] = torch.cuda.max_memory_allocated()
        result["run_peak"] = result["peak"] - before
    return result


def weight_bytes(model) -> tuple[int, int]:
    """(all parameter bytes, bytes a decode step reads: all but the input embedding table)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    return total, total - (0 if tied else embed.numel() * embed.element_size())


def cases(args):
    """(length, batch, spec, budget, mode) in the order they run: for each prompt and batch, budget by
    budget, mode by mode, every spec; the full cache's eager run first, its static-cache run with the
    first budget's reduce-overhead rows. With the defaults the issue's targets (32k, batch 8, 128 per
    head) come first, so a run that --max-seconds cuts short has them."""
    for length in args.lengths:
        for batch in args.batches:
            for i, budget in enumerate(args.budgets):
                for mode in args.modes:
                    if i == 0 and mode != "compiled":  # full cache: eager; transformers' static cache + CUDA graphs
                        yield length, batch, "full", None, mode
                    for spec in args.specs:
                        yield length, batch, spec, budget, mode


def run_e2e(args, dev: torch.device, dtype: torch.dtype, budget: Budget) -> None:
    import kvcompile

    bandwidth = copy_bandwidth(dev, 64 if args.small else 1024, args.repeat)
    model, reason = attempt(lambda: build_model(args, dev, dtype), budget, dev)
    if model is None:
        print(f"model not built: {reason}", flush=True)
        return
    weights, read = weight_bytes(model)
    kv_per_token = 2 * args.layers * args.kv_heads * args.head_dim * dtype.itemsize
    print(f"\nmodel: random Llama, {args.layers} layers, hidden {args.hidden}, {args.heads} query / "
          f"{args.kv_heads} KV heads, head dim {args.head_dim}, vocab {args.vocab}; weights {weights / GiB:.2f} GiB "
          f"({read / GiB:.2f} read per step); full K+V {kv_per_token / MiB:.3f} MiB per token; "
          f"{args.new_tokens} new tokens (greedy); copy bandwidth {bandwidth / 1e9:.0f} GB/s; built in "
          f"{budget.elapsed():.0f} s", flush=True)
    if dev.type != "cuda":
        print("peak memory: measured on CUDA only (torch.cuda.max_memory_allocated); '-' here", flush=True)
    table = Table("generate(), end to end",
                  ["prompt", "batch", "run", "mode", "prefill s", "1st step s", "ms/step", "tok/s", "KV GiB",
                   "peak GiB", "run peak GiB", "GB/s", "× bound", "× full eager", "note"])
    full_step = {}  # (length, batch) -> the full cache's eager step
    warmed = set()
    results = {}
    for length, batch, spec, per_head, mode in cases(args):
        name = "full" if spec == "full" else f"{spec} {per_head}/head"
        skip = budget.skip_reason()
        if skip:
            table.add(length, batch, name, mode, *[None] * 10, skip)
            continue
        ids = torch.randint(3, args.vocab, (batch, length), device=dev)
        note = []
        kwargs = {}
        if spec == "full" and mode == "reduce-overhead":
            kwargs["cache_implementation"] = "static"
            note.append("transformers' static cache" + ("" if dev.type == "cuda" else
                                                        " (compiled on CUDA only: ran uncompiled)"))
        if spec != "full":
            compiled, reason = attempt(lambda: kvcompile.compile(model, kvcompile.load_spec(spec, per_head=per_head),
                                                                 mode=mode), budget, dev)
            if compiled is None:
                table.add(length, batch, name, mode, *[None] * 10, f"refused: {reason}")
                continue
        # Triton kernels and kvcompile's Inductor graphs compile on a short prompt first; transformers' static
        # cache compiles for each cache length, so its compile lands in its first decode step instead
        if (spec, mode) not in warmed and "cache_implementation" not in kwargs:
            t0 = time.monotonic()
            warm, reason = attempt(lambda: generate_once(model, ids[:, :min(length, args.warmup_tokens)], 2, dev,
                                                         **kwargs), budget, dev)
            warmed.add((spec, mode))
            note.append(f"warm-up {time.monotonic() - t0:.1f} s" + ("" if warm is not None else f" ({reason})"))
            del warm
        run, reason = attempt(lambda: generate_once(model, ids, args.new_tokens, dev, **kwargs), budget, dev)
        if run is None and reason == "OOM" and spec == "full" and args.full_prefill_chunk:
            note.append(f"OOM in one pass: prompt in {args.full_prefill_chunk}-token chunks")
            run, reason = attempt(lambda: generate_once(model, ids, args.new_tokens, dev,
                                                        prefill_chunk_size=args.full_prefill_chunk, **kwargs),
                                  budget, dev)
        if spec != "full":
            kvcompile.uncompile(model)
        if run is None:
            table.add(length, batch, name, mode, *[None] * 10, "; ".join(note + [reason]))
            continue
        cache = run.pop("cache")
        if spec == "full":
            held = entries = batch * (length + args.new_tokens - 1) * kv_per_token
        else:
            report = cache.memory_report()
            held, entries = report["bytes_held"], report["bytes_entries"]
        del cache
        step = run["step"]
        if spec == "full" and mode == "eager":
            full_step[length, batch] = step
        base = full_step.get((length, batch))
        results[length, batch, spec, per_head, mode] = dict(run, held=held)
        table.add(length, batch, name, mode, run["prefill"], run["first"], step * 1e3, batch / step, held / GiB,
                  run.get("peak", 0) / GiB if "peak" in run else None,
                  run["run_peak"] / GiB if "run_peak" in run else None,
                  (read + entries) / step / 1e9, step / ((read + entries) / bandwidth),
                  None if base is None else base / step, "; ".join(note))
        del run
        if dev.type == "cuda":  # the next case's peak starts from what it allocates itself
            torch.cuda.empty_cache()
    targets(args, results, full_step)


def targets(args, results: dict, full_step: dict) -> None:
    length, batch = (32768, 8) if not args.small else (max(args.lengths), max(args.batches))
    low = min(args.budgets)
    print(f"\ntargets (issue 15): compressed decode at {low}/head ≥ 3× the full cache's tok/s at {length} tokens, "
          f"batch {batch}:", flush=True)
    base = full_step.get((length, batch))
    for (n, b, spec, per_head, mode), run in results.items():
        if (n, b, per_head) != (length, batch, low):
            continue
        if base is None:
            print(f"  {spec} {mode}: no full-cache eager run to compare with")
            continue
        ratio = base / run["step"]
        print(f"  {spec} {mode}: {ratio:.2f}× the full cache's eager tok/s: {'met' if ratio >= 3 else 'missed'}")
    print("targets (issue 15): AdaKV / LAVa peak memory within 10 % of SnapKV's at the same budget "
          "(peak GiB, and the run's own peak above what was allocated before it):", flush=True)
    any_peak = False
    for (n, b, spec, per_head, mode), run in results.items():
        snap = results.get((n, b, "snapkv", per_head, mode))
        if spec not in ("adakv", "lava") or snap is None or "peak" not in run:
            continue
        any_peak = True
        ratio, own = run["peak"] / snap["peak"], run["run_peak"] / max(snap["run_peak"], 1)
        print(f"  {spec} {per_head}/head, {n} tokens, batch {b}, {mode}: {ratio:.3f}× snapkv's peak, "
              f"{own:.3f}× its run peak: {'met' if ratio <= 1.10 else 'missed'}")
    if not any_peak:
        print("  no data (peak memory is measured on CUDA only, and needs snapkv with adakv or lava at one budget)")


# ------------------------------------------------------------------------------ main

def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--small", action="store_true", help="tiny shapes: a CPU run in seconds (the smoke test)")
    common.add_argument("--max-seconds", type=float, default=None,
                        help="start no case after this many seconds (default: 300 kernels, 420 e2e)")
    common.add_argument("--dtype", default="auto", help="auto (bf16 on a GPU, fp32 on a CPU) | bfloat16 | float16 | float32")
    common.add_argument("--repeat", type=int, default=None, help="timed calls per kernel (median)")
    sub.add_parser("bandwidth", parents=[common], help="the measured copy bandwidth")
    k = sub.add_parser("kernels", parents=[common], help="decode attention and compression kernels, one layer")
    k.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 32")
    k.add_argument("--tokens", type=int, nargs="+", default=None, help="tokens per KV head (default 8k-128k)")
    k.add_argument("--prompts", type=int, nargs="+", default=None, help="prompt lengths for the compression table")
    k.add_argument("--impls", nargs="+", default=None,
                   help="paged_attention impls (default: the device's default: triton on a GPU)")
    k.add_argument("--flush-mb", type=int, default=None, help="MiB written before each timed call")
    e = sub.add_parser("e2e", parents=[common], help="generate() on an 8B-shaped random model")
    e.add_argument("--lengths", type=int, nargs="+", default=None, help="prompt tokens (default 32768 8192)")
    e.add_argument("--batches", type=int, nargs="+", default=None, help="default 8 1 32")
    e.add_argument("--budgets", type=int, nargs="+", default=None, help="tokens per KV head (default 128 512)")
    e.add_argument("--specs", nargs="+", default=None, help="default snapkv adakv lava zsmerge")
    e.add_argument("--modes", nargs="+", default=None, choices=["eager", "compiled", "reduce-overhead"])
    e.add_argument("--new-tokens", type=int, default=None, help="tokens generated per run (default 32)")
    e.add_argument("--full-prefill-chunk", type=int, default=4096,
                   help="the full cache's prompt in chunks of this many tokens after an OOM in one pass (0: no retry)")
    args = parser.parse_args(argv)
    dev = pick_device()
    dtype = pick_dtype(args.dtype, dev)
    small = args.small
    defaults = {  # (GPU sizes, --small sizes)
        "repeat": (20, 3), "batches": ({"kernels": [1, 32], "e2e": [8, 1, 32]}, {"kernels": [1, 2], "e2e": [1, 2]}),
        "tokens": ([8192, 16384, 32768, 65536, 131072], [256, 1024]), "prompts": ([8192, 32768], [512]),
        "flush_mb": (256, 8), "lengths": ([32768, 8192], [160]), "budgets": ([128, 512], [48]),
        "specs": (["snapkv", "adakv", "lava", "zsmerge"],) * 2,
        "modes": (["eager", "compiled", "reduce-overhead"],) * 2, "new_tokens": (32, 4),
    }
    for name, pair in defaults.items():
        if getattr(args, name, "absent") is None:
            value = pair[1] if small else pair[0]
            setattr(args, name, value[args.command] if isinstance(value, dict) else value)
    if args.command == "e2e":
        args.new_tokens = max(args.new_tokens, 3)  # a prefill, a first step, then steps to take the median of
    if args.command == "kernels" and args.impls is None:
        args.impls = [None]
    shapes = dict(kv_heads=2, group=2, head_dim=64, page=16, select_budget=48) if small else \
        dict(kv_heads=8, group=4, head_dim=128, page=16, select_budget=128)
    if args.command == "e2e":
        shapes = dict(layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=128,
                      warmup_tokens=64) if small else \
            dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256,
                 warmup_tokens=256)
    for name, value in shapes.items():
        setattr(args, name, value)
    if args.max_seconds is None:
        args.max_seconds = {"kernels": 300, "e2e": 420}.get(args.command, 60)
    budget = Budget(args.max_seconds)
    print(f"bench_gpu {args.command}{' --small' if small else ''}; {device_line(dev, dtype)}; "
          f"--max-seconds {args.max_seconds:.0f}", flush=True)
    if args.command == "bandwidth":
        run_bandwidth(args, dev)
    elif args.command == "kernels":
        run_kernels(args, dev, dtype, budget)
    else:
        run_e2e(args, dev, dtype, budget)
    print(f"\ndone in {budget.elapsed():.0f} s", flush=True)


if __name__ == "__main__":
    main()
