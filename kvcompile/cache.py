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
from collections import Counter
from dataclasses import dataclass

import torch
import transformers
from packaging.version import Version
from torch import Tensor
from transformers.cache_utils import Cache

from kvcompile.cache_ref import CacheRef, new_token
from kvcompile.store import LayerStore, TieredStore
from kvcompile.engine.window import WindowLayer, window_step
from kvcompile.engine.state import HOLDS, NEXT, ChunkedPrompt, Phase, PromptChunks, device_of, map_tensors, rows_of
from kvcompile.layer_state import LayerState
from kvcompile.plan import Plan, build_plan
from kvcompile.policy import Policy




@dataclass
class DecodeState:
    """What decoding reads (the op's `decode`): the cache's `decoding` state, made by `engine.decode.start_decode`
    at the first generated token (its owner); the cache advances and cuts its length."""

    budgets: Tensor  # (B, L, H) entries each head may hold while decoding
    split: Tensor | None  # (B, L, H, 3) ZSMerge proximity, context, residual per head (None: no split)
    pad: Tensor  # (B,) the prompt's left pads: all a decode step reads of the prompt's state (with its width)
    totals: Tensor | None = None  # (B, L) Σ of the budgets over all heads, for `decode: every` pruning on a
    #   tensor-parallel rank (its `budgets` are its own heads'); None: the sum of `budgets`
    length: Tensor | None = None  # () int64 on the device: the cache's length (`seq_length`, pads included),
    #   bumped in place after each call's last layer; a decode step's positions are read from it, not from the
    #   host's count, so a replayed (captured) step writes the right ones

    def advance(self, tokens: int) -> None:
        """The cache grew by `tokens` (after a call's last layer): its length on the device too, in place (a
        copy first where it is an inference tensor and inference_mode is off)."""
        if self.length.is_inference() and not torch.is_inference_mode_enabled():
            self.length = self.length.clone()
        self.length.add_(tokens)

    def cut(self, length: int) -> None:
        """The cache was cut back to `length` tokens (KVCompileCache.crop)."""
        self.length = self.length.new_tensor(length)


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

    The cache is in one `phase` (engine.state.Phase: empty, prompt, compressed, decoding), which holds its
    state, read-only here and set by the phase's own module through `enter`: `prompt` (PromptState, from the
    prompt on), `chunks` / `compressing` (a prompt arriving in several calls, compressed once whole / after
    every chunk), `reconstruction` (a reconstruction scorer's prompt) and `decoding` (DecodeState). `plan` is
    bound once (`bind`, before a layer holds pages). The layers' contents, read-only lists that the engine's
    phases change through the cache's methods only (`hold_store`, `hold_stores`, `hold_queries`, `push_query`,
    `record_state`, `hold_windows`): `stores` (one page store per layer, of the class `plan.store` names),
    `rings` (latest queries per layer, for `decode: every`), `states` (recorded LayerStates), `windows`; and
    `seq_length` (`advance`).
    """

    is_compileable = False

    # transformers' per-layer kinds, one entry per model layer (the base class derives them from `layers`, which
    # this cache does not use): no layer is linear attention, sliding or a dummy. generate() reads `is_linear` (5.24
    # on) before it cuts a continued prompt down to the tokens after the cache: an empty list would say "all
    # linear", and the whole prompt would be fed again on top of the cache. A hybrid model's local layers are not
    # "sliding" to transformers either: their window is kvcompile's (`windows`), and the masks are kvcompile's
    # (kvcompile_mask), sized by get_mask_sizes for every layer alike.
    is_linear = is_sliding = is_dummy = property(lambda self: [False] * len(self._windows))  # one per model layer

    def __init__(self, policy: Policy | None = None, config=None, page_size: int = 16, headroom: int = 0,
                 record: bool = False, progress=None, kernels: str | None = None, *, plan: Plan | None = None):
        super().__init__(layers=[])
        if plan is None:
            if policy is None or config is None:
                raise TypeError("KVCompileCache needs a policy and the model's config, or a plan")
            plan = build_plan(policy, config, kernels=kernels, page_size=page_size, headroom=headroom)
        self._plan = plan
        self._phase, self._state = Phase.EMPTY, {}  # the phase and what it holds (`enter`)
        self.record = record
        self.progress = progress  # show a progress bar over the prompt's layers
        # the layers' contents, read-only lists written by the cache's own methods ("the layers' contents" below)
        self._stores: list[LayerStore | TieredStore | None] = [None] * plan.num_layers
        self._states: list[LayerState | None] = [None] * plan.num_layers
        self._rings: list[Tensor | None] = [None] * plan.num_layers  # latest query rows (decode: every)
        # a hybrid model's layers left to their window (kvcompile.engine.window), by model layer; None elsewhere
        self._windows: list[WindowLayer | None] = [None] * plan.model_layers
        self.seq_length = 0  # logical length: prompt (pads included) + generated tokens
        self.record_past = False  # local layers keep every position until crop() (activate_past_recording)
        self.ref = CacheRef(self)  # what kvcompile.attend gets for this cache, and the token it declares it
        self.token = new_token()  # writes (kvcompile.cache_ref)
        self.host_syncs: Counter[str] = Counter()  # the plan's named host reads while decoding (Plan.host_syncs)
        #   -> layers that ran one: every other decode step after the first reads nothing back

    # --- the phase and its state (engine.state: Phase, NEXT, HOLDS) ----------------------------------------
    plan = property(lambda self: self._plan)  # bound once: `bind`
    phase = property(lambda self: self._phase)
    prompt = property(lambda self: self._state.get("prompt"))  # PromptState
    chunks = property(lambda self: self._state.get("chunks"))  # PromptChunks
    compressing = property(lambda self: self._state.get("compressing"))  # ChunkedPrompt
    reconstruction = property(lambda self: self._state.get("reconstruction"))  # kvcompile.kvzip.Reconstruction
    decoding = property(lambda self: self._state.get("decoding"))  # DecodeState

    def enter(self, phase: Phase, **state) -> None:
        """Move to `phase`, with the state given (what the phase holds and is not given is kept): only along
        engine.state.NEXT, and only the state the phase holds (engine.state.HOLDS); refused (RuntimeError)
        before anything changes otherwise. Each phase's module alone calls it for the state it owns."""
        if phase not in NEXT[self._phase]:
            allowed = " or ".join(f"'{p.value}'" for p in NEXT[self._phase]) or "nothing (reset() empties it)"
            raise RuntimeError(f"kvcompile: a cache that is '{self._phase.value}' cannot move to '{phase.value}': "
                               f"it moves to {allowed}")
        if set(state) - set(HOLDS[phase]):
            raise TypeError(f"kvcompile: a cache that is '{phase.value}' holds {', '.join(HOLDS[phase]) or 'nothing'}"
                            f", not {', '.join(sorted(set(state) - set(HOLDS[phase])))}")
        self._state = {name: state.get(name, self._state.get(name)) for name in HOLDS[phase]}
        self._phase = phase

    def bind(self, plan: Plan) -> None:
        """Run `plan`, the same policy's plan for this model refined before anything is stored: bound to the
        prompt's device and dtype at its first layer (Plan.bound_to), planned for the autocast dtype or a
        generation's headroom (compile()'s entry, a caller's fresh cache). Refused once a layer holds pages."""
        if self.is_initialized or not self._same_model(plan):
            raise RuntimeError("kvcompile: a cache's plan is bound once, before its first layer holds pages, to "
                               "its own policy and model; copy_with(plan) gives a copy that runs another plan")
        self._plan = plan

    def copy_with(self, plan: Plan) -> "KVCompileCache":
        """An independent copy that runs `plan`, the same policy's plan for this model with other backends (tests
        and benchmarks run one prefilled cache through each implementation); this cache keeps its own."""
        if not self._same_model(plan):
            raise ValueError("kvcompile: copy_with() takes a plan of the cache's own policy and model")
        return copy.deepcopy(self, {id(self._plan): plan})  # (the copy's plan: __deepcopy__ keeps the memo's)

    def _same_model(self, plan: Plan) -> bool:
        return (plan.policy, plan.num_layers, tuple(plan.kv_heads)) == (self._plan.policy, self._plan.num_layers,
                                                                         tuple(self._plan.kv_heads))

    # --- the layers' contents: read here, written only by the methods below (tests/test_cache_states.py) ----
    stores = property(lambda self: self._stores)  # one page store per layer (kvcompile/store/), or None
    rings = property(lambda self: self._rings)  # per layer, the latest query rows (B, Hq, <=R, d), or None
    states = property(lambda self: self._states)  # per layer, its recorded LayerState (`record`), or None
    windows = property(lambda self: self._windows)  # per model layer, a local layer's WindowLayer, or None

    def hold_store(self, layer: int, store: LayerStore | TieredStore) -> None:
        """Layer `layer` now holds `store`'s entries: its compressed prompt (a prompt's layer, a chunk's, a
        cascade's re-selection) or, while decoding, its pruned entries in fresh pages."""
        self._stores[layer] = store

    def hold_stores(self, stores: list) -> None:
        """Every layer's entries, the same ones, in other pages: a serving engine's pool adopts a request's pages
        or gives them back (kvcompile.engine.batch.PooledPages)."""
        if len(stores) != len(self._stores):
            raise ValueError(f"kvcompile: hold_stores() takes one store per layer ({len(self._stores)}), got "
                             f"{len(stores)}")
        self._stores = list(stores)

    def hold_queries(self, layer: int, rows: Tensor) -> None:
        """Layer `layer`'s ring of latest query rows (B, Hq, <=R, d) is `rows` (a prompt's, a chunk's): what
        `decode: every` pruning scores with."""
        self._rings[layer] = rows

    def push_query(self, layer: int, row: Tensor) -> None:
        """Layer `layer`'s ring of latest queries (B, Hq, <=R, d) takes `row` (B, Hq, 1, d), dropping its oldest
        row once it holds `plan.ring_rows`: in place then (its storage kept, what a captured step replays into)."""
        ring, rows = self._rings[layer], self.plan.ring_rows
        if ring.shape[2] == rows and not (ring.is_inference() and not torch.is_inference_mode_enabled()):
            ring.copy_(torch.cat([ring[:, :, 1:], row], dim=2))
        else:
            self._rings[layer] = torch.cat([ring, row], dim=2)[:, :, -rows:]

    def record_state(self, layer: int, state: LayerState) -> None:
        """Layer `layer`'s prefill state, kept for tests and sweeps (a cache made with `record`)."""
        if not self.record:
            raise RuntimeError("kvcompile: record_state() on a cache made without record=True")
        self._states[layer] = state

    def hold_windows(self, windows: list) -> None:
        """A hybrid model's local layers as a captured prompt left them (kvcompile.tools.sweep.replay), on an empty
        cache: one entry per model layer (a WindowLayer, None for a compressed layer). A decode step replaces a
        layer's window, never changes it in place, so the windows given are shared, not copied."""
        if self._phase is not Phase.EMPTY or len(windows) != len(self._windows):
            raise ValueError(f"kvcompile: hold_windows() takes one entry per model layer ({len(self._windows)}) "
                             f"on an empty cache; got {len(windows)} on a cache that is '{self._phase.value}'")
        self._windows = list(windows)

    def advance(self, tokens: int) -> None:
        """The cache grew by `tokens` tokens per sequence (a call's last layer ran): its length on the host and,
        once decoding, on the device."""
        self.seq_length += tokens
        if self.decoding is not None and self.decoding.length is not None:
            self.decoding.advance(tokens)

    def state_to(self, device: torch.device) -> None:
        """Move the state every layer reads to `device`, where the layer about to run lives (its
        layer's device, Plan.layer_device; the runtime calls this before each layer's step when the plan's
        layers run on several devices). While
        the prompt runs that is `prompt` (its padding mask, lengths, pads, layer totals, a cascade's
        per-layer counts); once decoding, `decoding` alone (the (B, L, H) budgets, ZSMerge's split,
        the pads): a decode step reads nothing else, so the prompt's state stays where it is. It moves
        where the layers change devices, a few times per forward."""
        name = "decoding" if self._phase is Phase.DECODING else "prompt"
        state = self._state.get(name)
        if state is not None and device_of(state) not in (None, device):
            self._state[name] = map_tensors(state, lambda x: x.to(device))

    def count_host_sync(self, function: str) -> None:
        """A layer's decode step runs the host reads of the engine's `function`: counted under the plan's name
        for them (Plan.host_sync_name)."""
        self.host_syncs[self.plan.host_sync_name(function)] += 1

    # --- a decode step as a pure function of device tensors (kvcompile.graphs) ---------------------------
    def decode_tensors(self) -> list[Tensor]:
        """Every tensor a decode step reads or writes: each layer's pages, block table and counters, the decode
        state (budgets, split, pads, the length on the device) and the rings of latest queries. A step that
        needs the host for nothing (`host_step` None) keeps all of them in their storage and reads nothing
        else of the cache but Python values fixed since the first step, so a graph captured from one step
        replays the next ones on them."""
        out = [t for store in self.stores if store is not None for t in store.state_tensors()]
        if self.decoding is not None:
            out += [getattr(self.decoding, f) for f in self.decoding.__dataclass_fields__
                    if isinstance(getattr(self.decoding, f), Tensor)]
        return out + [ring for ring in self.rings if ring is not None]

    def host_step(self, tokens: int = 1) -> str | None:
        """Why the next decode call of `tokens` tokens per sequence needs the host, or None where it does not:
        it is then a pure function of `decode_tensors()` and the call's inputs, and a graph captured from such a
        step replays it (followed by `replayed(tokens)`, the step's host bookkeeping). The reasons: the first
        decode step (it sets up the decode state), a prompt still arriving, or one of the plan's named
        exceptions (Plan.host_syncs) falling in this step: a page allocation, a `decode: every` pruning."""
        if self._phase is not Phase.DECODING:
            return "not a decode step after the first (the first sets up the decode state)"
        if self.plan.online_eviction and not all(store.settled for store in self.stores):
            return "ZSMerge's first eviction rounds on these pages are counted on the host (the first decode step)"
        if any(store.room < tokens for store in self.stores):
            return self.plan.host_sync_name("append")
        every = self.plan.prune_every
        if every:
            generated = self.seq_length - self.prompt.width
            if any((generated + i + 1) % every == 0 for i in range(tokens)):
                return self.plan.host_sync_name("_prune")
        return None

    def replayed(self, tokens: int = 1) -> None:
        """The host's bookkeeping of a decode step of `tokens` tokens that ran as a replayed graph (which skips
        the op's Python): what the op's body does on the host in such a step (`host_step` None), nothing else."""
        self.seq_length += tokens
        for store in self.stores:
            store.replayed(tokens)
        self.token.add_(tokens * self.num_layers)  # the op's declared write, once per layer

    def expect_prompt(self, length: int) -> None:
        """The next `length` tokens (pads included) are one prompt, given in several forward
        calls: it is compressed when its last token arrives, exactly as in one call."""
        if self.is_initialized or self.seq_length:
            raise RuntimeError("kvcompile: expect_prompt() on a cache that already holds a prompt")
        if self.plan.prefill_chunk:  # the policy compresses after each chunk (schedule.prefill: chunk)
            self.enter(Phase.PROMPT, compressing=ChunkedPrompt(int(length)))
        else:
            n = self.plan.num_layers
            self.enter(Phase.PROMPT, chunks=PromptChunks(int(length), [None] * n, [None] * n, [None] * n))

    def __deepcopy__(self, memo):
        """An independent cache (transformers' prefix-caching recipe deep-copies a prefilled
        cache per question): its own pages and state, and its own `ref` and `token`, so the op
        writes into the copy, never into the original. The plan is immutable and shared."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        memo.setdefault(id(self._plan), self._plan)
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
        """The layers whose entries the policy keeps (kept(), kept_positions(): a hybrid model's compressed
        layers, in the model's order; its local layers are `windows`)."""
        return self.num_layers

    def attend_window(self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                      scale: float) -> Tensor:
        """Model layer `layer`, left to its window (a hybrid model's local layer the policy does not apply to):
        its sliding-window (or chunked) attention over the entries it holds and the new ones, which it then holds
        (the last window - 1 positions, or its chunk's so far; kvcompile.engine.window), except in a reconstruction scorer's forward
        (KVzip's repeat input reads the window as it stands after the prompt and adds nothing to it)."""
        kinds = self.plan.layer_kinds
        out, held = window_step(self.windows[layer], q, k, v, mask, scale, kinds.windows[layer], self.plan.softcap,
                                self.plan.model_layer_sinks(layer, q.device), self.record_past, kinds.chunked(layer))
        if self.reconstruction is None or not self.reconstruction.scoring:  # (a reconstruction forward, KVzip's,
            self._windows[layer] = held  # is no part of the sequence: its tokens attend within the window, kept not)
        return out

    def activate_past_recording(self) -> None:
        """What generate() calls before assisted and prompt-lookup decoding: from now on a hybrid model's local
        layers keep every position they see until the next crop(), which removes the rejected candidates and
        cuts them back to their last window - 1 positions (transformers' DynamicSlidingWindowLayer does the
        same); the compressed layers need nothing (crop() removes their latest entries)."""
        self.record_past = True

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
        if self.prompt is not None:
            self._select_rows(torch.arange(self.prompt.lengths.shape[0]).repeat_interleave(repeats))

    def _select_rows(self, index: Tensor) -> None:
        if self._phase is Phase.PROMPT:
            raise RuntimeError("kvcompile: a cache cannot change its rows in the middle of a prompt")
        if self._phase is Phase.EMPTY:
            return
        index = index.to(self.prompt.lengths.device)
        self._stores = [None if store is None else store.rows(index, self.plan.spare_pages)
                        for store in self._stores]
        self._state = {name: None if s is None else rows_of(s, index) for name, s in self._state.items()}
        self._rings = [None if ring is None else ring[index.to(ring.device)] for ring in self._rings]
        self._windows = [None if held is None else held.rows(index) for held in self._windows]
        self._states = [None] * self.plan.num_layers

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
        before the prompt runs). A hybrid model's local layers drop the same positions and are cut back to
        their last window - 1 (crop(0) only cuts back): past a window, that needs the positions recorded since
        `activate_past_recording()`, as in transformers' sliding-window cache."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop() takes the number of tokens to remove as a negative int (or 0), got "
                             f"{tokens_to_remove}")
        windows = [(i, w) for i, w in enumerate(self.windows) if w is not None]  # a hybrid model's local layers
        if tokens_to_remove == 0:
            for i, w in windows:  # back to their last window - 1 positions
                self._windows[i] = w.cropped(0)
            return
        if any(not w.can_crop(-tokens_to_remove) for _, w in windows):
            raise NotImplementedError(
                "kvcompile: crop() on a hybrid model whose local layers hold their last window - 1 positions only: "
                "the entries a crop would bring back into the window are gone; call activate_past_recording() "
                "before the tokens to crop run (generate()'s assisted and prompt-lookup decoding do), as "
                "transformers' sliding-window cache needs")
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
            store.crop(cutoff)
        for i, w in windows:
            self._windows[i] = w.cropped(-tokens_to_remove)
        self.seq_length = max_length
        if self.decoding is not None and self.decoding.length is not None:
            self.decoding.cut(max_length)

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
        pages = torch.stack([s.pages_per_head().to(store.lengths.device) for s in self.stores], dim=1)  # (B, L, H)
        kept = self.kept()
        b = kept.shape[0]
        meta = sum(s.metadata_bytes for s in self.stores)
        held = sum(s.kv_bytes_held() for s in self.stores)
        by_precision: Counter[str] = Counter()
        for s in self.stores:
            by_precision.update(s.bytes_by_precision())
        entries = sum(s.kv_bytes_entries() for s in self.stores)
        windows = sum(w.nbytes for w in self.windows if w is not None)  # a hybrid model's local layers
        if windows:
            by_precision["model_dtype"] += windows
        by_kind, full_by_kind = self._bytes_by_kind(b)
        report = {
            "bytes_held": held + windows,
            "bytes_by_precision": dict(by_precision),
            "bytes_by_kind": by_kind,
            "bytes_full_by_kind": full_by_kind,
            "bytes_entries": entries + windows,
            "bytes_allocated": sum(s.kv_bytes_allocated for s in self.stores) + windows,
            "bytes_metadata": meta,
            "bytes_full": sum(full_by_kind.values()),
            "kept": kept,
            "pages": pages,
            "page_size": self.page_size,
            "kv_heads": self.plan.kv_heads,
            # the empty slots of the pages held: each head's last page is filled only partly
            "bytes_unused_slots": held - entries,
        }
        if report["bytes_held"] > report["bytes_full"]:
            report["note"] = (
                "bytes_held exceeds bytes_full: nothing (or little) was evicted, and bytes_held counts whole pages "
                f"of {self.page_size} entries, so each head's partly filled last page (bytes_unused_slots) is "
                "counted; compression shows once the sequence is longer than the budget")
        return report

    def _bytes_by_kind(self, b: int) -> tuple[dict[str, int], dict[str, int]]:
        """Bytes held now by each kind of layer (transformers' config.layer_types: the layers a policy compresses,
        pages held; the layers left to their window, their keys and values), and what a full cache holds there,
        as transformers' own cache does: every token's key and value in the model's dtype, a local layer's last
        window - 1 tokens (pads included)."""
        element = torch.empty((), dtype=self.plan.dtype).element_size() if self.plan.dtype is not None else 4
        token = b * len(self.plan.kv_heads) * 2 * self.plan.head_dim * element
        kinds = self.plan.layer_kinds
        if kinds is None:
            return ({"full_attention": sum(s.kv_bytes_held() for s in self.stores)},
                    {"full_attention": token * self.seq_length * self.num_layers})
        held: dict[str, int] = {}
        full: dict[str, int] = {}
        for layer, (kind, window, engine) in enumerate(zip(kinds.kinds, kinds.windows, kinds.engine)):
            if engine is not None:
                bytes_now = self.stores[engine].kv_bytes_held()
            else:
                bytes_now = 0 if self.windows[layer] is None else self.windows[layer].nbytes
            held[kind] = held.get(kind, 0) + bytes_now
            tokens = self.seq_length if window is None else min(self.seq_length, window - 1)
            full[kind] = full.get(kind, 0) + token * tokens
        return held, full

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
        # the bytes of each kind of layer (the same kinds, in the same order, on every rank), summed over ranks
        kinds = list(report["bytes_by_kind"])
        mine = torch.tensor([[[report["bytes_by_kind"][k], report["bytes_full_by_kind"][k]] for k in kinds]],
                            dtype=torch.long, device=report["kept"].device)  # (1, K, 2)
        by_kind = shard.gather_heads(mine[:, None])[0].sum(0)  # (K, 2)
        return {**{name: int(per_rank[:, i].sum()) for i, name in enumerate(names)}, "kept": kept, "pages": pages,
                "bytes_by_kind": {k: int(by_kind[i, 0]) for i, k in enumerate(kinds)},
                "bytes_full_by_kind": {k: int(by_kind[i, 1]) for i, k in enumerate(kinds)},
                "page_size": self.page_size, "kv_heads": tuple(range(self.num_heads)),
                "per_rank": [dict(zip(names, row)) for row in per_rank.tolist()]}


