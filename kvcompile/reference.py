"""The eager reference engine: the specification of every policy, in plain PyTorch.

Everything fast (runtime, kernels, compiled graphs) is tested against these functions.
Written for clarity, not speed.

Shapes: B batch, H KV heads, Hq = H·G query heads, N prompt tokens, d head dim.
Left padding: `mask` (B, N) is True for real tokens; a sequence's real tokens have
positions 0 … n_b − 1 (n_b = its real length) and pad tokens are never kept.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvcompile.allocation import (HeadBudgets, decode_budgets, head_budgets, head_split, latest,  # noqa: F401
                                  layer_totals, ranked)
from kvcompile.layer_state import LayerState
from kvcompile.policies import scoring as scoring_parts
from kvcompile import selection as _select
from kvcompile.selection import (HeadEntries, Merged, merge_evicted, select,  # noqa: F401
                                 select_and_merge)
from kvcompile.selection import _held_slots


@dataclass
class Selection:
    """What a policy keeps of a prompt."""

    kept: list[Tensor]  # per layer: (B, H, N) bool, retained prompt tokens
    merged: list[Merged | None]  # per layer: residual slots, or None when the policy drops
    budgets: Tensor  # (B, L, H) long: tokens kept = kept[l].sum(-1)
    scores: list[Tensor]  # per layer: (B, H, N) float scores, -inf at padding


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor | None = None,
           lengths: Tensor | None = None, scale: float | None = None, softcap: float | None = None,
           sinks: Tensor | None = None) -> Tensor:
    """Decode attention over a compressed cache: the ground truth for every decode kernel.

    q: (B, Hq, T, d) queries (T new tokens, usually 1) that see every cache entry;
    keys, values: (B, H, S, d), entry s of head h valid when s < lengths[b, h];
    bias: (B, H, S) added to the logits (ZSMerge Eq. 8: α·log w, w = merge count);
    lengths: (B, H) long, None = all S valid. Returns (B, Hq, T, d).
    A head with no valid entry returns zeros.

    A model's soft-cap and learned sinks (`model_logits`, `model_weights`): the logit of entry s is
    cap·tanh(q·k_s·scale / cap) + bias_s, the cap before the bias: a slot standing for w tokens weighs
    w^α·exp(capped logit), as its tokens would under the cap; the sinks (Hq,) join the softmax's
    denominator only (one more logit per query head whose weight is dropped).
    """
    b, hq, t, d = q.shape
    h = keys.shape[1]
    g = hq // h
    scale = d ** -0.5 if scale is None else scale
    k = keys.repeat_interleave(g, dim=1).float()
    v = values.repeat_interleave(g, dim=1).float()
    logits = model_logits(torch.einsum("bhtd,bhsd->bhts", q.float(), k) * scale, softcap)
    if bias is not None:
        logits = logits + bias.repeat_interleave(g, dim=1).float()[:, :, None, :]
    if lengths is not None:
        valid = torch.arange(keys.shape[2], device=keys.device) < lengths[..., None]  # (B, H, S)
        valid = valid.repeat_interleave(g, dim=1)[:, :, None, :]
        logits = logits.masked_fill(~valid, float("-inf"))
    weights = model_weights(logits, None if sinks is None else sinks.view(1, hq, 1, 1))
    return torch.einsum("bhts,bhsd->bhtd", weights, v).to(q.dtype)


def model_logits(logits: Tensor, softcap: float | None) -> Tensor:
    """The model's logits from the scaled dot products s: cap·tanh(s/cap) where it soft-caps them (Gemma 2's
    attn_logit_softcapping), else s. A merge bias is added after (`decode_attention`)."""
    return logits if not softcap else softcap * torch.tanh(logits / softcap)


def model_weights(logits: Tensor, sinks: Tensor | None) -> Tensor:
    """softmax over the last dim of (biased, masked) logits; with learned sinks (gpt-oss; broadcast against
    logits[..., :1]) one more logit per row in the denominator, its weight dropped. A row with no key: zeros."""
    if sinks is not None:
        sink = sinks.float().expand(*logits.shape[:-1], 1)
        return torch.softmax(torch.cat([logits.float(), sink], dim=-1), dim=-1)[..., :-1].nan_to_num(0.0)
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)  # an empty head gives zeros


# --- scoring -------------------------------------------------------------------------------

def query_rows(policy, n: int) -> int:
    """How many of the last prompt queries the policy's scorer reads (R of LayerState)."""
    return policy.scoring.query_rows(n)


def score_layer(policy, state: LayerState) -> Tensor:
    """The scoring part's scores (B, H, N), −inf at pads."""
    return policy.scoring.score(state)


def layer_entropy(scores: Tensor, valid: Tensor) -> Tensor:
    """LAVa Eq. 7–8: normalized entropy of a layer's scores over heads × valid tokens, (B,)."""
    return scoring_parts.entropy(scores, valid)


# --- budgets -------------------------------------------------------------------------------

# --- selection -----------------------------------------------------------------------------

# --- merge -----------------------------------------------------------------------------------

# --- the whole prompt ------------------------------------------------------------------------

def compress(policy, states: list[LayerState], scores: list[Tensor] | None = None) -> Selection:
    """What a policy keeps of a prompt, layer by layer as prefill goes (docs/SPECS.md §2).

    Each layer: score_layer → select → merge_evicted. Layer-dynamic policies (layers:
    entropy, or schedule cascade) run LAVa Alg. 2 literally: after layer l, the totals
    of layers 0 … l are recomputed over the layers seen (the full total spread over
    them, capped at what each still holds) and every seen layer is re-selected among
    its kept entries with its new total (the evicted ones merged when the policy merges).
    `scores`: every layer's scores (B, H, N) when a model-level pass computed them (kvzip_scores).
    """
    first = states[0]
    b_, h_, n_, _ = first.keys.shape
    num_layers = len(states)
    mask = torch.ones(b_, n_, dtype=torch.bool, device=first.keys.device) if first.mask is None else first.mask.bool()
    valid = mask[:, None, :].expand(b_, h_, n_)
    lengths = mask.sum(-1)
    positions = (mask.long().cumsum(-1) - 1)[:, None, :].expand(b_, h_, n_)  # left pads get −1
    has_threshold = policy.budget.threshold is not None
    dynamic = policy.layer_dynamic and not has_threshold
    totals = None if (has_threshold or dynamic) else layer_totals(policy, lengths, num_layers, h_)

    given = scores
    if policy.budget.layers.ranks_entries:  # layers: global: every layer scored, then one ranking
        scores = [score_layer(policy, state) if given is None else given[layer] for layer, state in enumerate(states)]
        kept = global_keep(policy, scores, positions, valid, lengths)
        return Selection(kept, [None] * num_layers, torch.stack([k.sum(-1) for k in kept], dim=1), scores)
    scores, kept, merged, entropy = [], [], [], []

    def compress_layer(j: int, total: Tensor | None) -> None:
        kept[j], merged[j] = select_and_merge(policy, states[j].keys, states[j].values, scores[j], positions,
                                              kept[j], lengths, total, j, merged[j])

    for layer, state in enumerate(states):
        scores.append(score_layer(policy, state) if given is None else given[layer])
        kept.append(valid.clone())  # the layer holds its whole prompt until compressed
        merged.append(None)
        if not dynamic:
            compress_layer(layer, None if totals is None else totals[:, layer])
            continue
        entropy.append(layer_entropy(scores[layer], valid))
        held = torch.stack([k.sum((1, 2)) + _held_slots(m, k).sum(-1) for k, m in zip(kept, merged)], dim=1)
        step = layer_totals(policy, lengths, num_layers, h_, entropy=torch.stack(entropy, dim=1), capacity=held)
        for j in range(layer + 1):
            compress_layer(j, step[:, j])
    budgets = torch.stack([k.sum(-1) for k in kept], dim=1)
    return Selection(kept, merged, budgets, scores)


