"""The one op: `torch.ops.kvcompile.attend(q, k, v, mask, layer, cache, token, scale)`, and transformers' attention
and mask interfaces that call it.

The op runs one layer's step on its cache: the prompt (engine.prefill: in one call, or in calls the cache
was told to expect; engine.chunked: in chunks the policy compresses after each), a decode step (`decode`,
here: the plan's decode step backend on the layer's store; entering decoding and its pruning: engine.decode),
or a reconstruction scorer's forwards (engine.reconstruction). Every choice (which scorer,
selection, merge and decode kernels, what decoding does, spare pages) was made by the plan
(kvcompile.plan) the cache carries: the engine reads it.

The op is an opaque `torch.library.custom_op` with a fake implementation, so compiled graphs treat it
as one call and do not recompile as the cache grows.
"""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from kvcompile.cache import KVCompileCache
from kvcompile.cache_ref import CacheRef
from kvcompile.engine.chunked import chunked_prefill
from kvcompile.engine.decode import after_token, begin_decoding
from kvcompile.engine.prefill import prefill, prompt_attention, prompt_chunk
from kvcompile.engine.reconstruction import reconstruction_step
from kvcompile.engine.state import Phase
from kvcompile.engine.window import chunked_span, left_pads, window_attention


@torch.library.custom_op("kvcompile::attend", mutates_args=("token",))
def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int, cache: CacheRef, token: Tensor,
           scale: float) -> Tensor:
    """Prefill attention + scoring + compression, or decode append + paged attention.

    q (B, Hq, T, d), k/v (B, H, T, d): the layer's new queries, keys, values after RoPE;
    mask (B, ≥T) bool padding mask (True = real token) or None; `cache` and `token`: the
    KVCompileCache's `ref` and `token` (kvcompile.cache_ref). Returns (B, Hq, T, d).
    """
    token.add_(1)  # the declared write (see below the op)
    return run_layer(q, k, v, mask, layer, cache.cache, scale)


def run_layer(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int, cache: KVCompileCache,
              scale: float) -> Tensor:
    """The op's body on `cache` itself: what `kvcompile.attend` computes (the eager entry calls it directly
    where nothing traces and no gradient is asked for: the dispatcher's bookkeeping of an op that declares
    a write costs about 25 µs a call, 30 calls a generated token on SmolLM2)."""
    if k.shape[1] != len(cache.plan.kv_heads):
        if cache.plan.shard is None and k.shape[1] > len(cache.plan.kv_heads):
            cause = "the cache was made for a model with fewer KV heads (make it from this model)"
        else:
            cause = ("the cache was made for another model, or for another tensor-parallel split (a sharded model "
                     "needs its cache from kvcompile.compile(model, ...), or a plan built with "
                     "shard=kvcompile.sharding.model_shard(model))")
        raise RuntimeError(f"kvcompile: layer {layer} computes {k.shape[1]} KV heads but the cache's plan holds "
                           f"{len(cache.plan.kv_heads)}: {cause}")
    devices = cache.plan.layer_devices  # where each layer runs (Plan.layer_device), read here on every call
    expected = cache.plan.device if devices is None else devices[layer]
    if (layer or cache.stores[0] is not None) and expected is not None and q.device != expected:
        raise RuntimeError(  # compile() (or layer 0's first prompt) fixed where each layer runs: kvcompile.devices
            f"kvcompile: layer {layer} runs on {q.device} but its pages live on {expected}: the cache's plan puts "
            "every layer where it was told (kvcompile.compile() reads each layer's device off the model; a cache "
            "built from a policy and a config alone puts them all where layer 0's first prompt runs). Compile the "
            "model again after moving it, and give a model whose layers run on several devices the cache its "
            "generate() makes, or KVCompileCache.from_plan(model.kvcompile_plan)")
    if cache.plan.layer_devices is not None:  # layers on several devices: the state every layer reads, here
        cache.state_to(q.device)
    # Triton launches on the current CUDA device: the layer's (a pipeline's layers run on several GPUs)
    with torch.cuda.device(q.device) if q.device.type == "cuda" else contextlib.nullcontext():
        out = _in_autocast_dtype(lambda q, k, v: _attend(cache, q, k, v, mask, layer, scale), q, k, v)
    if layer == cache.num_layers - 1 and not (cache.reconstruction is not None and cache.reconstruction.scoring):
        cache.advance(q.shape[2])  # (a reconstruction forward adds nothing to the cache)
    return (out if out.dtype == q.dtype else out.to(q.dtype)).contiguous()


