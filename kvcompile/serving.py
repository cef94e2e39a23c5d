"""kvcompile inside transformers' continuous batching (`init_continuous_batching`, `generate_batch`,
`transformers serve`'s engine). docs/INTERNALS.md "Continuous batching: how kvcompile plugs in".

Design: every request gets its own `KVCompileCache` (one sequence, kvcompile's per-(layer, head)
pages), run by the same runtime and op as `generate()`, so a request's tokens are those of
`model.generate` with the same spec. transformers' engine keeps what it does well: the queue, the
scheduler, packing many requests' tokens into one forward (the projections and MLPs run as one
matrix product over all requests), sampling, streaming. Its block pool becomes kvcompile's byte
budget: a request holds the pool blocks that cover the bytes of its kvcompile pages, so admission
by free blocks admits by what requests really hold. The prompt's blocks are reserved before the
prefill (what the compressed prompt can hold at most), and after the forward that compresses it
the request keeps only the blocks its pages need: the rest go back to the pool and the scheduler
admits more requests into them. Head-wise budgets (AdaKV, LAVa) free their real memory the same way,
since kvcompile's pages are per (layer, head).

The pieces, each installed on the engine's own objects:
- `KVCompileBatchingManager` (a `ContinuousBatchingManager`): what `model.init_continuous_batching`
  returns on a compiled model (compile() installs it); refuses at start what cannot run, switches the
  model to the "kvcompile_batching" attention, and builds the cache and processor below.
- `KVCompilePagedCache` (a `PagedAttentionCache`): the pool as a byte budget; per-request
  kvcompile caches (`BatchingState`); reservation before a forward, release after it.
- `KVCompileBatchProcessor` (a `ContinuousBatchProcessor`): tells the cache which requests (and how
  many tokens of each) the next forward packs, and syncs their blocks after it.
- `batching_attention`: the attention function; cuts the packed tokens per request and runs
  `torch.ops.kvcompile.attend` on each request's cache (prefill + compression, or decode).

The pool's own cache tensor is released: kvcompile's pages are its own tensors, bounded by the
pool's budget (carving them out of the pool's memory is future work, see INTERNALS).
"""
from __future__ import annotations

import copy
import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION
from transformers.generation.continuous_batching.continuous_api import (ContinuousBatchingManager,
                                                                        ContinuousBatchProcessor)
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.masking_utils import AttentionMaskInterface

from kvcompile.cache import KVCompileCache, LayerStore
from kvcompile.errors import CompileError
from kvcompile.plan import Plan
from kvcompile.runtime import kvcompile_attention, kvcompile_mask

BATCHING_ATTENTION = "kvcompile_batching"  # the attention implementation name while the engine runs


class BatchingError(CompileError):
    """A compiled model, policy or engine configuration that continuous batching cannot run."""


# --- per-request state --------------------------------------------------------------------

@dataclass
class RequestKV:
    """One request's kvcompile cache (one sequence) and its prompt length."""

    cache: KVCompileCache
    prompt_length: int  # tokens of the prompt the cache compresses (the request's initial tokens)

    @property
    def compressed(self) -> bool:
        return all(store is not None for store in self.cache.stores)


@dataclass(frozen=True)
class RequestUsage:
    """What a finished request held at its end: pool blocks against what its full cache would need."""

    request_id: str
    tokens: int  # logical length: prompt + generated tokens
    bytes: int  # bytes of its kvcompile cache
    blocks: int  # pool blocks it held
    full_blocks: int  # blocks the uncompressed cache of `tokens` tokens takes in the engine


@dataclass
class Segment:
    """A run of the packed batch's tokens: `length` tokens of one request."""

    request_id: str
    kv: RequestKV
    length: int


@dataclass
class BatchingState:
    """What the cache keeps across forwards: the plan, each live request's cache, the next forward's
    segments (in the order of the packed tokens) and counters for reports."""

    plan: Plan
    bytes_per_block: int  # one pool block: page_size tokens of K and V for every layer and KV head
    requests: dict[str, RequestKV] = field(default_factory=dict)
    batch: list[Segment] = field(default_factory=list)
    peak_requests: int = 0  # the most requests holding a cache at the same time
    blocks_released: int = 0  # pool blocks given back after compression, over the whole run
    finished: deque = field(default_factory=lambda: deque(maxlen=1024))  # RequestUsage of the latest requests


@dataclass
class _Reservation:
    """What PagedAttentionCache.can_store_request_tokens reads of a request (its id, its length), for a
    reservation of `length` tokens' worth of blocks."""

    request_id: str
    length: int

    def current_len(self) -> int:
        return self.length


