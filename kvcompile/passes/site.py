"""The compiled entry's attention call on a model that transformers runs without SDPA.

Gemma 2 soft-caps its attention logits (cap·tanh(s/cap)) and gpt-oss adds a learned sink per query head to
the softmax's denominator; SDPA has a parameter for neither, so transformers runs both in its eager attention
(matmul, tanh or a concatenated sink column, softmax, matmul), which holds no call the passes could rewrite as
such. Their compiled entry therefore traces the model through an attention function of kvcompile's own
(`site_attention`, registered in transformers' AttentionInterface as NAME): under torch.compile it records
one opaque call per layer, `kvcompile.attention_site(q, k, v, mask, layer, scale)` — the layer's new queries,
keys and values after RoPE (before any GQA expansion), the 2-D padding mask (`site_mask`) and the module's
scaling — which the passes find (`passes.find`) and rewrite into `kvcompile.attend` / `attend_window` as they
do an SDPA call. The cap and the sinks are not in the graph: the op reads them from the cache's plan
(`Plan.softcap` from the config's attn_logit_softcapping, `Plan.sinks` read off the model by compile()), as
the eager entry's op does, so the compiled and the eager entry run the same attention code on the same data.

The call site is a placeholder: run as is (a graph the passes did not rewrite, e.g. a torch.compile of the
model outside kvcompile's entry) it raises. Outside tracing, `site_attention` is the eager entry's attention
function without a cache (`engine.op.kvcompile_attention`: the plain attention with the cap, the sinks and a
local layer's window), which is what the compiled entry runs for a call without a KVCompileCache.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kvcompile.engine.op import kvcompile_attention, kvcompile_mask

NAME = "kvcompile_site"  # the attention (and mask) implementation the compiled entry sets on such a model


@torch.library.custom_op("kvcompile::attention_site", mutates_args=())
def attention_site(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, layer: int, scale: float) -> Tensor:
    """Layer `layer`'s attention in a traced graph, for the passes to rewrite (module doc); never run."""
    raise RuntimeError("kvcompile: kvcompile.attention_site is the compiled entry's placeholder for a layer's "
                       "attention, which kvcompile's passes rewrite into kvcompile.attend; this graph was not "
                       "rewritten (compile the model with kvcompile.compile(model, spec, mode='compiled'))")


@attention_site.register_fake
def _(q, k, v, mask, layer, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def site_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers AttentionInterface entry (NAME): the call site under torch.compile, else the plain attention
    (module doc)."""
    if not torch.compiler.is_compiling():
        return kvcompile_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if dropout:
        raise RuntimeError(f"kvcompile: the compiled entry traced attention with dropout {dropout} (a model in "
                           "training mode); call model.eval()")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.kvcompile.attention_site(query, key, value, attention_mask, module.layer_idx, float(scale))
    return out.transpose(1, 2).contiguous(), None


def site_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
              **kwargs):
    """transformers AttentionMaskInterface entry (NAME): under torch.compile the 2-D padding mask as it came in
    (bool, True = real token), which the rewrite hands to the op; else the eager entry's (`kvcompile_mask`)."""
    if not torch.compiler.is_compiling():
        return kvcompile_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                              **kwargs)
    return attention_mask


def register() -> None:
    """Register NAME in transformers' attention and mask interfaces (compile() calls it before setting it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, site_attention)
    AttentionMaskInterface.register(NAME, site_mask)
