"""`kvcompile.compile(model, spec)`: make a transformers causal LM run a policy.

Eager entry: registers the "kvcompile" attention and mask functions in transformers'
AttentionInterface / AttentionMaskInterface (new names only; nothing else changes
globally), switches this model to them, and wraps this model's `forward` and
`generate` (`Entry` objects on the instance, bound to the model as attributes, so a deep
copy of the model gets its own) so every call without a cache gets a fresh KVCompileCache.
Nothing happens at import time; `uncompile(model)` restores the model.
"""
from __future__ import annotations

import copy
import functools
import warnings
from contextlib import contextmanager

import torch

from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import AttentionMaskInterface

from kvcompile import cache as cache_arg
from kvcompile.cache import KVCompileCache
from kvcompile.errors import CompileError
from kvcompile.integrations import transformers_patches
from kvcompile.layer_kinds import WINDOWED
from kvcompile.devices import DeviceError, execution_devices, has_hooks
from kvcompile.plan import PlanError, build_plan
from kvcompile.policy import Policy
from kvcompile.engine.op import kvcompile_attention, kvcompile_mask
from kvcompile.sharding import ShardingError, model_shard

# the model types kvcompile is tested on (tests/test_runtime.py, test_architectures.py, test_hybrid.py,
# test_llama4.py): decoders whose attention is softmax(q·kᵀ·scaling)·v over RoPE'd keys (or none: Llama 4's NoPE
# layers); they differ in norms, fused projections, MLPs (experts) and local layers (windows, chunks)
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3", "olmo2", "gemma3_text", "gemma2",
             "gpt_oss", "llama4_text")
_STATE = "_kvcompile"  # instance attribute holding what uncompile() restores


def unusual_attention(config) -> str | None:
    """The attention feature of `config` that kvcompile's op does not compute, named, or None: keys and values
    from a shared low-rank latent (MLA), attention to another sequence (cross-attention), position biases on the
    logits (ALiBi)."""
    if getattr(config, "kv_lora_rank", None) or getattr(config, "q_lora_rank", None):
        return "multi-head latent attention (MLA: keys and values decompressed from a low-rank latent, kv_lora_rank)"
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False) or \
            getattr(config, "cross_attention_layers", None):
        return "cross-attention (a decoder attending to an encoder's or an image's states)"
    attn_config = getattr(config, "attn_config", None)
    alibi_in = attn_config.get("alibi") if isinstance(attn_config, dict) else getattr(attn_config, "alibi", False)
    if getattr(config, "model_type", None) == "bloom" or getattr(config, "alibi", False) is True or alibi_in or \
            getattr(config, "position_embedding_type", None) == "alibi":
        return "ALiBi (linear position biases added to the attention logits)"
    return None


def _check_model(model) -> None:
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    feature = unusual_attention(config) if config is not None else None
    if feature is not None:
        raise CompileError(f"kvcompile: model type {kind!r} uses {feature}, which kvcompile's attention does not "
                           f"compute; tested model types: {', '.join(SUPPORTED)}")
    kinds = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention", *WINDOWED})
    if kinds:
        raise CompileError(f"kvcompile: model type {kind!r} has {' and '.join(kinds)} layers (config.layer_types), "
                           "whose attention sees blocks of keys only; kvcompile runs full_attention layers and "
                           f"leaves {', '.join(WINDOWED)} layers to their window")
    if getattr(config, "attention_chunk_size", None) and not getattr(config, "layer_types", None):
        raise CompileError(f"kvcompile: model type {kind!r} sets attention_chunk_size without layer_types, which "
                           "transformers runs as chunked attention on every layer; kvcompile leaves chunked layers "
                           "to their chunk and compresses full_attention layers, of which this model has none")
    why = _position_scaling(config)
    if why is not None:
        raise CompileError(f"kvcompile: model type {kind!r} {why}")
    if getattr(config, "use_bidirectional_attention", False):
        raise CompileError(f"kvcompile: model type {kind!r} with use_bidirectional_attention=True attends to later "
                           "tokens too; kvcompile's attention is causal")
    if kind not in SUPPORTED:
        text = getattr(getattr(config, "text_config", None), "model_type", None)  # a multimodal wrapper (Llama 4)
        hint = f"; its text model (model type {text!r}) is: load that alone, a *ForCausalLM" if text in SUPPORTED \
            else ""
        raise CompileError(f"kvcompile: unsupported model type {kind!r}; supported (tested): {', '.join(SUPPORTED)}"
                           f"{hint}")
    if not hasattr(model, "generate") or not hasattr(model, "model"):
        raise CompileError("kvcompile: expected a *ForCausalLM model (with .model and .generate)")
    layers = getattr(model.model, "layers", None)
    if not layers or not all(hasattr(layer.self_attn, "layer_idx") for layer in layers):
        raise CompileError("kvcompile: every decoder layer must have self_attn.layer_idx")
    impl = config._attn_implementation
    if impl not in ("sdpa", "eager", "kvcompile", None):
        raise CompileError(f"kvcompile: the model uses attn_implementation={impl!r}; load it with "
                           "attn_implementation='sdpa' (or 'eager')")