def _in_autocast_dtype(step, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """`step(q, k, v)` as the model's SDPA runs under torch.autocast: q, k, v in the autocast dtype, autocast off,
    the output back in q's dtype (see _attend); as it is where autocast is off."""
    if not torch.is_autocast_enabled(q.device.type):
        return step(q, k, v)
    low = torch.get_autocast_dtype(q.device.type)
    with torch.autocast(q.device.type, enabled=False):
        return step(q.to(low), k.to(low), v.to(low)).to(q.dtype)


def _attend(cache: KVCompileCache, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int,
            scale: float) -> Tensor:
    """attend()'s step on the layer's device: the prompt (in one call, in calls, or in chunks the policy
    compresses after each) or decode.

    Under torch.autocast, attend() gets q and k in float32 (RoPE's float32 cos and sin promote them)
    and v in the autocast dtype; the model's own SDPA would cast all three to the autocast dtype,
    and so does attend(): q, k, v in that dtype, then this step with autocast off (the plan's
    caches compile()'s entry makes are planned for that dtype, `Plan.with_dtype`, and the pages hold
    it), and the output back in q's dtype (the o_proj that follows casts it to the autocast dtype
    again, without loss)."""
    if cache.reconstruction is not None:  # a reconstruction scorer's prompt or reconstruction pass (kvcompile.kvzip)
        return reconstruction_step(cache, q, k, v, mask, layer, scale)
    if cache.plan.prefill_chunk and (cache.stores[layer] is None or cache.compressing is not None):
        out = chunked_prefill(cache, q, k, v, mask, layer, scale)
    elif cache.stores[layer] is None:
        chunks = cache.chunks
        if chunks is None:
            out = prefill(cache, q, k, v, mask, layer, scale)
        elif cache.seq_length + q.shape[2] <= chunks.length:
            out = prompt_chunk(cache, q, k, v, mask, layer, scale)
        else:  # the prompt ends inside this call (assisted decoding sends it with candidate tokens)
            end = chunks.length
            cut = end - cache.seq_length
            head = prompt_chunk(cache, q[:, :, :cut], k[:, :, :cut], v[:, :, :cut],
                                None if mask is None else mask[:, :end], layer, scale)
            tail = decode(cache, q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], layer, scale, start=end)
            out = torch.cat([head, tail], dim=2)
    else:
        if not torch.is_inference_mode_enabled():
            cache.stores[layer].writable()  # a cache made under inference_mode, used outside it
        out = decode(cache, q, k, v, layer, scale)
    return out


def decode(cache: KVCompileCache, q: Tensor, k: Tensor, v: Tensor, layer: int, scale: float,
           start: int | None = None) -> Tensor:
    """Append T new tokens and attend over the pages (new token t sees entries up to itself): per token, room where
    a head's pages are full (the append's named host read), one call of the plan's decode step backend (append,
    attention, running scores, online eviction: kvcompile.kernels.online_step), then `decode: every` pruning
    (engine.decode.after_token). `start`: the sequence index of the first new token (default: the cache's length)."""
    plan = cache.plan
    given, start = start is not None, cache.seq_length if start is None else start
    online, every = plan.online_eviction, plan.prune_every
    if cache.phase is Phase.COMPRESSED:
        begin_decoding(cache)
    elif cache.phase is Phase.EMPTY:
        raise RuntimeError("kvcompile: a decode step on an empty cache: its prompt runs first")
    elif cache.phase is Phase.PROMPT and (online or every):  # tokens after a prompt that ends inside this call
        raise RuntimeError("kvcompile: the decode schedule needs every layer compressed before tokens follow "
                           "the prompt in the same call")
    pad = cache.prompt.pad if cache.decoding is None else cache.decoding.pad
    # the first new token's logical position among real tokens (B,): from the device's count of the cache's
    # length once decoding (a step replayed from a captured graph reads it), else from the host's
    first = (start if given or cache.decoding is None else cache.decoding.length) - pad
    split = cache.decoding.split[:, layer] if online else None
    outs = []
    for i in range(q.shape[2]):
        store, position = cache.stores[layer], first + i if i else first
        if store.room <= 0:  # a head's pages are full: it takes its next run (Plan.host_syncs), counted
            cache.count_host_sync("append")
            store.make_room(plan.spare_pages)
        outs.append(plan.decode_step(plan, store, layer, q[:, :, i], k[:, :, i], v[:, :, i], position, split, scale))
        if every:  # the host's count of generated tokens: pruning is a named exception (Plan.host_syncs)
            after_token(cache, layer, q, i, start - cache.prompt.width + i + 1, position + 1, scale)
    out = outs[0].unsqueeze(2) if len(outs) == 1 else torch.stack(outs, dim=2)  # (one token: no copy)
    return out if out.dtype == q.dtype else out.to(q.dtype)


