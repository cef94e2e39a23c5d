"""kvcompile.kernels.attention_column_sums: the prompt's attention and the weighted column sums
of its probabilities in one pass, against the model's attention (engine.prefill.prompt_attention) and
the scorers' N×N specification (Decayed.score, Accumulated.score); and how the plan chooses it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

import kvcompile
from kvcompile.kernels import choice
from kvcompile.kernels.attention_column_sums import attention_column_sums, reconstruction_attention, runs_here
from kvcompile.layer_state import LayerState
from kvcompile.plan import PlanError, build_plan
from kvcompile.policies.scoring import Accumulated, Decayed, KVzip, MeanAttention
from kvcompile.engine.prefill import prompt_attention
from tiny import prompt, tiny_model

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not runs_here(CPU, torch.float32, 16), reason="no C++ toolchain")


def tensors(b, h, g, n, d, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h * g, n, d, generator=gen) * 2  # peaked attention: the sums differ from uniform
    return q, torch.randn(b, h, n, d, generator=gen), torch.randn(b, h, n, d, generator=gen)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 3), g=st.integers(1, 4), n=st.integers(1, 90),
       d=st.sampled_from([16, 32, 64]), pads=st.integers(0, 20), decay=st.sampled_from([1.0, 0.98, 0.5]),
       gqa=st.sampled_from(["mean", "max"]), threads=st.integers(1, 2), seed=st.integers(0, 99))
def test_equals_the_attention_and_the_scorers_specification(b, h, g, n, d, pads, decay, gqa, threads, seed):
    q, k, v = tensors(b, h, g, n, d, seed)
    valid = None
    if pads and b > 1:  # the first sequence left-padded
        valid = torch.ones(b, n, dtype=torch.bool)
        valid[0, :min(pads, n - 1)] = False
    scorer = Accumulated(gqa=gqa) if decay == 1.0 else Decayed(decay=decay, gqa=gqa)
    state = LayerState(q, k, v, valid, 0.3)
    out, sums = attention_column_sums(q, k, v, valid, 0.3, scorer.column_weights(n), threads=threads)
    assert_close(out, prompt_attention(q, k, v, valid, 0.3))
    assert_close(scorer.score_from_column_sums(sums, state), scorer.score(state))  # the N×N specification



@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 3), g=st.integers(1, 4), n=st.integers(1, 90), t=st.integers(1, 40),
       d=st.sampled_from([16, 64]), sinks=st.integers(0, 6), threads=st.integers(1, 2), data=st.data())
def test_reconstruction_equals_the_attention_and_kvzips_scores(b, h, g, n, t, d, sinks, threads, data):
    """A KVzip reconstruction forward's attention (the last T of N + T keys) is the kernel's without scores,
    bit for bit, and its scores are KVzip.score_keys' (the softmax over the sinks, the chunk and the own keys)."""
    start = data.draw(st.integers(0, n - 1))
    end = data.draw(st.integers(start + 1, n))
    q, k, v = tensors(b, h, g, n + t, d, n * 7 + t)
    q = q[:, :, n:]
    sink = min(sinks, start)
    out, scores = reconstruction_attention(q, k, v, 0.3, sink, start, end, threads=threads)
    assert torch.equal(out, attention_column_sums(q, k, v, None, 0.3, q.new_zeros(t), threads=threads)[0])
    assert_close(out, prompt_attention(q, k, v, None, 0.3, offset=n))
    expected = KVzip(sinks=sinks).score_reconstruction(q, k[:, :, :n], k[:, :, n:], start, end, 0.3)
    assert scores.shape == (b, h, end - start)
    assert_close(scores, expected)


def test_reconstruction_refuses_a_chunk_outside_the_cache():
    q, k, v = tensors(1, 1, 1, 30, 16, 0)
    with pytest.raises(ValueError, match="sink <= start <= end <= N - T"):
        reconstruction_attention(q[:, :, 20:], k, v, 0.3, 0, 5, 25)  # the cache is 20 keys
    with pytest.raises(ValueError, match="sink <= start"):
        reconstruction_attention(q[:, :, 20:], k, v, 0.3, 4, 2, 10)

