"""Pass 4 and the compiled entry (docs/INTERNALS.md "The op and its two entries").

`backend(gm, example_inputs)` is a torch.compile backend: it runs the passes (find the
attention calls, rewrite them into `kvcompile.attend`, remove what became dead) over the
graph dynamo captured, then hands it to Inductor, which fuses norms, RoPE and MLPs
around the opaque op.

`compile_forward(model)` wraps a transformers causal LM's forward (attn_implementation
"sdpa") in `torch.compile(backend=...)`. Two choices keep the graph independent of the
cache, so generating never recompiles:

- The cache's inputs. What torch.compile traces is `_forward_with_cache(forward, ref, token,
  *args, **kwargs)` (`traced_function`), which calls `kvcompile.cache_input(ref, token)` and
  then the model's forward: the call's KVCompileCache reaches the graph as two graph inputs,
  its `ref` (an opaque reference object, on which dynamo guards by type only) and its `token`
  (a (1,) tensor), which the rewrite wires into every `kvcompile.attend` (kvcompile.cache_ref;
  without the marker call dynamo would drop them: the model's own code never reads them). A
  baked per-cache constant would recompile for every new cache, a binding would be hidden
  state: here each call names its cache, and one graph serves every cache and every thread.
- The cache object. The traced forward gets a stateless stand-in (`GraphCache`): the
  real cache's `seq_length` is a Python int that dynamo would specialise on (one graph
  per generated token), and its mask sizes would give SDPA a (B, 1, T, past + T) mask
  against T new keys. The stand-in reports no past, so transformers builds a (B, 1, T, T)
  mask that the rewrite leaves dead; positions come from `position_ids`, which the
  wrapper computes from the real cache when the caller gives none.

Threads. A call does not trace unless it must: it first runs `_forward_with_cache` in
dynamo's run-only mode (`torch._dynamo.run`, per thread), which runs a compiled graph whose
guards pass, with no lock and nothing patched; when none does, the function runs eagerly,
and its first statement, `cache_input`, raises NotTraced before anything else runs. Only
then does the call trace, holding `TRACING` and with the process-wide configuration that
tracing needs patched (`backed_size_oblivious`, dynamo's recompile limit, `specialize_float`).
`TRACING` is dynamo's own compile lock, which every torch.compile in the process takes while
it compiles: no other compile (the op's kernels compile on first use) sees the patched
configuration, and it is restored before the lock is released. A model traces once per
graph kind (prefill, decode, under no_grad / inference_mode), so after its first prefill and
decode step concurrent calls run their graphs at once, each on its own cache; a call waits
only for a trace in progress that it needs itself, or to compile a kernel (tests/
test_isolation.py).

Shapes: one prefill graph and one decode graph serve every batch size and prompt length
(`_mark_dynamic`). The batch (dim 0) and the sequence lengths (dim 1 of the ids, mask and
positions) are symbolic from the first call; dim 1 of a one-token call stays static, which
is what separates the decode graph from the prefill graph. Batch 1 is the hard case:
dynamo turns a size-1 dimension into the constant 1 even when it is marked dynamic (0/1
specialisation), so a first generate() at batch 1 would give graphs that batch 2 cannot
use. Three ways out were weighed:
- marking dim 0 dynamic only from batch 2 on: batch 1 gets its own prefill + decode pair
  (what automatic dynamic shapes gave before, 117–133 s more on SmolLM2);
- `mark_unbacked(dim 0)`: an unbacked size makes size tests in the model's code
  data-dependent; tried here, tracing the tiny Llama fails under fullgraph=True in
  transformers' sdpa_attention_forward ("Could not guard on data-dependent expression
  Ne(16*s27*u1, 0)"), and the torch._check hints that would help belong in the model's code;
- `torch.fx.experimental._config.backed_size_oblivious` (chosen): a marked size-1 dimension
  gets a backed symbol (range [0, ∞), hint 1), and the framework's size tests (broadcast,
  contiguity, "is this dim 1?") are decided as for a general size, without a guard. It is
  patched only while the compiled forward traces (the graph itself runs with it off:
  `_plain_shapes`), so nothing else in the process sees it, the kernels that the op
  compiles on first use included.
Guards that remain are true for every batch: batch of ids = batch of positions, mask
length ≤ ids length at prefill. One size test of the model's own code still asked "is B
1?" with a guard: `hidden_states[:, -k:, :]` (transformers' `logits_to_keep`) is a view
that the LM head's matmul can fold into (B·k, hidden) without a copy only when B = 1. The
wrapper passes `logits_to_keep` as an index tensor `arange(-k, 0)` instead (the same rows,
gathered into a contiguous tensor), which folds for every B. A call without an
attention_mask gets an all-ones one (the op treats both alike: `prefill` drops a mask
without pads), so that a batch-1 generate() without a mask and a padded batch share the
graph, and an input made in another autograd mode than the call's is cloned into it
(`_same_kind`: dynamo guards on dispatch keys). With that, generate() at batch 1, 2, 3, 5
and any prompt length compiles one prefill and one decode graph in all
(tests/test_compiled.py); calls under no_grad and under inference_mode get a pair each.

Progress: every Inductor compile prints one line to stderr before it starts ("kvcompile:
compiling the prefill graph (30 layers) with Inductor …") and one with the time after;
a reused graph prints nothing. `PROGRESS = False` silences them.

Warm start: Inductor's on-disk caches (FX graph cache and AOTAutograd cache, under
TORCHINDUCTOR_CACHE_DIR) serve a second process: dynamo still traces the model and the
passes still run, Inductor's code generation and C++ compile are skipped (the custom op
hashes by name; nothing here makes a graph uncacheable: benchmarks/bench_compile.py).
`COMPILES[i]["cache"]` records what Inductor's counters said for each graph.
"""
from __future__ import annotations

