"""paged_attention (Triton under the interpreter, torch lowering eager and compiled)
against kvcompile.reference.decode_attention on the gathered cache."""
import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.testing import assert_close

from kvcompile.kernels import paged_attention as pa
from kvcompile.reference import decode_attention as attend
from tiny import on_triton


def paged_case(seed, batch, heads, group, dim, page, pages, dtype, bias):
    """A random paged cache: each head owns `pages` pages drawn from a permuted pool
    (plus spare pages), ragged lengths (0 … pages·page, 0 and full included), a bias
    with some −inf entries, NaN in
    every slot no head uses and -1 in block-table entries past a head's last page."""
    gen = torch.Generator().manual_seed(seed)
    pool = batch * heads * pages + 3
    k_pages = torch.randn(pool, page, dim, generator=gen).to(dtype)
    v_pages = torch.randn(pool, page, dim, generator=gen).to(dtype)
    bias_pages = None
    if bias:  # α·log w ≥ 0, and −inf for an empty merge slot (Residual.bias)
        bias_pages = torch.rand(pool, page, generator=gen) * 2
        bias_pages[torch.rand(pool, page, generator=gen) < 0.2] = float("-inf")
    table = torch.randperm(pool, generator=gen)[: batch * heads * pages].view(batch, heads, pages)
    lengths = torch.randint(0, pages * page + 1, (batch, heads), generator=gen)
    lengths.view(-1)[0] = 0  # an empty head
    lengths.view(-1)[-1] = pages * page  # a full head
    q = torch.randn(batch, heads * group, dim, generator=gen).to(dtype)

    # Ground truth input: the gathered cache, taken before the unused slots are poisoned.
    def gather(x):
        return x[table].flatten(2, 3)

    expected = attend(q[:, :, None], gather(k_pages), gather(v_pages),
                      None if bias_pages is None else gather(bias_pages), lengths)[:, :, 0]

    used = torch.zeros(pool, page, dtype=torch.bool)
    for b in range(batch):
        for h in range(heads):
            n = int(lengths[b, h])
            rows = torch.arange(n)
            used[table[b, h, rows // page], rows % page] = True
            table[b, h, -(-n // page):] = -1
    for x in (k_pages, v_pages) + ((bias_pages,) if bias else ()):
        x[~used] = float("nan")
    args = (q, k_pages, v_pages, table.to(torch.int32), lengths.to(torch.int32), bias_pages)
    return args, expected


shapes = dict(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 2), heads=st.integers(1, 3),
              group=st.sampled_from([1, 2, 3]), dim=st.sampled_from([4, 6, 16]),
              page=st.sampled_from([1, 2, 4]), pages=st.integers(1, 4),
              dtype=st.sampled_from([torch.float32, torch.float16]), bias=st.booleans())


@settings(max_examples=30, deadline=None)
@given(**shapes)
def test_triton_matches_reference(seed, batch, heads, group, dim, page, pages, dtype, bias):
    args, expected = paged_case(seed, batch, heads, group, dim, page, pages, dtype, bias)
    # Small blocks and chunks so one head spans several steps and several chunks.
    (args,) = on_triton("triton", args)  # on the GPU where there is one (real Triton)
    out = pa.paged_attention_triton(*args, block_n=2, chunk_tokens=4)
    assert out.dtype == dtype
    assert_close(out.cpu(), expected)


@settings(max_examples=60, deadline=None)
@given(**shapes, chunk=st.sampled_from([1, 2, 4, 1024]))
def test_torch_lowering_matches_reference(seed, batch, heads, group, dim, page, pages, dtype,
                                          bias, chunk):
    args, expected = paged_case(seed, batch, heads, group, dim, page, pages, dtype, bias)
    assert_close(pa.paged_attention(*args, impl="torch"), expected)  # the eager path (not the CPU default for fp32)
    scale = dim ** -0.5
    # The compiled path's math, run eagerly, at several chunk sizes.
    assert_close(pa._fused(*args, scale, chunk=chunk), expected)


@pytest.mark.slow
def test_compiled_torch_lowering_matches_reference_without_recompiling():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # other tests' graphs
    compiled = functools.partial(pa.paged_attention, impl="compiled")
    # Page counts that equal no other size (dynamo's duck sizing would add a guard); one
    # page (a size of 1, which dynamo specialises); 70 pages of 4 outgrow a 256-entry chunk.
    for seed, pages in enumerate([3, 5, 1, 7, 70]):
        args, expected = paged_case(seed, 2, 2, 3, 16, 4, pages, torch.float32, bias=True)
        if seed == 0:  # as the first run of an AOTAutograd graph calls the op: keys excluded
            with torch._C._AutoDispatchBelowADInplaceOrView():
                assert_close(compiled(*args), expected)
        assert_close(compiled(*args), expected)
        with torch.inference_mode():  # inference tensors
            args, expected = paged_case(seed, 2, 2, 3, 16, 4, pages, torch.float32, bias=True)
            assert_close(compiled(*args), expected)
    # Growing caches reuse one graph (dynamic shapes): one frame compiled, no recompiles.
    stats = torch._dynamo.utils.counters["stats"]
    assert stats["unique_graphs"] == 1, dict(stats)
    # Heads outgrowing one 4096-entry chunk (one thread) take a second graph, once.
    for seed, pages in enumerate([1100, 1500]):
        args, expected = paged_case(seed, 1, 2, 3, 16, 4, pages, torch.float32, bias=True)
        assert_close(compiled(*args), expected)
    assert stats["unique_graphs"] == 2, dict(stats)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [False, True])
def test_compiled_variant_follows_the_work(monkeypatch, parallel):
    """Below PARALLEL_WORK the one-thread variant runs (no OpenMP region: on a shared
    machine each region's join can wait a time slice), above it Inductor's parallel loops
    over 256-entry chunks (70 pages of 4 entries: two chunks); both equal the reference."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(pa, "PARALLEL_WORK", 0 if parallel else 2**62)
    args, expected = paged_case(1, 1, 2, 3, 16, 4, 70, torch.float32, bias=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            out, code = run_and_get_code(pa.paged_attention, *args, impl="compiled")
    finally:
        torch.set_num_threads(threads)
    assert_close(out, expected)
    assert ("#pragma omp parallel" in "".join(code)) == parallel


def test_scale_is_used():
    args, _ = paged_case(0, 1, 2, 2, 8, 4, 2, torch.float32, bias=False)
    for impl in ("torch", "triton"):
        q, k, v, table, lengths, _ = on_triton(impl, *args)
        out = pa.paged_attention(q, k, v, table, lengths, None, 0.3, impl=impl)
        assert_close(out, pa.paged_attention(2 * q, k, v, table, lengths, None, 0.15, impl=impl))
        assert not torch.allclose(out, pa.paged_attention(q, k, v, table, lengths, impl=impl))


def test_bad_shapes_raise():
    args, _ = paged_case(0, 1, 2, 2, 8, 4, 2, torch.float32, bias=False)
    q, k, v, table, lengths, _ = args
    with pytest.raises(ValueError, match="lengths"):
        pa.paged_attention(q, k, v, table, lengths[:, :1])
    with pytest.raises(ValueError, match="bias_pages"):
        pa.paged_attention(q, k, v, table, lengths, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="impl"):
        pa.paged_attention(q, k, v, table, lengths, impl="cuda")


cpp_shapes = dict(shapes, dim=st.sampled_from([16, 64]), group=st.sampled_from([1, 3]),
                  dtype=st.just(torch.float32),  # (group, dim) pairs: one C++ build each
                  page=st.sampled_from([1, 2, 4, 16]))


@settings(max_examples=60, deadline=None)
@given(**cpp_shapes, threads=st.sampled_from([1, 2]), chunk=st.sampled_from([None, 1, 4, 16]))
def test_cpp_kernel_matches_reference(seed, batch, heads, group, dim, page, pages, dtype, bias,
                                      threads, chunk):
    args, expected = paged_case(seed, batch, heads, group, dim, page, pages, dtype, bias)
    # chunk: entries per work item, so one head spans several items (their partials combined)
    # and a work item starts or ends inside a page.
    assert_close(pa.paged_attention_cpp(*args, threads=threads, chunk=chunk), expected)
    assert_close(pa.paged_attention(*args), expected)  # the CPU default for fp32


def test_cpu_default_is_the_cpp_kernel_for_fp32_only(monkeypatch):
    args, expected = paged_case(0, 1, 2, 2, 16, 4, 3, torch.float32, True)
    calls = []
    monkeypatch.setattr(pa, "paged_attention_cpp", lambda *a, **k: calls.append(1) or expected)
    pa.paged_attention(*args)
    assert calls == [1]
    half, expected_half = paged_case(0, 1, 2, 2, 16, 4, 3, torch.float16, True)
    assert_close(pa.paged_attention(*half), expected_half)  # fp16: the torch lowering
    assert calls == [1]
