"""residual_merge (Triton under the interpreter, torch lowering) and merge_order against
kvcompile.reference.merge_evicted."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.testing import assert_close

from kvcompile.kernels import merge as km
from kvcompile.kernels.paged_attention_cpp import supports as cpp_supports
from kvcompile.policies.budgets import Budget, Split
from kvcompile.policies.merge import Residual
from kvcompile.policy import Policy
from kvcompile.reference import Merged, merge_evicted
from tiny import on_triton

POLICY = Policy(budget=Budget(per_head=4, split=Split(proximity=0.0, context=0.5, residual=0.5)),
                merge=Residual())


def merge_case(seed, batch, heads, tokens, slots, dim, value_dim, dtype, positions):
    """Random evicted sets (scores from a small set, so ties occur), slots partly held
    (holes included) and a per-head number of usable slots (0 … S)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, tokens, dim, generator=gen).to(dtype)
    values = torch.randn(batch, heads, tokens, value_dim, generator=gen).to(dtype)
    scores = torch.randint(0, 4, (batch, heads, tokens), generator=gen).float() / 4
    evicted = torch.rand(batch, heads, tokens, generator=gen) < 0.7
    pos = torch.rand(batch, heads, tokens, generator=gen).argsort(-1) if positions else None
    num_slots = torch.randint(0, slots + 1, (batch, heads), generator=gen)
    num_slots.view(-1)[0] = slots  # some head uses every slot
    usable = torch.arange(slots) < num_slots[..., None]
    counts = torch.randint(0, 3, (batch, heads, slots), generator=gen) * usable
    held = Merged(torch.randn(batch, heads, slots, dim, generator=gen).to(dtype) * usable[..., None],
                  torch.randn(batch, heads, slots, value_dim, generator=gen).to(dtype) * usable[..., None],
                  counts)
    return keys, values, scores, evicted, pos, held, num_slots


cases = dict(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 2), heads=st.integers(1, 3),
             tokens=st.integers(0, 12), slots=st.integers(0, 4), dim=st.sampled_from([2, 3, 8]),
             value_dim=st.sampled_from([3, 8]), dtype=st.sampled_from([torch.float32, torch.float16]),
             positions=st.booleans())


def check(impl, **case):
    keys, values, scores, evicted, pos, held, num_slots = merge_case(**case)
    expected = merge_evicted(POLICY, keys, values, scores, evicted, held, num_slots, pos)
    ordered_k, ordered_v, num = km.merge_order(keys, values, scores, evicted, pos)
    inputs = on_triton(impl, held.keys, held.values, held.counts, ordered_k, ordered_v, num, num_slots)
    got = tuple(x.cpu() for x in km.residual_merge(*inputs, impl=impl))
    assert got[0].dtype == keys.dtype and got[2].dtype == torch.long
    for mine, ref in zip(got, (expected.keys, expected.values, expected.counts)):
        assert_close(mine, ref, rtol=0, atol=0)  # the same fp32 ops, rounded as stored: bitwise
    merged_tokens = (got[2] - held.counts).sum(-1)
    assert torch.equal(merged_tokens, torch.where(num_slots > 0, num, 0))  # counts sum to merged tokens


@settings(max_examples=40, deadline=None)
@given(**cases)
def test_triton_matches_merge_evicted(**case):
    check("triton", **case)


@settings(max_examples=60, deadline=None)
@given(**cases)
def test_torch_lowering_matches_merge_evicted(**case):
    check("torch", **case)


@pytest.mark.skipif(not cpp_supports(torch.device("cpu"), torch.float32, 16), reason="no C++ toolchain")
@settings(max_examples=60, deadline=None)
@given(**{**cases, "dtype": st.just(torch.float32), "dim": st.sampled_from([2, 3, 8, 64])})
def test_cpp_matches_merge_evicted(**case):
    check("cpp", **case)


def test_cpp_is_fp32_only():
    keys = torch.randn(1, 1, 3, 8, dtype=torch.float16)
    slots = torch.zeros(1, 1, 2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="merge: impl 'cpp' needs fp32 CPU tensors"):
        km.residual_merge(slots, slots, torch.zeros(1, 1, 2, dtype=torch.long), keys, keys, impl="cpp")


@pytest.mark.slow
def test_compiled_step_matches_merge_evicted_in_one_graph():
    """Bitwise equal to the reference, and one Inductor graph for every number of evicted
    tokens (the blocks' strides) and every call mode (below ADInplaceOrView, as the first run
    of an AOTAutograd graph calls the op)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    case = dict(batch=2, heads=3, slots=4, dim=8, value_dim=8, dtype=torch.float32, positions=True)
    check("compiled", seed=1, tokens=40, **case)
    check("compiled", seed=2, tokens=57, **case)
    with torch._C._AutoDispatchBelowADInplaceOrView():
        check("compiled", seed=3, tokens=33, **case)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_equal_dot_products_pick_the_lowest_slot(impl):
    """Every token is the same key: after the slots fill, all dots tie, so slot 0 takes all."""
    key = torch.tensor([1.0, -2.0, 0.5])
    keys = key.expand(1, 1, 7, 3).clone()
    values = torch.arange(7.0).view(1, 1, 7, 1).expand(1, 1, 7, 3).clone()
    empty = torch.zeros(1, 1, 3, 3), torch.zeros(1, 1, 3, 3), torch.zeros(1, 1, 3, dtype=torch.long)
    out = km.residual_merge(*on_triton(impl, *empty, keys, values), impl=impl)
    slot_k, slot_v, counts = (x.cpu() for x in out)
    assert counts.tolist() == [[[5, 1, 1]]]
    assert_close(slot_k, key.expand(1, 1, 3, 3))
    assert_close(slot_v[0, 0, :, 0], torch.tensor([(0 + 3 + 4 + 5 + 6) / 5, 1.0, 2.0]))


def test_merge_order_puts_evicted_first_by_score_then_position():
    keys = torch.arange(5.0).view(1, 1, 5, 1)
    scores = torch.tensor([[[0.2, 0.1, 0.2, 0.0, 0.1]]])
    evicted = torch.tensor([[[True, True, True, False, True]]])
    positions = torch.tensor([[[4, 3, 2, 1, 0]]])
    ordered, _, num = km.merge_order(keys, keys, scores, evicted, positions)
    assert num.tolist() == [[4]]
    assert ordered[0, 0, :4, 0].tolist() == [4.0, 1.0, 2.0, 0.0]
