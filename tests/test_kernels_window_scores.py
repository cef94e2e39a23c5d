"""window_scores (Triton under the interpreter, torch lowering) against the `score()`
references of WindowAttention and Lava in kvcompile/policies/scoring.py."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.testing import assert_close

from kvcompile.kernels import window_scores as ws
from kvcompile.policies.scoring import Lava, Pooling, WindowAttention
from kvcompile.reference import LayerState
from tiny import on_triton


def layer_state(seed, batch, heads, group, dim, tokens, extra_rows, rows, padded, dtype):
    """A random layer: left padding (one sequence may be all real, lengths 1 … N),
    R = the scorer's rows + extra_rows queries (capped at N)."""
    gen = torch.Generator().manual_seed(seed)
    r = min(rows + extra_rows, tokens)
    mask = None
    if padded:
        real = torch.randint(1, tokens + 1, (batch,), generator=gen)
        mask = torch.arange(tokens)[None, :] >= tokens - real[:, None]
    return LayerState(
        queries=(2 * torch.randn(batch, heads * group, r, dim, generator=gen)).to(dtype),
        keys=(2 * torch.randn(batch, heads, tokens, dim, generator=gen)).to(dtype),
        values=torch.randn(batch, heads, tokens, dim, generator=gen).to(dtype),
        mask=mask, scale=None if seed % 2 else 0.3)


scorers = st.builds(
    lambda lava, window, kind, kernel, gqa: (Lava if lava else WindowAttention)(
        window=window, pooling=Pooling(kind=kind, kernel=kernel), gqa=gqa),
    lava=st.booleans(), window=st.integers(1, 12),
    kind=st.sampled_from(["none", "avg", "max"]), kernel=st.sampled_from([1, 3, 5, 7]),
    gqa=st.sampled_from(["mean", "max"]))

cases = dict(scorer=scorers, seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 2),
             heads=st.integers(1, 3), group=st.sampled_from([1, 2, 3]),
             dim=st.sampled_from([4, 8, 20]), tokens=st.integers(1, 40),
             extra_rows=st.integers(0, 2), padded=st.booleans(),
             dtype=st.sampled_from([torch.float32, torch.float16]))


def check(impl, scorer, seed, batch, heads, group, dim, tokens, extra_rows, padded, dtype):
    state = layer_state(seed, batch, heads, group, dim, tokens, extra_rows,
                        scorer.query_rows(tokens), padded, dtype)
    expected = scorer.score(state)
    queries, keys, values, mask = on_triton(impl, state.queries, state.keys, state.values, state.mask)
    got = ws.score_fused(scorer, LayerState(queries, keys, values, mask, state.scale), impl=impl).cpu()
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert_close(got, expected)


@settings(max_examples=40, deadline=None)
@given(**cases)
def test_triton_matches_score(**case):
    check("triton", **case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scorer", [
    WindowAttention(window=8, pooling=Pooling(kind="avg", kernel=7), gqa="mean"),  # snapkv's parts
    Lava(window=8, pooling=Pooling(kind="avg", kernel=7), gqa="max")], ids=["snapkv", "lava"])
def test_triton_matches_score_at_model_shapes(scorer, dtype):
    """SmolLM2-135M's group of 3 query heads per KV head and head dim 64, both dtypes, padded."""
    check("triton", scorer, seed=5, batch=2, heads=1, group=3, dim=64, tokens=40, extra_rows=0,
          padded=True, dtype=dtype)


@settings(max_examples=80, deadline=None)
@given(**cases)
def test_torch_lowering_matches_score(**case):
    check("torch", **case)


@pytest.mark.slow
def test_compiled_torch_lowering_matches_score():
    scorer = Lava(window=8, pooling=Pooling(kind="max", kernel=5), gqa="max")
    state = layer_state(3, 2, 2, 3, 16, 48, 0, 8, True, torch.float32)
    assert_close(ws.score_fused(scorer, state, impl="compiled"), scorer.score(state))


def test_bad_arguments_raise():
    state = layer_state(0, 1, 2, 2, 8, 10, 0, 4, False, torch.float32)
    with pytest.raises(ValueError, match="window"):  # more rows than the queries given
        ws.window_scores(state.queries, state.keys, state.values, None, None, window=9)
    with pytest.raises(ValueError, match="value_weight"):
        ws.window_scores(state.queries, state.keys, None, None, None, window=4, value_weight=True)
    with pytest.raises(ValueError, match="key_norm"):
        ws.score_fused(type("KeyNorm", (), {"name": "key_norm"})(), state)
