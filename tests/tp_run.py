"""Tensor-parallel runs for tests/test_tensor_parallel.py: gloo processes spawned by
torch.multiprocessing, each loading a saved tiny model with transformers' `DistributedConfig(tp_plan="auto")`,
compiling every spec and generating; what each rank's cache holds is written to a file
for the test process to compare with a one-process run of the same weights."""
from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

import torch

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"
NEW_TOKENS = 6


def spec_names() -> list[str]:
    """Every shipped spec but the reconstruction scorers (kvzip): compile() refuses them under tensor
    parallelism, and their call refuses the padded batches these runs use (tests/test_kvzip.py); nor
    a scorer that reads every head (tova: tests/test_tensor_parallel.py checks its refusal)."""
    import kvcompile

    return sorted(p.stem for p in SPECS_DIR.glob("*.yaml")
                  if not getattr(kvcompile.load_spec(p.stem).scoring, "reconstructs", False)
                  and kvcompile.load_spec(p.stem).scoring.head_local)


# Decode-time pruning (`decode: every`, in no shipped spec) with pooled heads, a cascade, running scores:
# spec name and overrides (a window of 4 query rows: the ring of latest queries that pruning re-scores with)
PRUNING = {
    "adakv_every": ("adakv", dict(ranking={"by_score": {"window": 4}}, scoring={"window_attention": {"window": 4}},
                                  schedule={"decode": {"every": {"n": 2}}})),
    "lava_every": ("lava", dict(ranking={"by_score": {"window": 4}}, scoring={"lava": {"window": 4}},
                                schedule={"cascade": True, "decode": {"every": {"n": 3}}})),
    "h2o_every": ("h2o", dict(ranking={"by_score": {"window": 3}}, schedule={"decode": {"every": {"n": 2}}})),
}


def small_budget(name: str):
    """The spec with a budget that evicts most of a 150-token prompt (as tests/test_runtime.py),
    and, for ZSMerge's online eviction and `decode: every` pruning, evicts while decoding too."""
    import kvcompile

    if name in PRUNING:
        base, overrides = PRUNING[name]
        return kvcompile.load_spec(base, per_head=48, **overrides)
    policy = kvcompile.load_spec(name)
    if policy.budget.threshold is not None:
        return kvcompile.load_spec(name, budget={"threshold": {"attention_norm": {"t": 0.05}}})
    protected = policy.ranking.sinks + policy.ranking.window
    return kvcompile.load_spec(name, per_head=max(48, protected + 16))


def inputs():
    """A left-padded batch of two prompts (150 and 97 tokens)."""
    from tiny import left_pad, prompt

    return left_pad([prompt(150, seed=7)[0], prompt(97, seed=8)[0]])


def entries(cache) -> dict:
    """What a cache holds, per (sequence, layer, KV head of the model): the logical positions of its
    tokens (prompt and generated), its residual slots (index, count) and their keys."""
    out = {}
    for layer, store in enumerate(cache.stores):
        k, _, _, pos, counts, stored = store.gather()
        for b in range(k.shape[0]):
            for i, head in enumerate(cache.plan.kv_heads):
                held = stored[b, i]
                p = pos[b, i][held]
                tokens = sorted(p[p >= 0].tolist())
                slot = (p < 0).nonzero().squeeze(1)
                order = slot[(-1 - p[slot]).argsort()]
                out[b, layer, head] = (tokens, [(-1 - int(p[e]), int(counts[b, i][held][e])) for e in order],
                                       k[b, i][held][order].clone())
    return out


def run_specs(model, names, mode: str = "eager") -> dict:
    """Every spec on `model`: generated tokens, entries, memory reports (each rank's and gathered)."""
    import kvcompile

    ids, mask = inputs()
    results = {}
    for name in names:
        with torch.no_grad(), kvcompile.compiled(model, small_budget(name), mode=mode):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 return_dict_in_generate=True)
        cache = out.past_key_values
        results[name] = {"tokens": out.sequences[:, -NEW_TOKENS:].tolist(), "entries": entries(cache),
                         "report": cache.memory_report(), "gathered": cache.gathered_memory_report(),
                         "kv_heads": cache.plan.kv_heads, "exchange": cache.plan.heads_exchange,
                         # a hybrid model's local layers (by model layer): the keys of this rank's heads' windows
                         "windows": {i: w.keys.clone() for i, w in enumerate(cache.windows) if w is not None}}
    return results


def refused(model, name: str) -> str:
    """compile()'s error for a model it must refuse, and that the model was left as it was."""
    import kvcompile

    before = model.config._attn_implementation
    try:
        kvcompile.compile(model, name)
    except kvcompile.CompileError as exc:
        assert model.config._attn_implementation == before and "forward" not in model.__dict__
        return str(exc)
    return "compiled"


def worker(rank: int, world: int, init: str, jobs: list, out: str) -> None:
    """One rank: for each (key, path, arg) job, load the saved model sharded by tensor parallelism
    and run the specs `arg` names; a job whose key starts with "refuse" records compile()'s error
    for spec `arg` instead, one that starts with "compiled" runs the compiled entry."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, DistributedConfig

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    results = {}
    try:
        for key, path, arg in jobs:
            model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"),
                                                         dtype=torch.float64).eval()
            model.generation_config.pad_token_id = 0
            start = time.perf_counter()
            if key.startswith("refuse"):
                results[key] = refused(model, arg)
            else:
                results[key] = run_specs(model, arg, "compiled" if key.startswith("compiled") else "eager")
            results[key + ":seconds"] = time.perf_counter() - start
    except Exception:  # the test process reports it
        results["error"] = traceback.format_exc()
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def spawn(world: int, jobs: list, tmp: Path, timeout: float) -> list[dict]:
    """Run `worker` on `world` gloo processes; each rank's results, or RuntimeError (with the
    processes ended) past `timeout` seconds."""
    import torch.multiprocessing as mp

    context = mp.start_processes(worker, args=(world, str(tmp / "init"), jobs, str(tmp)), nprocs=world,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel run of {world} ranks took more than {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    results = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, result in enumerate(results):
        if "error" in result:
            raise RuntimeError(f"rank {r} failed:\n{result['error']}")
    return results