# --- the name under which transformers passes a model's cache -------------------------------------------------
# transformers 5.24 renamed the cache argument of `generate()`, of every model's `forward()` and of the mask
# functions from `past_key_values` to `cache` (the old name is deprecated, renamed by a decorator, and dropped when
# both are given), and model outputs carry it as `cache` (`past_key_values` stays readable). kvcompile's entries
# wrap `forward()` and `generate()`, so they take the cache under either name and hand it on under the name the
# installed version reads; otherwise generate()'s own `cache` and kvcompile's `past_key_values` arrive together and
# the compressed cache is ignored. (Callers import this module as `cache_arg`: `cache_arg.given(cache)`.)

# what the installed transformers' generate() and forward() read
NAME = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


def take(kwargs: dict):
    """Remove and return the cache a caller gave in `kwargs` under either name (None if none). Given under
    both names, they must be the same object (transformers would keep one and drop the other silently)."""
    new = kwargs.pop("cache", None) if NAME == "cache" else None
    old = kwargs.pop("past_key_values", None)
    if new is not None and old is not None and new is not old:
        raise ValueError("kvcompile: two caches given, as `cache` and as `past_key_values` (the name transformers "
                         "used before 5.24): give one")
    return new if new is not None else old


def given(cache) -> dict:
    """Keyword arguments that hand `cache` on to the installed transformers."""
    return {NAME: cache}


def of(output):
    """The cache a model's or generate()'s output carries (`output.cache` from 5.24, `past_key_values` before)."""
    return getattr(output, NAME)


def is_engine_cache(cache) -> bool:
    """Whether `cache` is continuous batching's paged cache. The engine passes it as `cache`, which up to 5.23 went
    through the model's keyword arguments to the attention function, and from 5.24 is the model's cache argument:
    kvcompile.integrations.batching's attention reads the requests' own caches from it, so it goes on unchanged."""
    if cache is None or NAME != "cache":
        return False
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    return isinstance(cache, PagedAttentionCache)
