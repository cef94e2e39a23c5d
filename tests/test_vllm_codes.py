"""Quantized storage (int8, int4) in the vLLM plugin's packed region (kvcompile/integrations/vllm/codes.py, no vLLM
needed): an entry's bytes decode to exactly what kvcompile stores of it (kvcompile.reference.stored); a
request's packed codes take ⌈E_l·B / slot⌉ slots per layer; and the decode attention of requests stored so
equals kvcompile.reference.decode_attention over the stored (quantized, then dequantized) kept entries and decode
entries, the decode entries written by vLLM in full precision and replaced in the step's attention. Every slot no
request keeps holds NaN, so a read of a wrong slot fails the test."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import kvcompile
from kvcompile.integrations.vllm.codes import Codes, slot_bytes
from kvcompile.integrations.vllm.packed_attention import (DecodePlan, PackedCpp, PackedLayer, PackedTorch, Record,
                                                         choose, key_view, read_positions, value_view)
from kvcompile.integrations.vllm.packing import layer_slots, locations, region
from kvcompile.reference import stored
from test_vllm_packed_attention import kept_request, reference_attention


def storage(bits: int, group: int):
    return kvcompile.load_spec({"name": "q", "scoring": "key_norm", "ranking": "by_score",
                                "budget": {"per_head": 8}, "storage": {f"int{bits}": {"group": group}}}).storage


@pytest.mark.parametrize("bits, group, d, entry", [(8, 0, 64, 144), (4, 0, 64, 80), (8, 32, 64, 160),
                                                   (4, 16, 16, 32)])
def test_an_entry_decodes_to_what_kvcompile_stores(bits, group, d, entry):
    part = storage(bits, group)
    codes = Codes.of(part, d)
    assert codes.entry_bytes == entry
    keys, values = torch.randn(11, d) * 3, torch.randn(11, d)
    data = codes.encode(keys, values)
    assert data.shape == (11, entry) and data.dtype == torch.uint8
    got_k, got_v = codes.decode(data)
    assert torch.equal(got_k, stored(part, keys)) and torch.equal(got_v, stored(part, values))
    assert torch.equal(codes.stored(keys), stored(part, keys))


def test_tiered_and_full_precision_storage_have_no_entry_format():
    assert Codes.of(kvcompile.load_spec("snapkv").storage, 64) is None
    with pytest.raises(ValueError, match="two tiers"):
        Codes.of(kvcompile.load_spec("kivi").storage, 64)


def test_codes_take_fewer_slots():
    """snapkv_int4's 64 entries per head of 30 layers × 3 KV heads, head dim 64 in float32 slots of 512 bytes: 80
    bytes an entry, so 10 of the 64 slots a full-precision request keeps."""
    counts = torch.full((30, 3), 64)
    codes = Codes.of(kvcompile.load_spec("snapkv_int4").storage, 64)
    room = slot_bytes(torch.zeros(1, 3, 32, 128))
    assert room == 512 and layer_slots(counts, codes, room) == [30] * 30
    assert region(counts) == 64 and region(counts, codes, room) == 10


@st.composite
def steps(draw):
    return dict(layers=draw(st.integers(1, 3)), heads=draw(st.integers(1, 3)), groups=draw(st.sampled_from([1, 3])),
                head_dim=draw(st.sampled_from([16, 64])), block_size=draw(st.sampled_from([8, 16, 32])),
                bits=draw(st.sampled_from([8, 4])), group=draw(st.sampled_from([0, 8, 16])),
                torch_backend=draw(st.booleans()),  # False: the chosen one (torch for groups of 8)
                requests=[(draw(st.integers(1, 70)), draw(st.integers(1, 6)), draw(st.integers(1, 2)))
                          for _ in range(draw(st.integers(1, 3)))],  # (prompt N, decode entries, query rows T)
                seed=draw(st.integers(0, 2 ** 16)), threads=draw(st.sampled_from([1, 2])))


@settings(max_examples=40, deadline=None)
@given(steps())
def test_decode_attention_over_codes_equals_the_reference_over_what_is_stored(step):
    assert_attends_what_is_stored(step)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [0, 16])
def test_the_kernel_attends_codes_of_ragged_requests_and_gqa_groups(bits, group):
    """The kernel over int8 and int4 codes, one scale an entry or per 16 channels: three requests of ragged prompts
    and budgets (random per head, some heads keeping nothing), two and one query rows, 3 query heads per KV head,
    two threads."""
    assert_attends_what_is_stored(dict(layers=3, heads=2, groups=3, head_dim=64, block_size=16, bits=bits,
                                       group=group, requests=[(70, 3, 2), (23, 1, 1), (41, 6, 1)], seed=bits + group,
                                       threads=2, torch_backend=False))


def assert_attends_what_is_stored(step):
    g = torch.Generator().manual_seed(step["seed"])
    layers, heads, groups, d, bs = (step[k] for k in ("layers", "heads", "groups", "head_dim", "block_size"))
    part = storage(step["bits"], step["group"])
    codes = Codes.of(part, d)
    backend = PackedTorch() if step["torch_backend"] else choose(groups, d, torch.float32, codes)
    if not step["torch_backend"]:  # the kernel loads 16 channels per scale
        assert isinstance(backend, PackedCpp if codes.group % 16 == 0 else PackedTorch)
    pool = sum(-(-(n + new) // bs) for n, new, _ in step["requests"]) + 3
    caches = {j: torch.full((pool, heads, bs, 2 * d), float("nan")) for j in range(layers)}
    room = slot_bytes(caches[0])
    free = torch.randperm(pool, generator=g).tolist()
    rows, truth, tokens = [], [], 1  # row 0 of the step belongs to a request that is not compressed
    table = torch.zeros(len(step["requests"]) + 1, pool, dtype=torch.int32)
    for i, (n, new, t) in enumerate(step["requests"]):
        seq = n + new
        block_row = torch.tensor([free.pop() for _ in range(-(-seq // bs))])
        table[i + 1, :len(block_row)] = block_row
        keys, values, counts, kept = kept_request(g, n, seq, layers, heads, d)
        size = region(counts, codes, room)
        where = locations(counts, n, block_row, bs, codes, room)
        assert all(w.shape[1] == s for w, s in zip(where, layer_slots(counts, codes, room)))
        packed = [PackedLayer(where[j], counts[j], codes) for j in range(layers)]
        for j in range(layers):  # what compression writes: each layer's kept entries as codes
            head, position = torch.repeat_interleave(torch.arange(heads), counts[j]), torch.cat(kept[j])
            packed[j].write(caches, keys[j, head, position], values[j, head, position])
        first = seq - t
        for j in range(layers):  # decode entries at N, N + 1, …, as vLLM writes them (full precision); the
            for p in range(n, seq):  # earlier steps' were stored by their step, this step's are as written
                k, v = keys[j, :, p], values[j, :, p]
                key_view(caches[j])[block_row[p // bs], :, :, p % bs] = k if p >= first else stored(part, k)
                value_view(caches[j])[block_row[p // bs], :, p % bs] = v if p >= first else stored(part, v)
        record = Record(n, size, packed)
        assert record.codes == codes and record.first_slot == n - size
        rows.append((i + 1, record, tokens, t, first))
        truth.append((keys, values, kept, n, first, t, tokens))
        tokens += t
    qkv = torch.randn(tokens, (heads * groups + 2 * heads) * d, generator=g)
    query = qkv[:, :heads * groups * d].view(tokens, heads * groups, d)
    scale = d ** -0.5
    plan = DecodePlan.plan(rows, table, heads, groups, d, backend)
    addresses = torch.tensor([caches[j].data_ptr() for j in range(layers)])
    for layer in range(layers):
        want = torch.full((tokens, heads * groups, d), -7.0)
        for keys, values, kept, n, first, t, q0 in truth:
            for r in range(t):
                p = first + r
                ks = [stored(part, torch.cat([keys[layer, h, kept[layer][h]], keys[layer, h, n:p + 1]]))
                      for h in range(heads)]
                vs = [stored(part, torch.cat([values[layer, h, kept[layer][h]], values[layer, h, n:p + 1]]))
                      for h in range(heads)]
                want[q0 + r] = reference_attention(query[q0 + r], ks, vs, scale)
        got = torch.full_like(want, -7.0)
        plan.run(layer, query, got, caches, addresses, scale, threads=step["threads"])
        torch.testing.assert_close(got, want)  # row 0 (another request) untouched
        for (keys, values, _, n, first, t, _), (i, *_) in zip(truth, rows):  # the step's new tokens: now x̂, exactly
            new = slice(max(first, n), first + t)
            new_keys, new_values = read_positions(caches[layer], table[i].long(), new.start, new.stop)
            assert torch.equal(new_keys, stored(part, keys[layer, :, new]))
            assert torch.equal(new_values, stored(part, values[layer, :, new]))
