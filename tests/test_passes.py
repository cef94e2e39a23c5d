"""FX passes of the compiled entry: find attention, rewrite it into kvcompile.attend,
remove dead code, backend (docs/INTERNALS.md "The op and its two entries").

Hand-built graphs (symbolic_trace, make_fx) test each pass; a graph dynamo captured from
a tiny Llama tests them together; generation through compile_forward must give the
eager entry's tokens without a new graph per token."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, symbolic_trace
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.testing import assert_close

import kvcompile
from kvcompile.cache import KVCompileCache
from kvcompile.passes import PassError, compile_forward, find_attention, remove_dead, rewrite_attention
from kvcompile.passes.backend import COMPILES, _GRAPH_CACHE, run_passes
from kvcompile.passes.find import SDPA_KERNELS, sdpa_arguments
from kvcompile.passes.rewrite import ATTEND, _dtype, shape, unrepeated
from tiny import ARCHS, left_pad, prompt, tiny_model

B, H, G, T, D = 2, 2, 2, 6, 8


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny shapes run on one intra-op thread: on the shared 2-core machine, two threads
    spin-wait on each other and a 64×64 linear takes 30 ms instead of 15 µs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- hand-built graphs --------------------------------------------------------------------

class Attention(nn.Module):
    """SDPA over GQA-repeated k/v with a causal ∧ padding mask built from the 2-D mask."""

    def __init__(self, fn=F.scaled_dot_product_attention, scale=None, repeat="repeat_kv"):
        super().__init__()
        self.fn, self.scale, self.repeat = fn, scale, repeat

    def expand(self, x):
        if self.repeat == "repeat_kv":
            return x[:, :, None, :, :].expand(B, H, G, T, D).reshape(B, H * G, T, D)
        if self.repeat == "interleave":
            return torch.repeat_interleave(x, G, dim=1)
        if self.repeat == "tile":  # heads in the wrong order for GQA grouping
            return x[:, None].expand(B, G, H, T, D).reshape(B, G * H, T, D)
        return x

    def forward(self, q, k, v, attention_mask):
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        return self.fn(q, self.expand(k), self.expand(v), attn_mask=mask, scale=self.scale)


class Stack(nn.Module):
    def __init__(self, n=2, **kw):
        super().__init__()
        self.layers = nn.ModuleList([Attention(**kw) for _ in range(n)])

    def forward(self, q, k, v, attention_mask):
        for layer in self.layers:
            q = layer(q, k, v, attention_mask)
        return q


def inputs(mask=None):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H * G, T, D, generator=g)
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    return q, k, v, torch.ones(B, T, dtype=torch.long) if mask is None else mask


def traced(module, args) -> GraphModule:
    gm = symbolic_trace(module)
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*args)
    return gm


def aten_graph(module, args, **kw) -> GraphModule:
    """make_fx graph; it records no module stack, so each SDPA gets `layers.i` by hand."""
    gm = make_fx(module, **kw)(*args)
    sdpa = [n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    for i, node in enumerate(sdpa):
        node.meta["nn_module_stack"] = {"m": (f"layers.{i}", Attention)}
    return gm


def placeholders(gm):
    return {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}


def attend_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is ATTEND]


@pytest.mark.parametrize("fn", [F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention])
def test_find_attention_torch_level(fn):
    gm = traced(Stack(3, fn=fn), inputs())
    found = find_attention(gm)
    assert [layer for _, layer in found] == [0, 1, 2]
    assert all(node.target is fn for node, _ in found)


def test_find_attention_aten_graphs():
    """make_fx gives the CPU flash kernel (a tuple) or, pre-dispatch, the composite op."""
    for kw, target in (({}, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default),
                       ({"pre_dispatch": True}, torch.ops.aten.scaled_dot_product_attention.default)):
        gm = aten_graph(Stack(2), inputs(), **kw)
        found = find_attention(gm)
        assert [layer for _, layer in found] == [0, 1]
        assert all(node.target is target for node, _ in found)


def test_find_attention_layer_from_meta_and_errors():
    gm = traced(Stack(2), inputs())
    nodes = [n for n, _ in find_attention(gm)]
    nodes[0].meta["nn_module_stack"] = {"a": ("L['self'].model.layers[7].self_attn", object)}
    assert [layer for _, layer in find_attention(gm)] == [7, 1]
    nodes[0].meta["nn_module_stack"] = {"a": ("L['self'].model.layers.1.self_attn", object)}
    with pytest.raises(PassError, match="two attention calls in layer 1"):
        find_attention(gm)
    nodes[0].meta.pop("nn_module_stack")
    with pytest.raises(PassError, match="which decoder layer"):
        find_attention(gm)
    plain = symbolic_trace(nn.Linear(4, 4))
    with pytest.raises(PassError, match="no attention found: the model would run uncompressed"):
        find_attention(plain)


def test_rewrite_binds_layer_unrepeated_kv_mask_and_scale():
    gm = traced(Stack(2, scale=0.3), inputs())
    found = find_attention(gm)
    new = rewrite_attention(gm, found, kv_heads=H)
    inp = placeholders(gm)
    # no cache_input marker (a hand-built graph): the cache's ref and token became its last two inputs
    assert list(inp)[-2:] == ["kvcompile_ref", "kvcompile_token"]
    assert [n.target for n in new] == [ATTEND, ATTEND]
    for layer, node in enumerate(new):
        q, k, v, mask, lay, ref, token, scale = node.args
        assert k is inp["k"] and v is inp["v"]  # repeat_kv stripped
        assert mask.target is torch.ops.aten.ne.Scalar and mask.args[0] is inp["attention_mask"]
        assert (lay, ref, token, scale) == (layer, inp["kvcompile_ref"], inp["kvcompile_token"], 0.3)
        assert node.meta["val"].shape == (B, H * G, T, D)
    assert not any(n.op == "call_function" and n.target is F.scaled_dot_product_attention for n in gm.graph.nodes)


def test_rewrite_default_scale_and_no_mask():
    class Causal(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    q, k, v, _ = inputs()
    gm = traced(Causal(), (q, k, v))
    for n in gm.graph.nodes:
        n.meta["nn_module_stack"] = {"x": ("model.layers.0.self_attn", Causal)}
    (node,) = rewrite_attention(gm, find_attention(gm))
    inp = placeholders(gm)
    assert node.args[1:] == (inp["k"], inp["v"], None, 0, inp["kvcompile_ref"], inp["kvcompile_token"], D ** -0.5)


def test_rewrite_aten_kernel_variant():
    """The tuple-returning kernel: item 0 is rewired to the op, the node and its getitems go."""
    gm = aten_graph(Stack(2), inputs())
    rewrite_attention(gm, find_attention(gm), kv_heads=H)
    remove_dead(gm)
    assert not any(n.target in SDPA_KERNELS for n in gm.graph.nodes)
    q, k, v, mask, _, _ = placeholders(gm).values()
    for node in attend_nodes(gm):
        assert node.args[1:3] == (k, v) and node.args[3].args[0] is mask
    assert not any(n.target is torch.ops.aten.expand.default for n in gm.graph.nodes)


def test_unrecognised_expansion_is_refused():
    """A tile-order expansion is not GQA grouping: it must not be stripped."""
    gm = traced(Stack(2, repeat="tile"), inputs())
    before = [n.name for n in gm.graph.nodes]
    with pytest.raises(PassError, match="unrecognised GQA expansion"):
        rewrite_attention(gm, find_attention(gm), kv_heads=H)
    assert len(find_attention(gm)) == 2 and not attend_nodes(gm)  # nothing half-applied
    assert [n.name for n in gm.graph.nodes] == before  # no cache input added either


def test_padding_mask_errors_on_a_4d_mask_input():
    class FourD(nn.Module):
        def forward(self, q, k, v, mask4d):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask4d, enable_gqa=True)

    q, k, v, _ = inputs()
    gm = traced(FourD(), (q, k, v, torch.ones(B, 1, T, T, dtype=torch.bool)))
    for n in gm.graph.nodes:
        n.meta["nn_module_stack"] = {"x": ("layers.0", FourD)}
    with pytest.raises(PassError, match="no single 2-D padding mask"):
        rewrite_attention(gm, find_attention(gm))


def test_cache_concatenation_is_followed_to_the_new_entries():
    """A DynamicCache-style graph: SDPA over cat([past, new]); the op gets `new`."""
    class WithPast(nn.Module):
        def forward(self, q, k, v, past_k, past_v):
            k_all, v_all = torch.cat([past_k, k], dim=-2), torch.cat([past_v, v], dim=-2)
            k_all = k_all[:, :, None].expand(B, H, G, 4, D).reshape(B, H * G, 4, D)
            v_all = v_all[:, :, None].expand(B, H, G, 4, D).reshape(B, H * G, 4, D)
            return F.scaled_dot_product_attention(q, k_all, v_all)

    q, k, v, _ = inputs()
    past = torch.randn(B, H, 3, D)
    gm = symbolic_trace(WithPast(), concrete_args=None)
    FakeTensorProp(gm).propagate(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], past, past)
    for n in gm.graph.nodes:
        n.meta["nn_module_stack"] = {"x": ("layers.0", WithPast)}
    (node,) = rewrite_attention(gm, find_attention(gm), kv_heads=H)
    assert node.args[1] is placeholders(gm)["k"] and node.args[2] is placeholders(gm)["v"]
    removed = remove_dead(gm)
    assert removed > 0 and not any(n.target is torch.cat for n in gm.graph.nodes)


@settings(max_examples=20, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 4), g=st.integers(1, 4), t=st.integers(1, 5),
       form=st.sampled_from(["repeat_kv", "interleave", "tile"]))
def test_unrepeated_finds_the_kv_heads(b, h, g, t, form):
    """repeat_kv and repeat_interleave lead back to the (B, H, T, d) input; a tile-order
    expansion is left alone unless it equals repeat_interleave (h == 1 or g == 1)."""
    def expand(x):
        if form == "repeat_kv":
            return x[:, :, None, :, :].expand(b, h, g, t, D).reshape(b, h * g, t, D)
        if form == "interleave":
            return torch.repeat_interleave(x, g, dim=1)
        return x[:, None].expand(b, g, h, t, D).reshape(b, g * h, t, D)

    x = torch.randn(b, h, t, D)
    for level, gm in (("torch", traced(_Fn(expand), (x,))), ("aten", make_fx(expand, tracing_mode="fake")(x))):
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        out = out[0] if isinstance(out, (tuple, list)) else out
        stripped = unrepeated(out).op == "placeholder"
        if stripped:  # only where it is exact
            assert torch.equal(expand(x), torch.repeat_interleave(x, g, dim=1))
        if g > 1 and (form == "repeat_kv" or form == "interleave" and level == "torch"):
            assert stripped, (form, level, gm.graph)


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_remove_dead_keeps_in_place_ops():
    class Body(nn.Module):
        def forward(self, x, m):
            unused = x.exp() & m  # noqa: F841  (dead and pure: two nodes)
            x.mul_(2)  # results unused, but they mutate x
            torch.relu_(x)
            F.relu(x, inplace=True)
            return x + 1

    gm = symbolic_trace(Body())
    assert remove_dead(gm) == 2
    assert [n.target for n in gm.graph.nodes if n.op == "call_method"] == ["mul_"]
    assert_close(gm(torch.ones(3), torch.ones(3)), torch.full((3,), 3.0))


def full_budget_policy(n: int):
    return kvcompile.load_spec("snapkv", per_head=n + 64)


@pytest.mark.parametrize("padded", [False, True])
def test_rewritten_graph_computes_the_attention(padded):
    """With a budget that keeps everything, the rewritten graph equals the original on
    every real query row (pad rows are undefined in the original: all-masked SDPA)."""
    mask = torch.ones(B, T, dtype=torch.long)
    if padded:
        mask[1, :2] = 0
    args = inputs(mask)
    module = Stack(2, scale=0.3)
    expected = module(*args)
    gm = traced(module, args)
    run_passes(gm, kv_heads=H, num_layers=2)
    dims = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=H, head_dim=D)
    cache = KVCompileCache(full_budget_policy(T), dims)
    out = gm(*args, cache.ref, cache.token)
    real = mask.bool()[:, None, :, None].expand_as(out)
    assert_close(out[real], expected[real])
    assert cache.seq_length == T and all(store is not None for store in cache.stores)
    assert torch.equal(cache.kept(), torch.full((B, 2, H), T) - (~mask.bool()).sum(-1)[:, None, None])
    assert int(cache.token) == 2  # one declared write per attention call


def test_one_rewritten_graph_serves_two_caches_and_refuses_a_collected_one():
    """The cache is an input of the graph: the same graph runs on two caches, each written alone; a
    reference whose cache was collected names nothing (the graph does not keep it alive)."""
    import gc
    import weakref

    args = inputs()
    gm = traced(Stack(2, scale=0.3), args)
    run_passes(gm, kv_heads=H, num_layers=2)
    dims = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=H, head_dim=D)
    a, b = KVCompileCache(full_budget_policy(T), dims), KVCompileCache(full_budget_policy(T), dims)
    out = gm(*args, a.ref, a.token)
    assert a.seq_length == T and b.seq_length == 0 and b.stores == [None, None]
    assert_close(gm(*args, b.ref, b.token), out)
    assert a.seq_length == b.seq_length == T and (int(a.token), int(b.token)) == (2, 2)
    ref, alive = b.ref, weakref.ref(b)
    del b
    gc.collect()
    assert alive() is None
    with pytest.raises(RuntimeError, match="names no live KVCompileCache"):
        gm(*args, ref, torch.zeros(1, dtype=torch.long))


def test_backend_refuses_graphs_without_attention_and_non_sdpa_models():
    from kvcompile.passes.backend import make_backend

    fn = torch.compile(nn.Linear(4, 4), backend=make_backend(inductor=False), fullgraph=True)
    with pytest.raises(Exception, match="no attention found: the model would run uncompressed"):
        fn(torch.ones(2, 4))
    eager = tiny_model("llama", layers=1)
    eager.set_attn_implementation("eager")
    with pytest.raises(PassError, match="needs attn_implementation='sdpa'"):
        compile_forward(eager)


class WithPointwise(nn.Module):
    """Two attention layers beside a wide pointwise op (as a decode step's 1536-wide SiLU), with the
    compiled entry's marker of the cache's inputs (the backend refuses a graph without it)."""

    def __init__(self):
        super().__init__()
        self.attn = Stack(2)

    def forward(self, q, k, v, attention_mask, wide, ref, token):
        torch.ops.kvcompile.cache_input(ref, token)
        return self.attn(q, k, v, attention_mask), F.silu(wide) * wide


@pytest.mark.parametrize("dynamic", [False, True])
def test_static_graphs_get_no_parallel_region_for_small_loops(dynamic):
    """Inductor code generated through the backend on two threads: a static graph (decode)
    has no OpenMP region around a 4096-element loop (each region's join stalls when
    another process holds a core); a graph with a symbolic length (prefill) keeps
    Inductor's default, which splits that loop over the threads."""
    from torch._inductor.utils import run_and_get_code

    from kvcompile.passes.backend import SERIAL_WORK, make_backend

    dims = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=H, head_dim=D)
    cache = KVCompileCache(full_budget_policy(T), dims)
    args = (*inputs(), torch.randn(1, 4096))
    expected = WithPointwise().attn(*args[:4]), F.silu(args[4]) * args[4]
    fn = torch.compile(WithPointwise(), backend=make_backend(H, 2), dynamic=dynamic, fullgraph=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
            (out, wide), code = run_and_get_code(fn, *args, cache.ref, cache.token)
    finally:
        torch.set_num_threads(threads)
    assert_close(out, expected[0])
    assert_close(wide, expected[1])
    assert COMPILES[-1]["options"] == ({} if dynamic else {"cpp.min_chunk_size": SERIAL_WORK})
    assert ("#pragma omp parallel" in "".join(code)) == dynamic


# --- a graph dynamo captured from a tiny Llama ----------------------------------------------

@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def capture(model, ids, mask):
    """The torch-level graph dynamo captures as compile_forward runs it (stand-in cache)."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(type(model).forward.__get__(model), backend=keep, fullgraph=True)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        fn(ids, attention_mask=mask, position_ids=positions, past_key_values=_GRAPH_CACHE, use_cache=True)
    torch._dynamo.reset()
    (graph,) = graphs
    return graph, positions


def test_passes_on_captured_llama(llama):
    ids, mask = left_pad([prompt(30, seed=3)[0], prompt(21, seed=4)[0]])
    (gm, example), positions = capture(llama, ids, mask)
    found = find_attention(gm)
    assert [layer for _, layer in found] == [0, 1, 2]
    assert all(sdpa_arguments(n)["attn_mask"] is not None for n, _ in found)  # padded: GQA via repeat_kv
    n_expand = sum(n.target == "expand" for n in gm.graph.nodes)
    new = rewrite_attention(gm, found, kv_heads=2)
    removed = remove_dead(gm)
    assert removed > 0
    assert sum(n.target == "expand" for n in gm.graph.nodes) < n_expand
    for node in new:
        assert tuple(node.args[1].meta["example_value"].shape) == (2, 2, 30, 16)  # un-repeated new keys
        assert "attention_mask" in node.args[3].args[0].name
    # the GQA expansions (5-D) and the 4-D masks built for SDPA are gone
    shapes = [shape(n) for n in gm.graph.nodes if shape(n) is not None]
    assert not [s for s in shapes if len(s) == 5]
    assert not [n for n in gm.graph.nodes if _dtype(n) == torch.bool and len(shape(n) or ()) == 4]

    policy = kvcompile.load_spec("snapkv", per_head=12, ranking={"by_score": {"window": 4}})
    cache = KVCompileCache(policy, llama.config, record=True)
    with torch.no_grad():  # a graph captured without the compiled entry's marker: the cache's inputs come last
        (logits,) = gm(*example, cache.ref, cache.token)
    eager = KVCompileCache(policy, llama.config, record=True)
    with kvcompile.compiled(llama, policy), torch.no_grad():
        expected = llama(ids, attention_mask=mask, position_ids=positions, past_key_values=eager).logits
    assert_close(logits, expected)
    assert torch.equal(cache.kept(), eager.kept()) and int(cache.kept().max()) == 12  # evicted down to 12


# --- generation through compile_forward ---------------------------------------------------------

def generate(model, policy, ids, mask, new_tokens):
    cache = KVCompileCache(policy, model.config, headroom=new_tokens)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             past_key_values=cache)
    return out[:, ids.shape[1]:], cache


def eager_tokens(model, policy, ids, mask, new_tokens):
    with kvcompile.compiled(model, policy):
        return generate(model, policy, ids, mask, new_tokens)


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


SPECS = [("snapkv", {"per_head": 40}), ("lava", {"per_head": 40}), ("dbudgetkv", {})]


def run_entries(model, specs, inductor, new_tokens=6):
    """Greedy tokens of the compiled entry against the eager entry, and graph counts."""
    ids, mask = left_pad([prompt(80, seed=7)[0], prompt(53, seed=8)[0]])
    expected = {name: eager_tokens(model, kvcompile.load_spec(name, **kw), ids, mask, new_tokens)
                for name, kw in specs}
    torch._dynamo.reset()
    before, start = graphs(), time.perf_counter()
    model.forward = compile_forward(model, inductor=inductor)
    try:
        for name, kw in specs:
            policy = kvcompile.load_spec(name, **kw)
            tokens, cache = generate(model, policy, ids, mask, new_tokens)
            want, want_cache = expected[name]
            assert tokens.tolist() == want.tolist(), name
            assert torch.equal(cache.kept(), want_cache.kept()), name
        warm = graphs()
        # after warm-up: a new prompt length and 64 more tokens add no graph
        ids2, mask2 = left_pad([prompt(70, seed=9)[0], prompt(45, seed=10)[0]])
        name, kw = specs[0]
        generate(model, kvcompile.load_spec(name, **kw), ids2, mask2, 64)
        return warm - before, graphs() - warm, time.perf_counter() - start
    finally:
        del model.forward


@pytest.mark.parametrize("arch", ARCHS)
def test_compiled_entry_without_inductor(arch, llama):
    """The passes alone (the rewritten graphs run as Python code): same tokens and kept
    entries as the eager entry for drop / cascade / threshold policies on a padded batch,
    and no graph per generated token."""
    model = llama if arch == "llama" else tiny_model(arch)
    warm, after, _ = run_entries(model, SPECS if arch == "llama" else SPECS[:1], inductor=False)
    assert warm == 2  # prefill (symbolic length) and decode (one token)
    assert after == 0


def test_compiled_forward_without_mask_or_cache(llama):
    """No attention_mask: SDPA is causal with enable_gqa and the op gets no mask. No
    KVCompileCache: the model's own forward runs (what the eager entry does then)."""
    ids = prompt(40, seed=11)
    policy = kvcompile.load_spec("snapkv", per_head=36)
    forward = compile_forward(llama, inductor=False)
    with torch.no_grad():
        with kvcompile.compiled(llama, policy):
            expected = llama(ids, past_key_values=KVCompileCache(policy, llama.config)).logits
        plain = llama(ids).logits
        cache = KVCompileCache(policy, llama.config)
        assert_close(forward(ids, past_key_values=cache).logits, expected)
        assert cache.seq_length == 40 and int(cache.kept().max()) == 36
        assert_close(forward(ids, use_cache=False).logits, plain)


@pytest.mark.slow
def test_compiled_entry_with_inductor(llama):
    """Passes + Inductor: same greedy tokens as the eager entry for two specs; after
    warm-up, 64 more generated tokens (and a new prompt length) add no graph."""
    COMPILES.clear()
    warm, after, seconds = run_entries(llama, SPECS[:2], inductor=True)
    print(f"\ncompiled entry: {warm} graphs, {after} after warm-up, {seconds:.1f} s in all; per graph: "
          + ", ".join(f"{c['seconds']:.1f} s" for c in COMPILES))
    assert warm == 2 and after == 0
    assert all(c["inductor"] and c["layers"] == [0, 1, 2] for c in COMPILES)