import copy
import functools
import sys
import time
import types

import torch
import torch.fx.experimental._config as fx_config
from torch._dynamo.convert_frame import compile_lock
from torch._dynamo.utils import counters
from torch.fx import GraphModule
from torch.fx.experimental.symbolic_shapes import is_symbolic
from transformers.cache_utils import Cache

from kvcompile import cache as cache_arg
from kvcompile.cache import KVCompileCache
from kvcompile.cache_ref import NotTraced
from kvcompile.passes.dead import remove_dead
from kvcompile.passes.find import PassError, find_attention
from kvcompile.passes.rewrite import rewrite_attention, shape

# dynamo keeps the graphs of every model compiled with one backend (models of one shape: each
# prefill and decode, under no_grad and under inference_mode) on one code object
# (`traced_function`), whose default limit of 8 entries two model classes already fill (and with
# fullgraph=True the ninth is a hard failure). Each compiled model adds at most 4 entries.
RECOMPILE_LIMIT = 64

# The compiled entry's one lock, held only while a call traces (module doc, "Threads"): dynamo's own.
TRACING = compile_lock

COMPILES: list[dict] = []  # one record per graph the backend compiled (layers, nodes removed, seconds, ...)
PROGRESS = True  # one line on stderr before and after each Inductor compile

# Inductor's C++ kernels open an OpenMP parallel region as soon as a loop has
# cpp.min_chunk_size (default 512) elements per thread. A decode step is made of such
# tiny kernels (a 1536-wide SiLU, a 576-wide norm): each region forks and joins every
# thread, and while another process holds a core the join waits for a time slice: on
# the shared 2-core machine a decode step took up to 1.6 s instead of 40 ms (ATen ops only
# go parallel past 32768 elements). Graphs with a static query length (decode, whose
# batch and mask length are symbolic but only feed the op or stay small) go parallel only
# past SERIAL_WORK elements per thread. Graphs with a symbolic length (prefill) keep
# Inductor's default: their kernels grow with the prompt, and the parallel choice is
# made once, at compile time, from the first prompt's length.
SERIAL_WORK = 1 << 18


def _symbols(size) -> set:
    return set(size.node.expr.free_symbols) if isinstance(size, torch.SymInt) and is_symbolic(size) else set()


def inductor_options(example_inputs, tokens=None, fixed_work=()) -> dict:
    """Inductor config for one graph (see SERIAL_WORK). A graph whose work grows with a
    symbolic size keeps Inductor's default; a static graph gets serial small loops.
    `tokens`: the attention calls' query length (new tokens per sequence); when it is
    static (decode), the sizes in `fixed_work` (the batch, the padding mask's sizes: the
    mask only feeds the op) do not count as growing work."""
    if tokens is not None and _symbols(tokens):
        return {}
    exempt = set().union(*(_symbols(size) for size in fixed_work)) if tokens is not None else set()
    sizes = [s for x in example_inputs for s in (x.shape if isinstance(x, torch.Tensor) else (x,))]
    symbolic = any(_symbols(size) - exempt for size in sizes)
    return {} if symbolic else {"cpp.min_chunk_size": SERIAL_WORK}