def _nope_scaling(config) -> bool:
    """Whether the model scales its NoPE layers' queries by position, read off the cache's length (Llama 4)."""
    return bool(getattr(config, "attn_temperature_tuning", False)) and \
        not all(getattr(config, "no_rope_layers", None) or (1,))


def _position_scaling(config) -> str | None:
    """Why a model's query scaling by position (Llama 4's attn_temperature_tuning on its NoPE layers, read off the
    cache's length before the layer's attention) would not see the position transformers gives it, or None.
    kvcompile's cache counts a forward's tokens once its last compressed layer has run (the model's last
    full_attention layer: a policy compresses every one), so a layer after it would read the count with them."""
    if not _nope_scaling(config):
        return None
    types = getattr(config, "layer_types", None) or ("full_attention",) * config.num_hidden_layers
    last = max((i for i, kind in enumerate(types) if kind == "full_attention"), default=-1)
    late = [i for i, (rope, kind) in enumerate(zip(config.no_rope_layers, types))
            if not rope and kind != "full_attention" and i > last]
    if not late:
        return None
    return (f"scales the queries of its NoPE layers by position (attn_temperature_tuning) and layers {late} are "
            f"NoPE layers left to their window after its last full_attention layer ({last}), where kvcompile's "
            "cache already counts the forward's tokens; kvcompile runs NoPE layers up to the last full_attention "
            "layer (as transformers' default layer_types make them), or attn_temperature_tuning=False")


def model_sinks(model) -> tuple | None:
    """Each layer's learned attention sinks (gpt-oss's self_attn.sinks: one logit per query head added to the
    softmax's denominator), as the plan holds them (kvcompile.plan.Plan.sinks), or None where no layer has any.
    Read once, at compile(): the plan is immutable, so changing the sinks' weights afterwards needs another
    compile()."""
    layers = getattr(getattr(model, "model", None), "layers", None) or ()
    sinks = [getattr(getattr(layer, "self_attn", None), "sinks", None) for layer in layers]
    if all(s is None for s in sinks):
        return None
    return tuple(None if s is None else tuple(float(x) for x in s.detach().float().cpu()) for s in sinks)


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
    """Refuse a mask whose pads are not all on the left: a right-padded batch (pads after the real
    tokens) or a hole (a pad between real tokens). kvcompile stores and positions a sequence's tokens
    as if its pads were all on the left, as generate() pads decoder-only models."""
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape[1] < 2:
        return
    mask = attention_mask.bool()
    if not bool((mask[:, :-1] & ~mask[:, 1:]).any()):  # no pad after a real token
        return
    real_after = mask.flip(1).cumsum(1).flip(1) > 0  # a real token at or after each position
    real_before = mask.cumsum(1) > 0
    holes = (~mask & real_before & real_after).any(1)
    if bool(holes.any()):
        row = int(holes.nonzero()[0])
        raise CompileError(f"kvcompile: the attention mask has a hole (a pad between real tokens, row {row}); "
                           "kvcompile masks only left padding (pads before a sequence's first real token): "
                           "remove the pads inside the sequence")
    raise CompileError("kvcompile: the batch is right-padded (a pad after a real token); pad on the left "
                       "(tokenizer.padding_side = 'left'), as generate() expects of decoder-only models")


