"""KVCompileCache: a paged, head-granular KV cache that holds only what a policy keeps.

Storage (per layer, see docs/INTERNALS.md "Paged cache layout"): pages of `page_size`
entries, each page owned by one (sequence, KV head); a block table maps a head's
entry e to page `block_table[b, h, e // S]`, slot `e % S`. Memory held is the pages in
use, so head-wise and layer-wise budgets free real memory. Residual merge slots (when
the policy merges) are the first entries of each head; prompt tokens follow in position
order, then generated tokens. Pads are never stored.

The cache does not store anything in `update()`: the `kvcompile.attend` op receives
the new keys and values and does prefill compression or decode append itself, so the
same op serves the eager and the compiled entry.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from kvcompile.cache_ref import CacheRef, new_token
from kvcompile.layer_state import LayerState
from kvcompile.plan import Plan, build_plan
from kvcompile.policy import Policy


@dataclass
class LayerStore:
    """One layer's pages. Entries carry their key, value, score, logical position
    (−1 for a residual slot) and merge count (1 for a plain token, 0 for an empty slot)."""

    k_pages: Tensor  # (P, S, d)
    v_pages: Tensor  # (P, S, d)
    score_pages: Tensor  # (P, S) float32
    pos_pages: Tensor  # (P, S) int64
    count_pages: Tensor  # (P, S) float32
    block_table: Tensor  # (B, H, M) int64
    lengths: Tensor  # (B, H) int64: entries stored per head
    slots: Tensor  # (B, H) occupied residual slots at the start of each head (0 when the policy drops)
    next_page: int  # bump allocator: pages [next_page, P) are free
    owned: Tensor  # (B, H) int64: pages a head owns, block_table[b, h, :owned]; those past its
    #                 entries are its spares, consecutive after its last page where the pool allows
    settled: bool = False  # on the host: every head holds at most its online-eviction budget (ZSMerge), so
    #                        a decode step evicts at most one entry per head (runtime._evict_online)
    room: int = 0  # on the host: appends every head can still take in the pages it owns (a lower bound:
    #                 removals and crops only add room); while positive an append reads nothing back

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[1]

    def pages_per_head(self) -> Tensor:
        return (self.lengths + self.page_size - 1) // self.page_size

    def entries(self) -> tuple[Tensor, Tensor]:
        """Page and slot of every entry slot (B, H, M·S), and which of them are stored."""
        s = self.page_size
        e = torch.arange(self.block_table.shape[-1] * s, device=self.lengths.device)
        page = self.block_table[..., e // s]
        return page * s + e % s, e < self.lengths[..., None]

    def gather(self):
        """The stored entries as dense per-head tensors (B, H, E, ·), padded beyond lengths."""
        flat, stored = self.entries()
        d = self.k_pages.shape[-1]
        k = self.k_pages.reshape(-1, d)[flat]
        v = self.v_pages.reshape(-1, d)[flat]
        return (k, v, self.score_pages.reshape(-1)[flat], self.pos_pages.reshape(-1)[flat],
                self.count_pages.reshape(-1)[flat], stored)


@dataclass
class Entries:
    """Candidate entries of one layer, per head: `take` (B, H, E) selects what is stored."""

    keys: Tensor  # (B, H, E, d)
    values: Tensor  # (B, H, E, d)
    scores: Tensor  # (B, H, E) float
    positions: Tensor  # (B, H, E) long, −1 for residual slots
    counts: Tensor  # (B, H, E) float merge counts (1 = plain token, 0 = empty slot)
    take: Tensor  # (B, H, E) bool


def build_store(sources: list[Entries], slots: Tensor, page_size: int, spare_pages: int) -> LayerStore:
    """Write the selected entries of `sources`, one after the other per head, into fresh pages.

    Every head gets ceil(n/S) + `spare_pages` consecutive pages, the spares for the tokens it
    generates: its decode appends then stay in order in the pool, which the decode kernel
    reads at streaming speed (benchmarks/bench_decode.py). Only the selected rows are copied
    (no dense copy of the layer).
    """
    first = sources[0]
    b, h, _, d = first.keys.shape
    dev = first.keys.device
    s = page_size
    counts_per_source = [src.take.sum(-1) for src in sources]  # each (B, H)
    n = torch.stack(counts_per_source).sum(0)
    owned = (n + s - 1) // s + spare_pages
    base = owned.flatten().cumsum(0).reshape(b, h) - owned  # first page of each head
    m = max(int(owned.max()), 1)
    cols = torch.arange(m, device=dev)
    block_table = torch.where(cols < owned[..., None], base[..., None] + cols, 0)
    cap = total = int(owned.sum())
    store = LayerStore(
        k_pages=first.keys.new_zeros(cap, s, d),
        v_pages=first.values.new_zeros(cap, s, d),
        score_pages=torch.zeros(cap, s, dtype=torch.float32, device=dev),
        pos_pages=torch.full((cap, s), -1, dtype=torch.long, device=dev),
        count_pages=torch.zeros(cap, s, dtype=torch.float32, device=dev),
        block_table=block_table, lengths=n.clone(), slots=slots, next_page=total, owned=owned,
        room=int((owned * s - n).min()) if n.numel() else 0)
    offset = torch.zeros_like(n)
    for src, cnt in zip(sources, counts_per_source):
        bi, hi, ei = src.take.nonzero(as_tuple=True)  # row-major: grouped per head, in entry order
        rank = offset[bi, hi] + (src.take.cumsum(-1) - 1)[bi, hi, ei]
        page, slot = base[bi, hi] + rank // s, rank % s
        store.k_pages[page, slot] = src.keys[bi, hi, ei]
        store.v_pages[page, slot] = src.values[bi, hi, ei]
        store.score_pages[page, slot] = src.scores[bi, hi, ei].float()
        store.pos_pages[page, slot] = src.positions[bi, hi, ei]
        store.count_pages[page, slot] = src.counts[bi, hi, ei].float()
        offset = offset + cnt
    return store


def append(store: LayerStore, k: Tensor, v: Tensor, positions: Tensor, step: int = 1) -> None:
    """Append one entry per head: k, v (B, H, d), positions (B,) long. O(1) amortised:
    a head whose last page is full moves on to its next spare page; one without spares
    takes a run of `step` fresh consecutive pages from the pool (its next spares, so its
    pages stay in runs the decode kernel streams), which grows (rarely) when none is left.

    While `store.room` (a host count: appends every head's owned pages still take) is positive,
    nothing is read back to the host and no shape changes: the slot of each head is computed on
    the device. Only when it runs out does the append read the heads that need pages (one host
    read, Plan.host_syncs "page allocation": the generation outgrew the pages reserved for it)."""
    b, h, d = k.shape
    s = store.page_size
    e = store.lengths  # (B, H)
    col = e // s
    if store.room <= 0:
        need = (col >= store.owned) & (e % s == 0)
        fresh, store.room = torch.stack([need.sum(), (store.owned * s - e).min()]).tolist()
        if fresh:
            if store.next_page + fresh * step > store.k_pages.shape[0]:
                _grow(store, max(fresh * step, store.k_pages.shape[0] // 4, b * h))
            width = int(col.max()) + step
            if width > store.block_table.shape[-1]:
                store.block_table = torch.nn.functional.pad(store.block_table,
                                                            (0, width - store.block_table.shape[-1]))
            bi, hi = need.nonzero(as_tuple=True)
            first = store.next_page + torch.arange(fresh, device=k.device) * step  # each head's run
            run = torch.arange(step, device=k.device)
            store.block_table[bi[:, None], hi[:, None], col[bi, hi][:, None] + run] = first[:, None] + run
            store.owned = torch.where(need, col + step, store.owned)
            store.next_page += fresh * step
            store.room = int((store.owned * s - e).min())
    page = store.block_table.gather(-1, col[..., None]).squeeze(-1)
    slot = e % s
    store.k_pages[page, slot] = k
    store.v_pages[page, slot] = v
    store.score_pages[page, slot] = 0.0
    store.pos_pages[page, slot] = positions[:, None].expand(b, h)
    store.count_pages[page, slot] = 1.0
    store.lengths = e + 1
    store.room -= 1


def writable(store: LayerStore) -> None:
    """Make a store made under torch.inference_mode() updatable outside it (its inference
    tensors are copied once into ordinary ones; DynamicCache concatenates, we write in place)."""
    if not store.k_pages.is_inference():
        return
    for f in dataclasses.fields(store):
        value = getattr(store, f.name)
        if isinstance(value, Tensor) and value.is_inference():
            setattr(store, f.name, value.clone())


def remove(store: LayerStore, b, h, e) -> None:
    """Remove entry e of head (b, h) in O(1): the head's last entry moves into its place
    (order within a head does not matter to attention); an emptied page stays the head's, a
    spare for its next appends (memory held counts only pages with entries).
    b, h, e are ints, or 1-D long tensors naming distinct heads (one entry each, removed at once)."""
    s = store.page_size
    dev = store.lengths.device
    b, h, e = (x if isinstance(x, Tensor) else torch.tensor([x], dtype=torch.long, device=dev) for x in (b, h, e))
    last = store.lengths[b, h] - 1
    ends = torch.stack([last, e])  # (2, K): the head's last entry and the removed one
    src, dst = store.block_table[b, h, ends // s] * s + ends % s
    for t in (store.k_pages, store.v_pages, store.score_pages, store.pos_pages, store.count_pages):
        entries = t.view(-1, *t.shape[2:])
        entries[dst] = entries[src]  # e == last copies the entry onto itself
    store.lengths[b, h] = last


def remove_where(store: LayerStore, leaving: Tensor, e: Tensor) -> None:
    """`remove` of entry e[b, h] (B, H) from every head with leaving[b, h] (B, H) bool, at once and
    with no host read (fixed shapes): the other heads copy one of their own entries onto itself."""
    s = store.page_size
    last = store.lengths - 1
    dst = torch.where(leaving, e, last.clamp(min=0))
    src = torch.where(leaving, last, dst)
    ends = torch.stack([src, dst], dim=-1)  # (B, H, 2)
    src, dst = (store.block_table.gather(-1, ends // s) * s + ends % s).unbind(-1)
    for t in (store.k_pages, store.v_pages, store.score_pages, store.pos_pages, store.count_pages):
        entries = t.view(-1, *t.shape[2:])
        entries[dst] = entries[src]
    store.lengths = torch.where(leaving, last, store.lengths)


def _grow(store: LayerStore, extra: int) -> None:
    """Add `extra` free pages to the layer's pool (copies the compressed pool: amortised O(1))."""
    for name in ("k_pages", "v_pages", "score_pages", "pos_pages", "count_pages"):
        t = getattr(store, name)
        fill = -1 if name == "pos_pages" else 0
        setattr(store, name, torch.cat([t, t.new_full((extra, *t.shape[1:]), fill)]))


def select_rows(store: LayerStore, index: Tensor, spare_pages: int) -> LayerStore:
    """A new store whose row i is a copy of row index[i] of `store` (entries in the same order,
    merge slots first), each head on fresh pages with its spares."""
    k, v, scores, pos, counts, stored = store.gather()
    index = index.to(k.device)
    taken = Entries(k[index], v[index], scores[index], pos[index], counts[index], stored[index])
    return build_store([taken], store.slots[index], store.page_size, spare_pages)


def _device_of(state) -> torch.device | None:
    """The device of a state dataclass's tensors (its first tensor field's: they all live on one)."""
    for f in dataclasses.fields(state):
        x = getattr(state, f.name)
        if isinstance(x, Tensor):
            return x.device
    return None


def _rows(state, index: Tensor):
    """A copy of a state dataclass with every batch-first tensor (lists of them too) indexed by rows."""
    return _map_tensors(state, lambda x: x[index.to(x.device)] if x.dim() >= 1 else x)


def _map_tensors(state, fn):
    """A copy of a state dataclass with fn applied to every tensor field (and to the tensors of list fields)."""
    def apply(x):
        if isinstance(x, Tensor):
            return fn(x)
        if isinstance(x, list):
            return [apply(y) for y in x]
        return x

    return dataclasses.replace(state, **{f.name: apply(getattr(state, f.name)) for f in dataclasses.fields(state)})


@dataclass
class PromptState:
    """What every layer's prompt compression reads; made by `runtime.start_prompt` at layer 0."""

    valid: Tensor  # (B, N) bool: real prompt tokens (left pads False)
    lengths: Tensor  # (B,) real prompt lengths n_b
    pad: Tensor  # (B,) left pads
    width: int  # N: prompt length with pads
    totals: Tensor | None  # (B, L) layer totals known from the lengths (None: threshold or cascade)
    entropy: list[Tensor]  # cascade: the (B,) entropy of every layer compressed so far
    progress: object | None = None  # a tqdm bar over the layers, or None
    held: list[Tensor] = dataclasses.field(default_factory=list)  # cascade: (B,) entries each layer holds
    #   as the cascade defines it (a lazy cascade's pages may still hold more, see Plan.lazy_cascade)
    protected: Tensor | None = None  # cascade: (B,) protected entries of a layer (the same in every layer)


@dataclass
class PromptChunks:
    """A prompt that arrives in chunks (generate(prefill_chunk_size=...)): every layer's keys
    and values (and the queries the scorer will read) are held until the chunk that ends the
    prompt, which then compresses the layer exactly as one pass over the prompt would."""

    length: int  # the whole prompt's length, pads included
    queries: list[Tensor | None]  # per layer: the latest query rows so far (B, Hq, ≤R, d)
    keys: list[Tensor | None]  # per layer: (B, H, seen, d)
    values: list[Tensor | None]


@dataclass
class ChunkedPrompt:
    """A prompt compressed while it arrives in chunks (schedule.prefill: chunk; runtime.chunked_prefill):
    every call brings the next chunk of at most `plan.prefill_chunk` tokens, compressed back to the
    budget before the next one; the calls after `length` tokens decode."""

    length: int  # the whole prompt's length, pads included


@dataclass
class DecodeState:
    """What decoding reads; made by `runtime.start_decode` at the first generated token."""

    budgets: Tensor  # (B, L, H) entries each head may hold while decoding
    split: Tensor | None  # (B, L, H, 3) ZSMerge proximity, context, residual per head (None: no split)
    pad: Tensor  # (B,) the prompt's left pads: all a decode step reads of the prompt's state (with its width)
    totals: Tensor | None = None  # (B, L) Σ of the budgets over all heads, for `decode: every` pruning on a
    #   tensor-parallel rank (its `budgets` are its own heads'); None: the sum of `budgets`


class KVCompileCache(Cache):
    """A `transformers.Cache` whose layers hold only the entries a policy keeps.

    Args:
        policy: the validated Policy (`kvcompile.load_spec`).
        config: the model's (text) config: layers, KV heads, head dim.
        page_size: entries per page (default 16).
        headroom: tokens per head to reserve for generation after the prompt
            (`generate()` passes max_new_tokens), as spare pages right after each head's
            pages (at most what the decode schedule lets a head grow); the pool grows
            when they run out.
        record: keep each layer's prefill state (LayerState with every query row) for
            tests and "prefill once, compress many" sweeps.
        kernels: which kernels run: None (Triton on a GPU; on a CPU the C++ decode kernel
            for fp32, else the eager torch lowering), "cpp", "torch", "compiled" (the torch
            lowering through Inductor) or "triton".
        plan: a `kvcompile.plan.Plan` (what compile() builds); instead of policy and config.

    The runtime's state lives in declared fields: `stores` (one LayerStore per layer),
    `prompt` (PromptState, while and after the prompt runs), `decoding` (DecodeState, once
    tokens are generated), `rings` (latest queries per layer, for `decode: every`),
    `states` (recorded LayerStates), `chunks` / `compressing` (a prompt arriving in several calls,
    compressed once whole / after every chunk) and `seq_length`.
    """

    is_compileable = False

    def __init__(self, policy: Policy | None = None, config=None, page_size: int = 16, headroom: int = 0,
                 record: bool = False, progress=None, kernels: str | None = None, *, plan: Plan | None = None):
        super().__init__(layers=[])
        if plan is None:
            if policy is None or config is None:
                raise TypeError("KVCompileCache needs a policy and the model's config, or a plan")
            plan = build_plan(policy, config, kernels=kernels, page_size=page_size, headroom=headroom)
        self.plan = plan
        self.record = record
        self.progress = progress  # show a progress bar over the prompt's layers
        self.stores: list[LayerStore | None] = [None] * plan.num_layers
        self.states: list[LayerState | None] = [None] * plan.num_layers
        self.rings: list[Tensor | None] = [None] * plan.num_layers  # latest query rows (decode: every)
        self.seq_length = 0  # logical length: prompt (pads included) + generated tokens
        self.prompt: PromptState | None = None
        self.decoding: DecodeState | None = None
        self.chunks: PromptChunks | None = None
        self.compressing: ChunkedPrompt | None = None  # a prompt compressed chunk by chunk, while it runs
        self.reconstruction = None  # kvcompile.kvzip.Reconstruction while a reconstruction scorer's prompt runs
        self.ref = CacheRef(self)  # what kvcompile.attend gets for this cache, and the token it declares it
        self.token = new_token()  # writes (kvcompile.cache_ref)

    def state_to(self, device: torch.device) -> None:
        """Move the state every layer reads to `device`, where the layer about to run lives (its
        layer's device, Plan.layer_device; the runtime calls this before each layer's step when the plan's
        layers run on several devices). While
        the prompt runs that is `prompt` (its padding mask, lengths, pads, layer totals, a cascade's
        per-layer counts); once decoding, `decoding` alone (the (B, L, H) budgets, ZSMerge's split,
        the pads): a decode step reads nothing else, so the prompt's state stays where it is. It moves
        where the layers change devices, a few times per forward."""
        name = "prompt" if self.decoding is None else "decoding"
        state = getattr(self, name)
        if state is not None and _device_of(state) not in (None, device):
            setattr(self, name, _map_tensors(state, lambda x: x.to(device)))

    def expect_prompt(self, length: int) -> None:
        """The next `length` tokens (pads included) are one prompt, given in several forward
        calls: it is compressed when its last token arrives, exactly as in one call."""
        if self.is_initialized or self.seq_length:
            raise RuntimeError("kvcompile: expect_prompt() on a cache that already holds a prompt")
        if self.plan.prefill_chunk:  # the policy compresses after each chunk (schedule.prefill: chunk)
            self.compressing = ChunkedPrompt(int(length))
            return
        n = self.plan.num_layers
        self.chunks = PromptChunks(int(length), [None] * n, [None] * n, [None] * n)

    def __deepcopy__(self, memo):
        """An independent cache (transformers' prefix-caching recipe deep-copies a prefilled
        cache per question): its own pages and state, and its own `ref` and `token`, so the op
        writes into the copy, never into the original. The plan is immutable and shared."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        memo[id(self.plan)] = self.plan
        bar = self.prompt.progress if self.prompt is not None else None
        if bar is not None:
            memo[id(bar)] = None  # a progress bar is not copied
        for key, value in self.__dict__.items():
            if key not in ("ref", "token"):
                setattr(new, key, copy.deepcopy(value, memo))
        new.ref, new.token = CacheRef(new), new_token()
        return new

    def __setstate__(self, state):
        """An unpickled (or shallow-copied) cache is a cache of its own: its own `ref` and `token` (a
        pickled CacheRef names nothing: kvcompile.cache_ref)."""
        self.__dict__.update(state)
        self.ref, self.token = CacheRef(self), new_token()

    @classmethod
    def from_plan(cls, plan: Plan, record: bool = False, progress=None) -> "KVCompileCache":
        return cls(plan=plan, record=record, progress=progress)

    # --- what the plan fixed ------------------------------------------------------------
    policy = property(lambda self: self.plan.policy)
    num_layers = property(lambda self: self.plan.num_layers)
    num_heads = property(lambda self: self.plan.num_heads)
    head_dim = property(lambda self: self.plan.head_dim)
    page_size = property(lambda self: self.plan.page_size)
    headroom = property(lambda self: self.plan.headroom)
    kernels = property(lambda self: self.plan.kernels)

    # --- the prompt and decode state, by their usual names ----------------------------------
    prompt_lengths = property(lambda self: None if self.prompt is None else self.prompt.lengths)  # (B,)
    pad = property(lambda self: None if self.prompt is None else self.prompt.pad)  # (B,) left pads
    prompt_width = property(lambda self: 0 if self.prompt is None else self.prompt.width)
    budgets = property(lambda self: None if self.decoding is None else self.decoding.budgets)  # (B, L, H)
    split = property(lambda self: None if self.decoding is None else self.decoding.split)

    # --- transformers.Cache interface -------------------------------------------------
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # The kvcompile.attend op stores the new entries; the model's own code sees them unchanged.
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seq_length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seq_length + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.seq_length

    def get_max_length(self, layer_idx=None) -> int:
        return -1

    def __len__(self) -> int:
        return self.num_layers

    @property
    def is_initialized(self) -> bool:  # used by generate() to tell prefill from decode
        return self.stores[0] is not None

    def reset(self):
        self.__init__(plan=self.plan, record=self.record, progress=self.progress)

    # --- rows: beam search, contrastive search, expanded inputs ---------------------------
    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Row i continues row beam_idx[i]'s compressed cache (beam search): each row gets a
        copy of its parent's pages, scores, counts and state, so beams never share a page."""
        self._select_rows(beam_idx.to(dtype=torch.long))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._select_rows(torch.as_tensor(indices, dtype=torch.long))

    def batch_repeat_interleave(self, repeats: int) -> None:
        b = self.prompt.lengths.shape[0] if self.prompt is not None else None
        if b is None:
            return
        self._select_rows(torch.arange(b).repeat_interleave(repeats))

    def _select_rows(self, index: Tensor) -> None:
        if self.chunks is not None or self.compressing is not None:
            raise RuntimeError("kvcompile: a cache cannot change its rows in the middle of a chunked prompt")
        if self.prompt is None:
            return
        index = index.to(self.prompt.lengths.device)
        self.stores = [None if store is None else select_rows(store, index, self.plan.spare_pages)
                       for store in self.stores]
        self.prompt = _rows(self.prompt, index)
        self.decoding = None if self.decoding is None else _rows(self.decoding, index)
        self.rings = [None if ring is None else ring[index.to(ring.device)] for ring in self.rings]
        self.states = [None] * self.plan.num_layers

    @property
    def is_croppable(self) -> bool:
        """crop() is exact only where the policy evicts nothing and updates no score while decoding."""
        plan = self.plan
        return not (plan.prune_every or plan.online_eviction or plan.running_scores)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the latest `-tokens_to_remove` generated entries (transformers' convention: 0 or a
        negative count), as assisted and prompt-lookup decoding do with rejected candidates.
        Exact only where the policy evicts nothing and updates no score while decoding
        (`is_croppable`); refused otherwise (compile()'s generate refuses those decoding modes
        before the prompt runs)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop() takes the number of tokens to remove as a negative int (or 0), got "
                             f"{tokens_to_remove}")
        if tokens_to_remove == 0:
            return
        if not self.is_croppable:
            raise NotImplementedError(
                f"kvcompile: crop() is exact only for policies that evict nothing and update no score while "
                f"decoding; {self.plan.policy.name} does (assisted and prompt-lookup decoding are not supported)")
        max_length = self.seq_length + tokens_to_remove
        if self.prompt is None or max_length < self.prompt.width:
            raise NotImplementedError("kvcompile: crop() into the compressed prompt is not possible: its "
                                      "evicted entries are gone")
        cutoff = (max_length - self.prompt.pad)[:, None, None]  # (B, 1, 1) logical positions kept
        for store in self.stores:
            _, _, _, pos, _, stored = store.gather()
            # decode appends sit after a head's prompt entries, in order: what is cut is a suffix
            store.lengths = (stored & ((pos < cutoff.to(pos.device)) | (pos < 0))).sum(-1)
        self.seq_length = max_length

    # --- reports -------------------------------------------------------------------------
    def kept(self, device: torch.device | None = None) -> Tensor:
        """(B, L, H) entries stored per sequence, layer and KV head (residual slots included), on
        `device` (default: layer 0's; layers may live on several devices)."""
        device = self.stores[0].lengths.device if device is None else device
        return torch.stack([s.lengths.to(device) for s in self.stores], dim=1)

    def kept_positions(self, layer: int) -> Tensor:
        """(B, H, N) bool: which prompt positions (padded index) the layer keeps."""
        store = self.stores[layer]
        _, _, _, pos, _, stored = store.gather()
        b, h = store.lengths.shape
        n = self.prompt_width
        out = torch.zeros(b, h, n, dtype=torch.bool, device=pos.device)
        ok = stored & (pos >= 0) & (pos < self.prompt_lengths.to(pos.device)[:, None, None])
        bi, hi, ei = ok.nonzero(as_tuple=True)
        out[bi, hi, pos[bi, hi, ei] + self.pad.to(pos.device)[bi]] = True
        return out

    def memory_report(self) -> dict:
        """Bytes and entries held now, against what a full (uncompressed) cache would hold, in this
        process: under tensor parallelism, its own KV heads (`kv_heads`; `kept` and `pages` are
        (B, L, H') over them); `gathered_memory_report()` is the view over all ranks."""
        if not self.is_initialized:
            raise RuntimeError("memory_report(): the cache is empty (no prompt processed yet)")
        store = self.stores[0]
        elt = store.k_pages.element_size()
        entry_bytes = 2 * self.head_dim * elt  # K and V
        pages = torch.stack([s.pages_per_head().to(store.lengths.device) for s in self.stores], dim=1)  # (B, L, H)
        kept = self.kept()
        b = kept.shape[0]
        pool_pages = sum(s.k_pages.shape[0] for s in self.stores)
        meta = sum(s.score_pages.nbytes + s.pos_pages.nbytes + s.count_pages.nbytes
                   + s.block_table.nbytes for s in self.stores)
        held = int(pages.sum()) * self.page_size * entry_bytes
        full = b * self.seq_length * self.num_layers * len(self.plan.kv_heads) * entry_bytes
        report = {
            "bytes_held": held,
            "bytes_entries": int(kept.sum()) * entry_bytes,
            "bytes_allocated": pool_pages * self.page_size * entry_bytes,
            "bytes_metadata": meta,
            "bytes_full": full,
            "kept": kept,
            "pages": pages,
            "page_size": self.page_size,
            "kv_heads": self.plan.kv_heads,
            # the empty slots of the pages held: each head's last page is filled only partly
            "bytes_unused_slots": held - int(kept.sum()) * entry_bytes,
        }
        if held > full:
            report["note"] = (
                "bytes_held exceeds bytes_full: nothing (or little) was evicted, and bytes_held counts whole pages "
                f"of {self.page_size} entries, so each head's partly filled last page (bytes_unused_slots) is "
                "counted; compression shows once the sequence is longer than the budget")
        return report

    def gathered_memory_report(self) -> dict:
        """memory_report() over every rank of a tensor-parallel group (every rank must call it, as
        any collective): bytes summed over ranks, `kept` and `pages` (B, L, H) over all heads,
        `per_rank` the byte counts of each rank. With one process, memory_report() itself."""
        report = self.memory_report()
        shard = self.plan.shard
        if shard is None:
            return report
        names = ("bytes_held", "bytes_entries", "bytes_allocated", "bytes_metadata", "bytes_full")
        # all_gather of this rank's five byte counts (P, 5), and of its kept and pages counts (B, L, H/P) each
        mine = torch.tensor([[report[name] for name in names]], dtype=torch.long,
                            device=report["kept"].device)  # the cache's device: NCCL sends CUDA tensors only
        per_rank = shard.gather_heads(mine[:, None])[0]  # (P, 5)
        counts = torch.stack([report["kept"], report["pages"]], dim=1).permute(0, 3, 1, 2)  # (B, H/P, 2, L)
        kept, pages = shard.gather_heads(counts).permute(0, 2, 3, 1).unbind(1)  # (B, L, H) each
        return {**{name: int(per_rank[:, i].sum()) for i, name in enumerate(names)}, "kept": kept, "pages": pages,
                "page_size": self.page_size, "kv_heads": tuple(range(self.num_heads)),
                "per_rank": [dict(zip(names, row)) for row in per_rank.tolist()]}