def run_passes(gm: GraphModule, kv_heads: int | None = None, num_layers: int | None = None,
               require_marker: bool = False, engine: tuple[int | None, ...] | None = None) -> dict:
    """find_attention → rewrite_attention → remove_dead, in place. With `num_layers`, every
    layer 0 … L−1 must have its attention call (none may run uncompressed). `require_marker`:
    the graph must hold the compiled entry's `kvcompile.cache_input` call (a graph without one
    gets its cache's `ref` and `token` as two inputs after its own: `rewrite.cache_inputs`). `engine`: a hybrid
    model's layers (rewrite_attention: its local layers' calls go to their windows)."""
    found = find_attention(gm)
    layers = sorted(layer for _, layer in found)
    if num_layers is not None and layers != list(range(num_layers)):
        raise PassError(f"kvcompile: attention found in layers {layers}, expected layers 0 … {num_layers - 1} "
                        "(a graph break? compile with fullgraph=True)")
    new = rewrite_attention(gm, found, kv_heads=kv_heads, require_marker=require_marker, engine=engine)
    removed = remove_dead(gm)
    q = shape(new[0].args[0]) if new else None
    mask = shape(new[0].args[3]) if new and new[0].args[3] is not None else None
    fixed_work = ((q[0],) if q else ()) + (tuple(mask) if mask else ())
    return {"layers": layers, "removed": removed, "tokens": q[2] if q else None, "fixed_work": fixed_work}


def graph_kind(tokens) -> str:
    """"decode" for a graph of one new token per sequence, else "prefill"."""
    return "decode" if isinstance(tokens, int) and tokens == 1 else "prefill"


def _cache_counts() -> dict:
    inductor = counters["inductor"]
    return {"hit": inductor["fxgraph_cache_hit"], "miss": inductor["fxgraph_cache_miss"],
            "bypass": inductor["fxgraph_cache_bypass"], "aot_hit": counters["aot_autograd"]["autograd_cache_hit"]}


def _say(message: str) -> None:
    if PROGRESS:
        print(message, file=sys.stderr, flush=True)


def backend(gm: GraphModule, example_inputs, *, kv_heads: int | None = None, num_layers: int | None = None,
            inductor: bool = True, engine: tuple[int | None, ...] | None = None):
    """torch.compile backend: the kvcompile passes, then Inductor (`inductor=False`: the
    rewritten graph runs as is, for tests and debugging)."""
    from torch._inductor.compile_fx import compile_fx

    start = time.perf_counter()
    record = run_passes(gm, kv_heads, num_layers, require_marker=True, engine=engine)
    if not inductor:
        record.pop("fixed_work")
    record["kind"] = kind = graph_kind(record["tokens"])
    if inductor:
        record["options"] = inductor_options(example_inputs, record["tokens"], record.pop("fixed_work"))
        before = _cache_counts()
        layers = len(record["layers"])
        _say(f"kvcompile: compiling the {kind} graph ({layers} layer{'s' * (layers != 1)}) with Inductor …")
        with torch._inductor.config.patch(record["options"]):
            compiled = compile_fx(gm, example_inputs)
        after = _cache_counts()
        record["cache"] = next((name for name in ("hit", "aot_hit", "bypass", "miss") if after[name] > before[name]),
                               None)
    else:
        compiled = gm.forward
    record["seconds"] = time.perf_counter() - start
    record["inductor"] = inductor
    COMPILES.append(record)
    if inductor:
        note = {"hit": " (Inductor cache hit)", "aot_hit": " (AOTAutograd cache hit)"}.get(record["cache"], "")
        _say(f"kvcompile: compiled the {kind} graph in {record['seconds']:.1f} s{note}")
    return _plain_shapes(compiled)


def _plain_shapes(compiled):
    """`compiled`, run with backed_size_oblivious off: the flag is for tracing the model
    (compile_forward), not for what the op compiles while it runs (the kernels'
    torch.compile'd lowerings keep torch's default 0/1 specialisation). Only the tracing
    thread (which holds TRACING) runs a graph with the flag on, right after tracing it;
    another thread leaves the process-wide flag alone (it would switch it off under the
    tracing thread), and any compile of its own waits for TRACING, the flag restored."""
    def run(*args):
        if not (fx_config.backed_size_oblivious and TRACING._is_owned()):
            return compiled(*args)
        with fx_config.patch(backed_size_oblivious=False):
            return compiled(*args)

    run._boxed_call = getattr(compiled, "_boxed_call", False)
    return run


@functools.cache
def make_backend(kv_heads: int | None = None, num_layers: int | None = None, inductor: bool = True,
                 engine: tuple[int | None, ...] | None = None):
    """One backend object per model shape, so dynamo reuses compiled graphs across
    compile_forward calls (a new backend object would compile again)."""
    return functools.partial(backend, kv_heads=kv_heads, num_layers=num_layers, inductor=inductor, engine=engine)


