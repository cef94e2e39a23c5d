"""Run vLLM (in the vLLM environment) on token-id prompts and print one JSON line after RESULT: greedy
tokens of the prompts run together and one at a time, and the KV block pool's free counts (total, after
the first prompt's prefill and first decode step, at the end). The engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so its block pool can be read. The plugin is whatever the environment
configures (KVCOMPILE_VLLM_SPEC...). Used by tests/test_vllm_plugin.py:

    .venv-vllm/bin/python tests/vllm_run.py '{"model": "models/smollm2-135m", "prompts": [[...]], "max_tokens": 8}'

With "runs": [{"spec": ..., "overrides": {...}, "record": file}, ...] (the plugin on), the same engine runs the
prompts once per policy, each in turn set as the policy of the engine's worker state (the model runner's
kvcompile.integrations.vllm.backend.Worker) between runs, when no request is in flight: one vLLM start for many
policies (the scheduler reads only what the worker recorded). The result is then {"runs": [one result per
policy]}, each saying whether the worker's decode attention had the C++ kernel's cache addresses
(kvcompile.integrations.vllm.packed_attention).

With "engines": [{"spec": ..., "overrides": {...}, "record": file}, ...] (the plugin on), one engine per entry is
built in this process, each naming its policy in vLLM's additional_config["kvcompile"], all alive together;
every engine gets all the prompts and the engines are stepped in turn until all finish (each engine's requests
in flight while the others' run), then each prompt runs alone on each engine in turn. The result is
{"engines": [{"together", "alone", "blocks_total", "blocks_end", "worker"} per engine]}.
"""
import json
import os
import sys


def main(args: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    options = dict(model=args["model"], dtype="float32", enforce_eager=True, seed=0,
                   max_model_len=args.get("max_model_len", 1024), enable_prefix_caching=False,
                   enable_chunked_prefill=False, max_num_batched_tokens=args.get("max_model_len", 1024),
                   block_size=args.get("block_size", 32), async_scheduling=False) | args.get("options", {})
    params = SamplingParams(max_tokens=args["max_tokens"], temperature=0, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in args["prompts"]]
    if "engines" in args:
        return engines(options, args["engines"], prompts, params)
    llm = LLM(**options)
    if "runs" not in args:
        return run(llm, prompts, params, "stepped") | {"block_size": options["block_size"]}
    from kvcompile.spec import load_spec
    from kvcompile.integrations.vllm.settings import check_policy

    worker = worker_state(llm)
    results = []
    for i, spec in enumerate(args["runs"]):
        policy = load_spec(spec["spec"], **spec.get("overrides", {}))
        check_policy(policy)
        worker.policy, worker.record_to = policy, spec.get("record")
        results.append(run(llm, prompts, params, f"stepped-{i}") | {"block_size": options["block_size"],
                                                                       "decode_kernel": worker.addresses is not None})
    return {"runs": results}


def worker_state(llm):
    """The plugin's state of an in-process engine's worker (its model runner's metadata builder's)."""
    from kvcompile.integrations.vllm.backend import worker_of

    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    return worker_of(runner)


def engines(options: dict, settings: list, prompts, params) -> dict:
    """One engine per settings entry, alive together in this process, the prompts interleaved between them."""
    from vllm import LLM

    llms = []
    for entry in settings:
        config = {"spec": entry["spec"], **entry.get("overrides", {}), "record": entry["record"]}
        llms.append(LLM(**options, additional_config={"kvcompile": config}))
    pools = [llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool for llm in llms]
    totals = [pool.get_num_free_blocks() for pool in pools]
    names = [[f"e{i}p{j}" for j in range(len(prompts))] for i in range(len(llms))]
    for llm, ids in zip(llms, names):
        for rid, prompt in zip(ids, prompts):
            llm.llm_engine.add_request(rid, prompt, params)
    done = [{} for _ in llms]
    while any(llm.llm_engine.has_unfinished_requests() for llm in llms):
        for llm, finished in zip(llms, done):
            if llm.llm_engine.has_unfinished_requests():
                finished.update({o.request_id: list(o.outputs[0].token_ids) for o in llm.llm_engine.step()
                                 if o.finished})
    together = [[next(t for k, t in finished.items() if k == rid or k.startswith(rid + "-")) for rid in ids]
                for finished, ids in zip(done, names)]
    alone = [[] for _ in llms]
    for p in prompts:
        for i, llm in enumerate(llms):
            alone[i].append(list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids))
    return {"engines": [{"together": t, "alone": a, "blocks_total": total, "blocks_end": pool.get_num_free_blocks(),
                         "worker": id(worker_state(llm))}
                        for t, a, total, pool, llm in zip(together, alone, totals, pools, llms)]}


def run(llm, prompts, params, stepped: str) -> dict:
    engine = llm.llm_engine
    pool = engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    total = pool.get_num_free_blocks()
    # the first prompt stepped by hand: blocks held after its prefill (the step that gives its first token:
    # the last chunk's, under chunked prefill) and after its first decode step
    engine.add_request(stepped, prompts[0], params)
    [request] = [r for rid, r in engine.engine_core.engine_core.scheduler.requests.items()
                 if rid.startswith(stepped + "-")]  # vLLM suffixes the id it was given
    while request.num_output_tokens == 0:  # (step() returns no outputs here once llm.generate() ran)
        engine.step()
    after_prefill = pool.get_num_free_blocks()
    engine.step()
    after_decode = pool.get_num_free_blocks()
    while engine.has_unfinished_requests():
        engine.step()
    together = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]
    return {"together": together, "alone": alone, "blocks": {"total": total, "after_prefill": after_prefill,
            "after_decode": after_decode, "end": pool.get_num_free_blocks()}}


if __name__ == "__main__":
    print("RESULT" + json.dumps(main(json.loads(sys.argv[1]))))