# --- bytes ----------------------------------------------------------------------------------

_PAGE_FIELDS = ("k_pages", "v_pages", "score_pages", "pos_pages", "count_pages")


def store_bytes(store: LayerStore) -> int:
    """Bytes one layer's store holds (pages allocated in its pool, block table and per-head counters)."""
    return sum(getattr(store, f.name).nbytes for f in dataclasses.fields(store)
               if isinstance(getattr(store, f.name), Tensor))


def page_bytes(store: LayerStore) -> int:
    """Bytes of one page (its entries' key, value, score, position and count)."""
    return sum(getattr(store, name)[0].nbytes for name in _PAGE_FIELDS)


def step_growth_bytes(store: LayerStore, step: int) -> int:
    """Bytes the store grows by when every head appends one entry (`cache.append`): nothing while each
    head has room in its pages; a head on a full last page without spares takes a run of `step` pages,
    from the pool's free pages or from a grown pool (`cache._grow`)."""
    s = store.page_size
    e = store.lengths
    col = e // s
    fresh = int(((col >= store.owned) & (e % s == 0)).sum())
    if not fresh:
        return 0
    b, h = e.shape
    pages = store.k_pages.shape[0]
    grown = 0
    if store.next_page + fresh * step > pages:
        grown = max(fresh * step, pages // 4, b * h) * page_bytes(store)
    width = int(col.max()) + step
    table = max(0, width - store.block_table.shape[-1]) * b * h * store.block_table.element_size()
    return grown + table


def request_bytes(kv: RequestKV) -> int:
    """Bytes a request's kvcompile cache holds now: its stores, or the prompt chunks it holds until the
    chunk that ends the prompt."""
    cache = kv.cache
    held = sum(store_bytes(s) for s in cache.stores if s is not None)
    if cache.chunks is not None:
        held += sum(t.nbytes for part in (cache.chunks.keys, cache.chunks.values, cache.chunks.queries)
                    for t in part if t is not None)
    return held


def prompt_bound_bytes(plan: Plan, tokens: int, elt: int, query_heads: int, chunked: bool) -> int:
    """The most a request's cache holds while and after a prompt of `tokens` tokens is compressed.

    Pages: where the layer totals follow from the length alone (`plan.static_totals`: per_head / ratio
    budgets), a layer of total T holds at most ceil(T/S) + H pages of entries however its heads share T
    (each head rounds up once), else each head at most its tokens; every head adds its spare pages
    (`build_store`). A prompt in chunks (`chunked`) holds every layer's keys, values and the query rows
    the scorer reads until its last chunk, which compresses layer after layer (a layer's chunks are let
    go as it is compressed): the larger of the two, plus one layer's chunks. The prompt's attention
    itself (one layer's full K/V at a time) is the forward's activation memory, not the cache's."""
    s, d = plan.page_size, plan.head_dim
    heads, layers = len(plan.kv_heads), plan.num_layers
    whole = heads * math.ceil(tokens / s)  # pages of every head holding all its tokens
    if plan.static_totals:
        from kvcompile.allocation import layer_totals

        totals = layer_totals(plan.policy, torch.tensor([tokens]), layers, plan.num_heads)[0].tolist()
        pages = sum(min(math.ceil(t / s) + heads, whole) for t in totals)
    else:
        pages = layers * whole
    pages += layers * heads * plan.spare_pages
    entry = 2 * d * elt + 4 + 8 + 4  # key, value; score float32, position int64, count float32
    width = math.ceil(tokens / s) + plan.spare_pages
    stores = pages * s * entry + layers * heads * (width * 8 + 4 * 8)  # + block table and per-head counters
    if not chunked:
        return stores
    rows = min(tokens, plan.policy.scoring.query_rows(tokens))
    chunk = (heads * tokens * 2 * d + query_heads * rows * d) * elt  # one layer's
    return max(stores, layers * chunk) + chunk


# --- the pool as kvcompile's byte budget -------------------------------------------------------

class KVCompilePagedCache(PagedAttentionCache):
    """transformers' paged cache whose blocks are a byte budget for kvcompile's per-request caches.

    A request's blocks cover the bytes of its kvcompile cache: before a forward, the scheduler reserves
    (through `can_store_request_tokens`) what the request can hold after it (a prompt: its compressed
    bound; a decode step: the pages the append may take); after the forward `sync_blocks` keeps the
    blocks its cache really needs and gives the others back to the pool. The engine's own K/V tensor
    is never read or written (kvcompile's op stores the entries), so it is released.
    """

    kvcompile: BatchingState

    @classmethod
    def adopt(cls, cache: PagedAttentionCache, plan: Plan) -> "KVCompilePagedCache":
        """Turn the engine's cache (built by ContinuousBatchingManager._create_batch_processor) into this
        class: one full-attention allocator, no prefix sharing."""
        if list(cache.cache_allocators) != [FULL_ATTENTION]:
            raise BatchingError(f"kvcompile: continuous batching needs full-attention layers only, the engine made "
                                f"{list(cache.cache_allocators)}")
        cache.__class__ = cls
        allocator = cache.cache_allocators[FULL_ATTENTION]
        cache.kvcompile = BatchingState(plan, allocator.bytes_per_block)
        cache.use_prefix_sharing = False
        # kvcompile reads its own pages, never the engine's read indices: the scheduler's per-batch read
        # budget (the size of those index tensors, counted in logical tokens) does not apply.
        cache.read_cache_limit = 0
        # the engine's K/V tensor is never used: release it (the allocator's views hold it too)
        cache.cache_tensor = torch.empty(0, dtype=torch.uint8, device=cache.device)
        for name in ("cache_tensor", "_copy_view"):
            if hasattr(allocator, name):
                setattr(allocator, name, cache.cache_tensor)
        allocator._kv_token_views, allocator._kv_page_views = {}, {}
        return cache

    # --- what the engine calls ----------------------------------------------------------------
    def can_store_request_tokens(self, state, request_len: int, dry_run: bool = False) -> bool:
        tokens = self.reserved_tokens(state, request_len)
        return super().can_store_request_tokens(_Reservation(state.request_id, tokens), 0, dry_run)

    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index) -> None:
        return None  # kvcompile's op reads and writes its own pages

    def fill_block_table(self, request_id, past_length, query_length, block_table) -> None:
        return None

    def update(self, key_states, value_states, layer_idx, kwargs):
        raise RuntimeError("kvcompile: the engine's cache update ran on a compiled model; its attention must be "
                           f"{BATCHING_ATTENTION!r} (see kvcompile.serving)")

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        state = self.kvcompile
        kv = state.requests.pop(request_id, None)
        if kv is not None and kv.compressed:
            tokens = kv.cache.seq_length
            state.finished.append(RequestUsage(request_id, tokens, request_bytes(kv),
                                               len(self.allocator.block_table.get(request_id, [])),
                                               math.ceil(tokens / self.allocator.tokens_per_page)))
        super().free_blocks(request_id, no_cache=True)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        super().free_all_requests(clear_ledgers)
        self.kvcompile.requests.clear()
        self.kvcompile.batch = []

    def prepare_fork_request(self, src_state, dst_req_ids, copy_src_and_dst):
        raise BatchingError("kvcompile: forking a request (num_return_sequences > 1) is not supported")

    # --- kvcompile's side ---------------------------------------------------------------------
    @property
    def allocator(self):
        return self.cache_allocators[FULL_ATTENTION]

    def reserved_tokens(self, state, request_len: int) -> int:
        """Tokens' worth of blocks (a multiple of the page size) the request must hold during its next
        forward of `request_len` tokens."""
        plan, kv = self.kvcompile.plan, self.kvcompile.requests.get(state.request_id)
        if kv is not None and kv.compressed:
            step = kv.cache.plan.spare_pages  # a head past its spares takes this many pages (cache.append)
            need = request_bytes(kv) + sum(step_growth_bytes(s, step) for s in kv.cache.stores) * request_len
        else:
            plan = plan.with_headroom(getattr(state, "max_new_tokens", None) or 0)
            prompt = len(state.initial_tokens)
            need = prompt_bound_bytes(plan, prompt, self.dtype.itemsize, self.config.num_attention_heads,
                                      chunked=kv is not None or request_len < prompt)
        return math.ceil(need / self.kvcompile.bytes_per_block) * self.allocator.tokens_per_page

    def begin_batch(self, scheduled) -> None:
        """The next forward's requests (FutureRequestStates, in the order of the packed tokens); a request
        seen for the first time gets its cache, sized for its max_new_tokens as generate() sizes it."""
        state = self.kvcompile
        batch = []
        for future in scheduled:
            request = future.state
            kv = state.requests.get(request.request_id)
            if kv is None:
                prompt = len(request.initial_tokens)
                if request.position_offset - future.query_length != 0:
                    raise BatchingError(f"kvcompile: request {request.request_id} starts at token "
                                        f"{request.position_offset - future.query_length}, not 0 (prefix sharing or "
                                        "an offloaded request, which kvcompile does not restore)")
                headroom = request.max_new_tokens or 0
                kv = RequestKV(KVCompileCache.from_plan(state.plan.with_headroom(headroom)), prompt)
                if future.query_length < prompt:  # the engine splits the prompt: compressed when it ends
                    kv.cache.expect_prompt(prompt)
                state.requests[request.request_id] = kv
            batch.append(Segment(request.request_id, kv, future.query_length))
        state.batch = batch
        state.peak_requests = max(state.peak_requests, len(state.requests))

    def sync_blocks(self) -> None:
        """After a forward: every request of the batch keeps the blocks that cover what its cache holds;
        the others go back to the pool (after a prompt's compression, most of them)."""
        state = self.kvcompile
        allocator = self.allocator
        for segment in state.batch:
            kv = state.requests.get(segment.request_id)
            table = allocator.block_table.get(segment.request_id)
            if kv is None or table is None:
                continue
            held = request_bytes(kv)
            if not kv.compressed:  # a prompt in chunks keeps its reservation until it is compressed
                continue
            blocks = math.ceil(held / state.bytes_per_block)
            if blocks > len(table):
                raise RuntimeError(f"kvcompile: request {segment.request_id} holds {held} bytes, more than its "
                                   f"{len(table)} reserved blocks ({len(table) * state.bytes_per_block} bytes)")
            if blocks < len(table):
                freed = table[blocks:]
                del table[blocks:]
                self.pool.free_blocks(allocator.index, freed)
                state.blocks_released += len(freed)
        state.batch = []

    def memory_report(self) -> dict:
        """The pool and what each live request holds, in bytes and blocks."""
        state = self.kvcompile
        allocator = self.allocator
        per_request = {rid: {"bytes": request_bytes(kv), "blocks": len(allocator.block_table.get(rid, [])),
                             "compressed": kv.compressed}
                       for rid, kv in state.requests.items()}
        return {"bytes_per_block": state.bytes_per_block, "num_blocks": self.num_blocks,
                "free_blocks": self.pool.count_free_blocks(allocator.index)
                + self.pool.num_free_sectors * allocator.blocks_per_sector,
                "requests": per_request, "peak_requests": state.peak_requests,
                "blocks_released": state.blocks_released, "finished": list(state.finished)}