@attend.register_fake
def _(q, k, v, mask, layer, cache, token, scale):
    return q.new_empty(q.shape)


@torch.library.custom_op("kvcompile::attend_window", mutates_args=("token",))
def attend_window(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int, cache: CacheRef, token: Tensor,
                  scale: float) -> Tensor:
    """A hybrid model's local layer left to its window (model layer `layer`: KVCompileCache.attend_window), what
    the compiled entry's graphs call where the model's own sliding-window attention was (passes.rewrite); the
    arguments and the declared write are `attend`'s."""
    token.add_(1)
    return _local(cache.cache, layer, q, k, v, mask, scale).contiguous()


@attend_window.register_fake
def _(q, k, v, mask, layer, cache, token, scale):
    return q.new_empty(q.shape)


def _plain_prompt(cache: KVCompileCache, q: Tensor, k: Tensor, layer: int) -> bool:
    """attend() just ran the plain prompt path at `layer`: a fresh cache's prompt in one call, whose
    output is the model's causal attention over the prompt (`prefill`; the first chunk of a prompt
    compressed chunk by chunk is the same attention). Read after the call, from the cache's state."""
    prompt, n = cache.prompt, k.shape[2]
    last = layer == cache.plan.num_layers - 1
    return (prompt is not None and cache.decoding is None and cache.chunks is None and prompt.width == n
            and q.shape[2] == n and cache.seq_length == (n if last else 0))


def _setup_backward(ctx, inputs, output):
    q, k, v, mask, layer, ref, token, scale = inputs
    cache = ref.cache
    ctx.plain = _plain_prompt(cache, q, k, layer)
    ctx.scale, ctx.softcap, ctx.sinks = scale, cache.plan.softcap, cache.plan.sinks is not None
    valid = cache.prompt.valid if ctx.plain else None
    ctx.save_for_backward(q, k, v, None if valid is None or bool(valid.all()) else valid)


def _backward(ctx, grad):
    """Backward through a prompt's attention (saliency maps, gradients of the prompt's logits): the
    prompt path's output is the model's causal attention over the prompt (`prompt_attention`), so its
    gradient is that attention's, recomputed here. The compression does not change the prompt's
    outputs, and nothing else is differentiable: a decode step or a prompt continued in later calls
    attends to what the policy kept (selection is not differentiable), refused with the reason."""
    if ctx.sinks:
        raise RuntimeError("kvcompile: backward through kvcompile.attend on a model with learned attention sinks is "
                           "not supported (the sinks' own gradient); train with model.train(), which runs the plain "
                           "attention without a cache")
    if not ctx.plain:
        raise RuntimeError("kvcompile: backward through kvcompile.attend is defined for a prompt's attention only "
                           "(a fresh cache, the prompt in one forward call); this call decoded or continued a "
                           "cache, whose attention reads the entries the policy selected (not differentiable): "
                           "run it under torch.no_grad(), or differentiate the prompt's forward call")
    q, k, v, valid = ctx.saved_tensors
    with torch.enable_grad():
        inputs = [x.detach().requires_grad_() for x in (q, k, v)]
        out = prompt_attention(*inputs, valid, ctx.scale, softcap=ctx.softcap)
        grads = torch.autograd.grad(out, inputs, grad.to(out.dtype), allow_unused=True)
    return (*(None if g is None else g.to(x.dtype) for g, x in zip(grads, (q, k, v))), None, None, None, None, None)


class _Attend(torch.autograd.Function):
    """The op with the gradient of a prompt's attention (`_setup_backward`, `_backward`), which the eager
    entry calls where grad mode is on. torch.library refuses an autograd formula on an op whose schema
    declares a write (`attend.register_autograd`: "non-functional operator"), so the formula sits in this
    Function around the op; the write is the token's (never differentiable), and the op runs below it as
    in any call."""

    @staticmethod
    def forward(q, k, v, mask, layer, cache, token, scale):
        return torch.ops.kvcompile.attend(q, k, v, mask, layer, cache, token, scale)

    setup_context = staticmethod(_setup_backward)
    backward = staticmethod(_backward)