def test_pads_anywhere_follow_the_model_attention():
    """A pad query sees itself only (as prompt_attention), a pad key is seen by no real query,
    and a pad query's row adds nothing to the sums; pads in the middle too."""
    q, k, v = tensors(2, 2, 2, 40, 16, 3)
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[0, :9] = False
    valid[1, 17:21] = False
    out, sums = attention_column_sums(q, k, v, valid, 0.25, torch.ones(40))
    assert_close(out, prompt_attention(q, k, v, valid, 0.25))
    assert_close(out[0, :, :9], v[0].repeat_interleave(2, dim=0)[:, :9])  # a leading pad: its own value
    state = LayerState(q, k, v, valid, 0.25)
    assert_close(Accumulated().score_from_column_sums(sums, state), Accumulated().score(state))
    assert (sums[1, :, 17:21] == 0).all() and (sums[0, :, :9] == 0).all()


@pytest.mark.parametrize("gqa", ["mean", "max"])
def test_mean_attention_from_the_sums_and_by_row_chunks_equals_its_specification(gqa):
    """MeanAttention (kvpress's ObservedAttentionPress) is the column sums divided by each key's count of queries:
    from the attention's sums and from the chunked rows as from its N×N specification, pads left and inside."""
    q, k, v = tensors(2, 2, 2, 70, 16, 5)
    valid = torch.ones(2, 70, dtype=torch.bool)
    valid[0, :11] = False
    state = LayerState(q, k, v, valid, 0.3)
    scorer = MeanAttention(gqa=gqa)
    out, sums = attention_column_sums(q, k, v, valid, 0.3, scorer.column_weights(70))
    expected = scorer.score(state)
    assert_close(scorer.score_from_column_sums(sums, state), expected)
    assert_close(scorer.score_prompt(state), expected)
    assert torch.isneginf(expected[0, :, :11]).all() and torch.isfinite(expected[:, :, 11:]).all()


def test_threads_agree_and_a_long_prompt_fits():
    q, k, v = tensors(1, 3, 3, 1000, 64, 4)  # SmolLM2's heads; rows past the L2-sized stripe
    w = Decayed().column_weights(1000)
    one = attention_column_sums(q, k, v, None, 0.125, w, threads=1)
    two = attention_column_sums(q, k, v, None, 0.125, w, threads=2)
    assert_close(one, two)
    state = LayerState(q, k, v, None, 0.125)
    assert_close(Decayed().score_from_column_sums(one[1], state), Decayed().score_chunked(state))


def chunk_reference(q, hk, hv, bias, k, v, real, scale, weights):
    """A chunk's attention (chunk_attention.SdpaChunkAttention, reference.ChunkedPrefill step 1) written out densely:
    a real query sees the held entries with their bias and the chunk's real keys up to itself, a pad query
    itself only; and Σ_t w_t A[t, i] over the real queries."""
    b, hq, t, d = q.shape
    h, e = hk.shape[1], hk.shape[2]
    g = hq // h
    keys = torch.cat([hk, k], dim=2).repeat_interleave(g, dim=1)
    values = torch.cat([hv, v], dim=2).repeat_interleave(g, dim=1)
    rows = torch.arange(t)
    own = (rows[None, :] <= rows[:, None])[None] & real[:, None, :]  # (B, T, T)
    own = own | (torch.eye(t, dtype=torch.bool)[None] & ~real[:, :, None])
    held = bias[:, :, None, :].expand(b, h, t, e).masked_fill(~real[:, None, :, None], float("-inf"))
    mask = torch.cat([held, torch.zeros(b, h, t, t).masked_fill(~own[:, None], float("-inf"))], dim=-1)
    logits = torch.einsum("bhtd,bhsd->bhts", q, keys) * scale + mask.repeat_interleave(g, dim=1)
    probs = torch.softmax(logits, dim=-1)
    sums = torch.einsum("bhts,t->bhs", probs * real[:, None, :, None], weights)
    return probs @ values, sums


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 3), g=st.integers(1, 3), e=st.integers(0, 40), t=st.integers(1, 50),
       d=st.sampled_from([16, 32]), pads=st.integers(0, 20), merged=st.booleans(), threads=st.integers(1, 2),
       seed=st.integers(0, 99))