def _forward_with_cache(forward, kvcompile_ref, kvcompile_token, *args, **kwargs):
    """What torch.compile traces: the cache's inputs marked (kvcompile.cache_ref.cache_input: raises
    NotTraced where this runs eagerly), then the model's forward."""
    torch.ops.kvcompile.cache_input(kvcompile_ref, kvcompile_token)
    return forward(*args, **kwargs)


@functools.cache
def traced_function(kv_heads: int | None = None, num_layers: int | None = None, inductor: bool = True,
                    engine: tuple[int | None, ...] | None = None):
    """`_forward_with_cache` for one backend (`make_backend`'s arguments), with a code object of its
    own: dynamo keeps graphs per code object, and its run-only mode (module doc, "Threads") runs any
    graph whose guards pass, whichever backend compiled it. Its name is made of the arguments, the same
    in every process."""
    code = _forward_with_cache.__code__
    name = f"_forward_with_cache_{kv_heads}_{num_layers}_{'inductor' if inductor else 'passes'}"
    if engine is not None:  # a hybrid model: which layers are local ("w") or compressed ("c")
        name += "_" + "".join("w" if e is None else "c" for e in engine)
    code = code.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, _forward_with_cache.__globals__, name)


class GraphCache(Cache):
    """The cache the traced forward sees: stores nothing, reports no past (see module doc)."""

    is_compileable = False

    def __init__(self):
        super().__init__(layers=[])

    def update(self, key_states, value_states, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0


_GRAPH_CACHE = GraphCache()


def _with_cache(out, stand_in, cache):
    if hasattr(out, cache_arg.NAME):
        setattr(out, cache_arg.NAME, cache)
    elif isinstance(out, tuple):
        out = tuple(cache if item is stand_in else item for item in out)
    return out


_INPUTS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids")


def _same_kind(args, kwargs) -> tuple:
    """The graph's tensor inputs as tensors of the caller's autograd mode. Dynamo guards on
    each input's dispatch keys, which differ between an inference tensor (made under
    torch.inference_mode) and a normal one: a mask made outside inference_mode beside ids
    that generate() made inside it would give the graph another variant. A mismatched
    input is cloned (B × N integers at most). The mode itself stays part of the guards:
    calls under no_grad and under inference_mode get a graph pair each."""
    inference = torch.is_inference_mode_enabled()

    def fix(t):
        return t.clone() if isinstance(t, torch.Tensor) and t.is_inference() != inference else t

    for name in _INPUTS:
        if name in kwargs:
            kwargs[name] = fix(kwargs[name])
    return (fix(args[0]), *args[1:]) if args else args


def _mark_dynamic(args, kwargs) -> None:
    """The batch (dim 0) and sequence lengths (dim 1 of the ids, embeddings, mask and
    positions) become symbolic from the first call (size 1 included, under
    backed_size_oblivious: see the module doc). Dim 1 of a one-token call (decode) is
    marked static: dynamo would otherwise carry the prefill's dynamic length over to it
    and, with 0/1 specialisation off, trace decode with a symbolic query length."""
    tensors = [args[0]] if args else []
    tensors += [kwargs.get(name) for name in _INPUTS]
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            continue
        torch._dynamo.maybe_mark_dynamic(t, 0)
        if t.shape[1] > 1:
            torch._dynamo.maybe_mark_dynamic(t, 1)
        else:
            torch._dynamo.mark_static(t, 1)


def compile_forward(model, forward=None, *, dynamic: bool | None = None, inductor: bool = True,
                    kv_heads: int | None = None, engine: tuple[int | None, ...] | None = None) -> "CompiledForward":
    """`forward` (default: the model class's forward) compiled with the kvcompile backend.

    The returned callable takes the model's forward arguments. With a KVCompileCache as
    `past_key_values` it runs the compiled graph (inference only, under no_grad) with that
    cache bound; otherwise (no cache, use_cache=False) it runs `forward` as is — plain
    attention, what the eager entry does then. The model must keep
    attn_implementation="sdpa" (a soft-capped or sinked model: kvcompile.passes.site.NAME). `dynamic` is torch.compile's; the default (None) keeps
    everything static but the batch and the sequence lengths (a float made symbolic, as
    dynamic=True does with the model's eps and scaling, would be read at run time). A call
    without an attention_mask or position_ids gets them here, so that every call has the
    same graph inputs (module doc, "Shapes"). `kv_heads`: the KV heads each attention computes
    (a tensor-parallel rank's; default the config's). `engine`: a hybrid model's layers
    (kvcompile.layer_kinds.LayerKinds.engine): its local layers' attention goes to their windows
    (`kvcompile.attend_window`), the others' to the op under their number among the compressed layers.
    """
    from kvcompile.passes.site import NAME

    config = model.config
    if config._attn_implementation not in ("sdpa", NAME):
        raise PassError(f"kvcompile: the compiled entry needs attn_implementation='sdpa' (or, on a model that "
                        f"soft-caps its logits or has learned sinks, {NAME!r}: kvcompile.passes.site), the model "
                        f"has {config._attn_implementation!r}")
    forward = forward or type(model).forward.__get__(model)
    return CompiledForward(forward, (kv_heads or config.num_key_value_heads, config.num_hidden_layers, inductor,
                                     None if engine is None else tuple(engine)), dynamic)


class CompiledForward:
    """A model's forward through torch.compile with the kvcompile backend (`compile_forward`).

    It holds the forward it compiles (a method bound to the model), so `copy.deepcopy` of a
    compiled model gives the copy a CompiledForward of the copy's own forward (its weights):
    the torch.compile'd function is made again for it (dynamo's guards decide whether the
    copy reuses the original's graphs). `key`: `make_backend`'s arguments (KV heads, layers,
    Inductor or not, a hybrid model's layers). It holds no cache and no lock: each call passes its cache to the graph."""

    def __init__(self, forward, key: tuple, dynamic):
        self.forward, self.key, self.dynamic = forward, key, dynamic
        self.backend = make_backend(*key)
        traced = traced_function(*key)
        self.kvcompile_compiled = torch.compile(traced, dynamic=dynamic, fullgraph=True, backend=self.backend)
        self.kvcompile_run = torch._dynamo.run(traced)  # the compiled graphs only, never a trace
        functools.update_wrapper(self, forward, updated=())

    def __deepcopy__(self, memo):
        return CompiledForward(copy.deepcopy(self.forward, memo), self.key, self.dynamic)

    def __call__(self, *args, **kwargs):
        forward = self.forward
        past_key_values = cache_arg.take(kwargs)
        kwargs.pop("kvcompile_cache", None)
        if not isinstance(past_key_values, KVCompileCache):
            return forward(*args, **cache_arg.given(past_key_values), **kwargs)
        tokens = args[0] if args else kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs["inputs_embeds"]
        t, start = tokens.shape[1], past_key_values.seq_length
        b = tokens.shape[0]
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = (torch.arange(t, device=tokens.device) + start)[None].expand(b, t).contiguous()
        if kwargs.get("attention_mask") is None:
            kwargs["attention_mask"] = torch.ones(b, start + t, dtype=torch.long, device=tokens.device)
        keep = kwargs.get("logits_to_keep")
        if isinstance(keep, int) and not isinstance(keep, bool) and 0 < keep <= t:  # B-free folding (module doc)
            kwargs["logits_to_keep"] = torch.arange(-keep, 0, device=tokens.device)
        args = _same_kind(args, kwargs)
        _mark_dynamic(args, kwargs)
        inputs = (forward, past_key_values.ref, past_key_values.token, *args)
        with torch.no_grad():
            try:  # a compiled graph fits: it runs, nothing locked or patched (module doc, "Threads")
                out = self.kvcompile_run(*inputs, **cache_arg.given(_GRAPH_CACHE), **kwargs)
            except NotTraced:
                out = self._trace(inputs, kwargs)
        if past_key_values.seq_length != start + t:
            raise PassError("kvcompile: the compiled forward did not run kvcompile.attend in every layer; "
                            "the cache was not updated")
        return _with_cache(out, _GRAPH_CACHE, past_key_values)

    def _trace(self, inputs, kwargs):
        """The call, traced first: under TRACING, with the configuration tracing needs (module doc)."""
        with TRACING, fx_config.patch(backed_size_oblivious=True), \
                torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, specialize_float=True):
            # specialize_float: a model's float attributes (its attention scale) stay constants of its graph;
            # else, once a second model of the same class with another head dim recompiles the shared code
            # object, dynamo makes the float a graph input and the op's scale is no longer known
            try:
                return self.kvcompile_compiled(*inputs, **cache_arg.given(_GRAPH_CACHE), **kwargs)
            except NotTraced:  # dynamo ran the function eagerly instead (e.g. the recompile limit was reached)
                raise PassError("kvcompile: dynamo did not compile the forward (it ran it eagerly: see "
                                "TORCH_LOGS=recompiles), so kvcompile.attend would not run; the cache was not "
                                "updated") from None
