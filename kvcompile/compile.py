"""`kvcompile.compile(model, spec)`: make a transformers causal LM run a policy.

Eager entry: registers the "kvcompile" attention and mask functions in transformers'
AttentionInterface / AttentionMaskInterface (new names only; nothing else changes
globally), switches this model to them, and wraps this model's `forward` and
`generate` so every call without a cache gets a fresh KVCompileCache. Nothing happens
at import time; `uncompile(model)` restores the model.
"""
from __future__ import annotations

import copy
import functools
from contextlib import contextmanager

import torch

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvcompile.cache import KVCompileCache
from kvcompile.errors import CompileError
from kvcompile.devices import DeviceError, execution_devices, has_hooks
from kvcompile.plan import PlanError, build_plan
from kvcompile.policy import Policy
from kvcompile.runtime import kvcompile_attention, kvcompile_mask
from kvcompile.sharding import ShardingError, model_shard

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
_STATE = "_kvcompile"  # instance attribute holding what uncompile() restores


def _check_model(model) -> None:
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        raise CompileError(f"kvcompile: unsupported model type {kind!r}; supported: {', '.join(SUPPORTED)}")
    if not hasattr(model, "generate") or not hasattr(model, "model"):
        raise CompileError("kvcompile: expected a *ForCausalLM model (with .model and .generate)")
    layers = getattr(model.model, "layers", None)
    if not layers or not all(hasattr(layer.self_attn, "layer_idx") for layer in layers):
        raise CompileError("kvcompile: every decoder layer must have self_attn.layer_idx")
    impl = config._attn_implementation
    if impl not in ("sdpa", "eager", "kvcompile", None):
        raise CompileError(f"kvcompile: the model uses attn_implementation={impl!r}; load it with "
                           "attn_implementation='sdpa' (or 'eager')")
    if getattr(config, "attention_chunk_size", None) or getattr(config, "layer_types", None) and \
            any(t != "full_attention" for t in config.layer_types):
        raise CompileError("kvcompile: sliding-window or chunked attention layers are not supported")


def sliding_window(config) -> int | None:
    """The window every layer applies when the config sets one for the whole model (Mistral's
    `sliding_window` without `layer_types`), else None. A query then sees the keys less
    than `window` positions behind it, so a sequence of at most `window` tokens attends
    to all of them, which is what kvcompile computes."""
    window = getattr(config, "sliding_window", None)
    return window if window and not getattr(config, "layer_types", None) else None


def check_length(config, length: int) -> None:
    """Refuse a sequence the model's sliding window would cut (kvcompile attends to every
    kept entry; it does not implement sliding-window attention)."""
    window = sliding_window(config)
    if window is not None and length > window:
        raise CompileError(f"kvcompile: a sequence of {length} tokens is longer than the model's sliding window "
                           f"({window} tokens), which kvcompile does not implement; sequences up to {window} "
                           "tokens run exactly")


def _length(args, kwargs) -> int | None:
    """The number of tokens a forward / generate call gets (ids or embeddings, dim 1)."""
    tokens = args[0] if args else kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    return tokens.shape[1] if tokens is not None and tokens.dim() >= 2 else None


def check_left_padded(attention_mask) -> None:
    """Refuse a right-padded batch (a pad after a real token): kvcompile stores and positions a
    sequence's tokens as if its pads were all on the left, as generate() pads decoder-only models."""
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape[1] < 2:
        return
    mask = attention_mask.bool()
    if bool((mask[:, :-1] & ~mask[:, 1:]).any()):
        raise CompileError("kvcompile: the batch is right-padded (a pad after a real token); pad on the left "
                           "(tokenizer.padding_side = 'left'), as generate() expects of decoder-only models")


def _refuse_outputs(kwargs, config) -> None:
    """output_attentions: the attention of a compressed cache is not the model's attention matrix,
    and kvcompile's kernels never build it; refused in both entries, before anything runs."""
    if kwargs.get("output_attentions") or (kwargs.get("output_attentions") is None
                                           and getattr(config, "output_attentions", False)):
        raise CompileError("kvcompile: output_attentions=True is not supported on a compiled model (the kernels "
                           "never build the attention matrix); call kvcompile.uncompile(model) first")


def _no_cache_implementation(kwargs: dict, gen) -> dict:
    """generate(cache_implementation=...) asks for another cache than kvcompile's: refused. A
    checkpoint's generation_config that sets one is overridden (compile() asked for kvcompile's)."""
    if kwargs.get("cache_implementation") is not None:
        raise CompileError(f"kvcompile: generate(cache_implementation={kwargs['cache_implementation']!r}) asks "
                           "for another cache; a compiled model generates with its KVCompileCache (leave "
                           "cache_implementation unset)")
    if getattr(gen, "cache_implementation", None) is not None:
        gen = copy.deepcopy(gen)
        gen.cache_implementation = None
        kwargs = {**kwargs, "generation_config": gen}
    return kwargs


