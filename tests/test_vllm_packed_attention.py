"""kvcompile.integrations.vllm.packed_attention (no vLLM needed): the decode attention of compressed requests over their
packed entries in vLLM's CPU cache layout. Both backends, the C++ kernel (one call per layer for all requests; float32,
head dims that are multiples of 16) and torch (any dtype and head dim), equal kvcompile.reference.decode_attention over
what each head keeps plus its decode entries, for random budgets, block sizes, GQA groups, block tables, head dims and
float32 or bfloat16 caches; everything the cache holds that no request keeps is NaN, so reading a wrong slot cannot
go unnoticed. The backend is chosen once per model: C++ where it runs, else torch."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvcompile.kernels.paged_attention_cpp import supports
from kvcompile.reference import decode_attention as attend
from kvcompile.integrations.vllm.codes import Codes
from kvcompile.integrations.vllm.packed_attention import (DecodePlan, PackedCpp, PackedLayer, PackedTorch, Record,
                                                         choose, cpp_refusal, key_view, value_view)
from kvcompile.integrations.vllm.packing import locations, region


def kept_request(g, n, seq, layers, heads, d):
    """A request's random keys and values (layers, heads, seq, d) and what each (layer, head) of its n-token prompt
    keeps: counts (layers, heads), some heads keeping nothing, and the kept positions, sorted."""
    keys = torch.randn(layers, heads, seq, d, generator=g)
    values = torch.randn(layers, heads, seq, d, generator=g)
    counts = torch.randint(0, n + 1, (layers, heads), generator=g)
    counts[torch.rand(layers, heads, generator=g) < 0.2] = 0  # heads keeping nothing happen
    kept = [[torch.randperm(n, generator=g)[:int(counts[j, h])].sort().values for h in range(heads)]
            for j in range(layers)]
    return keys, values, counts, kept


def reference_attention(q, keys, values, scale):
    """kvcompile.reference.decode_attention of one query row q (Hq, d) over each KV head's keys and values, given per
    head as lists of (n_h, d) (padded to one width, lengths masking the padding)."""
    lengths = torch.tensor([[len(k) for k in keys]])
    width = int(lengths.max())

    def pad(xs):
        return torch.stack([torch.cat([x, x.new_zeros(width - len(x), x.shape[-1])]) for x in xs])[None]

    return attend(q[None, :, None], pad(keys), pad(values), lengths=lengths, scale=scale)[0, :, 0]


@st.composite
def steps(draw):
    return dict(layers=draw(st.integers(1, 4)), heads=draw(st.integers(1, 3)), groups=draw(st.sampled_from([1, 3])),
                head_dim=draw(st.sampled_from([8, 16, 64])), block_size=draw(st.sampled_from([8, 16, 32])),
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
                torch_backend=draw(st.booleans()),  # False: the chosen one
                requests=[(draw(st.integers(1, 70)), draw(st.integers(1, 6)), draw(st.integers(1, 2)))
                          for _ in range(draw(st.integers(1, 3)))],  # (prompt N, decode entries, query rows T)
                seed=draw(st.integers(0, 2 ** 16)), threads=draw(st.sampled_from([1, 2])))


@settings(max_examples=60, deadline=None)
@given(steps())
def test_packed_decode_attention_equals_the_reference_over_what_is_kept(step):
    g = torch.Generator().manual_seed(step["seed"])
    layers, heads, groups, d, bs = (step[k] for k in ("layers", "heads", "groups", "head_dim", "block_size"))
    dtype = step["dtype"]
    backend = PackedTorch() if step["torch_backend"] else choose(groups, d, dtype, None)
    if not step["torch_backend"]:  # the kernel runs here (CI's toolchain has g++) for float32 and d = 16, 64
        assert supports(torch.device("cpu"), torch.float32, 16)
        assert isinstance(backend, PackedCpp if dtype == torch.float32 and d % 16 == 0 else PackedTorch)
    pool = sum(-(-(n + new) // bs) for n, new, _ in step["requests"]) + 3
    caches = {j: torch.full((pool, heads, bs, 2 * d), float("nan"), dtype=dtype) for j in range(layers)}
    free = torch.randperm(pool, generator=g).tolist()
    rows, truth, tokens = [], [], 1  # row 0 of the step belongs to a request that is not compressed
    table = torch.zeros(len(step["requests"]) + 1, pool, dtype=torch.int32)  # vLLM's block table
    for i, (n, new, t) in enumerate(step["requests"]):
        seq = n + new
        block_row = torch.tensor([free.pop() for _ in range(-(-seq // bs))])
        table[i + 1, :len(block_row)] = block_row
        keys, values, counts, kept = kept_request(g, n, seq, layers, heads, d)
        keys, values = keys.to(dtype), values.to(dtype)  # what the cache holds
        where = locations(counts, n, block_row, bs)
        packed = [PackedLayer(where[j], counts[j]) for j in range(layers)]
        for j in range(layers):  # what compression writes: each layer's kept entries at their packed places
            head, position = torch.repeat_interleave(torch.arange(heads), counts[j]), torch.cat(kept[j])
            packed[j].write(caches, keys[j, head, position], values[j, head, position])
        for j in range(layers):  # decode entries at N, N + 1, … in their own layer and column, as vLLM writes
            for p in range(n, seq):
                key_view(caches[j])[block_row[p // bs], :, :, p % bs] = keys[j, :, p]
                value_view(caches[j])[block_row[p // bs], :, p % bs] = values[j, :, p]
        record = Record(n, region(counts), packed)
        first = seq - t
        rows.append((i + 1, record, tokens, t, first))
        truth.append((keys, values, kept, n, first, t, tokens))
        tokens += t
    qkv = torch.randn(tokens, (heads * groups + 2 * heads) * d, generator=g)
    qkv = qkv.to(dtype)
    query = qkv[:, :heads * groups * d].view(tokens, heads * groups, d)  # strided like vLLM's qkv split
    scale = d ** -0.5
    plan = DecodePlan.plan(rows, table, heads, groups, d, backend)
    addresses = torch.tensor([caches[j].data_ptr() for j in range(layers)])
    for layer in range(layers):
        want = torch.full((tokens, heads * groups, d), -7.0, dtype=dtype)
        for keys, values, kept, n, first, t, q0 in truth:
            for r in range(t):
                p = first + r
                ks = [torch.cat([keys[layer, h, kept[layer][h]], keys[layer, h, n:p + 1]]) for h in range(heads)]
                vs = [torch.cat([values[layer, h, kept[layer][h]], values[layer, h, n:p + 1]]) for h in range(heads)]
                want[q0 + r] = reference_attention(query[q0 + r], ks, vs, scale)
        got = torch.full_like(want, -7.0)
        plan.run(layer, query, got, caches, addresses, scale, threads=step["threads"])
        # both compute in float32 (the reference too), so bfloat16 outputs differ by rounding: assert_close's
        # bfloat16 tolerance (rtol 1.6e-2)
        torch.testing.assert_close(got, want)  # row 0 (another request) untouched


@pytest.mark.parametrize("dtype, d, cpp", [(torch.float32, 64, True), (torch.float32, 16, True),
                                           (torch.bfloat16, 64, False), (torch.float16, 64, False),
                                           (torch.float32, 8, False), (torch.float32, 40, False)])
def test_the_backend_is_the_kernel_where_it_runs_else_torch(dtype, d, cpp):
    backend = choose(2, d, dtype, None)
    assert isinstance(backend, PackedCpp if cpp else PackedTorch)
    assert backend.needs_addresses == cpp
    why = cpp_refusal(d, dtype, None)
    assert (why is None) == cpp
    if dtype != torch.float32:
        assert why == f"the model runs in {dtype}, and the decode kernel reads float32 caches"
    elif not cpp:
        assert why == f"the decode kernel takes head dims that are multiples of 16, not {d}"


def test_codes_in_groups_the_kernel_cannot_load_take_torch():
    """Codes with one scale per 8 channels: kvcompile stores them, the kernel loads 16 channels per scale."""
    grouped = Codes(8, 8, 64)
    assert cpp_refusal(64, torch.float32, grouped) == ("the decode kernel dequantizes 16 channels with one scale: "
                                                       "groups of codes must be multiples of 16 channels, not 8")
    assert isinstance(choose(1, 64, torch.float32, grouped), PackedTorch)
    assert isinstance(choose(1, 64, torch.float32, Codes(8, 16, 64)), PackedCpp)
