"""Pass 2: rewrite each attention call into `torch.ops.kvcompile.attend` bound to its layer and
to the call's cache.

The op takes the layer's NEW keys and values with H KV heads (it stores them in the
paged cache itself), so the GQA expansion transformers puts in front of SDPA when it
does not pass `enable_gqa` — `repeat_kv`: `k[:, :, None].expand(B, H, G, T, d)
.reshape(B, H·G, T, d)` — is followed back to the un-repeated tensor, and so is a
cache concatenation `cat([past, new], dim=-2)` (a DynamicCache). The op also takes the
2-D padding mask (B, ≥T) the model received, not the 4-D mask built from it, and the
scale SDPA was given (d**-0.5 when none).

The cache reaches the op through two graph inputs, the cache's `ref` (an opaque CacheRef) and
its `token` (kvcompile.cache_ref): in a graph of the compiled entry they are the arguments of its
`kvcompile.cache_input(ref, token)` marker, which the rewrite erases; a graph traced without the
entry's wrapper (hand-built graphs) gets them as two new inputs after its own.

Shapes come from the nodes' fake values (`meta["val"]` / `meta["example_value"]`, or
ShapeProp's `meta["tensor_meta"]`), which dynamo and make_fx graphs carry; run
`FakeTensorProp` on a graph built by `symbolic_trace` first.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

import kvcompile.cache_ref  # noqa: F401  (registers torch.ops.kvcompile.cache_input)
import kvcompile.engine.op  # noqa: F401  (registers torch.ops.kvcompile.attend)
from kvcompile.passes.find import PassError, returns_tuple, sdpa_arguments

aten = torch.ops.aten
ATTEND = torch.ops.kvcompile.attend.default
ATTEND_WINDOW = torch.ops.kvcompile.attend_window.default  # a hybrid model's local layer, left to its window
CACHE_INPUT = {torch.ops.kvcompile.cache_input, torch.ops.kvcompile.cache_input.default}  # dynamo records the packet

_RESHAPE_METHODS = {"reshape", "view"}
_RESHAPE_FUNCTIONS = {torch.reshape, aten.reshape.default, aten.view.default, aten._unsafe_view.default}
_UNSQUEEZE_FUNCTIONS = {torch.unsqueeze, aten.unsqueeze.default}
_REPEAT_FUNCTIONS = {torch.repeat_interleave, aten.repeat_interleave.self_int}
_CAT_FUNCTIONS = {torch.cat, torch.concat, aten.cat.default}
# Ops that change nothing when their output has the input's shape and dtype.
_SAME_METHODS = {"contiguous", "clone", "to", "float", "detach", "view", "reshape", "expand", "__getitem__"}
_SAME_FUNCTIONS = {torch.clone, operator.getitem, aten.clone.default, aten.alias.default, aten.slice.Tensor,
                   aten._to_copy.default, aten.detach.default, aten.view.default, aten.reshape.default,
                   aten._unsafe_view.default, aten.expand.default}


# --- shapes from node metadata ------------------------------------------------------------

def meta_value(node):
    for key in ("val", "example_value"):
        if node.meta.get(key) is not None:
            return node.meta[key]
    return node.meta.get("tensor_meta")


def shape(node) -> tuple | None:
    value = meta_value(node) if isinstance(node, Node) else None
    return tuple(value.shape) if hasattr(value, "shape") else None


def _dtype(node):
    return getattr(meta_value(node), "dtype", None)


def _same(a, b) -> bool:
    """Statically equal sizes (symbolic sizes compared without adding guards)."""
    return a is not None and b is not None and len(a) == len(b) and \
        all(statically_known_true(x == y) for x, y in zip(a, b))


def _calls(node, methods, functions) -> bool:
    return isinstance(node, Node) and (
        (node.op == "call_method" and node.target in methods) or
        (node.op == "call_function" and node.target in functions))


def _plain_index(node) -> bool:
    """getitem whose index only has full slices, None and Ellipsis (no real indexing)."""
    index = node.args[1] if node.target is operator.getitem else None
    index = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or i == slice(None) for i in index)


def skip_identity(node: Node) -> Node:
    """Walk back through copies and no-op views (same shape and dtype as their input)."""
    while _calls(node, _SAME_METHODS, _SAME_FUNCTIONS) and isinstance(node.args[0], Node):
        if node.target is operator.getitem and not _plain_index(node):
            break
        source = node.args[0]
        if not (_same(shape(node), shape(source)) and _dtype(node) == _dtype(source)):
            break
        node = source
    return node


# --- following k and v back to the layer's new entries -------------------------------------

def unrepeated(node: Node) -> Node:
    """The KV-head tensor (B, H, T, d) that `node` repeats G times per head for GQA, or
    `node` itself when it is no such expansion. Recognised: transformers' repeat_kv
    (unsqueeze at dim 2 or `[:, :, None]`, expand of that dim from 1 to G, reshape merging
    H and G — the order that puts the G copies of a head next to each other, as
    repeat_interleave does) and `repeat_interleave(x, G, dim=1)`."""
    x = skip_identity(node)
    if _calls(x, {"repeat_interleave"}, _REPEAT_FUNCTIONS):
        repeats = x.args[1] if len(x.args) > 1 else x.kwargs.get("repeats")
        dim = x.args[2] if len(x.args) > 2 else x.kwargs.get("dim")
        base = x.args[0]
        if isinstance(repeats, int) and dim == 1 and len(shape(base) or ()) == 4:
            return base
        return node
    if not _calls(x, _RESHAPE_METHODS, _RESHAPE_FUNCTIONS):
        return node
    expanded = skip_identity(x.args[0])
    if not _calls(expanded, {"expand"}, {aten.expand.default}):
        return node
    inserted = skip_identity(expanded.args[0])
    is_unsqueeze = _calls(inserted, {"unsqueeze"}, _UNSQUEEZE_FUNCTIONS) or (
        _calls(inserted, {"__getitem__"}, {operator.getitem}) and _plain_index(inserted))
    if not is_unsqueeze:
        return node
    base = inserted.args[0]
    sb, su, se, sx = shape(base), shape(inserted), shape(expanded), shape(x)
    if sb is None or len(sb) != 4 or su is None or se is None or sx is None or len(se) != 5:
        return node
    b, h, t, d = sb
    g = se[2]
    if _same(su, (b, h, 1, t, d)) and _same(se, (b, h, g, t, d)) and _same(sx, (b, h * g, t, d)):
        return base
    return node


def new_entries(node: Node, t) -> Node:
    """The last piece of a cache concatenation `cat([past, new], dim=2 or -2)` when it
    holds the T new tokens, else `node`."""
    x = skip_identity(node)
    if _calls(x, set(), _CAT_FUNCTIONS):
        pieces = x.args[0]
        dim = x.args[1] if len(x.args) > 1 else x.kwargs.get("dim", 0)
        last = pieces[-1] if isinstance(pieces, (list, tuple)) and pieces else None
        s = shape(last) if isinstance(last, Node) else None
        if dim in (2, -2) and s is not None and len(s) == 4 and statically_known_true(s[2] == t):
            return last
    return node


# --- the padding mask -------------------------------------------------------------------

def _ancestors(node: Node) -> list[Node]:
    seen, todo = {node}, [node]
    while todo:
        for parent in todo.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return list(seen)


def _is_tensor_input(node: Node) -> bool:
    return node.op == "placeholder" and shape(node) is not None


def padding_mask(gm: GraphModule, attn_mask) -> Node | None:
    """The graph input holding the 2-D padding mask (B, N) that the attention mask of an
    SDPA call was built from; None when the mask depends on no input (purely causal) or
    there is none and the graph has no `attention_mask` input."""
    if not isinstance(attn_mask, Node):
        named = [n for n in gm.graph.nodes if _is_tensor_input(n) and "attention_mask" in n.name
                 and len(shape(n)) == 2]
        return named[0] if len(named) == 1 else None
    inputs = [n for n in _ancestors(attn_mask) if _is_tensor_input(n)]
    two_d = [n for n in inputs if len(shape(n)) == 2]
    if len(two_d) > 1:
        two_d = [n for n in two_d if "attention_mask" in n.name]
    if len(two_d) == 1:
        return two_d[0]
    if inputs:
        raise PassError(f"kvcompile: the attention mask {attn_mask.name!r} is built from inputs "
                        f"{[n.name for n in inputs]} but no single 2-D padding mask (B, N) among them")
    return None


# --- the rewrite ------------------------------------------------------------------------

def _fake(fn, *args):
    """fn applied to fake metadata values, when they are fake tensors."""
    modes = [a.fake_mode for a in args if hasattr(a, "fake_mode")]
    if not modes:
        return None
    with modes[0]:
        return fn(*args)


def _insert(gm: GraphModule, before: Node, op, source: Node, *args) -> Node:
    """`op(source, *args)` inserted before `before`, with its fake value as metadata."""
    with gm.graph.inserting_before(before):
        node = gm.graph.call_function(op, (source, *args))
    value = _fake(lambda x: op(x, *args), meta_value(source))
    for key in ("val", "example_value"):
        if key in source.meta and value is not None:
            node.meta[key] = value
    return node


def _bool_mask(gm: GraphModule, mask: Node, before: Node) -> Node:
    return mask if _dtype(mask) == torch.bool else _insert(gm, before, aten.ne.Scalar, mask, 0)


def _check_heads(node: Node, q: Node, k: Node, v: Node, kv_heads: int | None) -> None:
    sq, sk, sv = shape(q), shape(k), shape(v)
    if sq is None or sk is None or sv is None:
        raise PassError(f"kvcompile: attention node {node.name!r} has no shape metadata "
                        "(run torch.fx.passes.fake_tensor_prop.FakeTensorProp on the graph first)")
    hq, hk = sq[1], sk[1]
    if len(sk) != 4 or not _same(sk[:3], sv[:3]) or not statically_known_true(hq % hk == 0):
        raise PassError(f"kvcompile: attention node {node.name!r}: keys {sk} / values {sv} do not fit "
                        f"queries {sq} as (B, H, T, d) with H dividing the query heads")
    if not _same((sk[0], sk[2]), (sq[0], sq[2])):
        raise PassError(f"kvcompile: attention node {node.name!r}: keys {sk} are not the {sq[2]} new tokens of "
                        f"queries {sq} (an unrecognised cache concatenation?)")
    if kv_heads is not None and not statically_known_true(hk == kv_heads):
        raise PassError(f"kvcompile: attention node {node.name!r} gets keys with {hk} heads where the model "
                        f"has {kv_heads} KV heads: an unrecognised GQA expansion")


def _plan(gm: GraphModule, node: Node, kv_heads: int | None) -> dict:
    """What the op of one SDPA call gets, checked before the graph changes."""
    if returns_tuple(node):
        for user in node.users:
            index = user.args[1] if user.target is operator.getitem else None
            if index != 0 and user.users:
                raise PassError(f"kvcompile: output {index} of attention node {node.name!r} is used; "
                                "only the attention output can be rewritten")
    args = sdpa_arguments(node)
    q = args["query"]
    sq = shape(q)
    if sq is None:
        raise PassError(f"kvcompile: attention node {node.name!r} has no shape metadata "
                        "(run torch.fx.passes.fake_tensor_prop.FakeTensorProp on the graph first)")
    if args["dropout_p"]:
        raise PassError(f"kvcompile: attention node {node.name!r} uses dropout {args['dropout_p']}")
    if args["attn_mask"] is None and not args["is_causal"] and not statically_known_true(sq[2] == 1):
        raise PassError(f"kvcompile: attention node {node.name!r} is not causal (no mask, is_causal=False)")
    k, v = (new_entries(unrepeated(args[name]), sq[2]) for name in ("key", "value"))
    _check_heads(node, q, k, v, kv_heads)
    scale = args["scale"]
    if isinstance(scale, Node):
        raise PassError(f"kvcompile: attention node {node.name!r} has a computed scale")
    scale = float(scale) if scale is not None else float(int(sq[-1]) ** -0.5)
    return {"q": q, "k": k, "v": v, "mask": padding_mask(gm, args["attn_mask"]), "scale": scale}


def cache_marker(gm: GraphModule) -> Node | None:
    """The compiled entry's `kvcompile.cache_input(ref, token)` call, None in a graph without one."""
    marks = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in CACHE_INPUT]
    if len(marks) > 1:
        raise PassError(f"kvcompile: {len(marks)} kvcompile.cache_input calls in one graph; the compiled entry "
                        "makes one")
    if marks and not all(isinstance(a, Node) and a.op == "placeholder" for a in marks[0].args):
        raise PassError("kvcompile: kvcompile.cache_input's arguments are not graph inputs")
    return marks[0] if marks else None


