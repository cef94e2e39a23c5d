"""Every transformers internal kvcompile changes or relies on, declared in one table (`PATCHES`) and checked
by one function (`check`), where each integration is installed: `compile()` checks the "generate" rows
(kvcompile.integrations.generate), `KVCompileBatchingManager` the "batching" rows
(kvcompile.integrations.batching) before the engine starts. README "Supported transformers versions" and
docs/INTERNALS.md point here.

A `Patch` names its target (`module:Class.attr` in transformers), how kvcompile touches it (`kind`):
  override  a kvcompile subclass of a transformers class redefines the target (its callers are transformers')
  swap      a live object the engine built is turned into a kvcompile subclass (`obj.__class__ = ...`): the
            subclass relies on what the target (the base's `__init__`) gave the object
  instance  compile() replaces the target on one model instance (uncompile() restores it)
  register  a new name in one of transformers' registries: the target is the code that calls what is registered
  reads     kvcompile reads or calls the target, a private part of transformers
what it changes and why, the transformers versions it was checked against (`versions`), the fingerprints of
the target's source in the checked releases (`source`: {fingerprint: releases}, more than one where the code
differs between them; ABSENT where a release has no such target), and the fingerprints of the other transformers code the change relies on
(`relies_on`: ((target, {fingerprint: releases}), ...)). `check` refuses (the integration's error, before it
installs anything) a transformers outside a row's range, and one whose code under a row matches none of the
fingerprints checked; tests/test_transformers_patches.py fails, one test per row, when the installed
transformers changes under it, and fails when kvcompile overrides, swaps or registers something the table
does not declare. scripts/transformers_fingerprints.py prints the fingerprints of the installed transformers
(to add a release: run it there, run the suite there, add the fingerprints that differ).
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
from dataclasses import dataclass

RANGE = ">=5.21.0,<5.25"  # pyproject's transformers requirement (tests/test_transformers_patches.py compares them)
CHECKED = ("5.21.0", "5.22.0", "5.23.0", "5.24.0")  # the releases the fingerprints below were taken from
KINDS = ("override", "swap", "instance", "register", "reads")
ABSENT = "absent"  # a fingerprint: the target is not there in those releases (kvcompile's override then adds it)
ALL = " ".join(CHECKED)


@dataclass(frozen=True)
class Patch:
    """One transformers internal kvcompile changes or relies on (see the module's docstring)."""

    target: str
    kind: str
    integration: str  # "generate" (checked by compile()) or "batching" (checked when the engine is built)
    changes: str
    source: dict
    relies_on: tuple = ()
    versions: str = RANGE
    sites: tuple = ()  # swap / register: where kvcompile does it ("module:function expression")


_CB = "transformers.generation.continuous_batching"
_CACHE = f"{_CB}.cache:PagedAttentionCache"
_API = f"{_CB}.continuous_api"
_SCHED = f"{_CB}.scheduler"
_BATCHING = "kvcompile.integrations.batching"


def _cache(attr: str, changes: str, source: dict, **kw) -> Patch:
    return Patch(f"transformers.cache_utils:Cache.{attr}", "override", "generate", changes, source, **kw)


PATCHES = (
    # --- generate(): kvcompile's Cache, the attention and mask interfaces, the compiled model's entries ---------
    _cache("__init__", "KVCompileCache and the compiled entry's GraphCache build their own state (per-(layer, head) "
           "pages; the traced graph's stand-in) instead of Cache's list of layers",
           {'27ff579f129e8545': '5.21.0 5.22.0', 'd6aa3349b3f14ec9': '5.23.0 5.24.0'}),
    _cache("__len__", "KVCompileCache: the number of layers of the plan", {'6d0667161d9f567d': ALL}),
    _cache("update", "KVCompileCache refuses it: kvcompile's op stores what a layer keeps (engine.op); GraphCache "
           "records the call site under torch.compile", {'160f89cd9a968463': ALL}),
    _cache("get_seq_length", "the logical length (every token seen), not the entries kept: positions and masks "
           "follow the logical sequence", {'71da90bb1d283d6e': '5.21.0 5.22.0', 'cc9f5b487519dd8e': '5.23.0 5.24.0'}),
    _cache("get_mask_sizes", "the mask covers the logical length (kvcompile's op applies the kept entries' mask "
           "itself)", {'f7c9d499c2a30381': '5.21.0 5.22.0', '7c0f2b4e60a42f43': '5.23.0 5.24.0'}),
    _cache("get_query_offset", "the query's position in the logical sequence", {'d22e0b1944f93d81': ALL}),
    _cache("get_max_length", "no maximum (pages grow)", {'8e427b88a10fe17b': ALL}),
    _cache("is_compileable", "False: generate() must not pick its static-cache compile path for a KVCompileCache",
           {'b8825a7feb16d280': ALL}),
    _cache("is_linear", "per layer, no layer is linear: generate() (5.24) then cuts a continued prompt to its new "
           "tokens", {'443e3f2938fc1d3d': '5.21.0 5.22.0 5.23.0', 'd44eda43c250b54a': '5.24.0'}),
    _cache("is_sliding", "per layer: a hybrid model's local layers are sliding", {'0940356c852c276a': ALL}),
    _cache("is_dummy", "per layer: none is a placeholder",
    {'absent': '5.21.0 5.22.0', '571eb810f56784c0': '5.23.0 5.24.0'}),
    _cache("is_initialized", "whether a prompt has been stored", {'cbb161f2223e0715': ALL}),
    _cache("is_croppable", "whether crop(-n) can drop the last tokens (assisted and prompt-lookup decoding)",
    {'10b977e33dbbebd0': ALL}),
    _cache("crop", "drops the last n tokens' entries (assisted decoding rejects candidates)",
    {'6fea93de90503783': ALL}),
    _cache("reorder_cache", "beam search: reorders every store's sequences", {'1539ddde77446747': ALL}),
    _cache("reset", "empties the cache for reuse", {'8abb860460ff0567': ALL}),
    _cache("batch_select_indices", "keeps the selected sequences of every store (contrastive search)",
    {'139d9748fee29315': ALL}),
    _cache("batch_repeat_interleave", "repeats every store's sequences (num_return_sequences, beams)",
    {'815eeac54c4305d9': ALL}),
    _cache("activate_past_recording", "refused: kvcompile's cache does not record the past separately",
    {'9d771b4de2c3ea99': ALL}),
    Patch("transformers.generation.streamers:BaseStreamer.put", "override", "generate",
          "kvcompile.tools.models.TokenTimer times each decode step from the tokens generate() streams",
          {'fbb8f4e98440b9fc': ALL}),
    Patch("transformers.generation.streamers:BaseStreamer.end", "override", "generate",
          "TokenTimer: the end of a timed generate()", {'1e9949b796424bed': ALL}),
    Patch("transformers.masking_utils:create_causal_mask", "register", "generate",
          "the 'kvcompile' (and the compiled entry's call site, the reference's, the tools' batched answers') mask "
          "function in "
          "AttentionMaskInterface: called by this code with q_length, kv_length, ... keywords, it hands the 2-D "
          "padding mask through (engine.op.kvcompile_mask)",
          {'bd4450cc85d63644': '5.21.0 5.22.0', '341ee68974b114b3': '5.23.0', '143e39d36ae2d186': '5.24.0'},
          sites=("kvcompile.integrations.generate:compile AttentionMaskInterface",
                 "kvcompile.integrations.batching:KVCompileBatchingManager.switch_to_cb_friendly_attn "
                 "AttentionMaskInterface",
                 "kvcompile.passes.site:register AttentionMaskInterface",
                 "kvcompile.reference:_model_attention AttentionMaskInterface",
                 "kvcompile.tools.sweep:_stepped AttentionMaskInterface")),
    Patch("transformers.integrations.sdpa_attention:sdpa_attention_forward", "register", "generate",
          "the 'kvcompile' attention function in AttentionInterface (and 'kvcompile_batching', the compiled entry's "
          "call site, the reference's, 'kvcompile_decode_batch' of the tools' batched answers, sweep.greedy_together, "
          "which reads its batch from the forward's keywords): a model's attention calls it as it calls this one, (module, q, k, v, "
          "mask, scaling=, dropout=, **kwargs); each architecture's call is run by tests/test_runtime.py and "
          "test_architectures.py",
          {'b3604d235f012925': '5.21.0 5.22.0', 'e3d016070b6ac957': '5.23.0', '9be3d6b1f79abc00': '5.24.0'},
          sites=("kvcompile.integrations.generate:compile AttentionInterface",
                 "kvcompile.integrations.batching:KVCompileBatchingManager.switch_to_cb_friendly_attn "
                 "AttentionInterface",
                 "kvcompile.passes.site:register AttentionInterface",
                 "kvcompile.reference:_model_attention AttentionInterface",
                 "kvcompile.tools.sweep:_stepped AttentionInterface")),
    Patch("transformers.generation.utils:GenerationMixin.generate", "instance", "generate",
          "compile() sets the model's generate to an Entry: a call without a cache gets a fresh KVCompileCache, "
          "passed under the installed version's name (kvcompile.cache's NAME); the model's forward likewise (each "
          "architecture's own, run by the tests of each)",
          {'a469558165533afe': '5.21.0 5.22.0 5.23.0', 'bb6628b88fc66ed8': '5.24.0'}),
    Patch("transformers.configuration_utils:PreTrainedConfig._attn_implementation", "reads", "generate",
          "compile() reads the model's attention implementation (refuses flash; uncompile() restores it); the "
          "compiled entry and the paged cache check it", {'fb3c3d5f7ff70a6f': ALL}),
    Patch("transformers.distributed.mixin:DistributedMixin._mesh_manager", "reads", "generate",
          "compile() of a tensor-parallel model reads its device mesh (`model._mesh_manager.get_mesh('tp')`, set "
          "by from_pretrained(tp_plan=...)) to shard the plan over the ranks (kvcompile.sharding)",
          {'dc937b59892604f5': ALL},
          relies_on=(("transformers.distributed.mixin:DistributedMixin.maybe_distribute_model",
              {'5178c40ebc3a88d4': '5.21.0 5.22.0', 'd4958f76742e7958': '5.23.0 5.24.0'}),)),
    # --- continuous batching (kvcompile.integrations.batching) ------------------------------------------------
    Patch(f"{_API}:ContinuousMixin.init_continuous_batching", "instance", "batching",
          "compile() sets the model's init_continuous_batching to batching.init_continuous_batching: the same "
          "arguments and cached-manager rule (_cached_continuous_batching_manager), returning a "
          "KVCompileBatchingManager", {'864a244a2534b05a': ALL},
          relies_on=((f"{_API}:ContinuousMixin.destroy_cached_continuous_batching_manager",
              {'b2bf6db446b6d137': ALL}),)),
    Patch(f"{_API}:ContinuousBatchingManager.__init__", "override", "batching",
          "refuses what the engine cannot run with kvcompile (check_batching), forces synchronous batching and no "
          "block sharing, then the engine's own", {'c17deedf60b75aab': ALL},
          relies_on=((f"{_API}:ContinuousBatchingManager.stop", {'e739fc93466f2b7f': ALL}),)),
    Patch(f"{_API}:ContinuousBatchingManager.switch_to_cb_friendly_attn", "override", "batching",
          "switches the model to the 'kvcompile_batching' attention (the engine accepts only its own), keeping "
          "_original_attn_impl for the engine's restore (stop)", {'dbb1a528a7185c86': ALL}),
    Patch(f"{_API}:ContinuousBatchingManager._create_batch_processor", "override", "batching",
          "after the engine builds its processor, turns its cache, processor, scheduler, offloading manager and "
          "model runner into kvcompile's subclasses (the swaps below)", {'cc0fca82818d2471': ALL}),
    Patch(f"{_API}:ContinuousBatchingManager._generation_loop_body", "override", "batching",
          "an exception fails the step's requests (fail_forward) instead of stopping the engine",
          {'b138833254b235b0': ALL},
          relies_on=((f"{_API}:ContinuousBatchingManager._run_generation_loop",
              {'ccf319f4eb072ce8': '5.21.0 5.22.0 5.23.0', '56c9cdba165cd2cf': '5.24.0'}),)),
    Patch(f"{_CACHE}.__init__", "swap", "batching",
          "KVCompilePagedCache.adopt: the pool becomes a byte budget for kvcompile's per-request caches; reads "
          "cache_allocators, pool, num_blocks, max_batch_tokens, dtype, config, device, use_prefix_sharing, "
          "read_cache_limit and the allocators' views, released",
          {'7846b73eca22c36a': '5.21.0 5.22.0 5.23.0', 'c64951fe6abbc732': '5.24.0'},
          relies_on=((f"{_CB}.cache_allocators.full_attention:FullAttentionCacheAllocator.__init__",
              {'06ce8c87d7e0c099': ALL}),
                     (f"{_CB}.cache_allocators.sliding_attention:SlidingAttentionCacheAllocator.__init__",
                     {'3506e6cb878eddde': ALL}),
                     (f"{_CB}.cache_allocators.cache_pool:CachePool.free_blocks", {'c233222e45cf9a15': ALL}),
                     (f"{_CB}.cache_allocators.cache_pool:CachePool.count_free_blocks", {'c38548ecb60a3dd3': ALL}),
                     (f"{_CB}.cache_allocators.cache_allocator:CacheAllocator.free_blocks", {'df533fa33893419b': ALL})),
          sites=(f"{_BATCHING}:KVCompilePagedCache.adopt cache",)),
    Patch(f"{_CACHE}.can_store_request_tokens", "override", "batching",
          "reserves the blocks that cover what the request's kvcompile cache can hold after its next forward",
          {'f6ed5b58c1e298f5': ALL}),
    Patch(f"{_CACHE}.extend_read_and_write_indices", "override", "batching",
          "nothing: kvcompile's op reads and writes its own pages", {'1b8d731413e33842': ALL}),
    Patch(f"{_CACHE}.fill_block_table", "override", "batching", "nothing: the engine's block table is not read",
          {'982135b4fbbe5fce': ALL}),
    Patch(f"{_CACHE}.update", "override", "batching",
          "(5.24 on: each attention module calls it) hands the keys and values on unchanged and puts the cache in "
          "the attention's keyword arguments, where batching_attention reads each request's cache",
          {'b2e32368cbfdf65a': ALL}),
    Patch(f"{_CACHE}.free_blocks", "override", "batching",
          "gives the request's pages back to kvcompile's pools, hands a kept cache over with its blocks, records "
          "its usage; then the engine's", {'c8b076a99e2fc903': ALL}),
    Patch(f"{_CACHE}.free_all_requests", "override", "batching", "also forgets kvcompile's per-request state",
    {'eaebcd08252c0742': ALL}),
    Patch(f"{_CACHE}.prepare_fork_request", "override", "batching",
          "refused: kvcompile does not fork a request's cache (num_return_sequences > 1)", {'6172775739f1a772': ALL}),
    Patch(f"{_API}:ContinuousBatchProcessor.__init__", "swap", "batching",
          "KVCompileBatchProcessor: reads cache, scheduler, inputs_and_outputs (requests_in_batch), "
          "model_runner, offloading_manager", {'589aafcfc508b203': ALL},
          sites=(f"{_BATCHING}:KVCompileBatchingManager._create_batch_processor processor",)),
    Patch(f"{_API}:ContinuousBatchProcessor.prepare_next_batch", "override", "batching",
          "tells the cache which requests (and how many tokens of each) the forward packs", {'cbc297079d4a9591': ALL},
          relies_on=((f"{_CB}.input_outputs:ContinuousBatchingIOs.prepare_batch_tensors", {'2d979073bbd4f215': ALL}),
                     (f"{_CB}.requests:FutureRequestState.__init__", {'667b0995b8b8f1fa': ALL}))),
    Patch(f"{_API}:ContinuousBatchProcessor.update_batch", "override", "batching",
          "syncs each request's blocks to what its cache holds, then the engine's, over the forward's requests but "
          "those that fail alone (their own work raised, or their own sampling could not pick their token: "
          "_updating_without hands the engine's update the others' rows of prepare_batch_update, on the IO object "
          "for that one call), then fails those", {'cbad955852af2e67': ALL},
          relies_on=((f"{_CB}.input_outputs:ContinuousBatchingIOs.prepare_batch_update", {'f2e488c1cea7563f': ALL}),)),
    Patch(f"{_API}:ContinuousBatchProcessor._handle_request_error", "reads", "batching",
          "called to deliver a failed request's error (fail_forward, _fail_alone)", {'61bcda761e41b91e': ALL}),
    Patch(f"{_CB}.model_runner:ModelRunner.__init__", "swap", "batching",
          "KVCompileModelRunner: reads do_sample, logit_processor, return_logprobs, inputs_and_outputs, cache",
          {'a9d4b9ef2f008b40': ALL},
          sites=(f"{_BATCHING}:KVCompileBatchingManager._create_batch_processor processor.model_runner",)),
    Patch(f"{_CB}.model_runner:ModelRunner._forward_process_and_sample", "override", "batching",
          "requests with their own RequestSampling (kvcompile serve's) pick their tokens as generate() would",
          {'e326cff070721010': ALL}),
    Patch(f"{_CB}.input_outputs:ContinuousBatchingIOs.carry_over_tokens", "reads", "batching",
          "called by the overridden _forward_process_and_sample before the forward, as the engine's",
          {'587d3ae0475861ae': ALL}),
    Patch(f"{_CB}.offloading_manager:OffloadingManager.__init__", "swap", "batching",
          "KVCompileOffloadingManager: reads cache and scheduler", {'da2c109b383c5a79': ALL},
          sites=(f"{_BATCHING}:KVCompileBatchingManager._create_batch_processor processor.offloading_manager",)),
    Patch(f"{_CB}.offloading_manager:OffloadingManager.offload_requests", "override", "batching",
          "records the requests a soft reset re-queued (same id, prompt + generated tokens) so they are replayed",
          {'750d6cb99a3a4ac4': ALL}),
    Patch(f"{_CB}.requests:RequestState.create_equivalent_initial_request", "reads", "batching",
          "a soft reset's re-queued request: its _true_initial_tokens (the original prompt length) is checked "
          "against kvcompile's record", {'da32ec325450e039': ALL}),
    Patch(f"{_CB}.requests:RequestState", "reads", "batching",
          "kvcompile reads a request's id, status, position_offset, initial, generated and remaining prefill "
          "tokens, max_new_tokens, and builds one to size an admission (admission_error)", {'b3237ddf53bceb6b': ALL}),
    Patch("transformers.generation.configuration_utils:ContinuousBatchingConfig", "reads", "batching",
          "check_batching refuses the settings kvcompile cannot run (async batching, CPU offload, compiled or "
          "padded forwards) and sets use_async_batching and allow_block_sharing off", {'146a16fe0cfc93d1': ALL}),
    Patch(f"{_SCHED}:Scheduler.__init__", "swap", "batching",
          "KVCompileFIFOScheduler / KVCompilePrefillFirstScheduler (ReplaySteps): read cache, active_requests, "
          "waiting_requests, waiting_requests_order, block_new_requests", {'6c80686b2a1777b3': ALL},
          sites=(f"{_BATCHING}:KVCompileBatchingManager._create_batch_processor processor.scheduler",)),
    Patch(f"{_SCHED}:Scheduler.add_waiting_request", "override", "batching",
          "refuses a request the pool can never hold (RequestTooLarge); starts a continued one after its kept "
          "cache", {'9ef098f71ace6777': ALL}),
    Patch(f"{_SCHED}:Scheduler._infer_request_tokens", "override", "batching",
          "a replayed request takes the forwards of its original run", {'532be9998b22de8f': ALL}),
    Patch(f"{_SCHED}:Scheduler._schedule_request", "override", "batching",
          "a replay's step ends the forward at the engine's split", {'647344a9b5a0906a': ALL}),
    Patch(f"{_SCHED}:Scheduler.schedule_batch", "override", "batching",
          "ReplaySteps: lifts block_new_requests once no request is active (5.21 to 5.24 lift it only when a "
          "request finishes by itself: tests/test_scheduler_stall.py)", {'b4dcbda63894d74d': ALL}),
    Patch(f"{_SCHED}:FIFOScheduler.schedule_batch", "override", "batching", "KVCompileFIFOScheduler: as above",
    {'15a13a70ff385794': ALL}),
    Patch(f"{_SCHED}:PrefillFirstScheduler.schedule_batch", "override", "batching",
          "KVCompilePrefillFirstScheduler: as above", {'2a710fdda6d60dd9': ALL}),
    Patch("transformers.generation.utils:GenerationMixin._get_logits_processor", "reads", "batching",
          "RequestSampling builds a request's logits processors as generate() does",
          {'ed981fe8bafd3d5d': '5.21.0 5.22.0', '68fb7d0e2062182f': '5.23.0', 'bf919dbc9b664489': '5.24.0'}),
    Patch("transformers.generation.utils:GenerationMixin._prepare_generation_config", "reads", "batching",
          "kvcompile serve completes a request's generation config as generate() does", {'e31e7ac9816ecf01': ALL}),
    Patch(f"{_API}:OutputRouter.__init__", "reads", "batching",
          "kvcompile serve drops a cancelled request's result handler under the router's _lock",
          {'bbd24a9572cf71bb': ALL}),
)


def resolve(target: str):
    """The object `target` ("module:Class.attr", "module:function") names in the installed transformers: a
    class's own attribute (its descriptor: a property, not its value), never one it inherits."""
    module, _, path = target.partition(":")
    owner = importlib.import_module(module)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    if inspect.isclass(owner):
        if name not in vars(owner):
            raise AttributeError(f"{owner.__qualname__} defines no {name} of its own")
        return vars(owner)[name]
    return getattr(owner, name)


def fingerprint(obj) -> str:
    """The first 16 hex digits of the SHA-256 of an object's source (a property's getter and setter, a
    classmethod's function; a plain value: its repr)."""
    if isinstance(obj, property):
        text = "".join(inspect.getsource(f) for f in (obj.fget, obj.fset) if f is not None)
    elif isinstance(obj, (staticmethod, classmethod)):
        text = inspect.getsource(obj.__func__)
    elif inspect.isclass(obj) or inspect.isroutine(obj):
        text = inspect.getsource(inspect.unwrap(obj))
    else:
        text = repr(obj)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def drift(patch: Patch) -> list[str]:
    """How the installed transformers differs under `patch` from every release it was checked on: [] where it
    does not."""
    from packaging.specifiers import SpecifierSet

    import transformers

    have = transformers.__version__
    out = []
    if have not in SpecifierSet(patch.versions):
        out.append(f"transformers {have} is outside {patch.versions}")
    for target, want in ((patch.target, patch.source), *patch.relies_on):
        try:
            got = fingerprint(resolve(target))
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            if ABSENT in want and isinstance(exc, (ImportError, AttributeError)):
                continue
            out.append(f"{target} is not there as checked ({type(exc).__name__}: {exc})")
            continue
        if got not in want:
            checked = "; ".join(f"{fp} in {releases}" for fp, releases in want.items())
            out.append(f"{target}'s source differs from every release checked (fingerprint {got}; {checked})")
    return out


def check(integration: str, error: type[Exception]) -> None:
    """Raise `error` naming each row of `integration` the installed transformers differs under (its version
    outside the row's range, or its code under the row unlike every release checked)."""
    import transformers

    changed = [f"{p.target} ({p.kind}): {why}" for p in PATCHES if p.integration == integration for why in drift(p)]
    if changed:
        raise error(f"kvcompile: {integration} changes or relies on transformers internals checked on transformers "
                    f"{', '.join(CHECKED)} ({RANGE}), and transformers {transformers.__version__} differs under "
                    "them: " + "; ".join(changed) + " (kvcompile/integrations/transformers_patches.py; install "
                    f"transformers{RANGE} at one of the releases checked)")