class KVCompileBatchProcessor(ContinuousBatchProcessor):
    """The engine's batch processor, telling the cache what each forward packs and syncing blocks after."""

    cache: KVCompilePagedCache

    def prepare_next_batch(self) -> bool:
        ready = super().prepare_next_batch()
        if ready:
            self.cache.begin_batch(self.inputs_and_outputs.requests_in_batch)
        return ready

    def update_batch(self) -> None:
        self.cache.sync_blocks()
        super().update_batch()


# --- the attention ---------------------------------------------------------------------------

def batching_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None,
                       dropout: float = 0.0, cache=None, **kwargs):
    """The attention of a packed batch (1, H, T, d): each request's run of tokens through
    `torch.ops.kvcompile.attend` on its own cache, as generate() runs it (prefill + compression, a
    prompt chunk, or decode steps). A call from outside the engine while it runs (generate() on the same
    model) takes kvcompile's ordinary attention."""
    if not isinstance(cache, KVCompilePagedCache):
        return kvcompile_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                   **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    batch = cache.kvcompile.batch
    total = sum(seg.length for seg in batch)
    if total != query.shape[2]:
        raise RuntimeError(f"kvcompile: the forward packs {query.shape[2]} tokens, the scheduled requests {total}")
    outs, start = [], 0
    for seg in batch:
        end = start + seg.length
        outs.append(torch.ops.kvcompile.attend(query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                               None, module.layer_idx, seg.kv.cache.handle, scale))
        start = end
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


