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

Reservation rule: before every forward a request reserves an upper bound of what it holds after it
(a prompt: its compressed bound; a decode step: its bytes now plus what one append can take: the page store's
`LayerStore.nbytes` and `growth_bytes`), and
`sync_blocks` raises if a request ever holds more than it reserved. A request's cache is built as
generate() builds it, `plan.with_headroom(max_new_tokens)`: its heads get spare pages for the tokens
they will append, at most `plan.SPARE_RUN` pages each (64 tokens at the default page size) whatever
max_new_tokens is, so the 1024 new tokens transformers serve asks by default reserve what 64 do; past
its spares a head takes its next run of pages while decoding, reserved one step ahead. A smaller
headroom (one spare page) would admit a request with up to 3 pages per head less, but 16 to 31 decode
steps later its first head on a full page grows the layer's pool by a quarter (`LayerStore.append`), at 256
entries per head more than those 3 pages: admission would promise memory the request needs soon after,
paid for with soft resets, and its heads' pages would stop being the runs the decode kernel streams.
So the spares stay generate()'s.

Soft resets: when a decoding request cannot get the blocks of its next step, the engine's offloading
manager frees a starved request's blocks and re-queues an equivalent request (same id, prompt +
generated tokens as its initial tokens) to be prefilled again. Compressing all of that as one prompt
would keep other entries than the uninterrupted run did (other tokens, silently), so kvcompile replays
it: `KVCompileOffloadingManager` records the request the engine re-queued (that very object, so a
later request reusing the id is not replayed) with its original prompt length, and the scheduler
(`ReplaySteps`) gives it the forwards of its original run: the original prompt (in chunks of the
token budget where the engine splits it, compressed when it ends), then every generated token as a
decode step of its own forward. Its cache then equals the uninterrupted run's, and so do its next
tokens (preemption by recompute, as vLLM does it, at the cost of one forward per replayed token).

Every transformers internal this module overrides, swaps or reads is declared, with the releases it was
checked on, in kvcompile/integrations/transformers_patches.py (checked when the manager is built).

The pieces, each installed on the engine's own objects:
- `KVCompileBatchingManager` (a `ContinuousBatchingManager`): what `model.init_continuous_batching`
  returns on a compiled model (compile() installs it); refuses at start what cannot run, switches the
  model to the "kvcompile_batching" attention, and builds the cache and processor below.
- `KVCompilePagedCache` (a `PagedAttentionCache`): the pool as a byte budget; per-request
  kvcompile caches (`BatchingState`); reservation before a forward, release after it; the replays.
- `KVCompileBatchProcessor` (a `ContinuousBatchProcessor`): tells the cache which requests (and how
  many tokens of each) the next forward packs, and syncs their blocks after it.
- `KVCompileOffloadingManager`, `KVCompileFIFOScheduler` / `KVCompilePrefillFirstScheduler`: the
  engine's, recording and replaying soft-reset requests.
- `batching_attention`: the attention function; the step's decode tokens as one batch where the policy allows
  (kvcompile.engine.batch: per layer one append and one paged attention call, or one call of the plan's decode
  step, over the engine's page pools, kvcompile.store.pool), the other tokens cut per request through
  `torch.ops.kvcompile.attend` on each request's cache (prefill + compression, or decode).

The pool's own cache tensor is released: kvcompile's pages are its own tensors, bounded by the
pool's budget (carving them out of the pool's memory is future work, see INTERNALS).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import threading
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.generation.continuous_batching.cache import PagedAttentionCache
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION
from transformers.generation.continuous_batching.continuous_api import (ContinuousBatchingManager,
                                                                        ContinuousBatchProcessor)
from transformers.generation.continuous_batching.model_runner import ModelRunner
from transformers.generation.continuous_batching.offloading_manager import OffloadingManager
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus
from transformers.generation.continuous_batching.scheduler import FIFOScheduler, PrefillFirstScheduler, Scheduler
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.logits_process import LogitsProcessorList
from transformers.masking_utils import AttentionMaskInterface

from kvcompile.cache import KVCompileCache
from kvcompile.errors import CompileError
from kvcompile.integrations import transformers_patches
from kvcompile.plan import Plan
from kvcompile.engine.batch import PooledPages, StepPlan, decode_path
from kvcompile.engine.op import kvcompile_attention, kvcompile_mask
from kvcompile.store.tiers import TieredStore

logger = logging.getLogger("kvcompile.integrations.batching")

BATCHING_ATTENTION = "kvcompile_batching"  # the attention implementation name while the engine runs


class BatchingError(CompileError):
    """A compiled model, policy or engine configuration that continuous batching cannot run."""


class RequestTooLarge(BatchingError, ValueError):
    """A request whose prompt needs more blocks than the whole pool has: refused when it is admitted (it could
    never be scheduled), with its size and the pool's."""

    def __init__(self, message: str, blocks: int, pool_blocks: int):
        super().__init__(message)
        self.blocks, self.pool_blocks = blocks, pool_blocks


# --- per-request state --------------------------------------------------------------------

@dataclass
class RequestKV:
    """One request's kvcompile cache (one sequence) and its prompt length."""

    cache: KVCompileCache
    prompt_length: int  # tokens of the request's prompt: its initial tokens, or for a replayed request its original
    #   prompt (the tokens after it are decode steps); compressed when it ends, or, for a request continuing a kept
    #   sequence, its tokens after that sequence appended to a copy of the kept cache (any number per forward)

    @property
    def compressed(self) -> bool:
        return all(store is not None for store in self.cache.stores)