def _refuse_outputs(kwargs, config) -> None:
    """output_attentions: the attention of a compressed cache is not the model's attention matrix,
    and kvcompile's kernels never build it; refused in both entries, before anything runs."""
    if kwargs.get("output_attentions") or (kwargs.get("output_attentions") is None
                                           and getattr(config, "output_attentions", False)):
        raise CompileError("kvcompile: output_attentions=True is not supported on a compiled model (the kernels "
                           "never build the attention matrix); call kvcompile.uncompile(model) first")


def _ignored_cache_implementation(where: str, value, stacklevel: int) -> None:
    warnings.warn(f"kvcompile: {where} sets cache_implementation={value!r}; ignored: a compiled model generates "
                  "with its KVCompileCache (kvcompile owns the cache)", UserWarning, stacklevel=stacklevel)


def _no_cache_implementation(kwargs: dict, model) -> dict:
    """generate(cache_implementation=...) asks for another cache than kvcompile's: refused. A
    checkpoint's generation_config.json that sets one (from_pretrained puts it on
    model.generation_config) is ignored with a warning: compile() clears it (uncompile() restores
    it). A generation_config passed to generate() with one is ignored the same way (the call gets a
    copy without it). One set on model.generation_config after compile() is refused: transformers
    fills every unset field of the call's config from it, so it cannot be ignored for one call."""
    if kwargs.get("cache_implementation") is not None:
        raise CompileError(f"kvcompile: generate(cache_implementation={kwargs['cache_implementation']!r}) asks "
                           "for another cache; a compiled model generates with its KVCompileCache (leave "
                           "cache_implementation unset)")
    own = getattr(model.generation_config, "cache_implementation", None)
    if own is not None:
        raise CompileError(f"kvcompile: model.generation_config.cache_implementation={own!r} was set after compile() "
                           "(compile() clears a checkpoint's, with a warning): a compiled model generates with its "
                           "KVCompileCache; set it to None")
    gen = kwargs.get("generation_config")
    if getattr(gen, "cache_implementation", None) is not None:
        _ignored_cache_implementation("generate(generation_config=...)", gen.cache_implementation, 5)
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
        out = forward(*args, **cache_arg.given(cache), **piece, **kwargs)
        logits.append(out.logits)
    out.logits = torch.cat(logits, dim=1)
    return out


def build_kernels(plan, group: int) -> None:
    """Build (or load from the disk cache) the C++ kernels of the backends `plan` holds, for `group`
    query heads per KV head, now: built on first use instead, a cold build (~1 s each) lands inside a
    generation, e.g. the paged kernel in the first decode step past the fused step's one-thread bound
    (it cost a side-by-side dbudgetkv row 40 % of its decode speed)."""
    if plan.device is None or plan.device.type != "cpu":
        return
    for backend in plan.backends:
        backend.build(group, plan.head_dim)


def _autocast_plan(plan):
    """The plan for a fresh cache made under torch.autocast: attend() runs the step in the autocast dtype
    (as the model's SDPA would), so the cache's backends are chosen for that dtype (`Plan.with_dtype`)."""
    if plan.device is None or not torch.is_autocast_enabled(plan.device.type):
        return plan
    return plan.with_dtype(torch.get_autocast_dtype(plan.device.type))


def _check_transformers() -> None:
    """CompileError when the installed transformers is outside the range kvcompile's metadata declares
    (pyproject's `transformers` requirement, the one place it is written): compile() relies on
    transformers' internals that are tested at both ends of that range (docs/INTERNALS.md "Supported
    transformers versions"). An environment with another transformers (vLLM's, docs/VLLM.md) installs
    kvcompile without its dependencies; its policies, plans and kernels run there, compile() does not."""
    from importlib import metadata

    import transformers
    from packaging.requirements import Requirement

    try:
        required = [Requirement(r) for r in metadata.requires("kvcompile") or ()]
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed: nothing declared
        return
    for requirement in required:
        if requirement.name == "transformers" and requirement.marker is None and \
                transformers.__version__ not in requirement.specifier:
            raise CompileError(f"kvcompile: compile() supports transformers {requirement.specifier}, and this "
                               f"environment has transformers {transformers.__version__}; install a supported "
                               f"version: pip install \"transformers{requirement.specifier}\" (from a source "
                               "checkout of kvcompile: pip install -e . in its own environment)")