def test_a_chunk_after_held_entries(b, h, g, e, t, d, pads, merged, threads, seed):
    """Queries of the last T keys, the first E held with a per-head bias (−inf where a head holds nothing,
    α·log w at merge slots), left pads: the dense chunk attention and its column sums."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h * g, t, d, generator=gen) * 2
    hk, hv = torch.randn(b, h, e, d, generator=gen), torch.randn(b, h, e, d, generator=gen)
    k, v = torch.randn(b, h, t, d, generator=gen), torch.randn(b, h, t, d, generator=gen)
    stored = torch.rand(b, h, e, generator=gen) < 0.7
    real = torch.ones(b, t, dtype=torch.bool)
    if pads:  # the first sequence left-padded: it holds nothing yet
        real[0, :min(pads, t)] = False
        stored[0] = False
    bias = torch.zeros(b, h, e)
    if merged:
        bias = 0.6 * torch.log(torch.randint(1, 5, (b, h, e), generator=gen).float())
    bias = bias.masked_fill(~stored, float("-inf"))
    weights = torch.rand(t, generator=gen)
    valid = None if bool(real.all()) else torch.cat([torch.ones(b, e, dtype=torch.bool), real], dim=1)
    out, sums = attention_column_sums(q, torch.cat([hk, k], 2), torch.cat([hv, v], 2), valid, 0.3, weights,
                                      bias=bias if e else None, threads=threads)
    want_out, want_sums = chunk_reference(q, hk, hv, bias, k, v, real, 0.3, weights)
    assert_close(out, want_out)
    assert_close(sums, want_sums)


def test_bad_input_is_refused():
    q, k, v = tensors(1, 2, 2, 8, 16, 0)
    with pytest.raises(ValueError, match="fp32 CPU tensors"):
        attention_column_sums(q.half(), k.half(), v.half(), None, 0.3, torch.ones(8))
    with pytest.raises(ValueError, match="fp32 CPU tensors"):
        attention_column_sums(q[..., :8], k[..., :8], v[..., :8], None, 0.3, torch.ones(8))
    with pytest.raises(ValueError, match=r"q \(B, H·G, T, d\)"):
        attention_column_sums(q[:, :3], k, v, None, 0.3, torch.ones(8))
    with pytest.raises(ValueError, match=r"T <= N"):
        attention_column_sums(torch.cat([q, q], 2), k, v, None, 0.3, torch.ones(16))
    with pytest.raises(ValueError, match=r"E <= N - T"):  # held entries overlapping the queries' own keys
        attention_column_sums(q[:, :, 4:], k, v, None, 0.3, torch.ones(4), bias=torch.zeros(1, 2, 5))


# --- the plan and the runtime ----------------------------------------------------------------

CONFIG = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=16)
FP32 = dict(device="cpu", dtype=torch.float32)


@dataclass(frozen=True)
class SquaredAttention(Decayed):
    """A decayed scorer with its own score (Σ_j w_j A[j, i]²): not a column sum of A."""

    def score(self, state):
        return super().score(state) ** 2

    score_prompt = score


def test_the_plan_chooses_one_pass_where_it_runs_and_the_score_is_a_column_sum():
    for name in ("h2o", "zsmerge"):
        plan = build_plan(kvcompile.load_spec(name), CONFIG, **FP32)
        assert plan.score_impl == "column_sums:cpp" and plan.attention_scores
        assert build_plan(kvcompile.load_spec(name), CONFIG, kernels="cpp", **FP32).attention_scores
        assert build_plan(kvcompile.load_spec(name), CONFIG, kernels="torch", **FP32).score_impl == "part"
        assert build_plan(kvcompile.load_spec(name), CONFIG, device="cpu", dtype=torch.float16).score_impl == "part"
        odd = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=20)
        assert build_plan(kvcompile.load_spec(name), odd, **FP32).score_impl == "part"
    for name in ("snapkv", "tova", "streamingllm"):
        assert not build_plan(kvcompile.load_spec(name), CONFIG, **FP32).attention_scores
    own = dataclasses.replace(kvcompile.load_spec("zsmerge"), scoring=SquaredAttention())
    assert own.scoring.column_weights(4) is None
    assert build_plan(own, CONFIG, **FP32).score_impl == "part"
    with pytest.raises(PlanError, match="impl 'cpp' needs fp32 CPU tensors"):
        build_plan(kvcompile.load_spec("h2o"), CONFIG, device="cpu", dtype=torch.float16, kernels="cpp")


def test_the_plan_runs_a_chunks_attention_by_the_kernel_where_it_runs():
    chunked = {"schedule": {"prefill": {"chunk": 64}}}
    for name, scores in (("h2o", True), ("zsmerge", False), ("snapkv", False), ("lava", False)):
        policy = kvcompile.load_spec(name, **chunked)
        plan = build_plan(policy, CONFIG, **FP32)
        assert plan.chunk_impl == "cpp" and plan.chunk_scores == scores  # zsmerge: slots the score does not see
        assert build_plan(policy, CONFIG, kernels="torch", **FP32).chunk_impl is None
        assert build_plan(policy, CONFIG, device="cpu", dtype=torch.float16).chunk_impl is None
        assert build_plan(kvcompile.load_spec(name), CONFIG, **FP32).chunk_impl is None  # one pass
    own = dataclasses.replace(kvcompile.load_spec("h2o", **chunked), scoring=SquaredAttention(decay=1.0))
    assert not build_plan(own, CONFIG, **FP32).chunk_scores  # its own score: the scorer's pass


def test_the_resolver_names_column_sums():
    assert choice.resolve("column_sums", None, CPU, torch.float32, head_dim=64) == "cpp"
    assert choice.resolve("column_sums", None, CPU, torch.float16, head_dim=64) == "torch"
    assert choice.resolve("column_sums", None, "cuda", torch.float16, head_dim=64) == "torch"  # no GPU kernel
    with pytest.raises(ValueError, match="column_sums: impl 'cpp' needs fp32 CPU tensors"):
        choice.resolve("column_sums", "cpp", CPU, torch.float32, head_dim=20)
    with pytest.raises(ValueError, match="needs head_dim"):
        choice.resolve("column_sums", None, CPU, torch.float32)


@pytest.mark.parametrize("name", ["h2o", "zsmerge"])
def test_generate_keeps_what_the_scorers_own_pass_keeps(name):
    """Through generate(): the one-pass plan and the plan with the model's attention plus the
    scorer's own pass keep the same entries and give the same tokens (padded batch)."""
    from tiny import left_pad

    ids, mask = left_pad([prompt(150, seed=7)[0], prompt(111, seed=8)[0]])
    policy = kvcompile.load_spec(name, per_head=80)
    results = []
    for kernels in (None, "torch"):
        model = tiny_model()
        kvcompile.compile(model, policy, kernels=kernels)
        assert model.kvcompile_plan.attention_scores == (kernels is None)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             return_dict_in_generate=True)
        cache = out.past_key_values
        results.append((out.sequences, [cache.kept_positions(layer) for layer in range(3)]))
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)
        assert not a[0].all(), "the budget should evict from the longer sequence"


