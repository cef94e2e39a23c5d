"""Quantized KV pages (kvcompile/kernels/quantize.py) and decode attention over them
(kvcompile/kernels/paged_attention_quant.py): the quantizer against its written-out formula
(exact), its error bound and int4 packing; the eager reference against kvcompile.reference.decode_attention
on the gathered dequantized cache; the C++ kernel and the Triton kernel (under the interpreter,
or on the GPU where there is one) against the reference. The Triton kernel's compile for sm_80 and
sm_90 without a spill is tests/test_triton_targets.py's (kvcompile.kernels.targets lists its launches)."""
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.testing import assert_close

from kvcompile.kernels import paged_attention_quant as pq
from kvcompile.kernels import quantize as qz
from kvcompile.reference import decode_attention as attend
from tiny import on_triton


# --------------------------------------------------------------------------- the quantizer

def formula(x: torch.Tensor, bits: int):
    """The module docstring's formula for one group x (1-D), written out: (codes, scale, zero)."""
    x = x.float()
    zero = x.min()
    scale = (x.max() - x.min()) / (2 ** bits - 1)
    if scale == 0:
        scale = torch.tensor(1.0)
    codes = torch.clamp(torch.round((x - zero) / scale), 0, 2 ** bits - 1).to(torch.uint8)
    return codes, scale, zero