def compile(model, spec, *, mode: str = "eager", page_size: int = 16, progress: bool = False,
            kernels: str | None = None, tokenizer=None, repeat_prompt=None, **overrides):
    """Return `model` with its attention rewritten to run `spec` (path, name, mapping or Policy).

    `model.generate(...)` and `model(...)` then use a fresh KVCompileCache per call unless
    one is passed. Errors (bad spec, unsupported model) are raised before anything changes.

    mode: "eager" (transformers' AttentionInterface routes to the kvcompile op),
    "compiled" (torch.compile with the kvcompile backend: FX passes rewrite the captured
    SDPA calls into the op, Inductor fuses the rest; see kvcompile.passes) or, on a CUDA device,
    "reduce-overhead" (the compiled entry, its decode steps replayed from CUDA graphs where the
    cache's step needs no host: kvcompile.graphs; refused, with the reason, where the plan's
    decode cannot be: kvcompile.graphs.refusal).
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
    if mode not in ("eager", "compiled", "reduce-overhead"):
        raise ValueError(f"kvcompile: mode must be 'eager', 'compiled' or 'reduce-overhead', got {mode!r}")
    traced = mode != "eager"  # the compiled entry (reduce-overhead: with its decode steps in CUDA graphs)
    _check_transformers()
    transformers_patches.check("generate", CompileError)  # the internals compile() touches, as checked
    if isinstance(spec, Policy) and not overrides:
        policy = spec
    else:
        from kvcompile.spec import load_spec

        policy = load_spec(spec, **overrides)
    _check_model(model)
    if traced and has_hooks(model):
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
                          page_size=page_size, compiled_entry=traced, shard=shard,
                          layer_devices=layer_devices, sinks=model_sinks(model))
    except (PlanError, ShardingError, DeviceError) as exc:
        raise CompileError(str(exc)) from None
    if traced and _nope_scaling(model.config):
        raise CompileError(f"kvcompile: mode={mode!r} traces the model over a stand-in cache that reports no past "
                           f"(one graph for every length), and model type {model.config.model_type!r} scales its NoPE "
                           "layers' queries by the cache's length (attn_temperature_tuning); compile with "
                           "mode='eager', which gives it the cache's length, or load it with "
                           "attn_temperature_tuning=False")
    if mode == "reduce-overhead":
        from kvcompile import graphs

        why = graphs.refusal(plan)
        if why is not None:
            raise CompileError(f"kvcompile: {why}")
    repeat = None
    if getattr(policy.scoring, "reconstructs", False):  # a second, model-level pass scores the prompt
        from kvcompile import kvzip

        kvzip.check(plan, "compiled" if traced else mode)
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
    if traced:
        from kvcompile.passes import compile_forward

        if plan.softcap is not None or plan.sinks is not None:  # no SDPA call to capture: kvcompile's call site
            from kvcompile.passes import site

            site.register()
            model.set_attn_implementation(site.NAME)
        else:
            model.set_attn_implementation("sdpa")
        forward = compile_forward(model, forward, kv_heads=len(plan.kv_heads),
                                  engine=None if plan.layer_kinds is None else plan.layer_kinds.engine)
    else:
        AttentionInterface.register("kvcompile", kvcompile_attention)
        AttentionMaskInterface.register("kvcompile", kvcompile_mask)
        model.set_attn_implementation("kvcompile")

    cache_implementation = getattr(model.generation_config, "cache_implementation", None)
    if cache_implementation is not None:  # a checkpoint's generation_config.json (GENERATE.md)
        _ignored_cache_implementation("the model's generation_config", cache_implementation, 3)
        saved["cache_implementation"] = cache_implementation
        model.generation_config.cache_implementation = None
    model.forward = Entry(model, "forward", forward, plan, progress, repeat)
    if mode == "reduce-overhead":
        from kvcompile.graphs import DecodeGraphs

        model.forward.graphs = DecodeGraphs()
    model.generate = Entry(model, "generate", generate, plan, progress, repeat)
    # continuous batching (generate_batch, transformers serve's engine) with kvcompile's caches: kvcompile.integrations.batching
    model.init_continuous_batching = functools.partial(_init_continuous_batching, model)
    model.kvcompile_policy = policy
    model.kvcompile_plan = plan
    setattr(model, _STATE, saved)
    return model


class Entry:
    """A compiled model's `forward` or `generate` (compile() sets them on the instance).

    Everything it uses is an attribute, the model and its wrapped method (bound to the model)
    included, never a closure: `copy.deepcopy(model)` gives the copy Entries bound to the copy,
    so the copy runs its own weights (the compiled entry's CompiledForward makes its
    torch.compile'd function again for the copy). The state of a call lives in the call (its
    cache, passed along), so calls on several threads do not share anything but the plan,
    which is immutable."""

    graphs = None  # the forward's decode steps in CUDA graphs (mode="reduce-overhead": kvcompile.graphs.DecodeGraphs)

    def __init__(self, model, kind: str, wrapped, plan, progress, repeat=None):
        self.model, self.kind, self.wrapped, self.plan, self.progress = model, kind, wrapped, plan, progress
        self.repeat = repeat  # a reconstruction scorer's repeat prompt (kvcompile.kvzip.RepeatPrompt), else None
        functools.update_wrapper(self, wrapped, updated=())  # generate() reads forward's signature

    def __call__(self, *args, **kwargs):
        run = _forward if self.kind == "forward" else _generate
        return run(self, *args, **kwargs)

    def new_cache(self, headroom: int = 0) -> KVCompileCache:
        return KVCompileCache.from_plan(_autocast_plan(self.plan).with_headroom(headroom), progress=self.progress)


def _check_cache(plan, cache, call: str) -> None:
    """A cache given to `call` must be a KVCompileCache made for this model: another transformers
    Cache (StaticCache, DynamicCache, ...) is refused, and so is a KVCompileCache of a model of
    other dimensions, before anything runs."""
    if cache is None:
        return
    if not isinstance(cache, KVCompileCache):
        raise CompileError(f"kvcompile: {call}(past_key_values={type(cache).__name__}) gives a cache that is not "
                           "kvcompile's; a compiled model stores only what its policy keeps, in its KVCompileCache: "
                           "pass none (a fresh one is made per call), the KVCompileCache a previous call returned, or "
                           "KVCompileCache.from_plan(model.kvcompile_plan); or call kvcompile.uncompile(model) to "
                           "use another cache")
    mine = cache.plan
    ours = (plan.num_layers, plan.num_heads, plan.head_dim, tuple(plan.kv_heads))
    theirs = (mine.num_layers, mine.num_heads, mine.head_dim, tuple(mine.kv_heads))
    if ours[:3] == theirs[:3] and ours[3] != theirs[3]:  # the same model, other heads: a tensor-parallel split
        raise CompileError(f"kvcompile: this model computes KV heads {list(ours[3])} of {plan.num_heads} but the "
                           f"KVCompileCache given to {call}() holds KV heads {list(theirs[3])} (another tensor-parallel "
                           "split: a sharded model needs its cache from kvcompile.compile(model, ...), or a plan built "
                           "with shard=kvcompile.sharding.model_shard(model))")
    if ours != theirs:
        def say(dims):
            return f"{dims[0]} layers, {dims[1]} KV heads of dim {dims[2]} (this process: KV heads {list(dims[3])})"

        raise CompileError(f"kvcompile: the KVCompileCache given to {call}() was made for a model with "
                           f"{say(theirs)}; this model has {say(ours)}: a cache holds one model's keys and "
                           "values (pass none, or one from KVCompileCache.from_plan(model.kvcompile_plan))")


def _needs_grad(model, kwargs) -> bool:
    if not torch.is_grad_enabled():
        return False
    embeds = kwargs.get("inputs_embeds")
    if embeds is not None and embeds.requires_grad:
        return True
    return any(p.requires_grad for p in model.parameters())


def _forward(entry: Entry, *args, use_cache=None, **kwargs):
    past_key_values = cache_arg.take(kwargs)
    if cache_arg.is_engine_cache(past_key_values):  # continuous batching's forward (kvcompile.integrations.batching)
        return entry.wrapped(*args, **cache_arg.given(past_key_values), use_cache=use_cache, **kwargs)
    model, plan, forward = entry.model, entry.plan, entry.wrapped
    config = model.config
    _refuse_outputs(kwargs, config)
    t = _length(args, kwargs)
    if not model.training:
        if past_key_values is not None and type(past_key_values) is not DynamicCache:  # a DynamicCache: the plain
            _check_cache(plan, past_key_values, "model")  # attention over its keys and values, exact
        elif past_key_values is not None and "chunked_attention" in (getattr(config, "layer_types", None) or ()):
            raise CompileError("kvcompile: model(past_key_values=DynamicCache) on a model with chunked_attention "
                               "layers: the attention does not see where the cache's held keys sit in the sequence, "
                               "which a chunk needs; pass none (a KVCompileCache is made) or call "
                               "kvcompile.uncompile(model) to use a DynamicCache")
        kvcompile_cache = isinstance(past_key_values, KVCompileCache) or (past_key_values is None
                                                                          and use_cache is not False)
        if plan.compiled_entry and kvcompile_cache and _needs_grad(model, kwargs):
            raise CompileError("kvcompile: a forward that needs gradients (grad mode on, parameters or "
                               "inputs_embeds requiring grad) on a model compiled with mode='compiled': its graphs "
                               "run without autograd; compile with mode='eager' (backward through the prompt's "
                               "attention is supported there), or call under torch.no_grad()")
    if t is not None:
        check_length(config, t + (past_key_values.get_seq_length() if past_key_values is not None else 0))
    if model.training:  # training computes no cache: the plain attention, differentiable
        if isinstance(past_key_values, KVCompileCache):
            raise CompileError("kvcompile: a KVCompileCache in training mode; call model.eval() to generate")
        return forward(*args, **cache_arg.given(past_key_values), use_cache=False, **kwargs)
    if past_key_values is None and use_cache is not False:
        past_key_values = entry.new_cache()
    if isinstance(past_key_values, KVCompileCache):
        fresh = not past_key_values.seq_length
        if fresh:
            check_left_padded(kwargs.get("attention_mask"))
            if not past_key_values.is_initialized:  # its prompt runs in the autocast dtype, if any
                past_key_values.bind(_autocast_plan(past_key_values.plan))
        kwargs["kvcompile_cache"] = past_key_values
        chunk = past_key_values.plan.prefill_chunk
        if entry.repeat is not None and past_key_values.reconstruction is None and (
                fresh or past_key_values.compressing is not None):  # a reconstruction scorer's prompt
            return _reconstructed_prompt(entry, forward, past_key_values, t, args, {**kwargs, "use_cache": use_cache})
        if fresh and chunk and t is not None and t > chunk and past_key_values.compressing is None:
            return _forward_in_chunks(forward, chunk, past_key_values, args, {**kwargs, "use_cache": use_cache})
        if entry.graphs is not None and not fresh:  # a decode step, from a CUDA graph where it needs no host
            out = entry.graphs(forward, past_key_values, args, {**kwargs, "use_cache": use_cache})
            if out is not None:
                return out
    return forward(*args, **cache_arg.given(past_key_values), use_cache=use_cache, **kwargs)


def _reconstructed_prompt(entry: Entry, forward, cache: KVCompileCache, t: int | None, args, kwargs):
    """A prompt call under a reconstruction scorer (scoring: kvzip, kvcompile.kvzip): the whole prompt in one
    pass where it is one chunk (or the policy does not chunk), else chunk by chunk (schedule.prefill: chunk):
    this call's chunk, or, for a fresh cache given the whole prompt, every chunk in turn."""
    from kvcompile import kvzip

    chunk, prompt = cache.plan.prefill_chunk, cache.compressing
    step = kvzip.chunk_forward(forward, entry.repeat)
    if cache.seq_length or (prompt is not None and prompt.length != t):  # the next chunk of the prompt
        return step(*args, **cache_arg.given(cache), **kwargs)
    if not chunk or t is None or t <= chunk:  # the whole prompt, one chunk: one-pass KVzip exactly
        return kvzip.prefill(forward, cache, entry.repeat, args, kwargs)
    return _forward_in_chunks(step, chunk, cache, args, kwargs)  # the whole prompt, chunk after chunk