def test_compile_builds_the_plans_cpp_kernels_before_any_generation(monkeypatch):
    """compile() builds the C++ kernels its plan names (a cold build inside a generation costs ~1 s)."""
    from kvcompile.kernels import append_step, attention_column_sums as acs, merge, online_step, paged_attention_cpp

    built = []
    monkeypatch.setattr(paged_attention_cpp, "_kernel", lambda g, d: built.append(("paged", g, d)))
    monkeypatch.setattr(online_step, "_kernel", lambda g, d: built.append(("step", g, d)))
    monkeypatch.setattr(append_step, "_kernel", lambda g, d, group: built.append(("step", g, d)))
    monkeypatch.setattr(acs, "_kernel", lambda d: built.append(("column_sums", d)))
    monkeypatch.setattr(merge, "_cpp_kernel", lambda: built.append(("merge",)))
    kvcompile.compile(tiny_model(heads=4, kv_heads=2), "zsmerge")
    assert sorted(built) == [("column_sums", 16), ("merge",), ("paged", 2, 16), ("step", 2, 16)]
    built.clear()
    kvcompile.compile(tiny_model(heads=6, kv_heads=2), "snapkv")
    assert sorted(built) == [("paged", 3, 16), ("step", 3, 16)]
    built.clear()
    kvcompile.compile(tiny_model(), "snapkv", kernels="torch")
    assert built == []