@dataclass
class RequestSampling:
    """How one request picks its tokens, as `generate()` picks them with `config`: the logits processors
    generate() builds for that config (`model._get_logits_processor`: temperature, top-k, top-p, repetition
    penalty...) applied to the request's own logits with its own token history, then argmax, or (do_sample)
    `torch.multinomial` drawing from the request's own generator. generate() draws from torch's default
    generator after `torch.manual_seed(seed)`; a generator seeded with the same seed gives the same draws, and
    no other request's draws advance it. `top_logprobs` (None: none) asks, for every sampled token, its
    log-probability under the model (log-softmax of the raw logits) and that many most likely alternatives,
    appended to `logprobs` as (logprob, [(token, logprob), ...]). `error`: why picking failed (the processors
    or the draw raised, e.g. on non-finite probabilities); the engine then fails this request alone."""

    processors: LogitsProcessorList
    do_sample: bool
    generator: torch.Generator | None = None
    top_logprobs: int | None = None
    logprobs: list = field(default_factory=list)
    error: Exception | None = None

    @classmethod
    def for_config(cls, model, generation_config, seed: int | None = None,
                   top_logprobs: int | None = None) -> "RequestSampling":
        do_sample = bool(generation_config.do_sample)
        generator = None
        if do_sample:
            generator = torch.Generator(device=model.device)
            if seed is None:
                generator.seed()
            else:
                generator.manual_seed(seed)
        return cls(model._get_logits_processor(generation_config), do_sample, generator, top_logprobs)

    def pick(self, history: Tensor, raw: Tensor) -> Tensor:
        """The next token (1,) from the raw logits `raw` (1, V) after the tokens `history` (1, n), as generate()
        picks it (processors, then argmax or a draw from this request's generator); records its log-probability
        when asked."""
        processed = self.processors(history, raw.clone())
        if self.do_sample:
            token = torch.multinomial(torch.softmax(processed, dim=-1), 1, generator=self.generator)[0]
        else:
            token = processed.argmax(-1)
        if self.top_logprobs is not None:
            logprobs = torch.log_softmax(raw[0], dim=-1)
            top = torch.topk(logprobs, self.top_logprobs) if self.top_logprobs else None
            self.logprobs.append((float(logprobs[token]), [] if top is None else
                                  list(zip(top.indices.tolist(), top.values.tolist()))))
        return token


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
class Replay:
    """A request the engine soft-reset (`OffloadingManager.offload_requests`: its cache freed, an equivalent
    request re-queued under the same id with prompt + generated tokens as its initial tokens). kvcompile
    replays the original run: the original prompt is compressed as a prompt, every later token is one
    decode step in a forward of its own, so the cache ends as the uninterrupted run's did."""

    state: RequestState  # the re-queued request (by identity: a later request reusing the id is not this one)
    prompt_length: int  # the original prompt's tokens


@dataclass
class BatchingState:
    """What the cache keeps across forwards: the plan, each live request's cache, the requests being
    replayed after a soft reset, the next forward's segments (in the order of the packed tokens) and
    counters for reports."""

    plan: Plan
    bytes_per_block: int  # one pool block: page_size tokens of K and V for every layer and KV head
    requests: dict[str, RequestKV] = field(default_factory=dict)
    replays: dict[str, Replay] = field(default_factory=dict)  # by request id, until the request ends
    batch: list[Segment] = field(default_factory=list)
    offloading: bool = False  # the engine's offloading manager is freeing the requests it preempts
    peak_requests: int = 0  # the most requests holding a cache at the same time
    blocks_released: int = 0  # pool blocks given back after compression, over the whole run
    soft_resets: int = 0  # requests the engine preempted and kvcompile replayed, over the whole run
    replayed_tokens: int = 0  # generated tokens those replays ran again as decode steps
    finished: deque = field(default_factory=lambda: deque(maxlen=1024))  # RequestUsage of the latest requests
    sampling: dict[str, RequestSampling] = field(default_factory=dict)  # by request id: requests that pick
    #   their own tokens (KVCompileModelRunner); the others follow the engine's generation config
    admitted: set[str] = field(default_factory=set)  # ids the pool-size check passed, until the request ends
    rows: list[RequestState] = field(default_factory=list)  # the next forward's requests that sample a token,
    #   in the order of its logits rows
    failed_forwards: int = 0  # forwards that raised: their requests failed, the engine went on
    keep: set[str] = field(default_factory=set)  # ids whose cache is handed over when they end (`handed`)
    handed: dict[str, KVCompileCache] = field(default_factory=dict)  # caches of ended `keep` requests, each still
    #   holding its blocks under `outside_id(request id)` until its taker keeps or releases them
    outside: dict[str, int] = field(default_factory=dict)  # bytes held by caches outside the engine, by key
    pool_lock: threading.RLock = field(default_factory=threading.RLock)  # held by the engine thread while it
    #   schedules and updates a batch (not during the forward), and by releases of kept caches
    keep_lock: threading.Lock = field(default_factory=threading.Lock)  # `keep` and `handed` change under it
    outside_bound_blocks: int = 0  # blocks the caches kept outside the engine may take (kvcompile serve
    #   --reuse-context): a request must fit in the rest of the pool
    continued: dict[str, KVCompileCache] = field(default_factory=dict)  # by request id: the kept compressed cache
    #   a request continues (`submit(continues=...)`; never written: the request works on a copy in the pools),
    #   until the request ends
    pages: PooledPages = None  # where requests keep their pages and how a step decodes (engine.batch.decode_path)
    faults: dict[str, Exception] = field(default_factory=dict)  # by request id: requests of the step under way whose
    #   own work raised (their cache made or copied, its compression or append, its pages' move into the pools): the
    #   rest of the step leaves them out and `update_batch` fails each alone
    step: StepPlan | None = None  # the next forward's plan (`pages.plan`)

    def __post_init__(self):
        self.pages = decode_path(self.plan)


@dataclass
class _Reservation:
    """What PagedAttentionCache.can_store_request_tokens reads of a request (its id, its length), for a
    reservation of `length` tokens' worth of blocks."""

    request_id: str
    length: int

    def current_len(self) -> int:
        return self.length


# --- bytes ----------------------------------------------------------------------------------

def request_bytes(kv: RequestKV) -> int:
    """Bytes a request's kvcompile cache holds now: its stores, or the prompt chunks it holds until the
    chunk that ends the prompt."""
    cache = kv.cache
    held = sum(s.nbytes for s in cache.stores if s is not None)
    held += sum(w.nbytes for w in cache.windows if w is not None)  # a hybrid model's local layers
    if cache.chunks is not None:
        held += sum(t.nbytes for part in (cache.chunks.keys, cache.chunks.values, cache.chunks.queries)
                    for t in part if t is not None)
    return held