def _check_crop(plan) -> None:
    """Assisted and prompt-lookup decoding send candidate tokens with the prompt and crop the
    rejected ones: exact only where the policy evicts nothing and updates no score while
    decoding, and where a layer's compression is final when the layer has run (not a cascade,
    which shrinks lower layers as later ones run). Refused before the prompt runs otherwise."""
    if plan.prune_every or plan.online_eviction or plan.running_scores:  # KVCompileCache.is_croppable
        raise CompileError(f"kvcompile: assisted / prompt-lookup decoding needs crop(), which {plan.policy.name} "
                           "cannot do exactly (it evicts or re-scores while decoding)")
    if plan.prefill_chunk:
        raise CompileError(f"kvcompile: assisted / prompt-lookup decoding sends candidate tokens with the prompt, "
                           f"and {plan.policy.name} compresses its prompt chunk by chunk (schedule.prefill); "
                           "generate without an assistant")
    if plan.cascade:
        raise CompileError(f"kvcompile: assisted / prompt-lookup decoding sends candidate tokens with the prompt, "
                           f"and {plan.policy.name}'s cascade changes a layer's cache after those tokens attended "
                           "to it (not exact); generate without an assistant")


_CHUNKED_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "cache_position")


def _forward_in_chunks(forward, chunk: int, cache: KVCompileCache, args, kwargs):
    """A prompt that the policy compresses every `chunk` tokens (schedule.prefill: chunk), given to
    model(...) in one call: it runs through the model one chunk per forward call (every layer of a
    chunk before the next chunk, as the reference defines it), the attention mask growing with it.
    Returns the last call's output with the logits of every chunk concatenated."""
    if kwargs.get("output_hidden_states"):
        raise CompileError("kvcompile: output_hidden_states=True with a policy that compresses the prompt in chunks "
                           "(schedule.prefill): the prompt runs in several forward calls; call without it")
    if kwargs.get("logits_to_keep"):
        raise CompileError("kvcompile: logits_to_keep with a policy that compresses the prompt in chunks "
                           "(schedule.prefill) is not supported; call without it")
    kwargs = dict(kwargs)
    if args:
        kwargs["input_ids"], args = args[0], args[1:]
    inputs = {name: kwargs.pop(name) for name in _CHUNKED_INPUTS if kwargs.get(name) is not None}
    mask = kwargs.pop("attention_mask", None)
    length = _length((), inputs)
    cache.expect_prompt(length)
    logits, out = [], None
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        piece = {name: x[:, start:end] if name != "cache_position" else x[start:end] for name, x in inputs.items()}
        if mask is not None:
            piece["attention_mask"] = mask[:, :end]
        out = forward(*args, past_key_values=cache, **piece, **kwargs)
        logits.append(out.logits)
    out.logits = torch.cat(logits, dim=1)
    return out


def build_kernels(plan, group: int) -> None:
    """Build (or load from the disk cache) the C++ kernels `plan` names, for `group` query heads per
    KV head, now: built on first use instead, a cold build (~1 s each) lands inside a generation,
    e.g. the paged kernel in the first decode step past `runtime.one_thread`'s bound (it cost a
    side-by-side dbudgetkv row 40 % of its decode speed)."""
    if plan.device is None or plan.device.type != "cpu":
        return
    if plan.decode_impl == "cpp":
        from kvcompile.kernels import paged_attention_cpp

        paged_attention_cpp._kernel(group, plan.head_dim)
    if plan.online_impl == "cpp":
        from kvcompile.kernels import online_step

        online_step._kernel(group, plan.head_dim)
    if plan.attention_scores or plan.chunk_impl == "cpp":
        from kvcompile.kernels import attention_column_sums

        attention_column_sums._kernel(plan.head_dim)
    if plan.merge_impl == "cpp":
        from kvcompile.kernels import merge

        merge._cpp_kernel()