def global_keep(policy, scores: list[Tensor], positions: Tensor, valid: Tensor, lengths: Tensor) -> list[Tensor]:
    """`layers: global` (KVzip, arXiv:2505.23416: §3 scores S ∈ R^{L×H×n_c} by Eq. 2, §4.1 "Eviction
    Structure" keeps the top r % of them across all heads), literally: per sequence, every head of every
    layer keeps its protected entries (the ranking's sinks and window) and then its best ⌊floor·n⌋ others
    (its own order: the ranking's key descending, then the later position); every other entry of every
    (layer, head) goes into one list, sorted by the key descending, then the later position, the lower
    layer, the lower head, and the first n·H·L − (what is kept so far) of it are kept.
    scores: per layer (B, H, N); positions, valid (B, H, N); lengths (B,). Returns kept per layer (B, H, N)."""
    num_layers = len(scores)
    b_, h_, n_ = scores[0].shape
    kept = [torch.zeros(b_, h_, n_, dtype=torch.bool) for _ in scores]
    for b in range(b_):
        n_b = int(lengths[b])
        floor = policy.budget.layers.floor_tokens(policy.budget.total(n_b, 1, 1))
        protected = policy.ranking.protected(positions[b], torch.tensor(n_b)) & valid[b]
        rest = []
        for layer in range(num_layers):
            key = policy.ranking.key(scores[layer][b], positions[b])
            for h in range(h_):
                mine = []
                for i in range(n_):
                    if protected[h, i]:
                        kept[layer][b, h, i] = True
                    elif valid[b, h, i]:
                        mine.append((-float(key[h, i]), -int(positions[b, h, i]), layer, h, i))
                mine.sort()
                for *_, i in mine[:floor]:
                    kept[layer][b, h, i] = True
                rest += mine[floor:]
        rest.sort()
        room = policy.budget.total(n_b, h_, num_layers) - sum(int(k[b].sum()) for k in kept)
        for _, _, layer, h, i in rest[:max(0, room)]:
            kept[layer][b, h, i] = True
    return [k.to(valid.device) for k in kept]


# --- a prompt compressed while prefilling in chunks (docs/INTERNALS.md, same title) ------------------