def append_bytes(store, tokens: int, step: int, pooled: bool) -> int:
    """The most `store` grows by when every head appends `tokens` entries (a request continuing a kept sequence
    brings its new tokens in one forward): each head takes a run of `step` pages whenever its pages are full
    (`LayerStore._take_pages`: exactly these pages), its block table widens to the pages it owns, and a store with
    pages of its own (not `pooled`: in or bound for the engine's pools) may grow its tensors by a quarter
    (`_new_runs`); a store of two tiers: both tiers' bounds."""
    if isinstance(store, TieredStore):  # every entry enters the high tier, then some flush to the low one
        return append_bytes(store.high, tokens, step, pooled) + append_bytes(store.low, tokens, step, pooled)
    s, e, owned = store.page_size, store.lengths, store.owned
    runs = ((e + tokens + s - 1) // s - owned).clamp(min=0).add(step - 1).div(step, rounding_mode="floor")
    pages = int(runs.sum()) * step
    if not pages:
        return 0
    width = int((owned + runs * step).max())
    table = max(0, width - store.block_table.shape[-1]) * e.numel() * store.block_table.element_size()
    if pooled:  # the pool's own growth is the engine's
        return pages * store.page_bytes + table
    used, have = store.next_page + pages, store.k_pages.shape[0]
    grown = 0 if used <= have else used - have + max(e.numel() * step, used // 4)
    return grown * store.page_bytes + table


def window_bytes(plan: Plan, tokens: int, elt: int) -> int:
    """The most a hybrid model's local layers hold after `tokens` tokens: each its last window - 1 positions'
    keys and values (kvcompile.engine.window), in the model's dtype; 0 for a model without them."""
    kinds = plan.layer_kinds
    if kinds is None:
        return 0
    per_token = len(plan.kv_heads) * 2 * plan.head_dim * elt
    return sum(min(tokens, window - 1) * per_token for window in kinds.windows if window is not None)


def prompt_bound_bytes(plan: Plan, tokens: int, elt: int, query_heads: int, chunked: bool) -> int:
    """The most a request's cache holds while and after a prompt of `tokens` tokens is compressed.

    Pages: where the layer totals follow from the length alone (`plan.static_totals`: per_head / ratio
    budgets), a layer of total T holds at most ceil(T/S) + H pages of entries however its heads share T
    (each head rounds up once), else each head at most its tokens; every head adds its spare pages
    (`LayerStore.build`). A prompt in chunks (`chunked`) holds every layer's keys, values and the query rows
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
    width = math.ceil(tokens / s) + plan.spare_pages
    # + block tables and per-head counters, as the plan's store class holds them
    stores = plan.store.bound(plan.storage, pages, s, d, elt, layers * heads, width, plan.spare_pages)
    stores += window_bytes(plan, tokens, elt)
    if not chunked:
        return stores
    rows = min(tokens, plan.policy.scoring.query_rows(tokens))
    chunk = (heads * tokens * 2 * d + query_heads * rows * d) * elt  # one layer's
    return max(stores, layers * chunk) + chunk


# --- the pool as kvcompile's byte budget -------------------------------------------------------

def outside_id(name: str) -> str:
    """The pool's name for blocks held outside the engine under `name` (a kept cache)."""
    return f"kvcompile-outside:{name}"


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
        if FULL_ATTENTION not in cache.cache_allocators or \
                (len(cache.cache_allocators) > 1 and plan.layer_kinds is None):
            raise BatchingError(f"kvcompile: continuous batching needs full-attention layers (and, in a hybrid "
                                f"model, sliding ones), the engine made {list(cache.cache_allocators)}")
        cache.__class__ = cls
        allocator = cache.cache_allocators[FULL_ATTENTION]
        cache.kvcompile = BatchingState(plan, allocator.bytes_per_block)
        cache.use_prefix_sharing = False
        # kvcompile reads its own pages, never the engine's read indices: the scheduler's per-batch read
        # budget (the size of those index tensors, counted in logical tokens) does not apply.
        cache.read_cache_limit = 0
        # the engine's K/V tensor is never used: release it (the allocator's views hold it too)
        cache.cache_tensor = torch.empty(0, dtype=torch.uint8, device=cache.device)
        # (a hybrid model's sliding allocator too: its blocks are reserved by the engine beside kvcompile's
        # reservation, which already counts the local layers' windows, and freed with the request)
        for each in cache.cache_allocators.values():
            for name in ("cache_tensor", "_copy_view"):
                if hasattr(each, name):
                    setattr(each, name, cache.cache_tensor)
            each._kv_token_views, each._kv_page_views = {}, {}
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
        """transformers 5.24 on: each attention module calls this before its attention function, which no longer
        gets the cache. kvcompile's op stores what it keeps itself, so the keys and values go on unchanged and
        the cache goes to the attention in its keyword arguments (updated in place), where 5.23 put it. (Up to
        5.23 only the engine's own attention functions call it.)"""
        if self.config._attn_implementation != BATCHING_ATTENTION:
            raise RuntimeError("kvcompile: the engine's cache update ran on a compiled model; its attention must be "
                               f"{BATCHING_ATTENTION!r} (see kvcompile.integrations.batching)")
        kwargs["cache"] = self
        return key_states, value_states

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        state = self.kvcompile
        kv = state.requests.get(request_id)
        with state.keep_lock:
            if request_id in state.keep and not state.offloading:
                state.keep.discard(request_id)
                if kv is not None and kv.compressed:  # hand the cache over with the blocks that cover it
                    state.pages.detach(kv.cache)  # with pages of its own
                    self._move_blocks(request_id, outside_id(request_id), request_bytes(kv))
                    state.outside[outside_id(request_id)] = request_bytes(kv)
                    state.handed[request_id] = kv.cache
        kv = state.requests.get(request_id)
        if kv is not None and kv.compressed and not state.offloading:
            tokens = kv.cache.seq_length
            state.finished.append(RequestUsage(request_id, tokens, request_bytes(kv),
                                               len(self.allocator.block_table.get(request_id, [])),
                                               math.ceil(tokens / self.allocator.tokens_per_page)))
        if kv is not None:
            state.pages.release(kv.cache)  # its pages back to the pools
        state.replays.pop(request_id, None)
        if not state.offloading:  # a soft-reset request keeps its sampling, its admission and the cache it continues
            state.sampling.pop(request_id, None)
            state.admitted.discard(request_id)
            state.continued.pop(request_id, None)
        super().free_blocks(request_id, no_cache=True)
        # it leaves `requests` last: another thread that finds it gone (the server's metrics, a caller waiting for
        # a cancelled request to leave) finds its pages and blocks given back
        state.requests.pop(request_id, None)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        super().free_all_requests(clear_ledgers)
        for kv in self.kvcompile.requests.values():
            self.kvcompile.pages.release(kv.cache)
        self.kvcompile.outside.clear()
        self.kvcompile.handed.clear()
        self.kvcompile.requests.clear()
        self.kvcompile.replays.clear()
        self.kvcompile.sampling.clear()
        self.kvcompile.admitted.clear()
        self.kvcompile.continued.clear()
        self.kvcompile.batch = []
        self.kvcompile.rows = []
        self.kvcompile.faults = {}

    def prepare_fork_request(self, src_state, dst_req_ids, copy_src_and_dst):
        raise BatchingError("kvcompile: forking a request (num_return_sequences > 1) is not supported")

    # --- caches kept outside the engine (kvcompile serve --reuse-context) --------------------------
    def _move_blocks(self, source: str, key: str, nbytes: int) -> None:
        """Give `source`'s blocks to `key`, trimmed to those that cover `nbytes` (engine thread)."""
        table = self.allocator.block_table
        blocks = table.pop(source, [])
        keep = math.ceil(nbytes / self.kvcompile.bytes_per_block)
        if keep < len(blocks):
            self.pool.free_blocks(self.allocator.index, blocks[keep:])
            blocks = blocks[:keep]
        table[key] = table.get(key, []) + blocks

    def release_outside(self, key: str) -> None:
        """Give back what `key` holds (any thread)."""
        with self.kvcompile.pool_lock:
            self.kvcompile.outside.pop(key, None)
            PagedAttentionCache.free_blocks(self, key, no_cache=True)

    def outside_bytes(self) -> int:
        return sum(self.kvcompile.outside.values())

    # --- kvcompile's side ---------------------------------------------------------------------
    @property
    def allocator(self):
        return self.cache_allocators[FULL_ATTENTION]

    def replay_of(self, request) -> Replay | None:
        """The replay of a soft-reset request, if `request` is the very request the engine re-queued."""
        replay = self.kvcompile.replays.get(request.request_id)
        return replay if replay is not None and replay.state is request else None

    def prompt_length(self, request) -> int:
        """Tokens of the request's prompt as kvcompile compresses it: the original prompt of a replayed
        request, else its initial tokens."""
        replay = self.replay_of(request)
        return replay.prompt_length if replay is not None else len(request.initial_tokens)

    def headroom(self, request) -> int:
        """The request's max_new_tokens as it was first asked (a soft reset lowers the re-queued request's by
        the tokens it had generated, now part of its initial tokens), as generate() sizes its cache."""
        new = request.max_new_tokens
        return new + len(request.initial_tokens) - self.prompt_length(request) if new else 0

    def replay_step(self, request) -> int | None:
        """Tokens the next forward of a replayed request may take (the rest of its original prompt, else one
        token: a decode step), or None when the request is not replaying."""
        if request.status == RequestStatus.DECODING or self.replay_of(request) is None:
            return None
        return max(self.prompt_length(request) - request.position_offset, 1)

    def requeued(self, request, prompt: int) -> None:
        """The engine soft-reset a request whose original prompt has `prompt` tokens (its blocks are freed) and
        re-queued `request` in its place: replay it."""
        if getattr(request, "_true_initial_tokens", prompt) != prompt:  # the engine's own record of the prompt
            raise BatchingError(f"kvcompile: request {request.request_id} was re-queued with a {request._true_initial_tokens}"
                                f"-token prompt, kvcompile ran it with {prompt}")
        self.kvcompile.replays[request.request_id] = Replay(request, prompt)
        self.kvcompile.soft_resets += 1
        self.kvcompile.replayed_tokens += len(request.initial_tokens) - prompt

    def reserved_tokens(self, state, request_len: int, continues: KVCompileCache | None = None) -> int:
        """Tokens' worth of blocks (a multiple of the page size) the request must hold during its next
        forward of `request_len` tokens (`continues`: the kept cache it continues, where not registered yet)."""
        plan, kv = self.kvcompile.plan, self.kvcompile.requests.get(state.request_id)
        if continues is None:
            continues = self.kvcompile.continued.get(state.request_id)
        live = kv is not None
        if kv is None and continues is not None:  # its first forward: a copy of the kept cache, as many bytes
            kv = RequestKV(continues, 0)
        if kv is not None and kv.compressed:
            step = kv.cache.plan.spare_pages  # a head past its spares takes this many pages (LayerStore.append)
            if request_len == 1 and live:  # a decode step
                grows = sum(s.growth_bytes(step) for s in kv.cache.stores)
            else:  # a continued request's tokens after its kept sequence (its copy in the pools where they exist)
                pooled = self.kvcompile.pages.pools is not None
                grows = sum(append_bytes(s, request_len, step, pooled) for s in kv.cache.stores)
            windows = window_bytes(kv.cache.plan, 1, self.dtype.itemsize)  # a window not yet full takes each token
            need = request_bytes(kv) + grows + windows * request_len
        else:
            plan = plan.with_headroom(self.headroom(state))
            prompt = self.prompt_length(state)
            need = prompt_bound_bytes(plan, prompt, self.dtype.itemsize, self.config.num_attention_heads,
                                      chunked=kv is not None or request_len < prompt)
        return math.ceil(need / self.kvcompile.bytes_per_block) * self.allocator.tokens_per_page

    def pool_tokens(self) -> int:
        """Tokens' worth of blocks of the whole pool."""
        return self.num_blocks * self.allocator.tokens_per_page

    def admission_error(self, request_id: str, prompt: int, max_new_tokens: int,
                        continues: KVCompileCache | None = None) -> RequestTooLarge | None:
        """The refusal of a new request of `prompt` tokens (and `max_new_tokens`) whose first forward needs more
        blocks than the whole pool has (it could never be scheduled), else None. `continues`: the kept cache the
        request continues (its first forward: a copy of it and the prompt's tokens after it)."""
        state = RequestState(request_id, initial_tokens=[0] * prompt, max_new_tokens=max_new_tokens)
        start = 0 if continues is None else continues.seq_length
        # the engine splits what is longer than its token budget
        tokens = self.reserved_tokens(state, min(prompt - start, self.max_batch_tokens), continues)
        page = self.allocator.tokens_per_page
        kept = self.kvcompile.outside_bound_blocks
        if tokens <= self.pool_tokens() - kept * page:
            return None
        blocks = tokens // page
        beside = f", {kept} of them for kept contexts" if kept else ""
        what = f"{prompt}-token prompt" if continues is None else f"{prompt - start} tokens after a kept {start}"
        return RequestTooLarge(f"kvcompile: request {request_id} needs {blocks} blocks ({tokens} tokens of full cache) "
                               f"for its {what} under {self.kvcompile.plan.policy.name}; the pool has "
                               f"{self.num_blocks} blocks ({self.pool_tokens()} tokens{beside})", blocks,
                               self.num_blocks - kept)

    def admit(self, state) -> None:
        """Refuse (RequestTooLarge) a new request the pool can never hold; a request re-queued by a soft reset
        was admitted already. A request continuing a kept cache starts after it (`resume`)."""
        ours, rid = self.kvcompile, state.request_id
        if rid not in ours.admitted:
            error = self.admission_error(rid, len(state.initial_tokens), state.max_new_tokens or 0,
                                         ours.continued.get(rid))
            if error is not None:
                ours.sampling.pop(rid, None)
                ours.continued.pop(rid, None)
                raise error
            ours.admitted.add(rid)
        self.resume(state)

    def resume(self, state) -> None:
        """A request continuing a kept cache (new, or re-queued by a soft reset) starts after the tokens that cache
        holds, as transformers' prefix sharing starts a request after its shared prefix: its position, and the
        tokens left to feed."""
        continues = self.kvcompile.continued.get(state.request_id)
        if continues is not None and state.position_offset == 0 and state.status == RequestStatus.PENDING:
            state.position_offset = continues.seq_length
            state.remaining_prefill_tokens = state.remaining_prefill_tokens[continues.seq_length:]

    def begin_batch(self, scheduled) -> None:
        """The next forward's requests (FutureRequestStates, in the order of the packed tokens); a request
        seen for the first time gets its cache, sized for its max_new_tokens as generate() sizes it, or, continuing
        a kept cache, a copy of that cache in the pools."""
        state = self.kvcompile
        state.faults = {}
        batch = []
        for future in scheduled:
            request = future.state
            try:
                kv = self._request_kv(future)
            except Exception as error:  # noqa: BLE001 - this request's own: the forward runs without its cache
                state.faults[request.request_id] = error
                kv = None
            batch.append(Segment(request.request_id, kv, future.query_length))
        state.batch = batch
        state.step = state.pages.plan([(None if seg.kv is None else seg.kv.cache, seg.length) for seg in batch])
        for i, error in state.step.failed.items():  # its stores could not make room: the batch runs without it
            state.faults[batch[i].request_id] = error
        state.rows = [future.state for future in scheduled if future.has_new_token]
        state.peak_requests = max(state.peak_requests, len(state.requests))

    def _request_kv(self, future) -> RequestKV:
        """The cache a scheduled request's forward runs on: its own, or, seen for the first time, a new one sized for
        its max_new_tokens as generate() sizes it, or, continuing a kept cache, a copy of that cache in the pools."""
        state, request = self.kvcompile, future.state
        kv = state.requests.get(request.request_id)
        if kv is None:
            prompt = self.prompt_length(request)
            continues = state.continued.get(request.request_id)
            first = 0 if continues is None else continues.seq_length
            if request.position_offset - future.query_length != first:
                raise BatchingError(f"kvcompile: request {request.request_id} starts at token "
                                    f"{request.position_offset - future.query_length}, not {first} (prefix sharing "
                                    "or an offloaded request, which kvcompile does not restore)")
            if continues is not None:
                kv = RequestKV(state.pages.copy_in(continues), prompt)
            else:
                kv = RequestKV(KVCompileCache.from_plan(state.plan.with_headroom(self.headroom(request))), prompt)
                if future.query_length < prompt:  # the engine splits the prompt: compressed when it ends
                    kv.cache.expect_prompt(prompt)
            state.requests[request.request_id] = kv
        start = request.position_offset - future.query_length
        if start < kv.prompt_length < request.position_offset or (start >= kv.prompt_length
                                                                 and future.query_length > 1):
            raise BatchingError(f"kvcompile: request {request.request_id} brings tokens {start}.."
                                f"{request.position_offset - 1} in one forward, past its {kv.prompt_length}-token "
                                "prompt: each token after the prompt must be a decode step of its own")
        return kv

    def sync_blocks(self) -> None:
        """After a forward: every request of the batch keeps the blocks that cover what its cache holds;
        the others go back to the pool (after a prompt's compression, most of them)."""
        state = self.kvcompile
        for segment in state.batch:
            if segment.request_id in state.faults:  # failed in the forward: its blocks go back as it fails
                continue
            try:
                self._sync_request(segment.request_id)
            except Exception as error:  # noqa: BLE001 - this request's own: the others keep their blocks
                state.faults[segment.request_id] = error
        state.batch = []

    def _sync_request(self, request_id: str) -> None:
        state, allocator = self.kvcompile, self.allocator
        kv = state.requests.get(request_id)
        table = allocator.block_table.get(request_id)
        if kv is None or table is None:
            return
        if not kv.compressed:  # a prompt in chunks keeps its reservation until it is compressed
            return
        state.pages.adopt(kv.cache)  # its pages in the engine's pools (once)
        held = request_bytes(kv)
        blocks = math.ceil(held / state.bytes_per_block)
        if blocks > len(table):
            raise RuntimeError(f"kvcompile: request {request_id} holds {held} bytes, more than its "
                               f"{len(table)} reserved blocks ({len(table) * state.bytes_per_block} bytes)")
        if blocks < len(table):
            freed = table[blocks:]
            del table[blocks:]
            self.pool.free_blocks(allocator.index, freed)
            state.blocks_released += len(freed)

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
                "blocks_released": state.blocks_released, "soft_resets": state.soft_resets,
                "replayed_tokens": state.replayed_tokens,
                "finished": list(state.finished), "decode": state.pages.report()}


class KVCompileBatchProcessor(ContinuousBatchProcessor):
    """The engine's batch processor, telling the cache what each forward packs and syncing blocks after."""

    cache: KVCompilePagedCache

    forward: list  # the RequestStates of the forward under way (prepared, not yet updated)

    def prepare_next_batch(self) -> bool:
        self.forward = []
        with self.cache.kvcompile.pool_lock:  # kept caches' releases change the pool between forwards only
            ready = super().prepare_next_batch()
            if ready:
                scheduled = self.inputs_and_outputs.requests_in_batch
                self.forward = [future.state for future in scheduled]
                self.cache.begin_batch(scheduled)
        return ready

    def update_batch(self) -> None:
        """After a forward: every request's blocks synced to what its cache holds, then the engine's update of the
        forward's requests but those that failed alone (`_failing`), then each of those failed with its own error."""
        with self.cache.kvcompile.pool_lock:
            self.cache.sync_blocks()
            failing = self._failing()
            if failing:
                with self._updating_without(failing):
                    super().update_batch()
            else:
                super().update_batch()
            self._fail_alone(failing)
        self.forward = []

    def _failing(self) -> dict:
        """The requests of this forward that fail alone, with their errors: their own work raised
        (`BatchingState.faults`), or their own sampling could not pick their token (`RequestSampling.error`: the
        forward gave it a stand-in token, which no caller may read as its answer)."""
        state = self.cache.kvcompile
        failing = {}
        for request in self.forward:
            picked = state.sampling.get(request.request_id)
            error = state.faults.get(request.request_id)
            if error is None and picked is not None:
                error = picked.error
            if error is not None:
                failing[request.request_id] = error
        state.faults = {}
        return failing

    @contextlib.contextmanager
    def _updating_without(self, failing: dict):
        """The engine's update (`ContinuousBatchProcessor.update_batch`) reads the forward's requests and their
        tokens from `inputs_and_outputs.prepare_batch_update()`: for it, they are those without `failing` (their
        rows dropped), so that none of their tokens is recorded or delivered."""
        io = self.inputs_and_outputs
        requests, tokens, logprobs = io.prepare_batch_update()
        kept, kept_tokens, kept_logprobs, row = [], [], [] if logprobs is not None else None, 0
        for future in requests:
            keep = future.state.request_id not in failing
            if keep:
                kept.append(future)
            if future.has_new_token:
                if keep:
                    kept_tokens.append(tokens[row])
                    if logprobs is not None:
                        kept_logprobs.append(logprobs[row])
                row += 1
        io.prepare_batch_update = lambda: (kept, kept_tokens, kept_logprobs)
        try:
            yield
        finally:
            del io.prepare_batch_update

    def _fail_alone(self, failing: dict) -> None:
        """Fail each request of `failing` alone: its error is delivered and its blocks and pages go back; the
        forward's other requests go on."""
        scheduler = self.scheduler
        for state in self.forward:
            error = failing.get(state.request_id)
            if error is None or state.request_id not in scheduler.active_requests:
                continue
            logger.error(f"kvcompile: request {state.request_id} failed ({type(error).__name__}: {error}); the "
                         "others of its forward go on")
            self._handle_request_error(error, state)
            scheduler.finish_request(state.request_id)

    def fail_forward(self, error: Exception) -> list[str]:
        """A step of the engine raised: fail the requests it concerned and let the engine go on. A forward that
        raised fails the requests it packed (their caches may hold part of its tokens); an error before any
        forward was prepared (no request can be scheduled) fails the active requests, or, with none active, the
        waiting ones. Their blocks go back to the pool. Returns the failed request ids."""
        with self.cache.kvcompile.pool_lock:
            return self._fail_forward(error)

    def _fail_forward(self, error: Exception) -> list[str]:
        scheduler = self.scheduler
        states = getattr(self, "forward", None) or list(scheduler.active_requests.values())
        if not states:
            states = [scheduler.waiting_requests[rid] for rid in list(scheduler.waiting_requests_order)
                      if rid in scheduler.waiting_requests]
        failed = []
        for state in states:
            self._handle_request_error(error, state)
            scheduler.finish_request(state.request_id)
            if state.request_id in scheduler.waiting_requests:
                del scheduler.waiting_requests[state.request_id]
            if state.request_id in scheduler.waiting_requests_order:
                scheduler.waiting_requests_order.remove(state.request_id)
            failed.append(state.request_id)
        self.forward = []
        self.cache.kvcompile.batch = []
        self.cache.kvcompile.rows = []
        self.cache.kvcompile.faults = {}
        self.cache.kvcompile.failed_forwards += 1
        return failed


class KVCompileModelRunner(ModelRunner):
    """The engine's model runner; requests with a `RequestSampling` (kvcompile serve's) pick their own tokens
    as generate() would with their own settings and generator, the others as the engine's generation config."""

    cache: KVCompilePagedCache

    def _forward_process_and_sample(self, model, batch_data, carry_over_ids, prev_output_ids, output_ids) -> None:
        state = self.cache.kvcompile
        rows = state.rows
        if not any(r.request_id in state.sampling for r in rows):
            return super()._forward_process_and_sample(model, batch_data, carry_over_ids, prev_output_ids, output_ids)
        if self.do_sample or self.logit_processor.do_processing or self.return_logprobs:
            raise BatchingError("kvcompile: requests with their own sampling run on an engine whose generation config "
                                "is greedy and processes no logits (kvcompile serve builds it so)")
        self.inputs_and_outputs.carry_over_tokens(batch_data["input_ids"], carry_over_ids, prev_output_ids)
        logits = model(**batch_data).logits
        if "logits_to_keep" not in batch_data:
            logits = logits[:, batch_data["logits_indices"], :]
        # one row per request of the forward, those that sample a token first (in order), the rest unused
        scores = logits[0].float()  # as generate() reads its logits
        if scores.shape[0] < len(rows):
            raise RuntimeError(f"kvcompile: {scores.shape[0]} logits rows for {len(rows)} requests sampling a token")
        tokens = []
        for i, request in enumerate(rows):
            raw = scores[i:i + 1]
            sampling = state.sampling.get(request.request_id)
            if sampling is None or request.request_id in state.faults:  # (a failed request's token: never read)
                tokens.append(raw.argmax(-1))
                continue
            history = torch.tensor([request.initial_tokens + request.generated_tokens], device=raw.device)
            try:
                tokens.append(sampling.pick(history, raw))
            except Exception as error:  # noqa: BLE001 - this request's own failure (update_batch fails it alone)
                sampling.error = error
                tokens.append(raw.argmax(-1))  # a stand-in, so the forward's other rows keep their places
        output_ids[0, :len(tokens)].copy_(torch.cat(tokens))


class KVCompileOffloadingManager(OffloadingManager):
    """The engine's offloading manager (soft resets only: kvcompile refuses cpu_offload_space), telling the
    cache which requests it re-queued, so that they are replayed."""

    cache: KVCompilePagedCache

    def offload_requests(self) -> bool:
        cache, scheduler = self.cache, self.scheduler
        # each request's original prompt, read before the engine frees the preempted ones (and their replays)
        active = {rid: (request, cache.prompt_length(request)) for rid, request in scheduler.active_requests.items()}
        cache.kvcompile.offloading = True
        try:
            offloaded = super().offload_requests()
        finally:
            cache.kvcompile.offloading = False
        for rid, (request, prompt) in active.items():
            new = scheduler.waiting_requests.get(rid)
            if new is not None and new is not request:  # soft reset: an equivalent request under the same id
                cache.requeued(new, prompt)
        return offloaded


class ReplaySteps(Scheduler):
    """What kvcompile adds to the engine's schedulers: a soft-reset request goes through the forwards of its
    original run. Its original
    prompt in forwards of the engine's token budget (compressed when it ends, `expect_prompt`), then each
    token it had generated as one decode step in a forward of its own; the last one samples its next token."""

    cache: KVCompilePagedCache

    def _infer_request_tokens(self, state, request_ids_to_remove_from_waiting):
        tokens = super()._infer_request_tokens(state, request_ids_to_remove_from_waiting)
        step = self.cache.replay_step(state)
        return tokens if step is None else tokens[:step]

    def schedule_batch(self, token_budget: int, cache_budget: int):
        """The engine's schedule; new requests blocked after a soft reset (`block_new_requests`, so that the starved
        requests get the blocks first) are let in again once no request is active. transformers 5.21 to 5.24 (checked
        against both) lift the block only when a request finishes by itself (`update_batch`): after a soft reset
        whose last active request was cancelled or failed instead, the re-queued and waiting requests were never
        scheduled again (tests/test_scheduler_stall.py)."""
        if self.block_new_requests and not self.active_requests:
            self.block_new_requests = False
        return super().schedule_batch(token_budget, cache_budget)

    def add_waiting_request(self, state) -> None:
        # a request the pool can never hold is refused here (RequestTooLarge); one continuing a kept cache starts
        #   after it (a soft-reset one too: the engine re-queues it from token 0)
        self.cache.admit(state)
        super().add_waiting_request(state)

    def _schedule_request(self, state, request_tokens, token_budget, request_ids_to_remove_from_waiting):
        step = self.cache.replay_step(state)
        if step is not None:  # the engine splits what is left at the budget: the replay's step ends the forward
            request_tokens, token_budget = state.remaining_prefill_tokens, min(token_budget, step)
        super()._schedule_request(state, request_tokens, token_budget, request_ids_to_remove_from_waiting)


class KVCompileFIFOScheduler(ReplaySteps, FIFOScheduler):
    """transformers' FIFO scheduler, replaying soft-reset requests (ReplaySteps)."""


class KVCompilePrefillFirstScheduler(ReplaySteps, PrefillFirstScheduler):
    """transformers' prefill-first scheduler, replaying soft-reset requests (ReplaySteps)."""


SCHEDULERS = {FIFOScheduler: KVCompileFIFOScheduler, PrefillFirstScheduler: KVCompilePrefillFirstScheduler}


# --- the attention ---------------------------------------------------------------------------

def batching_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None,
                       dropout: float = 0.0, cache=None, **kwargs):
    """The attention of a packed batch (1, H, T, d): each request's run of tokens through
    `torch.ops.kvcompile.attend` on its own cache, as generate() runs it (prefill + compression, a
    prompt chunk, or decode steps), the step's decode tokens as one batch where the policy allows. A call from
    outside the engine while it runs (generate() on the same model) takes kvcompile's ordinary attention.

    A request's own work that raises (its op call; in the batch, its stores making room before the forward,
    `StepPlan.failed`, or its cache counting the token, `DecodeBatch.faults`) is that request's fault
    (`BatchingState.faults`): its tokens' outputs are zeros from then on, the batch goes on without it, and no other token reads them (each
    request attends over its own cache only; the projections and MLPs are per token), so the other requests'
    outputs are those of the forward without it. The batched kernel call covers every request of the batch: its
    failure is no one request's and fails the forward (the engine fails every request it packed)."""
    if not isinstance(cache, KVCompilePagedCache):
        return kvcompile_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                   **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    state = cache.kvcompile
    batch, faults = state.batch, state.faults
    total = sum(seg.length for seg in batch)
    if total != query.shape[2]:
        raise RuntimeError(f"kvcompile: the forward packs {query.shape[2]} tokens, the scheduled requests {total}")
    layer, kinds = module.layer_idx, state.plan.layer_kinds
    local = kinds is not None and kinds.windows[layer] is not None  # a hybrid model's local layer: its window
    if kinds is not None and not local:
        layer = kinds.engine[layer]  # its number among the layers the policy compresses
    step = state.step
    ran, batched = step.batch, None
    if ran is not None:  # a batch of decode tokens (engine.batch)
        batched = ran.run(layer, query, key, value, scale)
        for failed, error in ran.faults:  # a request's count of its token raised (the step's last layer): its own
            faults[_request_of(batch, failed)] = error
    if batched is not None and not step.alone and ran.whole and not faults:
        return batched.unsqueeze(0), None  # the whole forward, in order
    out = query.new_zeros(query.shape)
    if batched is not None:
        out[0, :, ran.index] = batched.transpose(0, 1)
    starts = [0]
    for seg in batch:
        starts.append(starts[-1] + seg.length)
    for i in step.alone:
        seg, start, end = batch[i], starts[i], starts[i + 1]
        if seg.request_id in faults:
            continue
        try:
            out[:, :, start:end] = _alone(seg, layer, local, query[:, :, start:end], key[:, :, start:end],
                                          value[:, :, start:end], scale)
        except Exception as error:  # noqa: BLE001 - this request's own: the others of the forward go on
            faults[seg.request_id] = error
            out[:, :, start:end] = 0
    for seg, start, end in zip(batch, starts, starts[1:]):  # a request that failed in an earlier layer or the batch
        if seg.request_id in faults:
            out[:, :, start:end] = 0
    return out.transpose(1, 2).contiguous(), None