def _total_length(t: int, kwargs: dict, gen) -> int:
    """The longest sequence generate() may reach: prompt + max_new_tokens where that is given (argument,
    then generation_config), else max_length (argument, then generation_config), as transformers decides."""
    new = kwargs.get("max_new_tokens", getattr(gen, "max_new_tokens", None))
    if new is not None:
        return t + new
    length = kwargs.get("max_length", getattr(gen, "max_length", None))
    return max(t, length) if length is not None else t


def _check_rows(cache, args, kwargs: dict, gen) -> None:
    """generate() expands every input row into max(num_beams, num_return_sequences) rows before the prompt
    runs, but not the rows of a cache it is given: a cache that already holds a sequence (a turn continued, a
    compressed context) must hold the rows the call runs. Refused up front otherwise (the page store would
    fail mid-generation)."""
    if not isinstance(cache, KVCompileCache) or not cache.seq_length or cache.prompt_lengths is None:
        return
    tokens = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs", kwargs.get("inputs_embeds")))
    if tokens is None or tokens.dim() < 2:
        return
    beams = kwargs.get("num_beams", getattr(gen, "num_beams", 1)) or 1
    sequences = kwargs.get("num_return_sequences", getattr(gen, "num_return_sequences", 1)) or 1
    rows, held = tokens.shape[0] * max(beams, sequences), cache.prompt_lengths.shape[0]
    if rows != held:
        asked = ", ".join(f"{name}={value}" for name, value in (("num_beams", beams),
                                                                 ("num_return_sequences", sequences)) if value > 1)
        raise CompileError(f"kvcompile: generate({asked}) runs {rows} rows from {tokens.shape[0]} input rows, and "
                           f"the cache it continues (a compressed context, an earlier call's cache) holds {held}: "
                           "generate() expands its inputs for beams and returned sequences, not a cache that "
                           "already holds a sequence. Continue such a cache one row per sequence (greedy or "
                           "sampling, without num_beams / num_return_sequences), or start from a fresh cache")


