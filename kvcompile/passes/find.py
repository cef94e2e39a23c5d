"""Pass 1: find the attention calls of a captured graph and the decoder layer of each.

Attention appears as scaled_dot_product_attention in one of several forms, depending on
where the graph was captured (docs/INTERNALS.md "The op and its two entries"): the Python function
(`F.scaled_dot_product_attention`, which is `torch._C._nn.scaled_dot_product_attention`)
in dynamo's torch-level graphs, `aten.scaled_dot_product_attention` in pre-dispatch
graphs, and the `aten._scaled_dot_product_*_attention*` kernels (which return a tuple
whose item 0 is the output) once the composite op is decomposed. A model that transformers runs
without SDPA (soft-capped logits, learned sinks) is traced with kvcompile's own call site instead,
`kvcompile.attention_site(q, k, v, mask, layer, scale)` (passes.site), found here the same way.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

import kvcompile.passes.site  # noqa: F401  (registers torch.ops.kvcompile.attention_site)

aten = torch.ops.aten


class PassError(RuntimeError):
    """A graph the kvcompile passes cannot rewrite; running it as is would skip the policy."""


# Argument names of each form, in positional order (schema order for the aten ops).
_FUNCTIONAL_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

SDPA_FUNCTIONS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}
SDPA_COMPOSITE = {aten.scaled_dot_product_attention, aten.scaled_dot_product_attention.default}
# Kernel variants: they return (output, logsumexp, ...).
SDPA_KERNELS = {
    getattr(aten, name).default
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable")
    if hasattr(aten, name)
}

SITES = {torch.ops.kvcompile.attention_site, torch.ops.kvcompile.attention_site.default}
_SITE_ARGS = ("query", "key", "value", "attn_mask", "layer", "scale")

_LAYER = re.compile(r"layers(?:\.|\[|_)(\d+)")


def is_sdpa(node: Node) -> bool:
    """An attention call the passes rewrite: an SDPA form, or kvcompile's call site (module doc)."""
    return node.op == "call_function" and (
        node.target in SDPA_FUNCTIONS or node.target in SDPA_COMPOSITE or node.target in SDPA_KERNELS or
        node.target in SITES)


def returns_tuple(node: Node) -> bool:
    """The kernel variants return a tuple; the functional and composite forms a tensor."""
    return node.target in SDPA_KERNELS


def sdpa_arguments(node: Node) -> dict:
    """The call's arguments by name: query, key, value, attn_mask (None if absent), scale
    (None = d**-0.5), dropout_p, is_causal, enable_gqa. `attn_bias` (efficient kernel) is
    reported as attn_mask."""
    target = node.target
    if target in SITES:  # causal by definition: the model's own (causal, or a local layer's window) attention
        bound = dict(zip(_SITE_ARGS, node.args))
        bound.update(node.kwargs, dropout_p=0.0, is_causal=True, enable_gqa=True)
        return bound
    if target in SDPA_FUNCTIONS:
        names = _FUNCTIONAL_ARGS
    else:
        if isinstance(target, torch._ops.OpOverloadPacket):
            target = target.default
        names = tuple(a.name for a in target._schema.arguments)
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    if "attn_bias" in bound:
        bound["attn_mask"] = bound.pop("attn_bias")
    for name, default in (("attn_mask", None), ("scale", None), ("dropout_p", 0.0), ("is_causal", False),
                          ("enable_gqa", False)):
        bound.setdefault(name, default)
    return bound


def layer_of(node: Node) -> int:
    """The decoder layer index N from the innermost `layers.N` / `layers[N]` entry of
    `node.meta["nn_module_stack"]` (dynamo writes paths like "L['self'].model.layers.3")."""
    if node.target in SITES:  # the call site names its layer (module.layer_idx)
        return int(sdpa_arguments(node)["layer"])
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        found = _LAYER.findall(str(path))
        if found:
            return int(found[-1])
    raise PassError(f"kvcompile: cannot tell which decoder layer attention node {node.name!r} belongs to: "
                    f"no 'layers.N' entry in its nn_module_stack {list(stack.values())!r}")


def find_attention(gm: GraphModule) -> list[tuple[Node, int]]:
    """Every scaled_dot_product_attention call of `gm` with its layer index, in graph order.

    Raises PassError when there is none (the model would run uncompressed) or when two
    calls claim the same layer (each layer has one cache slot).
    """
    found = [(node, layer_of(node)) for node in gm.graph.nodes if is_sdpa(node)]
    if not found:
        raise PassError("kvcompile: no attention found: the model would run uncompressed "
                        "(expected scaled_dot_product_attention calls; load the model with "
                        "attn_implementation='sdpa')")
    seen: dict[int, str] = {}
    for node, layer in found:
        if layer in seen:
            raise PassError(f"kvcompile: two attention calls in layer {layer} ({seen[layer]!r} and "
                            f"{node.name!r}); only one self-attention per layer is supported")
        seen[layer] = node.name
    return found
