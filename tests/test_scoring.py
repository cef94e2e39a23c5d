"""Scoring parts against brute-force loops, SDPA, torch pools and hand-computed cases."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close
from transformers.models.llama.modeling_llama import repeat_kv

from kvcompile.policies.scoring import (
    Accumulated, Decayed, KeyNorm, LastToken, Lava, MeanAttention, Pooling, Recency, WindowAttention,
    attention_rows, entropy, pool_scores, reduce_gqa,
)
from kvcompile.reference import LayerState

FEW = settings(max_examples=25, deadline=None)
NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- inputs


@dataclass
class Case:
    """A left-padded batch: all N queries of every sequence; pads hold large garbage."""

    queries: torch.Tensor  # (B, Hq, N, d), every prompt position
    keys: torch.Tensor  # (B, H, N, d)
    values: torch.Tensor  # (B, H, N, d)
    lengths: list[int]  # real tokens per sequence
    scale: float | None

    @property
    def n(self) -> int:
        return self.keys.shape[2]

    @property
    def mask(self) -> torch.Tensor:
        pos = torch.arange(self.n)
        return torch.stack([pos >= self.n - length for length in self.lengths])

    def state(self, rows: int) -> LayerState:
        """The batch's state with the last `rows` queries."""
        return LayerState(self.queries[:, :, self.n - rows:], self.keys, self.values,
                          self.mask, self.scale)

    def alone(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sequence b's real tokens only: queries (Hq, n_b, d), keys, values (H, n_b, d)."""
        start = self.n - self.lengths[b]
        return (self.queries[b, :, start:], self.keys[b, :, start:], self.values[b, :, start:])

    def alone_state(self, b: int, rows: int) -> LayerState:
        """Sequence b run alone (batch of 1, no padding) with its last `rows` queries."""
        q, k, v = self.alone(b)
        return LayerState(q[None, :, q.shape[1] - rows:], k[None], v[None], None, self.scale)


@st.composite
def cases(draw, padded=True, max_g=3, dtype=torch.float32):
    b = draw(st.integers(1, 2))
    h = draw(st.integers(1, 2))
    g = draw(st.integers(1, max_g))
    n = draw(st.integers(1, 24))
    d = draw(st.integers(1, 8))
    lengths = [draw(st.integers(1, n)) if padded else n for _ in range(b)]
    scale = draw(st.one_of(st.none(), st.floats(0.1, 2.0)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(b, h * g, n, d, generator=gen)
    k = torch.randn(b, h, n, d, generator=gen)
    v = torch.randn(b, h, n, d, generator=gen)
    for i, length in enumerate(lengths):  # garbage at pads: it must never leak in
        q[i, :, : n - length] *= 100
        k[i, :, : n - length] *= 100
        v[i, :, : n - length] = 1e4
    return Case(q.to(dtype), k.to(dtype), v.to(dtype), lengths, scale)


gqas = st.sampled_from(["mean", "max"])
poolings = st.builds(Pooling, kind=st.sampled_from(["avg", "max", "none"]),
                     kernel=st.sampled_from([1, 3, 5, 7]))
windows = st.integers(1, 30)
scorers = st.one_of(
    st.builds(WindowAttention, window=windows, pooling=poolings, gqa=gqas),
    st.builds(Lava, window=windows, pooling=poolings, gqa=gqas),
    st.builds(LastToken, gqa=gqas, heads=st.sampled_from(["group", "all"])),
    st.builds(Accumulated, gqa=gqas),
    st.builds(MeanAttention, gqa=gqas),
    st.builds(Decayed, decay=st.floats(0.0, 1.0, exclude_min=True), gqa=gqas),
    st.just(KeyNorm()),
    st.just(Recency()),
)
attention_scorers = st.one_of(
    st.builds(WindowAttention, window=windows, gqa=gqas),
    st.builds(Lava, window=windows, gqa=gqas),
    st.builds(LastToken, gqa=gqas, heads=st.sampled_from(["group", "all"])),
    st.builds(Accumulated, gqa=gqas),
    st.builds(MeanAttention, gqa=gqas),
    st.builds(Decayed, decay=st.floats(0.0, 1.0, exclude_min=True), gqa=gqas),
)


def rows_for(scorer, case: Case, data) -> int:
    """Some R between what the scorer needs and N (extra rows must not change anything)."""
    return data.draw(st.integers(scorer.query_rows(case.n), case.n), label="R")


# ------------------------------------------------------------------- brute force (fp64)


def brute_attention(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    """A[h, j, i] of one unpadded sequence, one query head and one query at a time.

    q (Hq, n, d) every position, k (H, n, d) -> (Hq, n, n), explicit causal softmax.
    """
    hq, n, d = q.shape
    g = hq // k.shape[0]
    scale = d ** -0.5 if scale is None else scale
    a = torch.zeros(hq, n, n, dtype=torch.float64)
    for head in range(hq):
        for j in range(n):
            logits = (k[head // g, : j + 1].double() @ q[head, j].double()) * scale
            e = torch.exp(logits - logits.max())
            a[head, j, : j + 1] = e / e.sum()
    return a


def brute_pool(s: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """Pool each row over the tokens within kernel//2, clipped at the sequence ends."""
    if pooling.kind == "none":
        return s
    half, n = pooling.kernel // 2, s.shape[-1]
    out = torch.empty_like(s)
    for i in range(n):
        window = s[:, max(0, i - half): min(n, i + half + 1)]
        out[:, i] = window.mean(-1) if pooling.kind == "avg" else window.amax(-1)
    return out


def brute_scores(scorer, q, k, v, scale) -> torch.Tensor:
    """(H, n) scores of one unpadded sequence, straight from the definitions."""
    h, n, _ = k.shape
    g = q.shape[0] // h
    if isinstance(scorer, KeyNorm):
        return -k.double().pow(2).sum(-1).sqrt()
    if isinstance(scorer, Recency):
        return torch.arange(n, dtype=torch.float64).repeat(h, 1)
    a = brute_attention(q, k, scale)
    if isinstance(scorer, (WindowAttention, Lava)):
        w = min(scorer.window, n)
        per_query_head = sum(a[:, j] for j in range(n - w, n)) / w
    elif isinstance(scorer, LastToken):
        per_query_head = a[:, n - 1]
    elif isinstance(scorer, MeanAttention):  # kvpress ObservedAttentionPress: the sum over the n − i queries j ≥ i
        per_query_head = torch.stack([a[:, i:, i].sum(-1) / (n - i) for i in range(n)], dim=-1)
    elif isinstance(scorer, Accumulated):
        per_query_head = sum(a[:, j] for j in range(n))
    else:  # Decayed
        per_query_head = sum(scorer.decay ** (n - 1 - j) * a[:, j] for j in range(n))
    groups = [per_query_head[kv * g: kv * g + g] for kv in range(h)]
    if isinstance(scorer, LastToken) and scorer.heads == "all":  # every query head of the layer, for each KV head
        groups = [per_query_head for _ in range(h)]
    s = torch.stack([grp.mean(0) if scorer.gqa == "mean" else grp.amax(0) for grp in groups])
    if isinstance(scorer, (WindowAttention, Lava)):
        s = brute_pool(s, scorer.pooling)
    if isinstance(scorer, Lava):
        v_bar = torch.tensor([max(float(v[kv, t].double().abs().sum()) for t in range(n))
                              for kv in range(h)], dtype=torch.float64)
        s = s * v_bar[:, None]
    return s


# ------------------------------------------------------------------------------ tests


@FEW
@given(scorers, cases(), st.data())
def test_every_scorer_matches_brute_force_per_sequence(scorer, case, data):
    scores = scorer.score(case.state(rows_for(scorer, case, data)))
    assert scores.dtype == torch.float32 and scores.shape == case.keys.shape[:3]
    for b, length in enumerate(case.lengths):
        pad = case.n - length
        assert torch.isneginf(scores[b, :, :pad]).all()
        expected = brute_scores(scorer, *case.alone(b), case.scale).float()
        assert_close(scores[b, :, pad:], expected, rtol=1e-5, atol=1e-5)


@FEW
@given(scorers, cases(), st.data())
def test_padded_scores_equal_the_sequence_run_alone(scorer, case, data):
    scores = scorer.score(case.state(rows_for(scorer, case, data)))
    for b, length in enumerate(case.lengths):
        alone = scorer.score(case.alone_state(b, scorer.query_rows(length)))
        assert_close(scores[b: b + 1, :, case.n - length:], alone)
        assert torch.isneginf(scores[b, :, : case.n - length]).all()
        assert torch.isfinite(alone).all()


@FEW
@given(cases(padded=False, max_g=1), st.integers(1, 30))
def test_window_attention_is_the_mean_of_sdpa_probabilities(case, window):
    """G = 1, no pooling: SDPA with V = identity returns the causal softmax rows A[j, :]."""
    b, h, n, _ = case.keys.shape
    eye = torch.eye(n).expand(b, h, n, n)
    probs = F.scaled_dot_product_attention(case.queries, case.keys, eye, is_causal=True,
                                           scale=case.scale)
    w = min(window, n)
    scores = WindowAttention(window=window).score(case.state(w))
    assert_close(scores, probs[:, :, n - w:].mean(dim=2))
    assert_close(attention_rows(case.state(n), n), probs)


@FEW
@given(attention_scorers, cases(), st.data())
def test_gqa_equals_reducing_the_repeated_kv_heads(scorer, case, data):
    """A GQA layer scores like its repeat_kv'd (G = 1) layer reduced over each group."""
    h = case.keys.shape[1]
    g = case.queries.shape[1] // h
    state = case.state(rows_for(scorer, case, data))
    repeated = LayerState(state.queries, repeat_kv(state.keys, g), repeat_kv(state.values, g),
                          state.mask, state.scale)
    assert_close(scorer.score(state), reduce_gqa(scorer.score(repeated), h, scorer.gqa))


def test_reduce_gqa_groups_consecutive_query_heads():
    a = torch.arange(12.0).reshape(1, 6, 2)  # query heads 0-2 -> KV head 0, 3-5 -> KV head 1
    assert_close(reduce_gqa(a, 2, "mean"), torch.tensor([[[2.0, 3.0], [8.0, 9.0]]]))
    assert_close(reduce_gqa(a, 2, "max"), torch.tensor([[[4.0, 5.0], [10.0, 11.0]]]))
    assert_close(reduce_gqa(a, 6, "max"), a)


@FEW
@given(cases(padded=False), st.integers(1, 30), st.sampled_from([3, 5, 7]), gqas)
def test_pooling_matches_torch_pools_on_unpadded_input(case, window, kernel, gqa):
    state = case.state(min(window, case.n))
    b, h, n, _ = case.keys.shape
    raw = WindowAttention(window=window, gqa=gqa).score(state).reshape(b * h, 1, n)
    avg = WindowAttention(window=window, gqa=gqa, pooling=Pooling("avg", kernel)).score(state)
    mx = WindowAttention(window=window, gqa=gqa, pooling=Pooling("max", kernel)).score(state)
    expected_avg = F.avg_pool1d(raw, kernel, 1, kernel // 2, count_include_pad=False)
    expected_max = F.max_pool1d(raw, kernel, 1, kernel // 2)
    assert_close(avg, expected_avg.reshape(b, h, n))
    assert_close(mx, expected_max.reshape(b, h, n))


@FEW
@given(st.integers(1, 9), st.integers(0, 12), st.sampled_from([3, 5, 7, 9]), st.integers(0, 2 ** 16))
def test_avg_pooling_of_a_padded_row_is_the_row_alone_bit_for_bit(n, pads, kernel, seed):
    """A window's real tokens summed in one order: a row pools bit for bit as it would alone, wherever its pads and
    ends put it, and windows over the same real tokens (all of them, when the kernel covers the row) give one
    float: an exact tie stays a tie, so "ties: the later position" decides, not the rounding (a mixed tier split,
    tests/test_storage_tiers.py). The specification (pool_scores) and the torch lowering (window_scores._pool)."""
    from kvcompile.kernels.window_scores import _pool

    gen = torch.Generator().manual_seed(seed)
    alone = torch.softmax(torch.randn(1, 1, n, generator=gen), dim=-1)
    row = torch.cat([torch.randn(1, 1, pads, generator=gen) * 9, alone], dim=-1)  # pads: garbage
    real = torch.arange(pads + n)[None] >= pads
    for pool in (lambda s, r: pool_scores(s, r, Pooling("avg", kernel)), lambda s, r: _pool(s, r, "avg", kernel)):
        one = pool(alone, torch.ones(1, n, dtype=torch.bool))
        padded = pool(row, real)
        assert torch.equal(padded[..., pads:], one)
        covering = [i for i in range(n) if i - kernel // 2 <= 0 and i + kernel // 2 >= n - 1]
        assert len({float(one[0, 0, i]) for i in covering}) <= 1


@FEW
@given(cases(), gqas)
def test_decayed_with_decay_one_is_accumulated(case, gqa):
    state = case.state(case.n)
    assert_close(Decayed(decay=1.0, gqa=gqa).score(state), Accumulated(gqa=gqa).score(state))


@FEW
@given(cases(), windows, poolings, gqas)
def test_lava_is_window_attention_times_max_value_l1(case, window, pooling, gqa):
    state = case.state(min(window, case.n))
    attention = WindowAttention(window=window, pooling=pooling, gqa=gqa).score(state)
    lava = Lava(window=window, pooling=pooling, gqa=gqa).score(state)
    b, h, n, _ = case.keys.shape
    for i, length in enumerate(case.lengths):
        for kv in range(h):
            v_bar = case.values[i, kv, n - length:].abs().sum(-1).max()
            assert_close(lava[i, kv], attention[i, kv] * v_bar)


@FEW
@given(scorers, cases(dtype=torch.float16), st.data())
def test_fp16_inputs_give_the_fp32_result(scorer, case, data):
    rows = rows_for(scorer, case, data)
    half = scorer.score(case.state(rows))
    upcast = Case(case.queries.float(), case.keys.float(), case.values.float(),
                  case.lengths, case.scale)
    assert half.dtype == torch.float32
    assert_close(half, scorer.score(upcast.state(rows)), rtol=1e-6, atol=1e-6)


def test_hand_computed_scores_with_a_left_pad():
    """d = 1, scale 1, keys (pad, 0, ln 3): the last query (1) attends 1/4, 3/4."""
    queries = torch.tensor([[[[7.0], [5.0], [1.0]]]])  # pad query, query 0, query 1
    keys = torch.tensor([[[[9.0], [0.0], [math.log(3.0)]]]])
    values = torch.tensor([[[[100.0], [-2.0], [1.0]]]])
    state = LayerState(queries, keys, values, torch.tensor([[False, True, True]]), 1.0)
    inf = NEG_INF
    # row 0 (query 0) sees key 0 only: (1, 0); row 1: (1/4, 3/4)
    assert_close(LastToken().score(state), torch.tensor([[[inf, 0.25, 0.75]]]))
    assert_close(LastToken(heads="all").score(state), torch.tensor([[[inf, 0.25, 0.75]]]))  # one head: the same
    assert_close(WindowAttention(window=2).score(state), torch.tensor([[[inf, 5 / 8, 3 / 8]]]))
    assert_close(WindowAttention(window=9).score(state), torch.tensor([[[inf, 5 / 8, 3 / 8]]]))
    assert_close(Accumulated().score(state), torch.tensor([[[inf, 1.25, 0.75]]]))
    assert_close(Decayed(decay=0.5).score(state), torch.tensor([[[inf, 0.75, 0.75]]]))
    assert_close(Lava(window=2).score(state), torch.tensor([[[inf, 1.25, 0.75]]]))  # V̄ = 2
    assert_close(KeyNorm().score(state), torch.tensor([[[inf, -0.0, -math.log(3.0)]]]))
    assert_close(Recency().score(state), torch.tensor([[[inf, 0.0, 1.0]]]))
    avg3 = WindowAttention(window=2, pooling=Pooling("avg", 3)).score(state)
    assert_close(avg3, torch.tensor([[[inf, 0.5, 0.5]]]))  # the pad never counts


@pytest.mark.parametrize("scorer, n, rows", [
    (WindowAttention(window=8), 5, 5), (WindowAttention(window=8), 20, 8),
    (Lava(window=3), 10, 3), (LastToken(), 10, 1), (Accumulated(), 10, 10),
    (Decayed(), 7, 7), (KeyNorm(), 10, 0), (Recency(), 10, 0),
])
def test_query_rows(scorer, n, rows):
    assert scorer.query_rows(n) == rows


def test_too_few_query_rows_is_an_error():
    state = LayerState(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4))
    with pytest.raises(ValueError, match="rows"):
        Accumulated().score(state)


@pytest.mark.parametrize("make", [
    lambda: WindowAttention(window=0), lambda: Lava(window=-1), lambda: Pooling("avg", 4),
    lambda: Pooling("median", 3), lambda: LastToken(gqa="sum"), lambda: Decayed(decay=1.5),
])
def test_bad_hyper_parameters_are_rejected(make):
    with pytest.raises(ValueError):
        make()


@FEW
@given(st.integers(1, 2), st.integers(1, 2), st.integers(1, 24), st.floats(0.01, 100.0),
       st.integers(0, 2**31 - 1))
def test_entropy_of_a_uniform_distribution_is_log_n_over_n(b, h, n, value, seed):
    gen = torch.Generator().manual_seed(seed)
    valid = torch.rand(b, h, n, generator=gen) < 0.7
    valid[:, 0, -1] = True  # at least one valid entry per sequence
    scores = torch.where(valid, value, NEG_INF)
    count = valid.sum(dim=(1, 2)).double()
    assert_close(entropy(scores, valid), (count.log() / count).float())


def test_entropy_hand_cases():
    valid = torch.tensor([[[True, True, False]]])
    scores = torch.tensor([[[1.0, 3.0, 50.0]]])  # p = (1/4, 3/4), 2 valid entries
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)) / 2
    assert_close(entropy(scores, valid), torch.tensor([expected]))
    zeros_count = torch.tensor([[[0.0, 1.0, 1.0]]])  # 0·log 0 = 0: log 2 / 3
    assert_close(entropy(zeros_count, torch.ones(1, 1, 3, dtype=torch.bool)),
                 torch.tensor([math.log(2.0) / 3]))
    with pytest.raises(ValueError):
        entropy(torch.tensor([[[-1.0, 1.0]]]), torch.ones(1, 1, 2, dtype=torch.bool))


def test_last_token_over_all_heads_gives_every_kv_head_one_score():
    """heads: all (TOVA's own code, kvpress's TOVAPress): the last row's mean over all query heads of the layer,
    the same for each KV head; heads: group (the default) reduces each group on its own."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 6, 5, 4, generator=gen), torch.randn(1, 2, 5, 4, generator=gen), torch.randn(1, 2, 5, 4)
    state = LayerState(q, k, v, None, None)
    last = torch.softmax(q[:, :, -1:] @ repeat_kv(k, 3).transpose(-1, -2) / 2.0, dim=-1)[:, :, 0]  # (1, 6, 5)
    every = LastToken(heads="all").score(state)
    assert_close(every, last.mean(1, keepdim=True).expand(1, 2, 5))
    assert_close(LastToken(heads="all", gqa="max").score(state), last.amax(1, keepdim=True).expand(1, 2, 5))
    assert_close(LastToken().score(state), torch.stack([last[:, :3].mean(1), last[:, 3:].mean(1)], dim=1))
    assert not torch.allclose(every, LastToken().score(state))