@dataclass
class ChunkedPrefill:
    """The specification of `schedule: {prefill: {chunk: c}}`: the prompt goes through the model in
    chunks of c tokens (index k·c … k·c + c − 1 of the padded prompt, the last one shorter), and
    every layer is compressed back to its budget after each chunk. Feed it what the model computes,
    chunk after chunk and, inside a chunk, layer after layer: `step(layer, q, k, v, mask, scale)`.

    One chunk at one layer (q (B, Hq, T, d) the chunk's queries after RoPE, k, v (B, H, T, d),
    mask (B, T) its real tokens, None = all real):
    1. Attention: real query t sees every entry the head holds (kept tokens and merge slots, with
       the merge rule's logit bias, α·log w for ZSMerge) and the chunk's real tokens up to itself;
       a pad query sees itself only (as in one pass). A model's soft-cap and learned sinks (`softcap`,
       `sinks`) apply as in `decode_attention`: cap·tanh(s/cap) + bias, the sinks in the denominator only.
    2. Scores: the scorer's `score_chunk` over the held tokens (in position order) followed by the
       chunk's tokens, per KV head with its own held set, from the chunk's last
       R = query_rows(T) queries (a window scorer: the last min(w, T) queries of the chunk;
       pooling runs over that order; LAVa's max ‖V‖₁ over those entries; recency ranks them in
       order). Running scorers (H2O, ZSMerge) carry their score over chunks as over decode steps:
       s ← λ^T·s + Σ_j λ^(T−1−j) A[j, i] (λ = 1 for H2O). Merge slots are not scored.
    3. Selection: `select_and_merge` among the held tokens and the chunk's real tokens, with the
       slots the head holds, and the budget of the tokens seen so far: n_b = real tokens of the
       chunks 0 … k (layer totals, ratio budgets, the protected window = the last `window` of the
       n_b positions, head allocation and splits as in one pass). A threshold (DBudgetKV) cuts
       among the same candidates (it has no budget: its memory is not bounded by one). Evicted
       tokens merge into the slots (shrinking them first when a head's slot count went down).
    4. Layer-dynamic budgets (`layers: entropy`, `schedule: cascade`): LAVa Alg. 2 inside each
       chunk: after layer l, the totals of layers 0 … l are recomputed from this chunk's
       entropies of those layers (each over its candidates' scores), capped at what each layer
       holds, and layers 0 … l − 1 are re-selected among what they hold. Layers above l hold
       their previous chunk's entries meanwhile, so layers 0 … l share the total of the n_b
       tokens seen less what the layers above hold (`layer_totals(reserved=...)`; never below 0).
       Why less: spreading the whole total over layers 0 … l (Alg. 2 as in one pass) while the
       layers above still hold their share let the cache hold up to about twice the budget plus
       one chunk in the middle of a chunk; this way the entries held after any layer step are at
       most the total (protected sets aside), and the peak is the budget plus the chunk at the
       layer that runs. The price: a layer can only grow within a chunk into what the layers
       below it give up (a lower layer cannot take entries back from higher ones, which still
       hold them when it runs). In the first chunk no layer above holds anything: with c ≥ N this
       is Alg. 2 over the whole prompt.
    With c ≥ N the prompt is one chunk and this is `compress` exactly. Decoding afterwards starts
    from `heads` as `decode_heads` gives after `compress`.

    Memory: with a budget (per_head or ratio), every layer holds at most its share of the total
    after each step, so KV memory peaks at the budget plus one chunk at one layer, whatever N
    (a ratio budget grows with the tokens seen). A threshold (DBudgetKV) has no budget: what it
    keeps of each layer's held entries and chunk is what its cut decides, so memory is not bounded
    by chunking; it is what the threshold keeps plus one chunk, and the layers it keeps whole
    (`keep_layers`) hold every real token of the prompt.
    """

    policy: object
    num_layers: int
    heads: list = field(default_factory=list)  # per layer: [b][h] HeadEntries (tokens in position order,
    #   then slots at positions −1 − r); None before the layer's first chunk
    real: Tensor | None = None  # (B, seen) real tokens of the chunks so far (extended at layer 0)
    entropy: list = field(default_factory=list)  # dynamic budgets: this chunk's (B,) entropy per layer so far
    chunks: int = 0  # chunks started (at layer 0)
    rope: Tensor | None = None  # the model's rotary inverse frequencies, for a scorer that reads them (LayerState.rope)
    temperature: tuple[float, float] | None = None  # every layer's query scale by position (LayerState.temperature:
    #   Llama 4's NoPE layers under attn_temperature_tuning), for a scorer that reads it
    softcap: float | None = None  # the model's logit soft-cap (Gemma 2), in the attention and the scores
    sinks: list | None = None  # per layer, its learned sinks (Hq,) or None (gpt-oss), in the attention and the scores

    def __post_init__(self):
        if not self.policy.scoring.head_local:
            raise ValueError(f"{self.policy.name}: scoring: {self.policy.scoring.name} reads every head's attention; "
                             "a chunk scores each head over the entries that head holds")
        if not self.heads:
            self.heads = [None] * self.num_layers

    def step(self, layer: int, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
             scale: float | None = None) -> Tensor:
        """One chunk at one layer: its attention output (B, Hq, T, d); the layer's entries updated."""
        policy = self.policy
        b_, hq, t_, d = q.shape
        h_ = k.shape[1]
        g = hq // h_
        scale = d ** -0.5 if scale is None else scale
        real = torch.ones(b_, t_, dtype=torch.bool) if mask is None else mask.bool()
        if layer == 0:
            self.start_chunk(real)
        first = self.heads[layer] is None
        held = self.held(layer, b_, h_, k, v)

        # 1. attention of the chunk's queries over the held entries and the chunk (causal)
        sinks = self.layer_sinks(layer)
        out = chunk_attention(policy, held, q, k, v, real, scale, softcap=self.softcap, sinks=sinks)

        # 2. scores of the held tokens and the chunk's, per head, from the chunk's last R queries
        rows = policy.scoring.query_rows(t_)

        def score(b: int, h: int, keys: Tensor, values: Tensor, valid: Tensor, carried: Tensor) -> Tensor:
            state = LayerState(q[b:b + 1, h * g:(h + 1) * g, t_ - rows:], keys[None, None], values[None, None],
                               valid[None], scale, self.rope, self.softcap,
                               None if sinks is None else sinks[h * g:(h + 1) * g],
                               temperature=self.temperature, seen=self.real.shape[1])
            return policy.scoring.score_chunk(state, None if first else carried[None, None])[0, 0]

        # 3. selection back to the budget of the tokens seen (4. inside the chunk's cascade)
        self.select(layer, k, v, real, score)
        return out.to(q.dtype)

    def layer_sinks(self, layer: int) -> Tensor | None:
        """The learned sinks (Hq,) of `layer`, or None."""
        return None if self.sinks is None or self.sinks[layer] is None else self.sinks[layer].float()

    def start_chunk(self, real: Tensor) -> None:
        """A new chunk (B, T) of real tokens arrives (at layer 0)."""
        self.real = real.clone() if self.real is None else torch.cat([self.real, real], dim=1)
        self.entropy = []
        self.chunks += 1

    def held(self, layer: int, b_: int, h_: int, k: Tensor, v: Tensor) -> list[list[HeadEntries]]:
        """[b][h] what the layer holds before this chunk (nothing before its first chunk)."""
        if self.heads[layer] is not None:
            return self.heads[layer]
        d = k.shape[-1]
        empty = HeadEntries(k.new_zeros(0, d), v.new_zeros(0, v.shape[-1]), torch.zeros(0, dtype=torch.long),
                            torch.zeros(0), torch.zeros(0))
        return [[empty] * h_ for _ in range(b_)]

    def select(self, layer: int, k: Tensor, v: Tensor, real: Tensor, score) -> None:
        """Steps 2–4 for one layer: its candidates, the held tokens (position order) then the chunk's
        (k, v (B, H, T, d), real (B, T)), scored per head by `score(b, h, keys, values, valid, carried)`
        (`carried`: the held tokens' scores, then 0 for the chunk's), selected back to the budget of the
        tokens seen (LAVa's cascade inside the chunk for layer-dynamic budgets)."""
        policy = self.policy
        b_, h_, t_, d = k.shape
        lengths = self.real.sum(-1)  # real tokens seen, this chunk's included
        before = lengths - real.sum(-1)
        chunk_positions = before[:, None] + real.long().cumsum(-1) - 1  # (B, T); pads: not used
        first = self.heads[layer] is None
        held = self.held(layer, b_, h_, k, v)
        width = max(int(x.tokens().sum()) for row in held for x in row) + t_
        keys = k.new_zeros(b_, h_, width, d)
        values = v.new_zeros(b_, h_, width, v.shape[-1])
        scores = torch.full((b_, h_, width), float("-inf"))
        positions = torch.full((b_, h_, width), -1, dtype=torch.long)
        valid = torch.zeros(b_, h_, width, dtype=torch.bool)
        for b in range(b_):
            for h in range(h_):
                x = held[b][h]
                tok = x.tokens()
                m = int(tok.sum())
                kh, vh = torch.cat([x.keys[tok], k[b, h]]), torch.cat([x.values[tok], v[b, h]])
                ok = torch.cat([torch.ones(m, dtype=torch.bool), real[b]])
                carried = torch.cat([x.scores[tok], torch.zeros(t_)])
                keys[b, h, :m + t_], values[b, h, :m + t_] = kh, vh
                scores[b, h, :m + t_] = score(b, h, kh, vh, ok, carried)
                positions[b, h, :m + t_] = torch.cat([x.positions[tok], chunk_positions[b]])
                valid[b, h, :m + t_] = ok
        slots = None if first or not policy.merges else _slots_of(held, keys)

        if policy.budget.threshold is not None or not policy.layer_dynamic:
            total = None
            if policy.budget.threshold is None:
                total = layer_totals(policy, lengths, self.num_layers, h_)[:, layer]
            kept, merged = select_and_merge(policy, keys, values, scores, positions, valid, lengths, total, layer,
                                            slots)
            self.heads[layer] = _entries_of(keys, values, positions, scores, kept, merged, policy.storage)
            return
        self.entropy.append(layer_entropy(scores, valid))
        capacity = [_held_count(self.heads[j]) for j in range(layer)]
        capacity.append(valid.sum((1, 2)) + _held_slots(slots, valid).sum(-1))
        above = torch.zeros(b_, dtype=torch.long)  # what the layers above still hold from the previous chunk
        for x in self.heads[layer + 1:]:
            if x is not None:
                above = above + _held_count(x)
        totals = layer_totals(policy, lengths, self.num_layers, h_, entropy=torch.stack(self.entropy, dim=1),
                              capacity=torch.stack(capacity, dim=1), reserved=above)
        for j in range(layer):  # the layers below: re-selected among what they hold
            below = self.heads[j]
            ck, cv, cs, cp, cvalid = _tokens_of(below)
            kept, merged = select_and_merge(policy, ck, cv, cs, cp, cvalid, lengths, totals[:, j], j,
                                            _slots_of(below, ck) if policy.merges else None)
            self.heads[j] = _entries_of(ck, cv, cp, cs, kept, merged, policy.storage)
        kept, merged = select_and_merge(policy, keys, values, scores, positions, valid, lengths, totals[:, layer],
                                        layer, slots)
        self.heads[layer] = _entries_of(keys, values, positions, scores, kept, merged, policy.storage)