def _generate(entry: Entry, *args, **kwargs):
    past_key_values = cache_arg.take(kwargs)
    model, plan, generate = entry.model, entry.plan, entry.wrapped
    config = model.config
    gen = kwargs.get("generation_config") or model.generation_config
    _refuse_outputs(kwargs, gen)
    kwargs = _no_cache_implementation(kwargs, model)
    _check_cache(plan, past_key_values, "generate")
    _check_rows(past_key_values, args, kwargs, gen)
    assisted = kwargs.get("assistant_model") is not None or bool(
        kwargs.get("prompt_lookup_num_tokens", getattr(gen, "prompt_lookup_num_tokens", None)))
    if assisted:
        _check_crop(plan)
        if isinstance(past_key_values, KVCompileCache) and past_key_values.seq_length:
            raise CompileError("kvcompile: assisted / prompt-lookup decoding on a cache that already holds a "
                               "sequence (a turn continued, a compressed context) is not exact: the candidate "
                               "tokens go with the new tokens into a compressed cache, and the tokens differ from "
                               "the same call without them; generate without an assistant there (a fresh prompt "
                               "takes one)")
    if entry.repeat is not None and (assisted or not plan.prefill_chunk and kwargs.get(
            "prefill_chunk_size", getattr(gen, "prefill_chunk_size", None))):
        raise CompileError(f"kvcompile: {plan.policy.name} scores its prompt by reconstruction once the whole "
                           "prompt has run in one forward (or, with schedule: {prefill: {chunk: c}}, once each chunk "
                           "has); generate without an assistant, and without prefill_chunk_size unless the policy "
                           "chunks its prefill")
    uses_cache = kwargs.get("use_cache", getattr(gen, "use_cache", True)) is not False
    t = _length(args, kwargs)
    fresh = past_key_values is None or not past_key_values.seq_length
    past = 0 if past_key_values is None else past_key_values.seq_length
    if t is not None:  # every length limit, before the prompt runs
        check_length(config, _total_length(t, kwargs, gen) if fresh else max(t, past) + (
            kwargs.get("max_new_tokens") or getattr(gen, "max_new_tokens", None) or 0))
    if fresh and uses_cache:
        check_left_padded(kwargs.get("attention_mask"))
    headroom = (_total_length(t, kwargs, gen) - t) if t is not None else (
        kwargs.get("max_new_tokens") or getattr(gen, "max_new_tokens", None) or 0)
    if past_key_values is None and uses_cache:
        past_key_values = entry.new_cache(headroom)
    elif (isinstance(past_key_values, KVCompileCache) and not past_key_values.is_initialized
          and not past_key_values.headroom):  # a fresh cache of the caller's: spares for what generate() adds
        past_key_values.bind(_autocast_plan(past_key_values.plan).with_headroom(headroom))
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
    return generate(*args, **cache_arg.given(past_key_values), **kwargs)


