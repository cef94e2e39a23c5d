"""Scoring parts: how important is each prompt token, per layer and KV head.

Every scorer maps one layer's state to scores (B, H, N): higher = more important.
The eager reference of each part is written for clarity; kernels are tested against it.

Each scorer has two methods:
  query_rows(n) -> how many of the last prompt queries it reads (R of LayerState);
  score(state)  -> (B, H, N) float32 scores, −inf at pad positions.

Conventions shared by every scorer (docs/SPECS.md §2 "Scoring"):
  * A[j, i] is the softmax of query j over keys i, scaled by the model's scale, with the
    causal mask (query j at absolute index N−R+j sees keys i ≤ that index) and the
    padding mask (pads are never attended). A pad query's row is all zeros. It is the model's
    own attention: soft-capped logits where the model caps them (LayerState.softcap, Gemma 2) and
    learned sinks in the denominator where it has them (LayerState.sinks, gpt-oss: `capped`,
    `model_softmax`).
  * Inputs are upcast to float32; the math is float32 throughout.
  * GQA: a score is computed per query head, then the G heads of a group reduce to
    their KV head (`gqa`: mean | max). KV head h owns query heads h·G … h·G+G−1, the
    order of transformers' `repeat_kv`.
  * Left padding: a sequence's real tokens get exactly the scores they would get if
    the sequence ran alone, unpadded (the property batching relies on).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from kvcompile.layer_state import LayerState
from kvcompile.policies.fields import FieldError, Part, bounded
from kvcompile.policies.registry import part

NEG_INF = float("-inf")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_gqa(gqa: str) -> None:
    _check(gqa in ("mean", "max"), f"gqa must be 'mean' or 'max', got {gqa!r}")


# ---------------------------------------------------------------------------------------
# Shared helpers


def real_tokens(state: LayerState) -> Tensor:
    """(B, N) bool, True = real token (all True when the state has no mask)."""
    b, _, n, _ = state.keys.shape
    if state.mask is None:
        return torch.ones(b, n, dtype=torch.bool, device=state.keys.device)
    return state.mask.to(device=state.keys.device, dtype=torch.bool)


def capped(logits: Tensor, softcap: float | None) -> Tensor:
    """The model's logits from the scaled dot products: cap·tanh(s/cap) where it soft-caps them (Gemma 2's
    attn_logit_softcapping, LayerState.softcap), else s. Applied before any mask (tanh(−inf) is finite)."""
    return logits if not softcap else torch.tanh(logits / softcap) * softcap


def model_softmax(logits: Tensor, sinks: Tensor | None) -> Tensor:
    """The model's softmax over the last dim of (masked) logits: with learned sinks (gpt-oss, LayerState.sinks,
    broadcast against logits[..., :1]) one more logit per query head joins the denominator and its weight is
    dropped, so a row sums to less than 1; a row with every key masked is then 0 (the sink takes it all)."""
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    sink = sinks.to(device=logits.device, dtype=logits.dtype).expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]


def attention_rows(state: LayerState, rows: int) -> Tensor:
    """A for the last `rows` prompt queries: (B, Hq, rows, N) float32.

    Row j is query N−rows+j; it attends to the real keys i ≤ N−rows+j (causal + padding
    masks), with the model's scale (None = d^−½), soft-cap (`state.softcap`) and learned sinks in the
    denominator (`state.sinks`): the weights the model's own attention computes. Rows of pad queries are zeros.
    """
    queries, keys = state.queries, state.keys
    b, hq, r, d = queries.shape
    h, n = keys.shape[1], keys.shape[2]
    _check(hq % h == 0, f"{hq} query heads do not split into groups over {h} KV heads")
    _check(1 <= rows <= min(r, n), f"need 1 <= rows <= min(R={r}, N={n}), got rows={rows}")
    scale = d ** -0.5 if state.scale is None else state.scale

    q = queries[:, :, r - rows:].float()  # (B, Hq, rows, d)
    k = keys.float().repeat_interleave(hq // h, dim=1)  # (B, Hq, N, d), repeat_kv order
    logits = capped(torch.einsum("bhjd,bhid->bhji", q, k) * scale, state.softcap)

    real = real_tokens(state)  # (B, N)
    query_pos = torch.arange(n - rows, n, device=keys.device)  # absolute index of each row
    key_pos = torch.arange(n, device=keys.device)
    causal = key_pos[None, :] <= query_pos[:, None]  # (rows, N)
    visible = causal[None, None] & real[:, None, None, :]  # (B, 1, rows, N)
    sinks = None if state.sinks is None else state.sinks.float().view(-1, hq, 1, 1)
    probs = model_softmax(logits.masked_fill(~visible, NEG_INF), sinks)

    real_query = real[:, None, n - rows:, None]  # (B, 1, rows, 1)
    return torch.where(real_query, probs, 0.0)  # a pad query sees no key: its row is 0


def reduce_gqa(a: Tensor, num_kv_heads: int, how: str) -> Tensor:
    """Reduce query heads (dim 1, Hq = H·G) to KV heads by mean or max over each group.

    KV head h owns query heads h·G … h·G+G−1 (transformers' repeat_kv order).
    """
    _check_gqa(how)
    b, hq = a.shape[:2]
    _check(hq % num_kv_heads == 0, f"{hq} query heads do not split over {num_kv_heads} KV heads")
    grouped = a.reshape(b, num_kv_heads, hq // num_kv_heads, *a.shape[2:])
    return grouped.mean(dim=2) if how == "mean" else grouped.amax(dim=2)


def window_sum(windows: Tensor) -> Tensor:
    """(…, k) → (…): each window's sum, its k terms added left to right. A pad or an end adds an exact 0, so
    windows over the same real tokens sum to the same float wherever they sit in a row (a reduction's order,
    `.sum(-1)`, depends on the window's place in memory: it broke exact ties, which pooling makes whenever a
    window covers all of a head's tokens, differently in a padded row and alone)."""
    total = windows[..., 0]
    for j in range(1, windows.shape[-1]):
        total = total + windows[..., j]
    return total


def pool_scores(scores: Tensor, real: Tensor, pooling: "Pooling") -> Tensor:
    """1-D pooling over tokens, stride 1, kernel k, k//2 on each side: same length (SnapKV §4.3).

    Only real tokens enter a window: avg divides the sum of the real tokens in the window
    by their count (what F.avg_pool1d(count_include_pad=False) does on an unpadded
    sequence), max takes the max over them. Left pads and the ends of the sequence never
    count, so a padded sequence pools exactly as it would alone. Output at pads: −inf.
    The avg's sum adds the window's tokens left to right (`window_sum`): windows over the same real
    tokens give the same float wherever they sit (a tie stays a tie, bit for bit, padded or not).
    scores (B, H, N), real (B, N) bool.
    """
    if pooling.kind == "none" or pooling.kernel == 1:
        return scores.masked_fill(~real[:, None], NEG_INF)
    half = pooling.kernel // 2
    real_h = real[:, None].expand_as(scores)

    def windows(x: Tensor, fill: float) -> Tensor:  # (B, H, N) -> (B, H, N, k)
        return F.pad(x, (half, half), value=fill).unfold(-1, pooling.kernel, 1)

    if pooling.kind == "max":
        pooled = windows(scores.masked_fill(~real_h, NEG_INF), NEG_INF).amax(dim=-1)
    else:
        total = window_sum(windows(scores.masked_fill(~real_h, 0.0), 0.0))
        count = windows(real_h.float(), 0.0).sum(dim=-1)
        pooled = total / count.clamp(min=1.0)
    return pooled.masked_fill(~real[:, None], NEG_INF)


def window_scores(state: LayerState, window: int, pooling: "Pooling", gqa: str) -> Tensor:
    """SnapKV's observation-window score, (B, H, N), −inf at pads.

    Per query head: s[i] = mean over the real rows among the last w' = min(window, N, R)
    queries of A[j, i] (R < min(window, N) only in a chunk of a chunked prompt, whose keys
    are the entries held before it and its own) (a padded sequence shorter than the window counts only its real
    rows: min(window, n_b) of them). Then reduce GQA, then pool. Order: reduce, then pool
    (pooling runs on H rows, not H·G); for gqa=mean with avg pooling and for gqa=max with
    max pooling the two orders are identical, for mixed choices they differ slightly.
    """
    n = state.keys.shape[2]
    rows = min(window, n, state.queries.shape[2])  # a chunk of a chunked prompt may have fewer than `window` queries
    real = real_tokens(state)
    a = attention_rows(state, rows)  # (B, Hq, rows, N)
    real_rows = real[:, n - rows:].sum(dim=-1).clamp(min=1)  # (B,)
    per_query_head = a.sum(dim=2) / real_rows[:, None, None]
    per_kv_head = reduce_gqa(per_query_head, state.keys.shape[1], gqa)
    return pool_scores(per_kv_head, real, pooling)


def mask_pads(scores: Tensor, state: LayerState) -> Tensor:
    """Set the scores of pad tokens to −inf. scores (B, H, N)."""
    return scores.masked_fill(~real_tokens(state)[:, None], NEG_INF)


# ---------------------------------------------------------------------------------------
# Parts


@dataclass(frozen=True)
class Pooling(Part):
    """1-D pooling of the scores over tokens, same length out (SnapKV §4.3 "clustering").

    kind: avg | max | none;  kernel: odd window size (1 = no pooling).
    """

    kind: Literal["avg", "max", "none"] = "none"
    kernel: int = bounded(1, low=1, odd=True)


class Scorer(Part):
    """Base of the scoring parts: what the runtime asks of a scorer besides `score`.

    `gqa`: how the G query heads of a group reduce to their KV head (a field on the parts
    that let a spec choose). `running`: the score keeps running while decoding
    (`running_update`, called with each new query's attention). `score_prompt`: the
    runtime's path to `score` (a scorer that would build the N×N attention gives a
    memory-bounded one). `fused_window`: the arguments of the fused window-scoring kernel
    when the scorer is one (kvcompile.kernels.window_scores), else None. `head_local`: a KV
    head's scores read only that head's keys and values and its group's queries (every scorer
    here), so a tensor-parallel rank scores its own heads; a scorer that reads other heads sets
    False and tensor parallelism refuses it (kvcompile.plan)."""

    gqa = "mean"
    running = False
    head_local = True
    needs_rope = False  # the scorer reads the model's rotary frequencies (LayerState.rope; the plan supplies them)
    softcaps = True  # the scorer's attention weights apply a model's logit soft-cap (LayerState.softcap)
    nonnegative = True  # scores are >= 0 (attention mass): what entropy layers and DBudgetKV's norm stop read
    whole_prompt = False  # the score needs the whole prompt at once: no chunked prefill, no re-scoring while decoding
    # the scores of a prompt do not depend on a question at its end (its own queries, keys or positions only), so a
    # compressed context can be reused for what follows it (docs/SPECS.md §4b; `kvcompile serve --reuse-context`)
    query_agnostic = False

    def query_rows(self, n: int) -> int:
        raise NotImplementedError

    def score(self, state: LayerState) -> Tensor:
        raise NotImplementedError

    def score_prompt(self, state: LayerState) -> Tensor:
        return self.score(state)

    def score_chunk(self, state: LayerState, carried: Tensor | None) -> Tensor:
        """The scores (B, H, N) of one layer while the prompt is compressed in chunks
        (`kvcompile.reference.ChunkedPrefill`): `state.keys` are the entries the layer held after
        the previous chunk, in position order, then the chunk's own; `state.queries` the chunk's
        last R = query_rows(chunk length) queries, causal inside the chunk; `state.mask` marks
        real entries. `carried` (B, H, N): the held entries' scores from the previous chunk (0 on
        the chunk's), None at the first chunk. Default: `score(state)`, a score of the chunk's
        queries alone; a running scorer adds the carried score (H2O, ZSMerge: as while decoding)."""
        return self.score(state)

    def score_chunk_prompt(self, state: LayerState, carried: Tensor | None) -> Tensor:
        """`score_chunk` as the runtime computes it (default: the same; a memory-bounded path)."""
        return self.score_chunk(state, carried)

    def reduce_group(self, probs: Tensor, dim: int) -> Tensor:
        """Attention of a GQA group's query heads (along `dim`) reduced to the KV head."""
        return probs.mean(dim) if self.gqa == "mean" else probs.amax(dim)

    def running_update(self, scores: Tensor, attention: Tensor) -> Tensor:
        """The running score after one more query whose (group-reduced) attention is `attention`."""
        raise NotImplementedError(f"scoring {type(self).__name__} keeps no running score")

    @property
    def running_decay(self) -> float | None:
        """λ when `running_update` is s ← λ·s + a (what a fused decode step computes), else None."""
        return None

    def fused_window(self) -> dict | None:
        return None

    def column_weights(self, n: int) -> Tensor | None:
        """The row weights w (N,) float32 when the prompt score is a weighted column sum of the
        attention, s[i] = reduce_group(Σ_j w_j A[j, i]) (masked at pads): then the runtime may
        compute it inside the prompt's attention (kvcompile.kernels.attention_column_sums) and
        hand the sums to `score_from_column_sums`. None (the default): the score is not of that form."""
        return None

    def score_from_column_sums(self, sums: Tensor, state: LayerState) -> Tensor:
        """The prompt score from the column sums (B, Hq, N) of `column_weights`: reduced over each
        GQA group, −inf at pads."""
        return mask_pads(reduce_gqa(sums, state.keys.shape[1], self.gqa), state)

    def carry(self, own: Tensor, carried: Tensor | None, state: LayerState) -> Tensor:
        """A chunk's score from its own queries' score `own` and the held entries' `carried` one
        (`score_chunk`): a running scorer adds them as it does while decoding; default `own`."""
        return own

    def score_chunk_from_column_sums(self, sums: Tensor, state: LayerState, carried: Tensor | None) -> Tensor:
        """`score_chunk` from the column sums (B, Hq, N) of `column_weights(R)` over the chunk's R query rows
        (the chunk's attention computed them: engine.chunked.compress_chunk)."""
        return self.carry(self.score_from_column_sums(sums, state), carried, state)


@part("scoring", "window_attention")
@dataclass(frozen=True)
class WindowAttention(Scorer):
    """SnapKV / PyramidKV / AdaKV: s[i] = mean over the last `window` queries j of A[j, i].

    A is the model's softmax attention (own scaling, causal mask, queries after RoPE).
    The G query heads of a GQA group reduce to their KV head by `gqa` (mean | max),
    then `pooling` smooths the scores over tokens.
    """

    window: int = bounded(32, low=1)
    pooling: Pooling = field(default_factory=Pooling)
    gqa: Literal["mean", "max"] = "mean"

    def query_rows(self, n: int) -> int:
        return min(self.window, n)

    def score(self, state: LayerState) -> Tensor:
        return window_scores(state, self.window, self.pooling, self.gqa)

    def fused_window(self) -> dict | None:
        return dict(window=self.window, gqa=self.gqa, pooling=self.pooling.kind, kernel=self.pooling.kernel,
                    value_weight=False)


@part("scoring", "lava")
@dataclass(frozen=True)
class Lava(WindowAttention):
    """LAVa (Eq. 6): window attention × max over all tokens k of ‖V[k]‖₁ of that KV head.

    The fields, checks and query rows of WindowAttention; GQA: max over the group (LAVa §4.3).
    """

    gqa: Literal["mean", "max"] = "max"

    def score(self, state: LayerState) -> Tensor:
        """s_h[i] = window_attention_h[i] · max over real k of ‖V_h[k]‖₁ (LAVa Eq. 6)."""
        attention = window_scores(state, self.window, self.pooling, self.gqa)
        value_l1 = state.values.float().abs().sum(dim=-1)  # (B, H, N)
        value_l1 = value_l1.masked_fill(~real_tokens(state)[:, None], 0.0)
        v_bar = value_l1.amax(dim=-1, keepdim=True)  # (B, H, 1)
        return mask_pads(attention * v_bar, state)  # re-mask: −inf · 0 would be NaN

    def fused_window(self) -> dict | None:
        return {**super().fused_window(), "value_weight": True}


@part("scoring", "last_token")
@dataclass(frozen=True)
class LastToken(Scorer):
    """TOVA / DBudgetKV (k = 1): s[i] = A[N-1, i], the attention of the last prompt token.

    `heads: group` reduces the query heads of each KV head's group (`gqa`); `heads: all` reduces every
    query head of the layer and gives each KV head that one score, so every head keeps the same tokens:
    TOVA's own code (schwartz-lab-NLP/TOVA, TOVACache.reduce: the mean of the last row over all heads)
    and kvpress's TOVAPress."""

    gqa: Literal["mean", "max"] = "mean"
    heads: Literal["group", "all"] = "group"

    @property
    def head_local(self) -> bool:
        """`heads: all` reads every query head of the layer: a tensor-parallel rank holds only its own, and a
        prompt compressed in chunks holds different entries per head, so both refuse it (kvcompile.plan)."""
        return self.heads == "group"

    def query_rows(self, n: int) -> int:
        return 1

    def score(self, state: LayerState) -> Tensor:
        last = attention_rows(state, 1)[:, :, 0]  # (B, Hq, N)
        h = state.keys.shape[1]
        if self.heads == "all":
            every = last.mean(dim=1, keepdim=True) if self.gqa == "mean" else last.amax(dim=1, keepdim=True)
            return mask_pads(every.expand(-1, h, -1).contiguous(), state)
        return mask_pads(reduce_gqa(last, h, self.gqa), state)


@part("scoring", "accumulated")
@dataclass(frozen=True)
class Accumulated(Scorer):
    """H2O: s[i] = Σ over all queries j ≥ i of A[j, i] (accumulated attention); while
    decoding s ← s + a (H2O Alg. 1)."""

    gqa: Literal["mean", "max"] = "mean"
    running = True

    def query_rows(self, n: int) -> int:
        return n

    def score(self, state: LayerState) -> Tensor:
        a = attention_rows(state, state.keys.shape[2])  # every query; pad rows are 0
        return mask_pads(reduce_gqa(a.sum(dim=2), state.keys.shape[1], self.gqa), state)

    def score_chunked(self, state: LayerState, chunk: int = 256) -> Tensor:
        """`score` in O(chunk·N) memory (the runtime's path): the decayed sum with λ = 1."""
        return decayed_scores_chunked(state, 1.0, self.gqa, chunk)

    score_prompt = score_chunked

    def score_chunk(self, state: LayerState, carried: Tensor | None) -> Tensor:
        """s[i] = carried[i] + Σ over the chunk's queries j of A[j, i] (the accumulated attention
        carries over chunks as over decode steps; = `score` for a chunk that is the whole prompt)."""
        a = attention_rows(state, state.queries.shape[2])  # the chunk's queries; pad rows are 0
        own = mask_pads(reduce_gqa(a.sum(dim=2), state.keys.shape[1], self.gqa), state)
        return own if carried is None else mask_pads(carried + own, state)

    def score_chunk_prompt(self, state: LayerState, carried: Tensor | None) -> Tensor:
        return self.carry(decayed_scores_chunked(state, 1.0, self.gqa, rows=state.queries.shape[2]), carried, state)

    def carry(self, own: Tensor, carried: Tensor | None, state: LayerState) -> Tensor:
        """s = carried + own (`score_chunk`)."""
        return own if carried is None else mask_pads(carried + own, state)

    def column_weights(self, n: int) -> Tensor | None:
        """w = 1 (a subclass with its own score gives None: its score may be another one)."""
        if not _own_score(self, Accumulated):
            return None
        return torch.ones(n, dtype=torch.float32)

    def running_update(self, scores: Tensor, attention: Tensor) -> Tensor:
        return scores + attention

    @property
    def running_decay(self) -> float | None:
        return 1.0 if type(self).running_update is Accumulated.running_update else None


@part("scoring", "mean_attention")
@dataclass(frozen=True)
class MeanAttention(Accumulated):
    """kvpress's ObservedAttentionPress: s[i] = (1/(N−i)) Σ over the queries j ≥ i of A[j, i], the mean attention
    key i receives from the N−i prompt queries that see it (H2O's accumulated attention, `Accumulated`, divided by
    that count, so late keys are not penalised for having been seen by fewer queries). The G query heads of a group
    are averaged (or maxed) after the division; the two commute, the count being per key.

    A score of the whole prompt only (`whole_prompt`): it keeps no running score while decoding, and a prompt
    compressed chunk by chunk, or re-scored while decoding, would need each held entry's count of queries so far
    (the spec refuses both)."""

    running = False
    whole_prompt = True

    @staticmethod
    def _per_query(summed: Tensor) -> Tensor:
        """The mean from the column sums (B, ·, N): divided by N−i, the queries j ≥ i (−inf at pads stays −inf)."""
        n = summed.shape[-1]
        return summed / torch.arange(n, 0, -1, device=summed.device, dtype=torch.float32)

    def score(self, state: LayerState) -> Tensor:
        return self._per_query(super().score(state))

    def score_prompt(self, state: LayerState) -> Tensor:
        return self._per_query(super().score_chunked(state))

    def column_weights(self, n: int) -> Tensor | None:
        """w = 1: the column sums of the prompt's attention, divided by N−i in `score_from_column_sums`."""
        return torch.ones(n, dtype=torch.float32)

    def score_from_column_sums(self, sums: Tensor, state: LayerState) -> Tensor:
        return self._per_query(super().score_from_column_sums(sums, state))

    def score_chunk(self, state: LayerState, carried: Tensor | None) -> Tensor:
        raise NotImplementedError("scoring mean_attention scores a whole prompt (the spec refuses a chunked one)")

    score_chunk_prompt = score_chunk_from_column_sums = score_chunk

    def running_update(self, scores: Tensor, attention: Tensor) -> Tensor:
        raise NotImplementedError("scoring mean_attention keeps no running score")

    @property
    def running_decay(self) -> float | None:
        return None


@part("scoring", "decayed")
@dataclass(frozen=True)
class Decayed(Scorer):
    """ZSMerge (Eq. 5): s ← λ·s + a at every step; over the prompt s[i] = Σ_j λ^(N−1−j) A[j, i]."""

    decay: float = bounded(0.98, low=0, high=1, low_open=True)
    gqa: Literal["mean", "max"] = "mean"
    running = True

    def query_rows(self, n: int) -> int:
        return n

    def score(self, state: LayerState) -> Tensor:
        n = state.keys.shape[2]
        a = attention_rows(state, n)  # (B, Hq, N, N); pad rows are 0
        age = torch.arange(n - 1, -1, -1, device=a.device, dtype=torch.float32)  # N−1−j
        weight = float(self.decay) ** age  # λ^(N−1−j)
        summed = torch.einsum("bhji,j->bhi", a, weight)
        return mask_pads(reduce_gqa(summed, state.keys.shape[1], self.gqa), state)

    def score_chunked(self, state: LayerState, chunk: int = 256) -> Tensor:
        """`score`, computed `chunk` query rows at a time in O(chunk·N) memory (the runtime's path)."""
        return decayed_scores_chunked(state, float(self.decay), self.gqa, chunk)

    score_prompt = score_chunked

    def score_chunk(self, state: LayerState, carried: Tensor | None) -> Tensor:
        """s[i] = λ^R·carried[i] + Σ over the chunk's R queries j of λ^(R−1−j) A[j, i] (Eq. 5 carried
        over chunks as over decode steps; = `score` for a chunk that is the whole prompt)."""
        r = state.queries.shape[2]
        a = attention_rows(state, r)  # (B, Hq, R, N); pad rows are 0
        age = torch.arange(r - 1, -1, -1, device=a.device, dtype=torch.float32)  # R−1−j
        summed = torch.einsum("bhji,j->bhi", a, float(self.decay) ** age)
        own = mask_pads(reduce_gqa(summed, state.keys.shape[1], self.gqa), state)
        return own if carried is None else mask_pads(float(self.decay) ** r * carried + own, state)

    def score_chunk_prompt(self, state: LayerState, carried: Tensor | None) -> Tensor:
        own = decayed_scores_chunked(state, float(self.decay), self.gqa, rows=state.queries.shape[2])
        return self.carry(own, carried, state)

    def carry(self, own: Tensor, carried: Tensor | None, state: LayerState) -> Tensor:
        """s = λ^R·carried + own (`score_chunk`; R the chunk's query rows)."""
        r = state.queries.shape[2]
        return own if carried is None else mask_pads(float(self.decay) ** r * carried + own, state)

    def column_weights(self, n: int) -> Tensor | None:
        """w_j = λ^(N−1−j), the float32 weights of `score` (None for a subclass with its own score)."""
        if not _own_score(self, Decayed):
            return None
        return float(self.decay) ** torch.arange(n - 1, -1, -1, dtype=torch.float32)

    def running_update(self, scores: Tensor, attention: Tensor) -> Tensor:
        return self.decay * scores + attention

    @property
    def running_decay(self) -> float | None:
        return float(self.decay) if type(self).running_update is Decayed.running_update else None


def _own_score(scorer: Scorer, cls: type) -> bool:
    """`scorer` computes the score `cls` defines, of a whole prompt and of a chunk (a subclass may
    redefine either)."""
    return all(getattr(type(scorer), name) is getattr(cls, name)
               for name in ("score", "score_prompt", "score_from_column_sums", "score_chunk", "score_chunk_prompt",
                            "carry", "score_chunk_from_column_sums"))


def decayed_scores_chunked(state: LayerState, decay: float, gqa: str, chunk: int = 256,
                           rows: int | None = None) -> Tensor:
    """ZSMerge Eq. 5 over the prompt, s[i] = Σ_j λ^(N−1−j) A[j, i], without the N×N matrix.

    Equal to `Decayed(decay, gqa).score(state)` (λ = 1: `Accumulated`), up to float
    summation order; the state must hold all N query rows. `rows` = R < N (a chunk of a
    chunked prompt, the state's last R query rows): the sum runs over the rows of the last R
    keys (`Decayed.score_chunk` without the carried score). Rows j are taken `chunk` at a time: the causal softmax of those rows
    against the keys they can see (i < end of the chunk), weighted by λ^(N−1−j) and summed
    into a (B, Hq, N) accumulator, so memory is O(chunk·N) per head. The G query heads of
    a group share one matmul against their KV head (no repeat of K); the scale multiplies
    the dot products, as in the reference (baddbmm's alpha). Rows whose weight
    underflows to exactly 0, and leading rows that are pads in every sequence, add exactly
    0 and are skipped.
    """
    _check(isinstance(chunk, int) and chunk >= 1, f"chunk must be an integer >= 1, got {chunk!r}")
    _check_gqa(gqa)
    queries, keys = state.queries, state.keys
    b, hq, r, d = queries.shape
    h, n = keys.shape[1], keys.shape[2]
    _check(hq % h == 0, f"{hq} query heads do not split into groups over {h} KV heads")
    if rows is None:
        _check(r >= n, f"the decayed score reads all N={n} query rows, got R={r}")
        rows = n
    _check(1 <= rows <= min(r, n), f"need 1 <= rows <= min(R={r}, N={n}), got rows={rows}")
    first_row = n - rows
    g = hq // h
    scale = d ** -0.5 if state.scale is None else state.scale
    device = keys.device
    real = real_tokens(state)  # (B, N)
    age = torch.arange(n - 1, -1, -1, device=device, dtype=torch.float32)
    weight = float(decay) ** age  # λ^(N−1−j), the reference's float32 weights
    nonzero = (weight > 0).nonzero()
    first_real = int(real.long().argmax(dim=-1).min()) if bool(real.any()) else n
    start = max(int(nonzero[0]) if len(nonzero) else n, first_real, first_row)

    q_all = queries[:, :, r - rows:]  # (B, Hq, rows, d): query of key first_row + j; head h·G+g of KV head h
    k = keys.float().reshape(b * h, n, d)
    padded = not bool(real.all())
    sinks = None if state.sinks is None else state.sinks.float().view(-1, h, g, 1, 1)  # query head h·G+g
    acc = torch.zeros(b, h, g, n, dtype=torch.float32, device=device)
    for lo in range(start, n, chunk):
        hi = min(lo + chunk, n)  # rows lo … hi−1 see keys 0 … hi−1 at most
        c = hi - lo
        q = q_all[:, :, lo - first_row:hi - first_row].float().reshape(b * h, g * c, d)  # a group's rows share one matmul
        logits = torch.baddbmm(q.new_zeros(1, 1, 1), q, k[:, :hi].transpose(1, 2), beta=0.0, alpha=scale)
        logits = capped(logits.view(b, h, g, c, hi), state.softcap)
        future = torch.ones(c, c, dtype=torch.bool, device=device).triu(1)  # key after the query
        logits[..., lo:hi].masked_fill_(future, NEG_INF)  # the causal mask lies in the last c keys
        if padded:
            logits.masked_fill_(~real[:, None, None, None, :hi], NEG_INF)
        probs = model_softmax(logits, sinks)
        real_rows = real[:, lo:hi]  # (B, c)
        if not bool(real_rows.all()):  # a pad query's row is 0 (it may be NaN: it sees no key)
            probs = torch.where(real_rows[:, None, None, :, None], probs, 0.0)
        acc[..., :hi] += torch.matmul(weight[lo:hi], probs)  # Σ_j λ^(N−1−j) A[j, i]
    per_kv_head = acc.mean(dim=2) if gqa == "mean" else acc.amax(dim=2)
    return per_kv_head.masked_fill(~real[:, None], NEG_INF)


@part("scoring", "key_norm")
@dataclass(frozen=True)
class KeyNorm(Scorer):
    """A cheap baseline (Devoto et al., 2024): s[i] = −‖K[i]‖₂ (low key norm = important).

    kvpress's KnormPress; query-agnostic (reads the keys only, no query row). Its scores are < 0:
    refused with entropy layers and DBudgetKV's norm stop, which read attention mass (`nonnegative`).
    Tensor parallelism: per-head local (a head reads its own keys; a rank gathers only what the
    allocator gathers: counts, or scores for pooled heads)."""

    nonnegative = False

    query_agnostic = True

    def query_rows(self, n: int) -> int:
        return 0

    def score(self, state: LayerState) -> Tensor:
        return mask_pads(-torch.linalg.vector_norm(state.keys.float(), dim=-1), state)


@part("scoring", "recency")
@dataclass(frozen=True)
class Recency(Scorer):
    """StreamingLLM: s[i] = i, later tokens matter more (no attention needed).

    i is the position among the sequence's real tokens (0 … n_b − 1), pads excluded.
    """

    query_agnostic = True

    def query_rows(self, n: int) -> int:
        return 0

    def score(self, state: LayerState) -> Tensor:
        real = real_tokens(state)
        position = (real.long().cumsum(dim=-1) - 1).float()  # (B, N)
        h = state.keys.shape[1]
        return mask_pads(position[:, None].expand(-1, h, -1), state)


def entropy(scores: Tensor, valid: Tensor) -> Tensor:
    """LAVa Eq. 7–8: the normalized entropy of one layer's scores, (B,).

    ŝ = s / Σ_{h, i valid} s (Eq. 7), e = −Σ_{h, i valid} ŝ log ŝ / (number of valid
    entries) (Eq. 8, H × N without padding), with 0·log 0 = 0. scores (B, H, N) must be
    ≥ 0 on valid entries (LAVa scores are); valid (B, H, N) bool. A layer whose valid
    scores are all 0, or with no valid entry, has entropy 0.
    """
    s = torch.where(valid, scores.float(), 0.0)
    _check(bool((s >= 0).all()), "entropy needs scores >= 0 on valid entries")
    total = s.sum(dim=(1, 2), keepdim=True)
    p = torch.where(total > 0, s / total, 0.0)
    p_log_p = torch.where(p > 0, p * p.log(), 0.0)  # 0·log 0 = 0
    count = valid.sum(dim=(1, 2)).clamp(min=1).float()
    return -p_log_p.sum(dim=(1, 2)) / count


# ---------------------------------------------------------------------------------------
# Query-agnostic scoring: scores that do not depend on a question following the prompt


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """RoPE's rotation of each channel pair (x₁, x₂) by its angle: x' = (x₁ cos − x₂ sin, x₂ cos + x₁ sin). Pair f
    is channels (f, f + d/2) in transformers' rotate-half layout, (2f, 2f + 1) where `interleaved` (Llama 4's
    rotary: (x₁ + i·x₂)·e^{iθ}). cos, sin (..., d/2) broadcast over x (..., d)."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def temperature_scales(temperature: tuple[float, float] | None, positions: Tensor) -> Tensor:
    """s(p) = 1 + attn_scale·log(1 + ⌊(p + 1)/floor_scale⌋) at each position (float32, as transformers computes
    Llama 4's temperature tuning of its NoPE queries; `temperature` = (attn_scale, floor_scale)); 1 where None."""
    if temperature is None:
        return torch.ones(positions.shape, device=positions.device)
    attn_scale, floor_scale = temperature
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


def future_rotation(rope: Tensor, future: int, scales: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The mean of RoPE's rotation R(t) over t = 0 … future − 1, each weighed by scales[t] where given (the
    temperature s(n + t) of the position it moves to), as (cos̄, sin̄) (d/2,) float32: per frequency ω the mean of
    the 2-D maps s_t·R(tω), which is cos̄·I + sin̄·J (rotate_pairs). Computed in float64 (angles up to future·ω)."""
    t = torch.arange(future, dtype=torch.float64, device=rope.device)[:, None]
    angle = t * rope.double()[None, :]
    if scales is None:
        return angle.cos().mean(0).float(), angle.sin().mean(0).float()
    s = scales.double()[:, None]
    return (s * angle.cos()).mean(0).float(), (s * angle.sin()).mean(0).float()


def moved_queries(state: LayerState) -> Tensor:
    """The state's query rows moved to position n = state.end with their temperature undone (float32 (B, Hq, R, d)):
    ẑ_p = R(n − p)·q_p / s(p) for the row at position p = n − R … n − 1 (R the layer's rotary, s its temperature,
    temperature_scales). The model's query at position n + t from the same input is s(n + t)·R(t)·ẑ_p, exactly:
    rotations compose (R(n + t − p)R(p) = R(n + t)), a norm after the rotary (Llama 4's qk_norm) commutes with it,
    and the scale is a number."""
    queries = state.queries.float()
    r = queries.shape[2]
    rope = state.rope.to(queries.device)
    offset = torch.arange(r, 0, -1, device=queries.device, dtype=torch.float64)[:, None] * rope.double()
    z = rotate_pairs(queries, offset.cos().float(), offset.sin().float(), state.interleaved)
    if state.temperature is None:
        return z
    positions = torch.arange(state.end - r, state.end, device=queries.device)
    return z / temperature_scales(state.temperature, positions)[:, None]


@part("scoring", "expected_attention")
@dataclass(frozen=True)
class ExpectedAttention(Scorer):
    """Expected Attention (Devoto et al., 2025, arXiv:2510.00636, §3; kvpress ExpectedAttentionPress):
    the attention the *next* `future` queries are expected to pay each key, from the statistics of the
    prompt's own queries; no question needed (query-agnostic).

    Per query head, from the prompt's real queries at positions p ≥ `sinks` (every query row of the
    prompt but the first `sinks`: R = query_rows(N) = N), in the model's form q_p = s(p)·R(p)·q̃_p: q̃_p the
    pre-positional query (what the layer's projections and norm give), R(p) the rotary (transformers'
    rotate-half pairs, Llama 4's interleaved ones where `state.interleaved`, the identity on a layer without
    one: zero `state.rope`) and s(p) = 1 + attn_scale·log(1 + ⌊(p + 1)/floor_scale⌋) Llama 4's temperature
    tuning of its NoPE layers (`state.temperature`, p counted in the padded sequence as transformers counts it;
    s = 1 elsewhere):
      1. Pre-positional statistics moved to the future: the next queries q_{n+t} = s(n+t)·R(n+t)·q̃, t = 0 …
         T−1 (T = `future`, n = state.end), are modelled with q̃ ~ N(μ̃, Σ̃), the mean and (biased) covariance
         of the prompt's q̃_p = R(p)ᵀ q_p / s(p), and the map replaced by its average over the window
         M = (1/T) Σ_t s(n+t)·R(n+t):
             μ = M μ̃,   Σ = M Σ̃ Mᵀ        (paper Eq. 7–9, where s = 1 and M = R̄).
         Rotations compose, M R(p)ᵀ = M₀ R(n−p) with M₀ = (1/T) Σ_t s(n+t)·R(t), so with
         ẑ_p = R(n−p) q_p / s(p) (the query moved to position n, its scale undone: moved_queries) this is
         μ = M₀ mean(ẑ), Σ = M₀ cov(ẑ) M₀ᵀ, computed from the queries the op receives. On a NoPE layer
         M₀ = s̄·I with s̄ = (1/T) Σ_t s(n+t): μ = s̄ μ̃, Σ = s̄² Σ̃ (the covariance takes the scale squared).
         Exact: ẑ_p, and s(n+t)·R(t)·ẑ_p as the model's query at n + t from the prompt's input at p (a norm after
         the rotary commutes with it; an attention scaling of the rotary multiplies every query alike). The
         scorer's approximations, the paper's and kvpress's: the next pre-positional queries are Gaussian with
         the prompt's statistics, and the map s(n+t)·R(n+t) is its mean M over the window (so Σ takes s̄², not
         the mean of s(n+t)², and not the spread of the mixture over t).
      2. Expected unnormalised attention of key k under q ~ N(μ, Σ) with the model's scale c (d^−½):
         E[exp(c qᵀk)] = exp(c μᵀk + c² kᵀΣk / 2) (Eq. 10; `covariance: false` drops the second term).
      3. Softmax of those logits over the real keys at positions ≥ `sinks` (Eq. 11; a model's learned sinks,
         LayerState.sinks, join its denominator as in the model's attention), mean over the G
         query heads of the KV group (gqa: mean), then × ‖v‖₂ with `epsilon` added first when
         `value_norm` (kvpress: (s + ε)·‖v‖₂).
    The first `sinks` tokens (attention sinks) are left out of the statistics and of the softmax and
    score the head's largest score + 1, so they are kept first (kvpress keeps them always).
    A prompt of at most `sinks` real tokens uses all its queries and keys.

    Query-agnostic: the scores depend only on the prompt's own queries, keys and values (no window
    at its end stands in for a question). Chunked prefill (`score_chunk`, the default): the chunk's
    queries give the statistics (the chunk's last query is at n − 1, n = state.seen the tokens seen
    so far), scored over the held entries and the chunk; "the first `sinks`" are then the first
    `sinks` real entries of that state (the prompt's first tokens while they are held).
    Tensor parallelism: per-head local (a KV head reads its own keys, values and its group's queries;
    no gather). All scores are ≥ 0 (entropy layers and DBudgetKV's threshold apply).
    """

    future: int = bounded(512, low=1)
    sinks: int = bounded(4, low=0)
    covariance: bool = True
    value_norm: bool = True
    epsilon: float = bounded(0.0, low=0)
    needs_rope = True  # the scorer reads the model's rotary frequencies (LayerState.rope)
    softcaps = False  # E[exp(cap·tanh(c·qᵀk/cap))] over a Gaussian query has no closed form (kvcompile.plan refuses)

    query_agnostic = True

    def query_rows(self, n: int) -> int:
        return n

    def score(self, state: LayerState) -> Tensor:
        _check(state.rope is not None, "expected_attention needs the model's rotary frequencies (LayerState.rope)")
        _check(not state.softcap, "expected_attention has no closed form for soft-capped logits (E[exp(cap·tanh(s/"
                                  "cap))] over a Gaussian query); a soft-capped model's state cannot be scored by it")
        keys, values = state.keys.float(), state.values.float()
        b, hq, r, d = state.queries.shape
        h, n = keys.shape[1], keys.shape[2]
        _check(hq % h == 0, f"{hq} query heads do not split into groups over {h} KV heads")
        _check(d % 2 == 0 and state.rope.shape[-1] == d // 2,
               f"rope has {state.rope.shape[-1]} frequencies, head dim {d} needs {d // 2}")
        scale = d ** -0.5 if state.scale is None else state.scale
        real = real_tokens(state)  # (B, N)
        rank = real.long().cumsum(-1) - 1  # position among the real entries
        many = (real.sum(-1) > self.sinks)[:, None]  # (B, 1): more real tokens than sinks
        counted = real & ((rank >= self.sinks) | ~many)  # (B, N): keys in the softmax, rows in the statistics

        # 1. statistics of the queries moved to position n (ẑ = R(n − p) q_p / s(p)), then M₀ over the window
        z = moved_queries(state)  # (B, Hq, R, d)
        rows = counted[:, n - r:].float()[:, None, :, None]  # (B, 1, R, 1)
        count = rows.sum(2).clamp(min=1)  # (B, 1, 1)
        mean_z = (z * rows).sum(2) / count  # (B, Hq, d)
        future = None if state.temperature is None else temperature_scales(
            state.temperature, torch.arange(state.end, state.end + self.future, device=keys.device))
        cos, sin = future_rotation(state.rope.to(keys.device), self.future, future)
        pairs = state.interleaved
        mu = rotate_pairs(mean_z, cos, sin, pairs)  # M₀ mean(ẑ)
        logits = torch.einsum("bhd,bhnd->bhn", mu, keys.repeat_interleave(hq // h, dim=1)) * scale
        if self.covariance:
            centred = rotate_pairs((z - mean_z[:, :, None]) * rows, cos, sin, pairs)  # M₀ (ẑ − ẑ̄), 0 on unused rows
            sigma = torch.einsum("bhri,bhrj->bhij", centred, centred) / count[..., None]  # (B, Hq, d, d)
            k = keys.repeat_interleave(hq // h, dim=1)  # (B, Hq, N, d)
            logits = logits + torch.einsum("bhni,bhij,bhnj->bhn", k, sigma, k) * (scale * scale / 2)  # c² kᵀΣk / 2
        # 3. softmax over the counted keys (and the model's learned sinks), mean over the group, value norm; the
        #    first `sinks` entries on top
        learned = None if state.sinks is None else state.sinks.float().view(-1, hq, 1)
        probs = model_softmax(logits.masked_fill(~counted[:, None], NEG_INF), learned)
        s = reduce_gqa(probs, h, "mean")
        if self.value_norm:
            s = (s + self.epsilon) * torch.linalg.vector_norm(values, dim=-1)
        s = s.masked_fill(~counted[:, None], NEG_INF)
        top = s.amax(dim=-1, keepdim=True)
        sink = real & ~counted  # (B, N)
        s = torch.where(sink[:, None], torch.where(torch.isfinite(top), top + 1, 1.0), s)
        return mask_pads(s, state)


# Query-agnostic scoring by context reconstruction (a second, model-level pass)


@part("scoring", "kvzip")
@dataclass(frozen=True)
class KVzip(Scorer):
    """KVzip (Kim et al., 2025, arXiv:2505.23416, §3): query-agnostic importance by
    context reconstruction.

    After the prompt (the context) is prefilled with every entry kept, the model reads, for each
    chunk [s, e) of `chunk` context tokens, a reconstruction input: a repeat prompt ("Repeat the
    previous context exactly."; later chunks: "Repeat the part of the previous context exactly,
    starting with" followed by the previous chunk's last `overlap` tokens), the chat template's
    turn end, and the chunk's tokens again. Its queries attend to the full cached context (that is
    what the model computes), and the chunk's reconstruction forward writes nothing to the cache.
    The score of a cached entry i ∈ [s, e) of KV head h is the largest attention any of the
    chunk's reconstruction queries t of h's GQA group g gives it, the softmax taken over the
    first `sinks` cached entries, the chunk's own cached entries and the chunk's reconstruction
    keys (causally), as KVzip computes it:

        a[t, i] = exp(q_t·k_i·c) / Σ_{j ∈ [0, min(sinks, s)) ∪ [s, e) ∪ {own keys u ≤ t}} exp(q_t·k_j·c)
        s_h[i] = max over g in h's group, t of a_g[t, i]        (the maximum attention received in reconstruction)

    with c the model's softmax scale. Nothing of a question enters: the scores are the context's
    own.

    `reconstruct`: what is reconstructed. "context" (the default): only what follows the chat template's
    prefix (RepeatPrompt.prefix, found from the tokenizer's template with a dummy message) where every row of
    the prompt starts with it, the chunks cut from there, and the prefix's entries scored 0 (evicted first,
    after the ranking's sinks); a prompt that does not start with the prefix (or a tokenizer without a chat
    template) is reconstructed whole. "prompt": the whole prompt from position 0, so a prompt in a chat
    template has its template prefix (system prompt, user header) repeated and scored like the rest.
    "context" is the paper's: KVzip (§2.1: the
    context c of n_c tokens prefilled into KV_c; §3, Eq. 2: S ∈ R^{L×H×n_c}, a score for each of the
    context's KV pairs; Appendix A, Algorithm 1: c partitioned into chunks c_1..c_T, the input "Repeat the
    previous context:" + c_t) scores and reconstructs the context, not the template around it, and it is
    kvpress's KVzipPress (which reconstructs from the end of the template's prefix and leaves the prefix's
    scores 0). The extra work is one more forward over the context's length plus the repeat prompts
    (one per chunk) and the score's attention over the chunk; the full cache of every layer is
    held while scoring (kvcompile.kvzip runs the pass; `score` of a single layer does not exist).
    """

    chunk: int = bounded(2048, low=1, why="context tokens per reconstruction forward (KVzip: 2000, kvpress: 2048)")
    sinks: int = bounded(4, low=0, why="first cached entries in every chunk's softmax (kvpress n_sink = 4)")
    overlap: int = bounded(8, low=0, why="previous chunk's last tokens quoted in the next repeat prompt (KVzip: 8)")
    reconstruct: Literal["prompt", "context"] = "context"  # the context after the template (the paper's), or all
    gqa = "max"
    reconstructs = True  # scores come from a model-level reconstruction pass (kvcompile.kvzip)

    def __post_init__(self):
        super().__post_init__()
        if self.overlap > self.chunk:  # it would quote tokens of chunks before the previous one
            raise FieldError("overlap", f"overlap {self.overlap} is larger than chunk {self.chunk}: the repeat "
                             "prompt quotes the last `overlap` tokens of the previous chunk, which has `chunk`",
                             f"an integer in [0, chunk] (here [0, {self.chunk}])")

    query_agnostic = True

    def query_rows(self, n: int) -> int:
        return 0

    def score(self, state: LayerState) -> Tensor:
        raise NotImplementedError("kvcompile: scoring kvzip scores a prompt by running the model again on its "
                                  "reconstruction (kvcompile.kvzip, what a compiled model's forward and generate() "
                                  "do); one layer's prefill state alone cannot score it")

    def chunks(self, n: int, start: int = 0) -> list[tuple[int, int]]:
        """The context spans [s, e) reconstructed one forward each, from `start` (context_start) on."""
        return [(s, min(s + self.chunk, n)) for s in range(start, n, self.chunk)]

    def context_start(self, ids: Tensor, prefix: tuple[int, ...]) -> int:
        """Where the reconstruction starts in the prompt `ids` (B, N): 0 under reconstruct: prompt; under
        reconstruct: context, after the chat template's `prefix` where every row starts with it (else 0)."""
        p = len(prefix)
        if self.reconstruct == "prompt" or not p or p >= ids.shape[1]:
            return 0
        head = torch.tensor(prefix, dtype=ids.dtype, device=ids.device)
        return p if bool((ids[:, :p] == head).all()) else 0

    def score_reconstruction(self, queries: Tensor, cached_k: Tensor, own_k: Tensor, start: int, end: int,
                             scale: float, budget: int = 1 << 23, softcap: float | None = None,
                             sinks: Tensor | None = None) -> Tensor:
        """s_h[i] for the chunk's cached entries i ∈ [start, end): (B, H, end − start) float32.

        queries (B, Hq, T, d): the reconstruction input's queries after RoPE; cached_k (B, H, N, d): the
        prompt's keys; own_k (B, H, T, d): the reconstruction input's keys (query t sees own keys u ≤ t).
        The softmax runs over KVzip's keys only: the first min(sinks, start) entries, the chunk's, the own
        keys u ≤ t (`score_keys`; softcap, sinks: the model's, as there)."""
        sink = min(self.sinks, start)
        return self.score_keys(queries, cached_k[:, :, :sink], cached_k[:, :, start:end], own_k, scale,
                               budget=budget, softcap=softcap, learned=sinks)

    def score_keys(self, queries: Tensor, sink_k: Tensor, chunk_k: Tensor, own_k: Tensor, scale: float,
                   sink_valid: Tensor | None = None, budget: int = 1 << 23, softcap: float | None = None,
                   learned: Tensor | None = None) -> Tensor:
        """s_h[i] of the chunk's entries `chunk_k` (B, H, W, d): (B, H, W) float32, the softmax of each
        reconstruction query over the sink entries `sink_k` (B, H, S, d) (those of `sink_valid` (B, H, S)
        only, where given: a head that no longer holds a sink), the chunk's entries and the own keys u ≤ t.
        Rows go in blocks of about `budget` logits (a max over rows splits), each block reading the own keys
        up to its last row: memory O(budget) floats. softcap: the model's logit soft-cap (Gemma 2) applied to the
        logits; learned (Hq,): the layer's learned sinks (gpt-oss), one more logit per query head in the softmax's
        denominator (the model's own attention, over KVzip's keys)."""
        b, hq, t, d = queries.shape
        h = chunk_k.shape[1]
        g = hq // h
        sink, width = sink_k.shape[2], chunk_k.shape[2]
        keys = torch.cat([sink_k, chunk_k, own_k], dim=2).float()
        keys = keys.transpose(2, 3)  # (B, H, d, sink + width + T)
        q = queries.float().view(b, h, g, t, d)
        best = torch.zeros(b, h, width, dtype=torch.float32, device=queries.device)
        block = max(1, budget // max(1, b * hq * (sink + width + t)))
        own = torch.arange(t, device=queries.device)
        for lo in range(0, t, block):
            hi = min(lo + block, t)
            seen = sink + width + hi  # the own keys up to the block's last row
            rows = q[:, :, :, lo:hi].reshape(b, h, g * (hi - lo), d)  # a group's rows share one matmul
            logits = torch.matmul(rows, keys[..., :seen]).mul_(scale).view(b, h, g, hi - lo, seen)
            logits = capped(logits, softcap)
            logits[..., sink + width:].masked_fill_(own[None, :hi] > own[lo:hi, None], float("-inf"))
            if sink_valid is not None:
                logits[..., :sink].masked_fill_(~sink_valid[:, :, None, None, :], float("-inf"))
            probs = model_softmax(logits, None if learned is None else learned.float().view(1, h, g, 1, 1))
            probs = probs[..., sink:sink + width]
            best = torch.maximum(best, probs.amax(dim=(2, 3)))
        return best