# --- the manager ------------------------------------------------------------------------------

def check_batching(model, plan: Plan, generation_config, cb_config: ContinuousBatchingConfig) -> None:
    """Refuse, before the engine starts, what continuous batching cannot run with kvcompile."""
    saved = getattr(model, "_kvcompile", {})
    if saved.get("mode") == "compiled":
        raise BatchingError("kvcompile: continuous batching runs the eager entry; compile the model with "
                            "mode='eager' (the compiled entry's graph is traced for generate()'s cache)")
    if plan.shard is not None:
        raise BatchingError("kvcompile: continuous batching of a tensor-parallel model is not supported yet")
    if plan.prune_every:
        raise BatchingError(f"kvcompile: {plan.policy.name} prunes every {plan.prune_every} tokens while decoding, "
                            "which rebuilds a head's pages; continuous batching does not account for it yet")
    if plan.prefill_chunk:
        raise BatchingError(f"kvcompile: {plan.policy.name} compresses its prompt every {plan.prefill_chunk} tokens, one "
                            "forward per chunk (schedule.prefill: chunk); the engine cuts prompts at its own token "
                            "budget and packs other requests with them, which continuous batching does not align yet")
    if getattr(model.config, "sliding_window", None) is not None and not getattr(model.config, "layer_types", None):
        raise BatchingError("kvcompile: the engine treats a model with a sliding window as sliding-attention "
                            "layers, which kvcompile does not implement")
    if (getattr(generation_config, "num_return_sequences", None) or 1) > 1:
        raise BatchingError("kvcompile: num_return_sequences > 1 forks a request's cache, which continuous "
                            "batching with kvcompile does not support")
    if cb_config.use_async_batching:
        raise BatchingError("kvcompile: use_async_batching=True prepares a batch while the previous forward "
                            "runs; kvcompile releases a request's blocks after its forward (synchronous only)")
    if cb_config.cpu_offload_space:
        raise BatchingError("kvcompile: cpu_offload_space copies the engine's blocks, which hold nothing on a "
                            "compiled model (kvcompile's pages are its own); leave it at 0")
    if cb_config.varlen_compile_config is not None or cb_config.decode_compile_config is not None or \
            cb_config.q_padding_interval_size or cb_config.kv_padding_interval_size:
        raise BatchingError("kvcompile: compiled or padded (CUDA graph) forwards of the engine are not supported "
                            "with kvcompile's op; leave varlen/decode_compile_config and the padding intervals unset")