def _init_continuous_batching(model, *args, **kwargs):
    if "chunked_attention" in (getattr(model.config, "layer_types", None) or ()):
        raise CompileError(f"kvcompile: continuous batching (generate_batch, the server) does not run model type "
                           f"{model.config.model_type!r}'s chunked_attention layers: transformers' paged engine has "
                           "no chunked layer (its cache groups full and sliding layers only); use generate()")
    try:
        from kvcompile.integrations.batching import init_continuous_batching
    except ImportError as exc:  # the engine's internals kvcompile.integrations.batching builds on (pyproject's transformers range)
        import transformers

        raise CompileError(f"kvcompile: continuous batching needs the engine of a transformers version kvcompile "
                           f"supports (pyproject.toml's range; generation/continuous_batching); transformers "
                           f"{transformers.__version__} lacks what kvcompile.integrations.batching uses: {exc}") from None

    return init_continuous_batching(model, *args, **kwargs)


def uncompile(model):
    """Undo `compile`: the model's own forward, generate and attention come back."""
    saved = getattr(model, _STATE, None)
    if saved is None:
        return model
    if hasattr(getattr(model, "_cached_continuous_batching_manager", None), "kvcompile_plan"):
        model.destroy_cached_continuous_batching_manager()  # a kept kvcompile.integrations.batching manager
    for name in ("forward", "generate", "init_continuous_batching", "kvcompile_policy", "kvcompile_plan"):
        model.__dict__.pop(name, None)
    model.__dict__.update(saved.get("instance", {}))
    if saved.get("cache_implementation") is not None:
        model.generation_config.cache_implementation = saved["cache_implementation"]
    model.set_attn_implementation(saved["attn"] or "sdpa")
    delattr(model, _STATE)
    return model


_COMPILED = ("forward", "generate", "init_continuous_batching", "kvcompile_policy", "kvcompile_plan", _STATE)


@contextmanager
def compiled(model, spec, **kwargs):
    """`with kvcompile.compiled(model, "lava"): ...` compiles for the block only. After it the model is as it was
    before: plain, or compiled with its own policy (its very entries, plan and attention come back; a
    continuous-batching engine cached on it is stopped, as compile() stops it)."""
    before = None
    if hasattr(model, _STATE):  # compiled by its user: what uncompile() takes off, put back after the block
        before = ({name: model.__dict__[name] for name in _COMPILED if name in model.__dict__},
                  model.config._attn_implementation, getattr(model.generation_config, "cache_implementation", None))
    compile(model, spec, **kwargs)
    try:
        yield model
    finally:
        uncompile(model)
        if before is not None:
            model.__dict__.update(before[0])
            model.set_attn_implementation(before[1])
            model.generation_config.cache_implementation = before[2]