NO_MARKER = ("kvcompile: the graph has no kvcompile.cache_input(ref, token) call, so no cache reaches its "
             "attention: compile the model with kvcompile.compile(model, spec, mode='compiled') "
             "(kvcompile.passes.compile_forward), whose traced function makes the call")


def cache_inputs(gm: GraphModule) -> tuple[Node, Node]:
    """The graph inputs that carry the call's cache (its `ref` and `token`): the arguments of
    the compiled entry's `cache_input` marker, which is erased; in a graph without one, two new
    inputs `kvcompile_ref` and `kvcompile_token` after the graph's own (its caller passes the
    cache's `ref` and `token` last). A graph that dynamo calls (the backend's) must hold the
    marker: dynamo passes the graph its own inputs only."""
    mark = cache_marker(gm)
    if mark is not None:
        ref, token = mark.args
        gm.graph.erase_node(mark)
        return ref, token
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        ref = gm.graph.placeholder("kvcompile_ref")
    with gm.graph.inserting_after(ref):
        token = gm.graph.placeholder("kvcompile_token")
    return ref, token


def rewrite_attention(gm: GraphModule, found: list[tuple[Node, int]], kv_heads: int | None = None,
                      require_marker: bool = False, engine: tuple[int | None, ...] | None = None) -> list[Node]:
    """Replace each SDPA call of `found` (from find_attention) by
    `kvcompile.attend(q, k, v, mask, layer, ref, token, scale)`; returns the new nodes. `engine`: a hybrid
    model's layers (kvcompile.layer_kinds.LayerKinds.engine: each model layer's number among the compressed
    ones, None for a local layer): a compressed layer's call takes its number there, a local layer's becomes
    `kvcompile.attend_window` (its window, the same arguments with the model layer).

    `ref` and `token` are graph inputs (`cache_inputs`), never constants: each call passes its
    cache's, so one graph serves every cache. `kv_heads` (the model's KV heads), when given, is
    checked against the keys; `require_marker`: refuse a graph without the `cache_input` marker
    (the backend's). Every call is checked before any is rewritten: on error the graph is
    unchanged.
    """
    plans = [_plan(gm, node, kv_heads) for node, _ in found]
    if cache_marker(gm) is None and require_marker:
        raise PassError(NO_MARKER)
    ref, token = cache_inputs(gm)
    new_nodes = []
    masks: dict[Node, Node] = {}
    replaced: dict[Node, Node] = {}  # an earlier call's output may feed a later one
    for (node, layer), plan in zip(found, plans):
        plan = {name: replaced.get(value, value) if isinstance(value, Node) else value
                for name, value in plan.items()}
        mask = plan["mask"]
        if mask is not None:
            if mask not in masks:
                masks[mask] = _bool_mask(gm, mask, before=found[0][0])
            mask = masks[mask]
        # The op returns a contiguous tensor and its fake kernel returns empty_like(q):
        # a contiguous q makes the two agree (transformers' q is a transposed view).
        q = _insert(gm, node, aten.contiguous.default, plan["q"])
        op = ATTEND
        if engine is not None:
            op, layer = (ATTEND_WINDOW, layer) if engine[layer] is None else (ATTEND, engine[layer])
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(op, (q, plan["k"], plan["v"], mask, layer, ref, token, plan["scale"]))
        new.meta = dict(node.meta)
        for key in ("val", "example_value"):
            if key in node.meta and returns_tuple(node):
                new.meta[key] = node.meta[key][0]
        new.meta.pop("tensor_meta", None)
        replaced.update(_replace(gm, node, new))
        new_nodes.append(new)
    gm.graph.lint()
    gm.recompile()
    return new_nodes


def _replace(gm: GraphModule, node: Node, new: Node) -> dict[Node, Node]:
    """Rewire the users of the call's output to `new`, erase the call; returns old → new."""
    if not returns_tuple(node):
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        return {node: new}
    done = {}
    for user in list(node.users):
        if user.target is operator.getitem and user.args[1] == 0:
            user.replace_all_uses_with(new)
            done[user] = new
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    return done