class KVCompileBatchingManager(ContinuousBatchingManager):
    """`model.init_continuous_batching()` of a compiled model: the engine with kvcompile's caches."""

    def __init__(self, model, generation_config, continuous_batching_config, workload_hints=None, *, plan: Plan):
        cb = copy.deepcopy(continuous_batching_config)
        check_batching(model, plan, generation_config, cb)
        cb.use_async_batching = False
        cb.allow_block_sharing = False  # prefix sharing: a compressed request's blocks hold no tokens
        self.kvcompile_plan = plan
        super().__init__(model, generation_config, cb, workload_hints)

    def switch_to_cb_friendly_attn(self, model, auto_switch_to_flash: bool = True) -> None:
        current = model.config._attn_implementation
        if current != BATCHING_ATTENTION:
            AttentionInterface.register(BATCHING_ATTENTION, batching_attention)
            # the engine passes no mask (each request attends causally over its own cache); generate() on the
            # same model meanwhile gets kvcompile's own
            AttentionMaskInterface.register(BATCHING_ATTENTION, kvcompile_mask)
            model.set_attn_implementation(BATCHING_ATTENTION)
            self._original_attn_impl = current

    def _create_batch_processor(self) -> ContinuousBatchProcessor:
        processor = super()._create_batch_processor()
        if not isinstance(processor.cache, KVCompilePagedCache):
            KVCompilePagedCache.adopt(processor.cache, self.kvcompile_plan)
            processor.__class__ = KVCompileBatchProcessor
        return processor


def init_continuous_batching(model, generation_config=None, continuous_batching_config=None, workload_hints=None):
    """`ContinuousMixin.init_continuous_batching` for a compiled model (compile() installs it on the
    instance): the same arguments and cached-manager rule, returning a KVCompileBatchingManager."""
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if isinstance(cached, ContinuousBatchingManager):
        cached.switch_to_cb_friendly_attn(model, cached.continuous_batching_config.auto_switch_to_flash)
        return cached
    gen = generation_config if generation_config is not None else model.generation_config
    if gen is None:
        raise ValueError("A GenerationConfig must be provided or set in the model.")
    if gen.eos_token_id is None:
        gen.eos_token_id = -1
    if continuous_batching_config is None:
        continuous_batching_config = getattr(gen, "continuous_batching_config", None)
        if not isinstance(continuous_batching_config, ContinuousBatchingConfig):
            continuous_batching_config = ContinuousBatchingConfig()
    return KVCompileBatchingManager(model, gen, continuous_batching_config, workload_hints,
                                    plan=model.kvcompile_plan)