def groups_of(pages: torch.Tensor, group: int | None, axis: str):
    """Every group of pages (P, S, d) with its index: (p, s, g) per token, (p, c) per channel."""
    p, s, d = pages.shape
    if axis == "channel":
        for i in range(p):
            for c in range(d):
                yield (i, c), pages[i, :, c], (i, slice(None), c)
    else:
        group = group or d
        for i in range(p):
            for t in range(s):
                for g in range(d // group):
                    yield (i, t, g), pages[i, t, g * group:(g + 1) * group], (i, t, slice(g * group, (g + 1) * group))


def random_pages(seed, p, s, d, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(p, s, d, generator=gen) * torch.rand(p, 1, 1, generator=gen) * 4
    x[0, 0] = 1.5  # a constant token (every per-token group constant)
    x[-1, :, 0] = -2.0  # a constant channel
    return x.to(dtype)


quant_shapes = dict(seed=st.integers(0, 2**31 - 1), p=st.integers(1, 3), s=st.sampled_from([1, 2, 4, 16]),
                    d=st.sampled_from([2, 4, 8, 16, 32]), bits=st.sampled_from([4, 8]),
                    axis=st.sampled_from(["token", "channel"]), groups=st.integers(0, 3),
                    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))


def pick_group(d, axis, groups):
    """None for per channel, else a divisor of d (groups = how many times d is halved, at most)."""
    if axis == "channel":
        return None
    group = d
    for _ in range(groups):
        if group % 2 == 0:
            group //= 2
    return group


@settings(max_examples=40, deadline=None)
@given(**quant_shapes)
def test_quantize_is_the_written_formula(seed, p, s, d, bits, axis, groups, dtype):
    x = random_pages(seed, p, s, d, dtype)
    group = pick_group(d, axis, groups)
    q = qz.quantize(x, bits, group, axis)
    codes = qz.unpack_int4(q.codes) if bits == 4 else q.codes
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (p, s, d * bits // 8)
    assert q.scale.dtype == q.zero.dtype == torch.float32
    assert q.scale.shape == ((p, d) if axis == "channel" else (p, s, d // group))
    for at, xg, where in groups_of(x, group, axis):
        want_codes, want_scale, want_zero = formula(xg, bits)
        assert torch.equal(codes[where], want_codes), (at, codes[where], want_codes)
        assert torch.equal(q.scale[at], want_scale) and torch.equal(q.zero[at], want_zero), at
    # dequantize = code · scale + zero, written out per group
    deq = qz.dequantize(*q, bits, axis)
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    for at, _, where in groups_of(x, group, axis):
        assert torch.equal(deq[where], codes[where].float() * q.scale[at] + q.zero[at]), at


@settings(max_examples=40, deadline=None)
@given(**quant_shapes)
def test_round_trip_error_is_at_most_half_a_step(seed, p, s, d, bits, axis, groups, dtype):
    x = random_pages(seed, p, s, d, dtype).float()
    group = pick_group(d, axis, groups)
    q = qz.quantize(x, bits, group, axis)
    deq = qz.dequantize(*q, bits, axis)
    if axis == "channel":
        step = q.scale[:, None, :].expand_as(x)
    else:
        step = q.scale.repeat_interleave(group, dim=-1)
    # round to nearest: |x − x̂| ≤ scale / 2, up to fp32 rounding of (x − zero) / scale and of x̂
    slack = 4 * torch.finfo(torch.float32).eps * (x.abs() + step * (2 ** bits))
    assert ((x - deq).abs() <= step / 2 + slack).all()
    # a constant group comes back exactly (scale 1, codes 0)
    assert torch.equal(deq[0, 0], x[0, 0]) if axis == "token" else torch.equal(deq[-1, :, 0], x[-1, :, 0])


@pytest.mark.parametrize("bits", [4, 8])
def test_round_trip_error_is_that_of_the_bit_width(bits):
    """On a page of 16 x 64 normal values the worst error is close to half a step, not far below
    it (the codes use the whole range), and a quarter of a step on average."""
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(0))
    q = qz.quantize(x, bits, 32)
    err = (x - qz.dequantize(*q, bits)).abs() / q.scale.repeat_interleave(32, dim=-1)
    assert 0.45 < err.max() <= 0.5 + 1e-4  # in steps
    assert 0.2 < err.mean() < 0.3  # uniform rounding error: a quarter of a step on average


def test_rounding_is_half_to_even_and_clamped():
    x = torch.tensor([[[0.0, 2.5, 3.5, 255.0]]])  # scale (255 − 0) / 255 = 1: codes are x exactly
    q = qz.quantize(x, 8)
    assert torch.equal(q.codes, torch.tensor([[[0, 2, 4, 255]]], dtype=torch.uint8))
    assert torch.equal(q.scale, torch.ones(1, 1, 1)) and torch.equal(q.zero, torch.zeros(1, 1, 1))
    x4 = torch.tensor([[[0.0, 0.5, 1.5, 15.0]]])  # 4 bits: scale 1, 0.5 -> 0 and 1.5 -> 2
    assert torch.equal(qz.unpack_int4(qz.quantize(x4, 4).codes), torch.tensor([[[0, 0, 2, 15]]], dtype=torch.uint8))


def test_int4_packing_is_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = qz.pack_int4(codes)
    assert torch.equal(packed, torch.tensor([[0x21, 0x43, 0x0F]], dtype=torch.uint8))
    assert torch.equal(qz.unpack_int4(packed), codes)
    every = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(qz.pack_int4(qz.unpack_int4(every)), every)  # each byte, both ways


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_into_pages_writes_one_entry_per_head(bits):
    gen = torch.Generator().manual_seed(0)
    p, s, d, group = 5, 4, 16, 8
    codes = torch.randint(0, 256, (p, s, d * bits // 8), dtype=torch.uint8, generator=gen)
    scale, zero = torch.rand(p, s, d // group, generator=gen), torch.rand(p, s, d // group, generator=gen)
    before = codes.clone(), scale.clone(), zero.clone()
    x = torch.randn(2, 3, d, generator=gen)  # (B, H, d): one new entry per head
    page = torch.tensor([[0, 3, 1], [4, 2, 0]])
    slot = torch.tensor([[1, 0, 3], [2, 2, 0]])
    qz.quantize_into_pages(x, codes, scale, zero, page, slot, bits)
    want = qz.quantize(x[..., None, :], bits, group)
    assert torch.equal(codes[page, slot], want.codes[..., 0, :])
    assert torch.equal(scale[page, slot], want.scale[..., 0, :]) and torch.equal(zero[page, slot], want.zero[..., 0, :])
    untouched = torch.ones(p, s, dtype=torch.bool)
    untouched[page, slot] = False
    for now, then in zip((codes, scale, zero), before):
        assert torch.equal(now[untouched], then[untouched])


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_quantize_pages_into_writes_whole_pages(axis):
    gen = torch.Generator().manual_seed(1)
    p, s, d, bits = 6, 4, 8, 4
    x = torch.randn(2, s, d, generator=gen)  # two full residual pages (KIVI: quantized once full)
    codes = torch.zeros(p, s, d // 2, dtype=torch.uint8)
    shape = (p, d) if axis == "channel" else (p, s, 2)
    scale, zero = torch.zeros(shape), torch.zeros(shape)
    page = torch.tensor([4, 1])
    qz.quantize_pages_into(x, codes, scale, zero, page, bits, axis)
    want = qz.quantize(x, bits, None if axis == "channel" else d // 2, axis)
    assert torch.equal(codes[page], want.codes) and torch.equal(scale[page], want.scale)
    assert torch.equal(zero[page], want.zero)
    others = torch.tensor([0, 2, 3, 5])
    assert not codes[others].any() and not scale[others].any() and not zero[others].any()


def test_quantizer_errors_name_the_reason():
    x = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match="bits must be one of"):
        qz.quantize(x, 2)
    with pytest.raises(ValueError, match="axis must be one of"):
        qz.quantize(x, 8, axis="head")
    with pytest.raises(ValueError, match="positive divisor of d = 8"):
        qz.quantize(x, 8, group=3)
    with pytest.raises(ValueError, match="group must be None"):
        qz.quantize(x, 8, group=4, axis="channel")
    with pytest.raises(ValueError, match="d must be even"):
        qz.quantize(torch.randn(2, 4, 5), 4)
    with pytest.raises(ValueError, match="float pages"):
        qz.quantize(torch.ones(2, 4, 8, dtype=torch.long), 8)
    q = qz.quantize(x, 8, 4)
    with pytest.raises(ValueError, match="per-token scale must be"):
        qz.dequantize(q.codes, q.scale[..., :1].expand(2, 4, 3).contiguous(), q.zero[..., :1].expand(2, 4, 3).contiguous(), 8)
    with pytest.raises(ValueError, match="codes must be uint8"):
        qz.dequantize(q.codes.long(), q.scale, q.zero, 8)
    with pytest.raises(ValueError, match="float32"):
        qz.dequantize(q.codes, q.scale.half(), q.zero, 8)
    with pytest.raises(ValueError, match="per-channel scale must be"):
        qz.dequantize(q.codes, q.scale, q.zero, 8, "channel")
    with pytest.raises(ValueError, match="leading shape"):
        qz.quantize_into_pages(torch.randn(3, 8), *q, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), 8)


# ------------------------------------------------------------------- quantized paged caches

def quant_case(seed, batch, heads, group, dim, page, pages, bits, key_group, value_group, bias):
    """A random paged cache, quantized: each head owns `pages` pages of a permuted pool (plus spare
    pages), ragged lengths (0 and full included), a bias with −inf entries. Keys per channel when
    key_group is None. Returns (args, expected): expected = reference.decode_attention on the gathered
    dequantized cache, taken before every slot no head uses is poisoned (NaN scales, zeros and bias
    per token, NaN per-channel scales of unused pages, random codes, −1 past each head's last page)."""
    gen = torch.Generator().manual_seed(seed)
    pool = batch * heads * pages + 3
    k_float = torch.randn(pool, page, dim, generator=gen) * 2 + torch.randn(dim, generator=gen)  # offset channels
    v_float = torch.randn(pool, page, dim, generator=gen)
    k_axis = "channel" if key_group is None else "token"
    kq = qz.quantize(k_float, bits, key_group, k_axis)
    vq = qz.quantize(v_float, bits, value_group)
    bias_pages = None
    if bias:
        bias_pages = torch.rand(pool, page, generator=gen) * 2
        bias_pages[torch.rand(pool, page, generator=gen) < 0.2] = float("-inf")
    table = torch.randperm(pool, generator=gen)[: batch * heads * pages].view(batch, heads, pages)
    lengths = torch.randint(0, pages * page + 1, (batch, heads), generator=gen)
    lengths.view(-1)[0] = 0
    lengths.view(-1)[-1] = pages * page
    q = torch.randn(batch, heads * group, dim, generator=gen)
    k_deq, v_deq = qz.dequantize(*kq, bits, k_axis), qz.dequantize(*vq, bits)

    def gather(x):
        return x[table].flatten(2, 3)

    expected = attend(q[:, :, None], gather(k_deq), gather(v_deq),
                      None if bias_pages is None else gather(bias_pages), lengths)[:, :, 0]
    used = torch.zeros(pool, page, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            n = int(lengths[b, h])
            rows = torch.arange(n)
            used[table[b, h, rows // page], rows % page] = True
            table[b, h, -(-n // page):] = -1
    noise = torch.randint(0, 256, kq.codes.shape, dtype=torch.uint8, generator=gen)
    for codes in (kq.codes, vq.codes):
        codes[~used] = noise[~used]
    for x in ((vq.scale, vq.zero) + ((kq.scale, kq.zero) if k_axis == "token" else ())):
        x[~used] = float("nan")
    if k_axis == "channel":
        unused_pages = ~used.any(1)
        kq.scale[unused_pages] = float("nan")
        kq.zero[unused_pages] = float("nan")
    if bias:
        bias_pages[~used] = float("nan")
    args = (q, *kq, *vq, table.to(torch.int32), lengths.to(torch.int32), bias_pages)
    return args, expected


shapes = dict(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 2), heads=st.integers(1, 3),
              page=st.sampled_from([1, 2, 4]), pages=st.integers(1, 4), bits=st.sampled_from([4, 8]),
              bias=st.booleans())
# (G, d, key group (None: per channel), value group): any group dividing d
layouts = st.sampled_from([(1, 4, None, 2), (2, 6, 3, 6), (3, 8, 8, 4), (2, 16, None, 16), (3, 12, 4, 12)])


@settings(max_examples=40, deadline=None)
@given(**shapes, layout=layouts)
def test_reference_dequantizes_then_attends(seed, batch, heads, page, pages, bits, bias, layout):
    group, dim, key_group, value_group = layout
    args, expected = quant_case(seed, batch, heads, group, dim, page, pages, bits, key_group, value_group, bias)
    assert_close(pq.paged_attention_quant_torch(*args), expected)
    assert_close(pq.TorchQuantPagedAttention()(*args), expected)


@settings(max_examples=15, deadline=None)
@given(**shapes, layout=layouts)
def test_triton_matches_reference(seed, batch, heads, page, pages, bits, bias, layout):
    group, dim, key_group, value_group = layout
    args, expected = quant_case(seed, batch, heads, group, dim, page, pages, bits, key_group, value_group, bias)
    reference, lse = pq.paged_attention_quant_torch(*args, return_lse=True)
    targs = on_triton("triton", *args)
    # Small chunks, so that one head spans several programs whose partials the reduce combines.
    out, got_lse = pq.paged_attention_quant_triton(*targs, return_lse=True, block_n=2, chunk_tokens=4)
    assert out.dtype == torch.float32
    assert_close(out.cpu(), reference)
    assert_close(out.cpu(), expected)
    assert_close(got_lse.cpu(), lse)


# The C++ kernel's layouts: head dim and groups multiples of 16; each is one build (keys per
# channel, per token in one group, per token in several groups).
cpp_layouts = st.sampled_from([(1, 16, None, 16), (3, 64, 64, 32), (2, 32, 16, 32), (3, 64, None, 64)])


@settings(max_examples=60, deadline=None)
@given(**dict(shapes, page=st.sampled_from([1, 2, 4, 8, 16])), layout=cpp_layouts,
       threads=st.sampled_from([1, 2]), chunk=st.sampled_from([None, 1, 4, 16]))
def test_cpp_matches_reference(seed, batch, heads, page, pages, bits, bias, layout, threads, chunk):
    group, dim, key_group, value_group = layout
    args, expected = quant_case(seed, batch, heads, group, dim, page, pages, bits, key_group, value_group, bias)
    reference, lse = pq.paged_attention_quant_torch(*args, return_lse=True)
    # chunk: entries per work item, so that a head spans several items and an item starts or ends in a page
    out, got_lse = pq.paged_attention_quant_cpp(*args, return_lse=True, threads=threads, chunk=chunk)
    assert_close(out, reference)
    assert_close(out, expected)
    assert_close(got_lse, lse)
    assert_close(pq.CppQuantPagedAttention()(*args), reference)  # the default split of the work


@settings(max_examples=20, deadline=None)
@given(**dict(shapes, page=st.sampled_from([1, 4, 16])), threads=st.sampled_from([1, 2]))
def test_cpp_portable_code_paths_match_reference(seed, batch, heads, page, pages, bits, bias, threads):
    """The C++ kernel's paths for CPUs without AVX2 (ARM: at::vec and plain loops for the codes and
    the logit sums), built here with the x86 ISA macro undefined (KVCOMPILE_PORTABLE)."""
    kernel = pq.load_cpp(pq._ARGTYPES, "paged_attention.cpp", G=3, D=64, GK=0, GV=32,
                         AHEAD=pq.PREFETCH_AHEAD, PORTABLE=1)
    args, expected = quant_case(seed, batch, heads, 3, 64, page, pages, bits, None, 32, bias)
    with mock.patch.object(pq, "_kernel", lambda *layout: kernel):
        assert_close(pq.paged_attention_quant_cpp(*args, threads=threads, chunk=4), expected)


def test_lse_merges_a_full_precision_residual():
    """KIVI's residual: the quantized full pages and a float residual page per head, attended
    separately and merged by their log-sum-exp, equal attention over all of a head's entries."""
    args, _ = quant_case(3, 2, 2, 3, 16, 4, 3, 8, None, 16, False)
    q, kc, ks, kz, vc, vs, vz, table, lengths, _ = args
    gen = torch.Generator().manual_seed(4)
    k_res, v_res = torch.randn(2, 2, 4, 16, generator=gen), torch.randn(2, 2, 4, 16, generator=gen)
    n_res = torch.tensor([[3, 0], [1, 4]])
    n_res[0, 0] = 3
    out_q, lse_q = pq.paged_attention_quant_cpp(*args, return_lse=True)
    out_r, lse_r = pq.dense_attention_lse(q, k_res, v_res, n_res)
    merged = pq.merge_partials(out_q, lse_q, out_r, lse_r)
    # ground truth: the dequantized entries and the residual concatenated per head
    k_deq, v_deq = qz.dequantize(kc, ks, kz, 8, "channel"), qz.dequantize(vc, vs, vz, 8)
    m = table.shape[-1] * 4
    keys = torch.zeros(2, 2, m + 4, 16)
    values = torch.zeros(2, 2, m + 4, 16)
    for b in range(2):
        for h in range(2):
            n = int(lengths[b, h])
            rows = torch.arange(n)
            pages, slots = table[b, h, rows // 4].long(), rows % 4
            r = int(n_res[b, h])
            keys[b, h, : n + r] = torch.cat([k_deq[pages, slots], k_res[b, h, :r]])
            values[b, h, : n + r] = torch.cat([v_deq[pages, slots], v_res[b, h, :r]])
    expected = attend(q[:, :, None], keys, values, None, lengths.long() + n_res)[:, :, 0]
    assert_close(merged, expected)
    # an empty part has weight 0; both empty give zeros
    assert_close(pq.merge_partials(out_q, lse_q, torch.zeros_like(out_q), torch.full_like(lse_q, float("-inf"))), out_q)
    none = torch.full_like(lse_q, float("-inf"))
    assert not pq.merge_partials(out_q, none, out_r, none).any()


def test_scale_is_used():
    args, _ = quant_case(0, 1, 2, 2, 16, 4, 2, 8, 16, 16, False)
    q, rest = args[0], args[1:]
    for fn in (pq.paged_attention_quant_torch, pq.paged_attention_quant_cpp):
        out = fn(q, *rest[:-1], None, 0.3)
        assert_close(out, fn(2 * q, *rest[:-1], None, 0.15))
        assert not torch.allclose(out, fn(q, *rest))


def test_backends_agree_and_describe_themselves():
    args, expected = quant_case(5, 1, 2, 3, 64, 16, 3, 4, None, 32, True)
    for name in ("cpp", "torch", "triton"):
        backend = pq.backend(name)
        assert backend.name == name and isinstance(backend, pq.QuantPagedAttention)
        assert backend.describe().startswith(name)
        call_args = on_triton(name, *args)
        assert_close(backend(*call_args).cpu(), expected)
    with pytest.raises(ValueError, match="unknown impl"):
        pq.backend("compiled")
    built = pq.CppQuantPagedAttention(key_group=0, value_group=32)
    built.build(3, 64)  # the layout it names, ahead of the first call


def test_bad_calls_raise_with_the_reason():
    args, _ = quant_case(0, 1, 2, 2, 16, 4, 2, 8, 16, 16, True)
    q, kc, ks, kz, vc, vs, vz, table, lengths, bias = args
    with pytest.raises(ValueError, match="do not match"):
        pq.paged_attention_quant_torch(q, kc, ks, kz, vc, vs, vz, table, lengths[:, :1])
    with pytest.raises(ValueError, match="bias_pages"):
        pq.paged_attention_quant_cpp(q, kc, ks, kz, vc, vs, vz, table, lengths, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="codes of 12 bytes"):
        pq.paged_attention_quant_torch(q, kc[..., :12], ks, kz, vc[..., :12], vs, vz, table, lengths)
    with pytest.raises(ValueError, match="uint8"):
        pq.paged_attention_quant_torch(q, kc.to(torch.int8), ks, kz, vc, vs, vz, table, lengths)
    with pytest.raises(ValueError, match="k_scale"):
        pq.paged_attention_quant_torch(q, kc, ks[:, 0], kz[:, 0], vc, vs, vz, table, lengths)
    with pytest.raises(ValueError, match="values are quantized per token"):
        pq.paged_attention_quant_torch(q, kc, ks, kz, vc, vs[:, 0, :1].expand(-1, 16).contiguous(),
                                       vz[:, 0, :1].expand(-1, 16).contiguous(), table, lengths)
    with pytest.raises(ValueError, match="must be float32"):
        pq.paged_attention_quant_torch(q, kc, ks.double(), kz, vc, vs, vz, table, lengths)
    with pytest.raises(ValueError, match="block_table must be int32 or int64"):
        pq.paged_attention_quant_torch(q, kc, ks, kz, vc, vs, vz, table.float(), lengths)
    # the C++ kernel: groups of 16 channels or more, fp32 queries
    q8, k8 = qz.quantize(torch.randn(5, 4, 16), 8, 8), qz.quantize(torch.randn(5, 4, 16), 8, 8)
    table8, lengths8 = torch.zeros(1, 1, 2, dtype=torch.long), torch.ones(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"multiples of 16.*groups \(8, 8\)"):
        pq.paged_attention_quant_cpp(torch.randn(1, 1, 16), *q8, *k8, table8, lengths8)
    with pytest.raises(ValueError, match="torch.float16"):
        pq.paged_attention_quant_cpp(q.half(), kc, ks, kz, vc, vs, vz, table, lengths)


