"""Decode speed of continuous batching: the batched decode step (kvcompile.engine.batch, one page pool per layer)
against the per-request path (the op once per request and layer), on the same engine, spec and requests.

`--code LABEL=PATH` names a kvcompile source tree (a checkout: PATH/kvcompile); each configuration runs in a fresh
process with PYTHONPATH=PATH, `--rounds` times, interleaved. `--per-request LABEL` also runs this tree with the
batched path switched off (every request through its own op, pages of its own: the path before the pool);
`--plan-step LABEL` with every batch through the plan's own decode step (a plain policy's fused `CppAppendStep`
instead of the store's append and the decode attention backend).
Every run: the embedded SmolLM2-135M (fp32), `--requests` prompts of `--length` tokens (the haystack text, a
different stretch each) sent at once, `--new-tokens` greedy tokens each, compiled with `--spec`.

Measured on the decode-only forwards (every request of the forward decodes one token): their tokens over the
time of their forwards (the model's forward: projections, MLPs, attention), and the calls per layer per step of
the op (`engine.op.run_layer`) and of the decode kernels (the paged attention backend's `run`, the fused decode
step). Columns: decode-only steps, tokens, tok/s, tokens per CPU second of the process (on a loaded machine, with
`--threads 1`, the steadier measure of the work), ms per decode-only forward, CPU ms of it, ms of it in the attention
function (every layer's), op calls/layer/step, kernel calls/layer/step, torch operators the attention function
dispatches per layer and step (counted in the first `--aten-steps` decode-only forwards, which are not timed; a
C++ kernel's call is not a torch operator), total s, the 1-minute load average before and after the run.

    nice python3 benchmarks/bench_batched_decode.py --code after=. --code before=/tmp/kvcompile-55ed859 \\
        [--per-request after] [--plan-step after] [--requests 16] [--length 1024] [--new-tokens 32] \\
        [--spec snapkv:128] [--rounds 2] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter


def run_one(args) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import kvcompile
    import kvcompile.engine.op as op
    from kvcompile.kernels import paged_attention, paged_attention_quant

    serving = _module("kvcompile.integrations.batching", "kvcompile.serving")
    load_haystack = _module("kvcompile.tools.data", "kvcompile.data").load_haystack
    load_model = _module("kvcompile.tools.models", "kvcompile.models").load_model

    torch.set_num_threads(args.threads)
    if args.per_request_run:  # the batched path off: every request through its own op, pages of its own
        from kvcompile.engine.batch import PerRequestDecode
        serving.decode_path = lambda plan: PerRequestDecode(None, reason="benchmark: per request")
    if args.plan_step_run:  # every batch through the plan's own decode step (plain policies too: CppAppendStep)
        decode_path = serving.decode_path

        def plan_step(plan):
            path = decode_path(plan)
            if getattr(path, "step", None) is None:
                raise SystemExit("--plan-step: this tree's batch has no decode step to choose")
            path.step = plan.decode_step
            return path
        serving.decode_path = plan_step
    model, tokenizer = load_model()
    spec, per_head = args.spec.split(":")
    kvcompile.compile(model, spec, per_head=int(per_head))
    ids = tokenizer(load_haystack(), add_special_tokens=False)["input_ids"]
    need = args.requests * args.length
    ids = (ids * (need // len(ids) + 1))[:need]
    inputs = [ids[i * args.length:(i + 1) * args.length] for i in range(args.requests)]
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=tokenizer.pad_token_id or 0)
    cb = ContinuousBatchingConfig(num_blocks=args.kv_tokens // 16, page_size=16,
                                  max_batch_tokens=args.length + 64, use_async_batching=False,
                                  allow_block_sharing=False)

    calls, counting = Counter(), [False]

    def counted(name, fn):
        def wrapper(*a, **k):
            if counting[0] is True:  # a timed decode-only forward
                calls[name] += 1
            return fn(*a, **k)
        return wrapper

    op.run_layer = counted("op", op.run_layer)
    for cls in (paged_attention.CppPagedAttention, paged_attention.TorchPagedAttention,
                paged_attention_quant.CppQuantPagedAttention, paged_attention_quant.TorchQuantPagedAttention):
        cls.run = counted("kernel", cls.run)  # (over two tiers: the codes' call; the float tier's is beside it)
    for cls in _classes(("kvcompile.store.pages", "CppOnlineStep"), ("kvcompile.store.pages", "CppAppendStep"),
                        ("kvcompile.kernels.tiered_step", "CppTieredStep"),  # this tree's fused steps
                        ("kvcompile.kernels.online_step", "CppOnlineStep"),  # (an older tree's)
                        ("kvcompile.kernels.quant_step", "CppQuantStep")):
        cls.__call__ = counted("kernel", cls.__call__)
    attention = [0.0]  # seconds in the attention function during decode-only forwards
    batching_attention = serving.batching_attention
    aten, aten_steps = Counter(), []  # torch operators the attention function dispatches, in untimed forwards

    class Operators(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            aten[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    def timed_attention(*a, **k):
        if counting[0] == "aten":
            with Operators():
                return batching_attention(*a, **k)
        start = time.perf_counter()
        out = batching_attention(*a, **k)
        if counting[0] is True:
            attention[0] += time.perf_counter() - start
        return out

    serving.batching_attention = timed_attention  # what the manager registers as the model's attention
    steps = []  # (requests, seconds) of each decode-only forward
    cpu_s = [0.0]  # the process's CPU seconds in them (with --threads 1: the forwards' work, whatever else runs)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    forward = model.forward

    def timed(*a, **k):
        batch = manager.batch_processor.cache.kvcompile.batch
        tokens = k["input_ids"].shape[1]
        decode_only = len(batch) == tokens
        if decode_only and len(aten_steps) < args.aten_steps:  # counted, not timed
            counting[0] = "aten"
            out = forward(*a, **k)
            aten_steps.append(tokens)
            counting[0] = False
            return out
        counting[0] = decode_only
        start, cpu = time.perf_counter(), time.process_time()
        out = forward(*a, **k)
        if decode_only:
            steps.append((tokens, time.perf_counter() - start))
            cpu_s[0] += time.process_time() - cpu
        counting[0] = False
        return out

    model.forward = timed
    load_before = os.getloadavg()[0]
    manager.start()
    start = time.perf_counter()
    request_ids = manager.add_requests(inputs=inputs, max_new_tokens=args.new_tokens)
    results = {}
    while len(results) < len(request_ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            if result.error is not None:
                raise RuntimeError(result.error)
            results[result.request_id] = result
    total = time.perf_counter() - start
    report = manager.batch_processor.cache.memory_report()
    manager.stop(block=True, timeout=30)
    layers = model.config.num_hidden_layers
    tokens = sum(n for n, _ in steps)
    seconds = sum(s for _, s in steps)
    return {"steps": len(steps), "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "tok_cpu_s": tokens / cpu_s[0], "cpu_ms_step": 1000 * cpu_s[0] / len(steps),
            "requests_per_step": statistics.median(n for n, _ in steps),
            "op_per_layer_step": calls["op"] / layers / len(steps),
            "kernel_per_layer_step": calls["kernel"] / layers / len(steps), "total_s": total,
            "aten_per_layer_step": sum(aten.values()) / layers / max(1, len(aten_steps)), "aten": dict(aten),
            "attention_ms_step": 1000 * attention[0] / len(steps), "forward_ms_step": 1000 * seconds / len(steps),
            "load_before": load_before, "load_after": os.getloadavg()[0],
            "decode": str(report.get("decode", "per request (before the pool)"))[:200],
            "step_s": [round(s, 4) for _, s in steps], "answers": [results[r].generated_tokens for r in request_ids]}


def _module(*names: str):
    """The first of `names` this tree has (a module another tree, such as the `--code before` one, names otherwise)."""
    import importlib

    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"none of {names} in this tree")


def _classes(*where: tuple[str, str]) -> list:
    """The classes (module, name) this tree has, each once."""
    import importlib

    found = []
    for module, name in where:
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ModuleNotFoundError:
            cls = None
        if cls is not None and cls not in found:
            found.append(cls)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", action="append", default=[], help="LABEL=PATH of a kvcompile source tree")
    parser.add_argument("--per-request", action="append", default=[],
                        help="LABEL: also run that tree with the batched path off")
    parser.add_argument("--plan-step", action="append", default=[],
                        help="LABEL: also run that tree with every batch through the plan's own decode step")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--kv-tokens", type=int, default=32768, help="the engine's pool, in tokens of full cache")
    parser.add_argument("--spec", default="snapkv:128")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--aten-steps", type=int, default=2,
                        help="the first decode-only forwards, untimed: the torch operators of their attention counted")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one run, JSON out
    parser.add_argument("--per-request-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--plan-step-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args)), flush=True)
        return
    codes = dict(c.split("=", 1) for c in args.code) or {"this": "."}
    runs = [(label, path, None) for label, path in codes.items()]
    runs += [(f"{label} per-request", codes[label], "--per-request-run") for label in args.per_request]
    runs += [(f"{label} plan-step", codes[label], "--plan-step-run") for label in args.plan_step]
    common = [f"--requests={args.requests}", f"--length={args.length}", f"--new-tokens={args.new_tokens}",
              f"--kv-tokens={args.kv_tokens}", f"--spec={args.spec}", f"--threads={args.threads}",
              f"--aten-steps={args.aten_steps}"]
    print(f"{args.requests} requests x {args.length}-token prompts, {args.new_tokens} new tokens, {args.spec}, "
          f"{args.threads} threads", flush=True)
    print(f"{'run':<22} {'steps':>5} {'tokens':>6} {'tok/s':>8} {'tok/cpu s':>9} {'fwd ms':>7} {'cpu ms':>7} "
          f"{'attn ms':>7} {'op/l/s':>7} "
          f"{'kern/l/s':>8} {'aten/l/s':>8} {'total s':>8} {'load':>11}", flush=True)
    rows: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for label, path, flag in runs:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
            cmd = [sys.executable, os.path.abspath(__file__), f"--one={label}", *common]
            out = subprocess.run(cmd + ([flag] if flag else []), capture_output=True, text=True,
                                 env=env, cwd=os.path.abspath(path))
            if out.returncode != 0:
                print(f"{label}: failed\n{out.stderr[-3000:]}", file=sys.stderr, flush=True)
                continue
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.setdefault(label, []).append(row)
            print(f"{label:<22} {row['steps']:>5} {row['tokens']:>6} {row['tok_s']:>8.1f} {row['tok_cpu_s']:>9.1f} "
                  f"{row['forward_ms_step']:>7.1f} {row['cpu_ms_step']:>7.1f} {row['attention_ms_step']:>7.1f} "
                  f"{row['op_per_layer_step']:>7.2f} {row['kernel_per_layer_step']:>8.2f} "
                  f"{row['aten_per_layer_step']:>8.1f} {row['total_s']:>8.1f} "
                  f"{row['load_before']:>5.2f}/{row['load_after']:<5.2f}", flush=True)
    if len(rows) > 1:
        labels = list(rows)
        for label in labels:
            med, cpu = (statistics.median(r[key] for r in rows[label]) for key in ("tok_s", "tok_cpu_s"))
            print(f"{label:<22} median {med:.1f} tok/s, {cpu:.1f} tokens per CPU second", flush=True)
        answers = {label: rows[label][0]["answers"] for label in labels}
        same = all(a == answers[labels[0]] for a in answers.values())
        print(f"answers identical across runs: {same}", flush=True)


if __name__ == "__main__":
    main()