def chunk_attention(policy, held: list[list[HeadEntries]], q: Tensor, k: Tensor, v: Tensor, real: Tensor,
                    scale: float, seen_k: Tensor | None = None, seen_v: Tensor | None = None,
                    softcap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """ChunkedPrefill's step 1, (B, Hq, T, d) float32: real query t of the chunk (q, k, v; real (B, T))
    sees every entry its head holds (kept tokens and merge slots, with the merge rule's logit bias), then
    `seen_k`, `seen_v` (B, H, T', d) where given (a reconstruction forward sees the chunk it reconstructs
    whole), then the chunk's real tokens up to itself; a pad query sees itself only. softcap, sinks (Hq,): the
    model's, as `decode_attention` applies them (the cap before the merge bias; the sinks in the denominator)."""
    b_, hq, t_, d = q.shape
    h_ = k.shape[1]
    g = hq // h_
    out = torch.zeros(b_, hq, t_, v.shape[-1])
    for b in range(b_):
        for h in range(h_):
            x = held[b][h]
            bias = torch.zeros(len(x.counts))
            if policy.merges:
                bias = torch.where(x.tokens(), 0.0, policy.merge.bias(x.counts))
            before_k, before_v = x.keys.float(), x.values.float()
            if seen_k is not None:
                before_k = torch.cat([before_k, seen_k[b, h].float()])
                before_v = torch.cat([before_v, seen_v[b, h].float()])
                bias = torch.cat([bias, torch.zeros(seen_k.shape[2])])
            for t in range(t_):
                if real[b, t]:
                    mine = real[b, :t + 1]
                    keys = torch.cat([before_k, k[b, h, :t + 1][mine].float()])
                    values = torch.cat([before_v, v[b, h, :t + 1][mine].float()])
                    logit_bias = torch.cat([bias, torch.zeros(int(mine.sum()))])
                else:  # a pad query sees itself only
                    keys, values, logit_bias = k[b, h, t:t + 1].float(), v[b, h, t:t + 1].float(), torch.zeros(1)
                logits = model_logits(q[b, h * g:(h + 1) * g, t].float() @ keys.T * scale, softcap) + logit_bias
                weights = model_weights(logits, None if sinks is None else sinks[h * g:(h + 1) * g, None])
                out[b, h * g:(h + 1) * g, t] = weights @ values
    return out


def _held_count(heads) -> Tensor:
    """(B,) entries (tokens and occupied slots) a layer holds over its heads."""
    return torch.tensor([sum(len(x.positions) for x in row) for row in heads], dtype=torch.long)


def _slots_of(heads, like: Tensor) -> Merged:
    """The merge slots the heads hold, in slot order, as Merged (B, H, S)."""
    b_, h_ = len(heads), len(heads[0])
    size = max(int((~x.tokens()).sum()) for row in heads for x in row)
    d = like.shape[-1]
    out = Merged(like.new_zeros(b_, h_, size, d), like.new_zeros(b_, h_, size, d),
                 torch.zeros(b_, h_, size, dtype=torch.long))
    for b in range(b_):
        for h in range(h_):
            x = heads[b][h]
            sl = (~x.tokens()).nonzero().squeeze(1)
            sl = sl[(-1 - x.positions[sl]).argsort()]
            n = len(sl)
            out.keys[b, h, :n], out.values[b, h, :n], out.counts[b, h, :n] = x.keys[sl], x.values[sl], \
                x.counts[sl].long()
    return out


def _tokens_of(heads):
    """The tokens the heads hold as candidates (B, H, M): keys, values, scores, positions, valid."""
    b_, h_ = len(heads), len(heads[0])
    width = max(int(x.tokens().sum()) for row in heads for x in row)
    first = heads[0][0]
    keys = first.keys.new_zeros(b_, h_, width, first.keys.shape[-1])
    values = first.values.new_zeros(b_, h_, width, first.values.shape[-1])
    scores = torch.full((b_, h_, width), float("-inf"))
    positions = torch.full((b_, h_, width), -1, dtype=torch.long)
    valid = torch.zeros(b_, h_, width, dtype=torch.bool)
    for b in range(b_):
        for h in range(h_):
            x = heads[b][h]
            tok = x.tokens()
            m = int(tok.sum())
            keys[b, h, :m], values[b, h, :m], scores[b, h, :m] = x.keys[tok], x.values[tok], x.scores[tok]
            positions[b, h, :m], valid[b, h, :m] = x.positions[tok], True
    return keys, values, scores, positions, valid


def stored(storage, x: Tensor) -> Tensor:
    """What a storage part keeps of entries x (…, d): x itself in the model's dtype, or for a part that
    quantizes x̂ = code · scale + zero of each entry's groups (kvcompile.kernels.quantize; float32)."""
    if storage is None or not storage.quantizes or storage.tiered:  # a tiered part splits whole heads (`tiers`)
        return x
    from kvcompile.kernels.quantize import dequantize, quantize

    rows = x.reshape(-1, x.shape[-1])
    q = quantize(rows, storage.bits, storage.group_size(x.shape[-1]))
    return dequantize(q.codes, q.scale, q.zero, storage.bits).reshape(x.shape)


def _per_token(storage, x: Tensor) -> Tensor:
    """x̂ of entries x (E, d), each quantized alone in groups of the part's `group` channels."""
    from kvcompile.kernels.quantize import dequantize, quantize

    q = quantize(x, storage.bits, storage.group_size(x.shape[-1]))
    return dequantize(q.codes, q.scale, q.zero, storage.bits)


def _per_channel(storage, x: Tensor) -> Tensor:
    """x̂ of a group of entries x (G, d), each channel quantized over the group (KIVI's keys)."""
    from kvcompile.kernels.quantize import dequantize, quantize

    q = quantize(x, storage.bits, None, "channel")
    return dequantize(q.codes, q.scale, q.zero, storage.bits, "channel")


def tiers(storage, heads: list[list[HeadEntries]]) -> None:
    """A tiered storage part's split of every head, in place (kvcompile.policies.storage), applied when a
    head's entries are chosen (a prompt's selection, a chunk's, the cascade's, `decode: every`):
    - mixed: of its n tokens, the round(full · n) of highest score (ties: the later position) keep their
      values, the others become x̂, each entry alone (`group` channels per scale); merge slots keep theirs;
    - kivi: in position order, the first L(n) tokens in groups of `tokens`: each group's keys x̂ per
      channel over the group, its values x̂ per entry; the last n − L(n) keep theirs.
    Values already stored are taken as they are (re-quantizing x̂ gives x̂ again up to float rounding)."""
    if storage is None or not storage.tiered:
        return
    for row in heads:
        for head in row:
            tokens = head.tokens().nonzero().squeeze(1).tolist()  # merge slots keep their running means
            n = len(tokens)
            if storage.key_axis == "channel":
                order = head.positions.argsort()[len(head.positions) - n:]  # the tokens, in position order
                for j in range(0, storage.quantized_count(n), storage.tokens):
                    _quantize_group(storage, head, order[j:j + storage.tokens])
                continue
            by_score = sorted(tokens, key=lambda e: (-float(head.scores[e]), -int(head.positions[e])))
            low = torch.tensor(by_score[storage.high_count(n):], dtype=torch.long)
            if len(low):
                head.keys[low] = _per_token(storage, head.keys[low].float()).to(head.keys.dtype)
                head.values[low] = _per_token(storage, head.values[low].float()).to(head.values.dtype)


def _quantize_group(storage, head: HeadEntries, idx: Tensor) -> None:
    head.keys[idx] = _per_channel(storage, head.keys[idx].float()).to(head.keys.dtype)
    head.values[idx] = _per_token(storage, head.values[idx].float()).to(head.values.dtype)


def decode_prune(policy, heads: list[list[HeadEntries]], ring: Tensor, lengths: Tensor, budgets: Tensor,
                 layer: int, scale: float | None = None, **kwargs) -> None:
    """`decode: every`: selection.decode_prune, then the storage part's split of each head (`tiers`)."""
    _select.decode_prune(policy, heads, ring, lengths, budgets, layer, scale, **kwargs)
    tiers(policy.storage, heads)


def _entries_of(keys, values, positions, scores, kept, merged, storage=None) -> list[list[HeadEntries]]:
    """[b][h] HeadEntries: the kept candidates in position order (as `storage` keeps them), then the
    occupied slots."""
    heads = []
    for b in range(kept.shape[0]):
        row = []
        for h in range(kept.shape[1]):
            keep = kept[b, h].nonzero().squeeze(1)
            keep = keep[positions[b, h, keep].argsort()]
            x = HeadEntries(stored(storage, keys[b, h, keep]), stored(storage, values[b, h, keep]),
                            positions[b, h, keep], scores[b, h, keep].float(), torch.ones(len(keep)))
            if merged is not None:
                for r in range(merged.counts.shape[-1]):
                    if merged.counts[b, h, r] > 0:
                        x.add(merged.keys[b, h, r], merged.values[b, h, r], -1 - r, 0.0, float(merged.counts[b, h, r]))
            row.append(x)
        heads.append(row)
    tiers(storage, heads)
    return heads


def compressed_cache(policy, state: LayerState, kept: Tensor, merged: Merged | None):
    """One layer's compressed cache as `decode_attention` takes it: per head the kept tokens in
    position order, then the occupied merge slots; returns keys, values (B, H, S, d),
    bias (B, H, S) (0 for tokens, α·log w for slots; None when the policy drops) and
    lengths (B, H)."""
    b_, h_, _, d = state.keys.shape
    parts = []
    for b in range(b_):
        for h in range(h_):
            k, v = state.keys[b, h, kept[b, h]], state.values[b, h, kept[b, h]]
            bias = k.new_zeros(len(k), dtype=torch.float32)
            if merged is not None:
                full = merged.counts[b, h] > 0
                k = torch.cat([k, merged.keys[b, h, full]])
                v = torch.cat([v, merged.values[b, h, full]])
                bias = torch.cat([bias, policy.merge.bias(merged.counts[b, h, full])])
            parts.append((k, v, bias))
    size = max(len(k) for k, _, _ in parts)
    keys = state.keys.new_zeros(b_, h_, size, d)
    values = state.values.new_zeros(b_, h_, size, state.values.shape[-1])
    bias = torch.zeros(b_, h_, size)
    lengths = torch.zeros(b_, h_, dtype=torch.long)
    for i, (k, v, c) in enumerate(parts):
        b, h = divmod(i, h_)
        keys[b, h, :len(k)], values[b, h, :len(k)], bias[b, h, :len(k)], lengths[b, h] = k, v, c, len(k)
    return keys, values, (bias if merged is not None else None), lengths


# --- decoding: policies that act while tokens are generated (docs/SPECS.md §2 "Schedule") -------

def decode_heads(policy, state: LayerState, kept: Tensor, merged: Merged | None, scores: Tensor
                 ) -> list[list[HeadEntries]]:
    """The [b][h] HeadEntries of one layer after its prefill compression."""
    b_, h_, n_, _ = state.keys.shape
    mask = torch.ones(b_, n_, dtype=torch.bool) if state.mask is None else state.mask.bool()
    positions = mask.long().cumsum(-1) - 1
    heads = []
    for b in range(b_):
        row = []
        for h in range(h_):
            keep = kept[b, h]
            entry = HeadEntries(stored(policy.storage, state.keys[b, h, keep]),
                                stored(policy.storage, state.values[b, h, keep]), positions[b, keep],
                                scores[b, h, keep].float(), torch.ones(int(keep.sum())))
            if merged is not None:
                for r in range(merged.counts.shape[-1]):
                    if merged.counts[b, h, r] > 0:
                        entry.add(merged.keys[b, h, r], merged.values[b, h, r], -1 - r, 0.0,
                                  float(merged.counts[b, h, r]))
            row.append(entry)
        heads.append(row)
    tiers(policy.storage, heads)
    return heads


def _kivi_group_after_append(storage, head: HeadEntries) -> None:
    """KIVI: the append that makes L(n) grow quantizes the new group (the `tokens` entries after the last
    group, in position order); the groups before it stay as they are."""
    if storage is None or not storage.tiered or storage.key_axis != "channel":
        return
    n = len(head.positions)
    before, after = storage.quantized_count(n - 1), storage.quantized_count(n)
    if after > before:
        _quantize_group(storage, head, head.positions.argsort()[before:after])


def _merge_one(policy, head: HeadEntries, e: int, slots: int) -> None:
    """Evict entry e of the head: it fills a free slot, or merges into the slot with the largest
    key dot product (ZSMerge Alg. 1 lines 11–15); dropped when the head has no slot."""
    key, value = head.keys[e], head.values[e]
    head.drop(e)
    if slots == 0:
        return
    is_slot = ~head.tokens()
    order = (-1 - head.positions[is_slot]).argsort()
    idx = is_slot.nonzero().squeeze(1)[order]
    pad = slots - len(idx)
    k_r = torch.cat([head.keys[idx], head.keys.new_zeros(pad, key.shape[-1])])
    v_r = torch.cat([head.values[idx], head.values.new_zeros(pad, value.shape[-1])])
    w = torch.cat([head.counts[idx].long(), torch.zeros(pad, dtype=torch.long)])
    k_r, v_r, w = policy.merge.merge(k_r, v_r, w, key[None], value[None])
    for r in range(slots):
        if r < len(idx):
            i = idx[r]
            head.keys[i], head.values[i], head.counts[i] = k_r[r], v_r[r], float(w[r])
        elif w[r] > 0:
            head.add(k_r[r], v_r[r], -1 - r, 0.0, float(w[r]))


def decode_step(policy, heads: list[list[HeadEntries]], q: Tensor, k: Tensor, v: Tensor, position: Tensor,
                budgets: Tensor, scale: float | None = None, softcap: float | None = None,
                sinks: Tensor | None = None) -> Tensor:
    """One generated token at one layer: append it, attend, update running scores, and
    (decode: online, ZSMerge Alg. 1) evict the lowest-scored context token into the slots.

    q (B, Hq, d), k, v (B, H, d), position (B,) the new token's position, budgets (B, H)
    entries per head (decode_budgets). Returns the attention output (B, Hq, d).
    softcap, sinks (Hq,): the model's (`decode_attention`): the logits capped, then the merge bias added,
    the sinks in the denominator; the running scores take those weights (the model's attention).
    """
    b_, hq, d = q.shape
    h_ = k.shape[1]
    g = hq // h_
    scale = d ** -0.5 if scale is None else scale
    online = policy.schedule.decode is not None and policy.schedule.decode.online
    out = q.new_zeros(b_, hq, d, dtype=torch.float32)
    for b in range(b_):
        for h in range(h_):
            head = heads[b][h]
            head.add(stored(policy.storage, k[b, h]), stored(policy.storage, v[b, h]), int(position[b]), 0.0, 1.0)
            _kivi_group_after_append(policy.storage, head)
            bias = torch.zeros(len(head.counts))
            if policy.merges:
                bias = torch.where(head.tokens(), 0.0, policy.merge.bias(head.counts))
            logits = model_logits(q[b, h * g:(h + 1) * g].float() @ head.keys.float().T * scale, softcap) + bias
            probs = model_weights(logits, None if sinks is None else sinks[h * g:(h + 1) * g, None])  # (G, E)
            out[b, h * g:(h + 1) * g] = probs @ head.values.float()
            if policy.scoring.running:  # H2O: s ← s + a; ZSMerge Eq. 5: s ← λ·s + a
                a = policy.scoring.reduce_group(probs, 0)
                head.scores = torch.where(head.tokens(), policy.scoring.running_update(head.scores, a), head.scores)
            if online:
                prox, context, slots = head_split(policy, int(budgets[b, h]))
                while int(head.tokens().sum()) > prox + context:
                    tok = head.tokens()
                    recent = latest(head.positions[None], tok[None], torch.tensor([prox]))[0]
                    cand = (tok & ~recent).nonzero().squeeze(1)
                    cand = cand[head.positions[cand].argsort(stable=True)]  # ties: earliest position …
                    e = int(cand[head.scores[cand].argsort(stable=True)[0]])  # … lowest running score
                    _merge_one(policy, head, e, slots)
    return out.to(q.dtype)




# --- query-agnostic scoring: Expected Attention written out as the paper states it ----------------

def rope_matrix(rope: Tensor, position: int, interleaved: bool = False) -> Tensor:
    """RoPE's (d, d) rotation at `position` (transformers' rotate-half layout: q·cos + rotate_half(q)·sin),
    built as kvpress builds it: cos·I + sin·P, float64. `interleaved`: Llama 4's, each pair (2f, 2f + 1) turned as
    the complex number x₂f + i·x₂f₊₁ times e^{iθ}: the 2×2 block [[cos, −sin], [sin, cos]] on those channels."""
    half = rope.shape[0]
    if interleaved:
        angle = rope.double() * position
        m = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
        m[0::2, 0::2], m[0::2, 1::2] = torch.diag(angle.cos()), -torch.diag(angle.sin())
        m[1::2, 0::2], m[1::2, 1::2] = torch.diag(angle.sin()), torch.diag(angle.cos())
        return m
    angle = torch.cat([rope, rope]).double() * position
    p = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    p[half:, :half], p[:half, half:] = torch.eye(half), -torch.eye(half)
    return torch.diag(angle.cos()) + angle.sin()[:, None] * p


def expected_attention(part, state: LayerState) -> Tensor:
    """`scoring: expected_attention`, literally (arXiv:2510.00636 Eq. 7–11, kvpress's press): per
    sequence and query head, un-rotate the real queries at positions p ≥ sinks (p = index among the
    real tokens) to pre-RoPE q̃ = R(p)ᵀ q (Llama 4's interleaved pairs where state.interleaved), divided by the
    temperature s(i) = 1 + attn_scale·log(1 + ⌊(i + 1)/floor_scale⌋) of its index i in the padded sequence where
    state.temperature is set (Llama 4's NoPE layers), take their mean and biased covariance, map them by the
    mean map M = (1/T) Σ_t s(e + t)·R(n + t) over the next `future` positions (n the real length, e the padded one:
    state.end), μ = M μ̃, Σ = M Σ̃ Mᵀ, score each real key at position
    ≥ sinks by softmax(c μᵀk + c² kᵀΣk / 2) (the model's learned sinks, state.sinks, one more logit of the
    query head's in the sum), mean over the group, (s + ε)·‖v‖₂; the sinks score the
    head's max + 1. Float64, loops; (B, H, N), −inf at pads."""
    b_, hq, r, d = state.queries.shape
    h, n = state.keys.shape[1], state.keys.shape[2]
    g = hq // h
    scale = d ** -0.5 if state.scale is None else state.scale
    mask = torch.ones(b_, n, dtype=torch.bool) if state.mask is None else state.mask.bool()
    out = torch.full((b_, h, n), float("-inf"), dtype=torch.float64)

    def temperature(i: int) -> float:  # the scale of the query at index i of the padded sequence
        if state.temperature is None:
            return 1.0
        attn_scale, floor_scale = state.temperature
        return 1.0 + attn_scale * math.log1p(math.floor((i + 1) / floor_scale))

    for b in range(b_):
        real = mask[b].nonzero().squeeze(1).tolist()  # indices of the real tokens, position = their rank
        length = len(real)
        sinks = part.sinks if length > part.sinks else 0
        rbar = sum(temperature(state.end + t) * rope_matrix(state.rope, length + t, state.interleaved)
                   for t in range(part.future)) / part.future
        row_of = {i: i - (n - r) for i in real if i >= n - r}  # key index -> query row
        for kv in range(h):
            probs = torch.zeros(n, dtype=torch.float64)
            for head in range(kv * g, (kv + 1) * g):
                pre = [rope_matrix(state.rope, p, state.interleaved).T @ state.queries[b, head, row_of[i]].double()
                       / temperature(state.end - n + i) for p, i in enumerate(real) if p >= sinks and i in row_of]
                pre = torch.stack(pre)
                mu_pre = pre.mean(0)
                cov_pre = (pre - mu_pre).T @ (pre - mu_pre) / len(pre)
                mu, cov = rbar @ mu_pre, rbar @ cov_pre @ rbar.T
                logits = []
                for p, i in enumerate(real):
                    if p >= sinks:
                        k = state.keys[b, kv, i].double()
                        quad = k @ cov @ k * scale * scale / 2 if part.covariance else 0.0
                        logits.append(scale * (mu @ k) + quad)
                learned = [] if state.sinks is None else [state.sinks[head].double()]  # the model's, in the sum
                weights = torch.softmax(torch.stack(logits + learned), dim=0)[:len(logits)]
                for w, i in zip(weights, real[sinks:]):
                    probs[i] += w / g
            for i in real[sinks:]:
                s = probs[i]
                if part.value_norm:
                    s = (s + part.epsilon) * state.values[b, kv, i].double().norm()
                out[b, kv, i] = s
            top = max(float(out[b, kv, i]) for i in real[sinks:])
            for i in real[:sinks]:
                out[b, kv, i] = top + 1
    return out.float()


# --- query-agnostic scores by context reconstruction (scoring: kvzip) ---------------------------

def kvzip_scores(model, ids: Tensor, repeat, scorer) -> tuple[list[Tensor], list[LayerState]]:
    """KVzip's scores (arXiv:2505.23416) of the prompt `ids` (B, N), from the uncompressed model: for
    each chunk [s, e) of `scorer.chunk` tokens, the model runs the prompt followed by the chunk's
    reconstruction input (repeat prompt, for a later chunk the previous `overlap` tokens, the suffix,
    the chunk) as one sequence, which is exactly what the reconstruction reads (its keys see the full
    prompt, its positions follow the prompt). Then, with the layer's queries q and keys k of that
    sequence, for the reconstruction rows t and every prompt entry i ∈ [s, e):
        a[t, i] = softmax over the keys [0, min(sinks, s)) ∪ [s, e) ∪ {N + u : u ≤ t} of q_t·k·scale
        s_h[i] = max over the group's query heads and t of a[t, i]
    (the logits soft-capped, and the layer's learned sinks one more logit in the softmax, where the model has
    them: the captured states say so).
    Under `scorer.reconstruct` "context", the chunks start after `repeat.prefix` (the chat template's
    prefix) where every row starts with it, and the prefix's entries keep the score 0.
    Returns the scores per layer (B, H, N) and the prompt's states (keys, values, scale; no queries)."""
    b, n = ids.shape
    origin = 0  # reconstruct: context skips the chat template's prefix where every row starts with it
    prefix = list(getattr(repeat, "prefix", ()))
    if scorer.reconstruct == "context" and prefix and len(prefix) < n \
            and all(ids[i, :len(prefix)].tolist() == prefix for i in range(b)):
        origin = len(prefix)
    scores, states = None, None
    for k, start in enumerate(range(origin, n, scorer.chunk)):
        end = min(start + scorer.chunk, n)
        rows = []
        for i in range(b):
            quoted = ids[i, max(origin, start - scorer.overlap):start].tolist()  # the previous chunk's last tokens
            lead = list(repeat.first) if k == 0 else list(repeat.later) + quoted
            rows.append(lead + list(repeat.suffix) + ids[i, start:end].tolist())
        rebuilt = torch.tensor(rows, dtype=ids.dtype)  # (B, T): the chunk's reconstruction input
        layers = captured_states(model, torch.cat([ids, rebuilt], dim=1))
        if scores is None:
            scores = [torch.zeros(b, st.keys.shape[1], n) for st in layers]
            states = [LayerState(st.queries[:, :, :0], st.keys[:, :, :n], st.values[:, :, :n], None, st.scale)
                      for st in layers]
        t = rebuilt.shape[1]
        sink = min(scorer.sinks, start)
        for layer, st in enumerate(layers):
            q = st.queries[:, :, n:].float()  # (B, Hq, T, d): the reconstruction rows
            hq, h = q.shape[1], st.keys.shape[1]
            keys = st.keys.float().repeat_interleave(hq // h, dim=1)  # (B, Hq, N + T, d)
            scale = q.shape[-1] ** -0.5 if st.scale is None else st.scale
            logits = torch.einsum("bhtd,bhkd->bhtk", q, keys) * scale
            if st.softcap:  # the model's soft-cap (Gemma 2), before the mask
                logits = st.softcap * torch.tanh(logits / st.softcap)
            col = torch.arange(n + t)
            row = torch.arange(t)[:, None]
            seen = (col < sink) | ((col >= start) & (col < end)) | ((col >= n) & (col - n <= row))  # (T, N + T)
            logits = logits.masked_fill(~seen, float("-inf"))
            if st.sinks is not None:  # the model's learned sinks (gpt-oss): one more logit of each query head
                logits = torch.cat([logits, st.sinks.float().view(1, hq, 1, 1).expand(b, hq, t, 1)], dim=-1)
            probs = torch.softmax(logits, dim=-1)
            most = probs[..., start:end].amax(dim=2)  # (B, Hq, e − s): the max over reconstruction rows
            scores[layer][:, :, start:end] = scoring_parts.reduce_gqa(most, h, "max")
    return scores, states


@torch.no_grad()
def captured_states(model, ids: Tensor) -> list[LayerState]:
    """Every compressed layer's state (all queries, keys and values after RoPE, and the scale) of the uncompressed
    model's forward over the unpadded sequences `ids` (B, T): the model's own attention with each layer's inputs
    recorded on the way (`_recorded_step`). On a hybrid model (`config.layer_types`) the full-attention layers
    only, in order: a policy leaves the local layers to their window."""
    states: dict[int, LayerState] = {}
    with _model_attention(model, "kvcompile_reference_capture", _recorded_step):
        model(ids, kvcompile_states=states, use_cache=False)
    kinds = getattr(model.config, "layer_types", None)  # a hybrid model: a policy compresses its full layers only
    return [states[layer] for layer in sorted(states) if not kinds or kinds[layer] == "full_attention"]


def _recorded_step(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention entry while `captured_states` runs a model: the layer's state recorded (with the
    model's soft-cap and the layer's learned sinks, where it has them), then the model's own attention of the
    unpadded sequence: causal SDPA over grouped query heads, or, for a layer with a sliding window (Gemma 3's
    local layers: keys less than `sliding_window` behind) or a chunked one (Llama 4's: keys of the query's own chunk
    of `attention_chunk_size` positions), a logit soft-cap (Gemma 2) or learned sinks (gpt-oss:
    one more logit of each query head in the softmax's denominator), the same written out."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    kinds = getattr(getattr(module, "config", None), "layer_types", None)  # a chunked layer (Llama 4's local
    # layers) attends within its chunk
    chunk = module.config.attention_chunk_size if kinds and kinds[module.layer_idx] == "chunked_attention" else None
    kwargs["kvcompile_states"][module.layer_idx] = LayerState(
        query.clone(), key.clone(), value.clone(), None, scale, softcap=softcap or None,
        sinks=None if sinks is None else sinks.detach().clone())
    if not (window or chunk or softcap or sinks is not None):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                                               enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    dtype = torch.promote_types(query.dtype, torch.float32)
    group = query.shape[1] // key.shape[1]
    k, v = (x.to(dtype).repeat_interleave(group, dim=1) for x in (key, value))
    logits = torch.einsum("bhtd,bhkd->bhtk", query.to(dtype), k) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    row, col = torch.arange(query.shape[2])[:, None], torch.arange(key.shape[2])[None, :]
    allowed = col <= row
    if window:
        allowed = allowed & (row - col < window)
    if chunk:
        allowed = allowed & (row // chunk == col // chunk)
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        b, hq, t, _ = logits.shape
        logits = torch.cat([logits, sinks.to(dtype).view(1, hq, 1, 1).expand(b, hq, t, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :key.shape[2]]
    out = torch.einsum("bhtk,bhkd->bhtd", probs, v).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None


# --- KVzip under a chunked prefill (scoring: kvzip, schedule: {prefill: {chunk: c}}) ------------------

@dataclass
class ChunkedKVzip:
    """The specification of `scoring: kvzip` with `schedule: {prefill: {chunk: c}}`: KVzip's context
    reconstruction (arXiv:2505.23416, §3) done chunk by chunk, so that only the budget plus one chunk is
    ever held. The prompt (unpadded) is cut into chunks [start, end) of c tokens (the last one shorter);
    for each chunk, in order:

    1. The chunk's forward (`attend_chunk`, every layer): real query t sees every entry its head holds after the
       previous chunk (kept tokens and merge slots, with the merge rule's logit bias) and the chunk's tokens
       up to itself: ChunkedPrefill's step 1. The chunk's keys and values are held.
    2. Its reconstruction (`reconstruct`, every layer of every forward): for each span [s, e) of the chunk,
       `scoring.chunk` tokens from `start` on, the model reads KVzip's reconstruction input (`first` if s = 0,
       else `later` followed by the `overlap` prompt tokens before s; the turn end; the span's tokens) at
       positions end, end + 1, …, writing nothing. Its queries attend over the held entries, the whole
       chunk and their own keys (causal); the span's entry i of KV head h gets
           a[t, i] = exp(q_t·k_i·c) / Σ_{j ∈ S ∪ [s, e) ∪ {own keys u ≤ t}} exp(q_t·k_j·c)
           s_h[i]  = max over the query heads of h's group and the rows t of a[t, i]
       with S the sink entries: the tokens at positions < min(sinks, s) among those the head holds and the
       chunk's (a head that evicted a sink leaves it out of the softmax).
    3. Selection (`select`, layer after layer): ChunkedPrefill's steps 2–4 with KVzip's scores: the held
       tokens keep the score they got when their own chunk was reconstructed, the chunk's tokens get the
       scores of step 2, and `select_and_merge` keeps the budget of the tokens seen so far (ranking,
       protected sets, layer and head allocation, threshold, merge rule, and LAVa's cascade inside the
       chunk for layer-dynamic budgets, as for any other scorer).

    Why this is KVzip: each score is a softmax over its span's own keys (plus the sinks and the
    reconstruction's own keys), so scores of different chunks are comparable and the selection over held
    tokens and the new chunk is KVzip's global selection restricted to what is still held. The
    reconstruction reads the compressed cache (the held entries), as the chunk's forward does: with one
    chunk nothing is held and this is one-pass KVzip exactly (`kvzip_scores` + `compress`): the spans are
    those of `KVzip.chunks`, their repeat prompts and positions the same, the sinks the first
    min(sinks, s) entries. Memory: the budget plus the chunk's keys and values at every layer (held from
    step 1 to step 3), plus one reconstruction forward's activations.

    `run(model, ids, repeat)` drives a transformers model through it (the prompt's logits come back)."""

    policy: object
    num_layers: int
    chunked: ChunkedPrefill | None = None  # the held entries and the selection (steps 1 and 3–4 are its own)
    chunk: tuple[int, int] | None = None  # the chunk [start, end) being compressed
    span: tuple[int, int] | None = None  # the span being reconstructed; None while the chunk's forward runs
    keys: list = field(default_factory=list)  # per layer: the chunk's keys (B, H, T, d), held until `select`
    values: list = field(default_factory=list)
    scores: list = field(default_factory=list)  # per layer: (B, H, T) the chunk's KVzip scores

    def __post_init__(self):
        if self.chunked is None:
            self.chunked = ChunkedPrefill(self.policy, self.num_layers)
        self.keys, self.values, self.scores = ([None] * self.num_layers for _ in range(3))

    @property
    def heads(self) -> list:
        """Per layer: [b][h] HeadEntries, what each head holds."""
        return self.chunked.heads

    def begin(self, start: int, end: int) -> None:
        self.chunk, self.span = (start, end), None

    def attend_chunk(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float | None = None,
                     sinks: Tensor | None = None) -> Tensor:
        """Step 1 at one layer: the chunk's attention output (B, Hq, T, d); its keys and values held. softcap,
        sinks (Hq,): the model's (`chunk_attention`)."""
        b_, _, t_, _ = q.shape
        real = torch.ones(b_, t_, dtype=torch.bool)
        if layer == 0:
            self.chunked.start_chunk(real)
        held = self.chunked.held(layer, b_, k.shape[1], k, v)
        self.keys[layer], self.values[layer] = k, v
        self.scores[layer] = torch.zeros(b_, k.shape[1], t_)
        return chunk_attention(self.policy, held, q, k, v, real, scale, softcap=softcap, sinks=sinks).to(q.dtype)

    def reconstruct(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float | None = None,
                    sinks: Tensor | None = None) -> Tensor:
        """Step 2 at one layer, for the span being reconstructed: the reconstruction's attention output
        (B, Hq, T, d) (over the held entries, the chunk, its own keys); the span's scores recorded. softcap,
        sinks (Hq,): the model's, in the attention and in the scores' softmax (the cap on every logit, the
        sinks in the denominator)."""
        start, end = self.chunk
        s, e = self.span
        b_, hq, t_, _ = q.shape
        h_ = k.shape[1]
        g = hq // h_
        chunk_k, chunk_v = self.keys[layer], self.values[layer]
        held = self.chunked.held(layer, b_, h_, chunk_k, chunk_v)
        out = chunk_attention(self.policy, held, q, k, v, torch.ones(b_, t_, dtype=torch.bool), scale,
                              seen_k=chunk_k, seen_v=chunk_v, softcap=softcap, sinks=sinks)
        sink = min(self.policy.scoring.sinks, s)
        causal = torch.arange(t_)[None, :] <= torch.arange(t_)[:, None]  # (T, T): own key u ≤ row t
        learned = sinks  # (the model's; `sinks` below: KVzip's sink entries)
        for b in range(b_):
            for h in range(h_):
                x = held[b][h]
                tok = x.tokens()
                positions = torch.cat([x.positions[tok], torch.arange(start, end)])
                candidates = torch.cat([x.keys[tok].float(), chunk_k[b, h].float()])
                sinks = candidates[positions < sink]
                span = chunk_k[b, h, s - start:e - start].float()
                keys = torch.cat([sinks, span, k[b, h].float()])  # (S + W + T, d)
                allowed = torch.cat([torch.ones(t_, len(sinks) + len(span), dtype=torch.bool), causal], dim=1)
                best = torch.zeros(e - s)
                for head in range(h * g, (h + 1) * g):
                    logits = model_logits(q[b, head].float() @ keys.T * scale, softcap).masked_fill(~allowed,
                                                                                                   float("-inf"))
                    probs = model_weights(logits, None if learned is None else learned[head].view(1, 1))
                    probs = probs[:, len(sinks):len(sinks) + len(span)]
                    best = torch.maximum(best, probs.amax(dim=0))
                self.scores[layer][b, h, s - start:e - start] = best
        return out.to(q.dtype)

    def select(self) -> None:
        """Step 3, every layer in order: the held tokens and the chunk's, selected by their KVzip scores."""
        for layer in range(self.num_layers):
            k, v, chunk_scores = self.keys[layer], self.values[layer], self.scores[layer]
            t_ = k.shape[2]

            def score(b, h, keys, values, valid, carried):  # the held tokens' scores, then the chunk's
                return torch.cat([carried[:len(carried) - t_], chunk_scores[b, h]])

            self.chunked.select(layer, k, v, torch.ones(k.shape[0], t_, dtype=torch.bool), score)
            self.keys[layer] = self.values[layer] = self.scores[layer] = None

    def step(self, layer: int, q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float | None = None,
             sinks: Tensor | None = None) -> Tensor:
        """What the model's attention at `layer` computes now: step 1, or step 2 while a span is reconstructed
        (softcap, sinks: the model's, where it has them)."""
        if self.span is None:
            return self.attend_chunk(layer, q, k, v, scale, softcap, sinks)
        return self.reconstruct(layer, q, k, v, scale, softcap, sinks)

    @classmethod
    @torch.no_grad()
    def run(cls, model, policy, ids: Tensor, repeat) -> tuple["ChunkedKVzip", Tensor]:
        """The model (a transformers causal LM) through steps 1–3 on the prompt `ids` (B, N): the reference
        and the prompt's logits (B, N, V), each chunk's from its forward. The model's attention is this
        class's (`step`) for the duration of the call."""
        ref = cls(policy, model.config.num_hidden_layers)
        c, r, overlap = policy.schedule.chunk_tokens, policy.scoring.chunk, policy.scoring.overlap
        b_, n = ids.shape
        # reconstruct: context: the spans start after the chat template's prefix where the first chunk starts
        # with it (its entries keep score 0), as one-pass KVzip's (`kvzip_scores`) do
        origin = policy.scoring.context_start(ids[:, :c], repeat.prefix)
        logits = []
        with _reference_attention(model):
            for start in range(0, n, c):
                end = min(start + c, n)
                ref.begin(start, end)
                logits.append(model(ids[:, start:end], position_ids=torch.arange(start, end)[None].expand(b_, -1),
                                    use_cache=False, kvcompile_reference=ref).logits)
                spans = [(s, min(s + r, end)) for s in range(max(start, origin), end, r)]
                for span, rebuilt in zip(spans, repeat.inputs(ids, spans, overlap, origin=origin)):
                    ref.span = span
                    t_ = rebuilt.shape[1]
                    model(rebuilt, position_ids=torch.arange(end, end + t_)[None].expand(b_, -1), use_cache=False,
                          kvcompile_reference=ref)
                ref.span = None
                ref.select()
        return ref, torch.cat(logits, dim=1)


def _reference_step(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention entry while `ChunkedKVzip.run` drives a model: the reference's step."""
    ref = kwargs["kvcompile_reference"]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sinks = kwargs.get("s_aux")  # gpt-oss's learned sinks; Gemma 2's soft-cap comes as `softcap`
    return ref.step(module.layer_idx, query, key, value, scale, kwargs.get("softcap") or None,
                    None if sinks is None else sinks.detach().float()).transpose(1, 2).contiguous(), None


def _reference_attention(model):
    """The model's attention routed to `_reference_step` inside the block (its own restored after)."""
    return _model_attention(model, "kvcompile_reference", _reference_step)


@contextmanager
def _model_attention(model, name: str, step):
    """The model's attention routed to `step` (transformers' attention entry) under `name` inside the block,
    without a mask (unpadded sequences); the model's own attention restored after."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, step)
    AttentionMaskInterface.register(name, lambda *args, **kwargs: None)  # unpadded: no mask
    saved = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(saved or "sdpa")