# What the op mutates: the cache its `cache` argument names (pages, lengths, scores; a CacheRef, opaque to
# torch), which no schema can name. The schema declares it as a write of that cache's `token` ((1,) int64,
# `mutates_args=("token",)`; the op bumps it): functionalization and Inductor see every call as a write
# of its cache's state, and all calls of a graph write the same token, so none is reordered, merged or
# dropped, whatever data flows between them (tests/test_isolation.py). q, k, v, mask: not written. No
# effect token: an ordered effect (`attend.register_effect`) would thread one through the graph, and torch
# 2.13's Inductor does not cache graphs holding its `with_effects` operator, so every process would compile
# the model again; the token is an ordinary graph input, which the FX graph cache takes (tests/
# test_compiled.py's warm start; docs/INTERNALS.md "The op and its two entries").


# --- transformers' attention and mask interfaces ------------------------------------------

def kvcompile_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers AttentionInterface entry: `torch.ops.kvcompile.attend` (its body, `run_layer`, where
    nothing traces and no gradient is asked for)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cache = kwargs.get("kvcompile_cache")
    mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    layer = module.layer_idx
    kinds = None if cache is None else cache.plan.layer_kinds
    if cache is None:  # no KVCompileCache (use_cache=False or another cache): plain attention
        offset = key.shape[2] - query.shape[2]
        window = kwargs.get("sliding_window")  # a hybrid model's local layer: its window (Gemma 3)
        chunk = chunked_span(module)  # or its chunk (Llama 4)
        softcap = kwargs.get("softcap")  # the model's logit soft-cap (Gemma 2)
        sinks = kwargs.get("s_aux")  # the layer's learned sinks (gpt-oss)
        if window or chunk:
            valid = mask[:, -key.shape[2]:].bool() if mask is not None else \
                torch.ones(key.shape[0], key.shape[2], dtype=torch.bool, device=key.device)
            start = None  # chunked: key 0's real position (the mask covers every position; no mask: no cache)
            if chunk:
                start = -left_pads(valid) if mask is None else mask.shape[1] - key.shape[2] - left_pads(mask.bool())
            out = window_attention(query, key, value, valid, scale, chunk or window, offset, softcap, sinks, start)
        else:
            out = prompt_attention(query, key, value, mask, scale, offset, softcap, sinks)
    elif kwargs.get("s_aux") is not None and cache.plan.sinks is None:
        raise RuntimeError("kvcompile: this model has learned attention sinks (self_attn.sinks) and the cache's plan "
                           "has none: a cache for it comes from kvcompile.compile(model, ...) (its generate() and "
                           "forward make one, or KVCompileCache.from_plan(model.kvcompile_plan)), which reads them")
    elif kinds is not None and kinds.windows[layer] is not None:  # a local layer, left to its window
        out = _local(cache, layer, query, key, value, mask, scale)
    else:
        if kinds is not None:  # a hybrid model: the layer's number among those the policy compresses
            layer = kinds.engine[layer]
        args = (query, key, value, mask, layer, cache.ref, cache.token, scale)
        if torch.is_grad_enabled():  # the op, with the prompt's gradient
            out = _Attend.apply(*args)
        elif torch.compiler.is_compiling():  # traced by a torch.compile around the eager entry: the op
            out = torch.ops.kvcompile.attend(*args)
        else:  # the op's body, without the dispatcher in between (run_layer); the same declared write
            cache.token.add_(1)
            out = run_layer(query, key, value, mask, layer, cache, scale)
    return out.transpose(1, 2).contiguous(), None


def _local(cache: KVCompileCache, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
           scale: float) -> Tensor:
    """A hybrid model's local layer left to its window (KVCompileCache.attend_window), in the autocast dtype
    where autocast is on, as the model's SDPA runs it (see _attend)."""
    return _in_autocast_dtype(lambda q, k, v: cache.attend_window(layer, q, k, v, mask, scale), q, k, v)


def kvcompile_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, **kwargs):
    """transformers AttentionMaskInterface entry: the op takes the 2-D padding mask as is
    (True = real token); None when nothing is padded."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask.bool()