def _request_of(batch: list, cache) -> str:
    return next(seg.request_id for seg in batch if seg.kv is not None and seg.kv.cache is cache)


def _alone(seg: Segment, layer: int, local: bool, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """One request's run of tokens through its own cache: the op (or a hybrid model's window)."""
    if local:
        return seg.kv.cache.attend_window(layer, q, k, v, None, scale)
    return torch.ops.kvcompile.attend(q, k, v, None, layer, seg.kv.cache.ref, seg.kv.cache.token, scale)


# --- the manager ------------------------------------------------------------------------------

def check_batching(model, plan: Plan, generation_config, cb_config: ContinuousBatchingConfig) -> None:
    """Refuse, before the engine starts, what continuous batching cannot run with kvcompile."""
    saved = getattr(model, "_kvcompile", {})
    if saved.get("mode") in ("compiled", "reduce-overhead"):
        raise BatchingError("kvcompile: continuous batching runs the eager entry; compile the model with "
                            "mode='eager' (the compiled entry's graph is traced for generate()'s cache)")
    if plan.shard is not None:
        raise BatchingError("kvcompile: continuous batching of a tensor-parallel model is not supported yet")
    if plan.layer_devices is not None:
        raise BatchingError("kvcompile: continuous batching of a model whose layers run on several devices is not "
                            "supported yet (the engine's block pool and kvcompile's request pages live on one device)")
    if plan.prune_every:
        raise BatchingError(f"kvcompile: {plan.policy.name} prunes every {plan.prune_every} tokens while decoding, "
                            "which rebuilds a head's pages; continuous batching does not account for it yet")
    if getattr(plan.policy.scoring, "reconstructs", False):
        raise BatchingError(f"kvcompile: {plan.policy.name} scores a prompt by a second forward over it (scoring "
                            "kvzip: context reconstruction), which the engine's packed forwards do not run")
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
        transformers_patches.check("batching", BatchingError)  # the engine's internals, as checked
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
            scheduler = SCHEDULERS.get(type(processor.scheduler))
            if scheduler is None:
                raise BatchingError(f"kvcompile: the engine's {type(processor.scheduler).__name__} is not one kvcompile "
                                    f"replays soft-reset requests with ({', '.join(c.__name__ for c in SCHEDULERS)})")
            KVCompilePagedCache.adopt(processor.cache, self.kvcompile_plan)
            processor.__class__ = KVCompileBatchProcessor
            processor.scheduler.__class__ = scheduler
            processor.offloading_manager.__class__ = KVCompileOffloadingManager
            processor.model_runner.__class__ = KVCompileModelRunner
            processor.forward = []
        return processor

    def _generation_loop_body(self, batch_processor, bootstrapping: bool) -> bool:
        """The engine's loop step; an error fails the requests it concerned (`fail_forward`) instead of the
        engine: every other request, and every later one, goes on."""
        try:
            return super()._generation_loop_body(batch_processor, bootstrapping)
        except Exception as error:  # noqa: BLE001 - any failure of one step is that step's requests'
            if not isinstance(batch_processor, KVCompileBatchProcessor) or self.batch_processor is not batch_processor:
                raise  # not kvcompile's processor, or the manager was torn down under the loop (stop): the engine's
            failed = batch_processor.fail_forward(error)
            logger.error(f"kvcompile: a step of the engine failed ({type(error).__name__}: {error}); failed "
                         f"request(s) {', '.join(failed) or 'none'}, the engine goes on")
            return True

    def submit(self, input_ids: list[int], request_id: str, max_new_tokens: int, sampling: RequestSampling,
               streaming: bool = False, eos_token_id=None, continues: KVCompileCache | None = None) -> str:
        """Queue a request that picks its own tokens (`RequestSampling`); its output reaches the handler
        registered for `request_id`. The engine must be running (its cache is what admission reads).
        `continues`: a compressed cache of `input_ids[:n]` (n its length, less than the prompt's), kept outside the
        engine: the request works on a copy of it in the pools and feeds only `input_ids[n:]`, as
        `generate(input_ids, past_key_values=copy)` does (kvcompile serve --reuse-context); it is never written."""
        processor = self.batch_processor
        if processor is None or not isinstance(processor.cache, KVCompilePagedCache):
            raise RuntimeError("kvcompile: the engine is not running")
        state = processor.cache.kvcompile
        if continues is not None:
            if not 0 < continues.seq_length < len(input_ids) or any(s is None for s in continues.stores):
                raise ValueError(f"kvcompile: request {request_id} continues a cache of {continues.seq_length} tokens "
                                 f"(compressed: {all(s is not None for s in continues.stores)}); it must be a "
                                 f"compressed cache of fewer tokens than its {len(input_ids)}-token prompt")
            state.continued[request_id] = continues
        state.sampling[request_id] = sampling
        queued = self.add_request(input_ids, request_id=request_id, max_new_tokens=max_new_tokens,
                                  streaming=streaming, eos_token_id=eos_token_id)
        if queued is None:
            state.sampling.pop(request_id, None)
            state.continued.pop(request_id, None)
            raise RuntimeError("kvcompile: the engine is stopping and accepts no request")
        return queued


def init_continuous_batching(model, generation_config=None, continuous_batching_config=None, workload_hints=None):
    """`ContinuousMixin.init_continuous_batching` for a compiled model (compile() installs it on the
    instance): the same arguments and cached-manager rule, returning a KVCompileBatchingManager. A generation config
    without an eos_token_id runs as a copy with -1 (no end token), as transformers runs it; unlike transformers, the
    model's (or the caller's) config is left as it is, also when the engine refuses the model."""
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if isinstance(cached, ContinuousBatchingManager):
        cached.switch_to_cb_friendly_attn(model, cached.continuous_batching_config.auto_switch_to_flash)
        return cached
    gen = generation_config if generation_config is not None else model.generation_config
    if gen is None:
        raise ValueError("A GenerationConfig must be provided or set in the model.")
    if gen.eos_token_id is None:
        gen = copy.deepcopy(gen)
        gen.eos_token_id = -1
    if continuous_batching_config is None:
        continuous_batching_config = getattr(gen, "continuous_batching_config", None)
        if not isinstance(continuous_batching_config, ContinuousBatchingConfig):
            continuous_batching_config = ContinuousBatchingConfig()
    return KVCompileBatchingManager(model, gen, continuous_batching_config, workload_hints,
                                    plan=model.kvcompile_plan)