def compile(model, spec, *, mode: str = "eager", page_size: int = 16, progress: bool = False,
            kernels: str | None = None, tokenizer=None, repeat_prompt=None, **overrides):
    """Return `model` with its attention rewritten to run `spec` (path, name, mapping or Policy).

    `model.generate(...)` and `model(...)` then use a fresh KVCompileCache per call unless
    one is passed. Errors (bad spec, unsupported model) are raised before anything changes.

    mode: "eager" (transformers' AttentionInterface routes to the kvcompile op) or
    "compiled" (torch.compile with the kvcompile backend: FX passes rewrite the captured
    SDPA calls into the op, Inductor fuses the rest; see kvcompile.passes).
    kernels: the kernels (KVCompileCache); by default Triton on a GPU, the C++ decode kernel
    on a CPU for fp32, else the torch lowering ("compiled" in compiled mode).

    The decisions are made here, once, into a `kvcompile.plan.Plan` (`model.kvcompile_plan`):
    which scorer, selection, merge and decode implementations run, what decoding does, the
    spare pages. A choice that cannot run here (an unknown kernel, a policy part without an
    implementation on this path) raises CompileError before the model is touched.

    tokenizer / repeat_prompt: for a reconstruction scorer (scoring: kvzip) only, the repeat prompt's
    token ids (kvcompile.kvzip.RepeatPrompt, or built from the tokenizer; default: the tokenizer saved
    in the model's local checkpoint folder).
    """
    if mode not in ("eager", "compiled"):
        raise ValueError(f"kvcompile: mode must be 'eager' or 'compiled', got {mode!r}")
    if isinstance(spec, Policy) and not overrides:
        policy = spec
    else:
        from kvcompile.spec import load_spec

        policy = load_spec(spec, **overrides)
    _check_model(model)
    if mode == "compiled" and has_hooks(model):
        raise CompileError("kvcompile: the compiled entry cannot trace accelerate's hooks on model.forward "
                           "(device_map dispatch, offload); compile with mode='eager', which keeps them running")
    if page_size < 1:
        raise ValueError(f"kvcompile: page_size must be >= 1, got {page_size}")
    try:
        shard = model_shard(model)
        # the device the layers run on: accelerate's execution device where hooks move offloaded
        # weights in (model.device is then where the first weight is stored: "meta", "cpu"); each
        # layer's where they run on several (a pipeline over GPUs)
        device, layer_devices = execution_devices(model)
        plan = build_plan(policy, model.config, device=device, dtype=model.dtype, kernels=kernels,
                          page_size=page_size, compiled_entry=mode == "compiled", shard=shard,
                          layer_devices=layer_devices)
    except (PlanError, ShardingError, DeviceError) as exc:
        raise CompileError(str(exc)) from None
    repeat = None
    if getattr(policy.scoring, "reconstructs", False):  # a second, model-level pass scores the prompt
        from kvcompile import kvzip

        kvzip.check(plan, mode)
        repeat = kvzip.repeat_prompt_for(model, tokenizer, repeat_prompt)
    build_kernels(plan, model.config.num_attention_heads // model.config.num_key_value_heads)
    if hasattr(model, _STATE):
        uncompile(model)
    config = model.config
    saved = {"attn": config._attn_implementation, "policy": policy, "mode": mode,
             # an accelerate hook (device_map, offload) lives on the instance: restored by uncompile()
             "instance": {name: model.__dict__[name] for name in ("forward", "generate", "init_continuous_batching")
                          if name in model.__dict__}}
    forward, generate = model.forward, model.generate
    if mode == "compiled":
        from kvcompile.passes import compile_forward

        model.set_attn_implementation("sdpa")
        forward = compile_forward(model, forward, kv_heads=len(plan.kv_heads))
    else:
        AttentionInterface.register("kvcompile", kvcompile_attention)
        AttentionMaskInterface.register("kvcompile", kvcompile_mask)
        model.set_attn_implementation("kvcompile")

    def new_cache(headroom: int = 0) -> KVCompileCache:
        return KVCompileCache.from_plan(plan.with_headroom(headroom), progress=progress)

    @functools.wraps(forward)
    def compiled_forward(*args, past_key_values=None, use_cache=None, **kwargs):
        _refuse_outputs(kwargs, config)
        t = _length(args, kwargs)
        if t is not None:
            check_length(config, t + (past_key_values.get_seq_length() if past_key_values is not None else 0))
        if model.training:  # training computes no cache: the plain attention, differentiable
            if isinstance(past_key_values, KVCompileCache):
                raise CompileError("kvcompile: a KVCompileCache in training mode; call model.eval() to generate")
            return forward(*args, past_key_values=past_key_values, use_cache=False, **kwargs)
        if past_key_values is None and use_cache is not False:
            past_key_values = new_cache()
        if isinstance(past_key_values, KVCompileCache):
            fresh = not past_key_values.seq_length
            if fresh:
                check_left_padded(kwargs.get("attention_mask"))
            kwargs["kvcompile_cache"] = past_key_values
            if fresh and repeat is not None and past_key_values.reconstruction is None:
                from kvcompile import kvzip

                return kvzip.prefill(forward, past_key_values, repeat, args, {**kwargs, "use_cache": use_cache})
            chunk = past_key_values.plan.prefill_chunk
            if fresh and chunk and t is not None and t > chunk and past_key_values.compressing is None:
                return _forward_in_chunks(forward, chunk, past_key_values, args, {**kwargs, "use_cache": use_cache})
        return forward(*args, past_key_values=past_key_values, use_cache=use_cache, **kwargs)

    @functools.wraps(generate)
    def compiled_generate(*args, past_key_values=None, **kwargs):
        gen = kwargs.get("generation_config") or model.generation_config
        _refuse_outputs(kwargs, gen)
        kwargs = _no_cache_implementation(kwargs, gen)
        headroom = kwargs.get("max_new_tokens") or getattr(gen, "max_new_tokens", None) or 0
        assisted = kwargs.get("assistant_model") is not None or bool(
            kwargs.get("prompt_lookup_num_tokens", getattr(gen, "prompt_lookup_num_tokens", None)))
        if assisted:
            _check_crop(plan)
        if repeat is not None and (assisted or kwargs.get("prefill_chunk_size",
                                                          getattr(gen, "prefill_chunk_size", None))):
            raise CompileError(f"kvcompile: {plan.policy.name} scores its prompt by reconstruction once the whole "
                               "prompt has run in one forward; generate without an assistant or prefill_chunk_size")
        uses_cache = kwargs.get("use_cache", getattr(gen, "use_cache", True)) is not False
        t = _length(args, kwargs)
        fresh = past_key_values is None or (isinstance(past_key_values, KVCompileCache)
                                            and not past_key_values.seq_length)
        if fresh and uses_cache:
            check_left_padded(kwargs.get("attention_mask"))
            if t is not None and kwargs.get("max_new_tokens") is not None:  # fail before the prompt runs
                check_length(config, t + kwargs["max_new_tokens"])
        if past_key_values is None and uses_cache:
            past_key_values = new_cache(headroom)
        elif (isinstance(past_key_values, KVCompileCache) and not past_key_values.is_initialized
              and not past_key_values.headroom):  # a fresh cache of the caller's: spares for what generate() adds
            past_key_values.plan = past_key_values.plan.with_headroom(headroom)
        chunk = kwargs.get("prefill_chunk_size", getattr(gen, "prefill_chunk_size", None))
        if plan.prefill_chunk:  # the prompt runs chunk by chunk, compressed after each (schedule.prefill: chunk)
            if chunk is not None and chunk != plan.prefill_chunk:
                raise CompileError(f"kvcompile: {plan.policy.name} compresses its prompt every {plan.prefill_chunk} "
                                   f"tokens (schedule.prefill); generate(prefill_chunk_size={chunk}) would cut it "
                                   f"otherwise: leave prefill_chunk_size unset or give {plan.prefill_chunk}")
            if t is not None and t > plan.prefill_chunk:
                chunk = kwargs["prefill_chunk_size"] = plan.prefill_chunk
        if (chunk or assisted) and t is not None and isinstance(past_key_values, KVCompileCache) \
                and not past_key_values.seq_length:
            # the prompt is compressed whole, as in one pass: over its chunks, and without the
            # candidate tokens that assisted decoding sends along with it
            past_key_values.expect_prompt(t)
        return generate(*args, past_key_values=past_key_values, **kwargs)

    model.forward = compiled_forward
    model.generate = compiled_generate
    # continuous batching (generate_batch, transformers serve's engine) with kvcompile's caches: kvcompile.serving
    model.init_continuous_batching = functools.partial(_init_continuous_batching, model)
    model.kvcompile_policy = policy
    model.kvcompile_plan = plan
    setattr(model, _STATE, saved)
    return model


def _init_continuous_batching(model, *args, **kwargs):
    try:
        from kvcompile.serving import init_continuous_batching
    except ImportError as exc:  # the engine's internals kvcompile.serving builds on (pyproject's transformers range)
        import transformers

        raise CompileError(f"kvcompile: continuous batching needs the engine of a transformers version kvcompile "
                           f"supports (pyproject.toml's range; generation/continuous_batching); transformers "
                           f"{transformers.__version__} lacks what kvcompile.serving uses: {exc}") from None

    return init_continuous_batching(model, *args, **kwargs)


def uncompile(model):
    """Undo `compile`: the model's own forward, generate and attention come back."""
    saved = getattr(model, _STATE, None)
    if saved is None:
        return model
    if hasattr(getattr(model, "_cached_continuous_batching_manager", None), "kvcompile_plan"):
        model.destroy_cached_continuous_batching_manager()  # a kept kvcompile.serving manager
    for name in ("forward", "generate", "init_continuous_batching", "kvcompile_policy", "kvcompile_plan"):
        model.__dict__.pop(name, None)
    model.__dict__.update(saved.get("instance", {}))
    model.set_attn_implementation(saved["attn"] or "sdpa")
    delattr(model, _STATE)
    return model


@contextmanager
def compiled(model, spec, **kwargs):
    """`with kvcompile.compiled(model, "lava"): ...` compiles for the block only."""
    compile(model, spec, **kwargs)
    try:
        yield model
    finally:
        uncompile(model)
