"""GPU-only tests (issue 15): marked `gpu` (pyproject's markers), so `pytest -m gpu` selects them, and
skipped, saying so, where no CUDA device is present.

They were written on a machine without a GPU and first run on one in a later session
(`bash scripts/gpu_session.sh tests`, docs/INTERNALS.md "Running on a GPU"): until a GPU run is
recorded in benchmarks/RESULTS.md, none of them has passed anywhere.

- The Triton kernels for real (conftest.py turns Triton's interpreter on only without CUDA) at the
  sizes of an 8B GQA model (8 KV heads, 4 query heads each, head dim 128, a few thousand tokens),
  in bf16 and fp16, against the torch lowerings on the same GPU tensors (and the selection against
  the reference on the CPU). Both sides compute in fp32 from the same inputs, so the tolerances are
  the output dtype's rounding, not the input's.
- The compiled entry on CUDA gives the eager entry's tokens and kept entries, and so does mode="reduce-overhead"
  (its decode steps replayed from a CUDA graph: kvcompile.graphs).
- flash-attn's prefill path, where flash_attn imports.
"""
import dataclasses

import pytest
import torch
from torch.testing import assert_close

import kvcompile
from kvcompile import reference
from kvcompile.store import Entries, LayerStore
from kvcompile.kernels import merge as km
from kvcompile.kernels import select as ks
from kvcompile.kernels.paged_attention import paged_attention
from kvcompile.kernels.window_scores import window_scores
from kvcompile.selection import select_with
from kvcompile.spec import load_spec
from tiny import left_pad, prompt, tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (real Triton, flash-attn, the compiled entry on CUDA); "
                                        "run on one with scripts/gpu_session.sh tests")]

CUDA = torch.device("cuda")
B, H, G, D, PAGE = 2, 8, 4, 128, 16  # an 8B GQA layer: 8 KV heads × 4 query heads, head dim 128
TOLERANCE = {torch.bfloat16: dict(rtol=1.6e-2, atol=1e-3), torch.float16: dict(rtol=2e-3, atol=1e-4)}
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def randn(*shape, dtype=torch.float32, gen):
    return torch.randn(*shape, generator=gen).to(dtype).to(CUDA)


def left_padded_mask(n: int, pads: tuple[int, ...]) -> torch.Tensor:
    """(len(pads), n) bool, True = real token: sequence i starts after pads[i] pad tokens."""
    return (torch.arange(n)[None, :] >= torch.tensor(pads)[:, None]).to(CUDA)


# --------------------------------------------------------------------------- decode attention

@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "merge-bias"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_triton_matches_the_torch_lowering(dtype, bias):
    """Ragged heads of 0 to 4096 entries (an empty head, a full one), each head's pages scattered over
    the pool with a spare page, block-table entries past a head's pages -1 (never read), int64 tables
    and lengths as the cache keeps them; with ZSMerge's bias (α·log w ≥ 0, −inf for an empty slot)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 4096, (B, H), generator=gen)
    lengths[0, 0], lengths[1, -1] = 0, 4096
    owned = (lengths + PAGE - 1) // PAGE + 1
    width = int(owned.max())
    pool = int(owned.sum()) + 7
    order = torch.randperm(pool, generator=gen)
    table = torch.full((B, H, width), -1, dtype=torch.long)
    start = 0
    for b in range(B):
        for h in range(H):
            table[b, h, :owned[b, h]] = order[start:start + owned[b, h]]
            start += int(owned[b, h])
    k_pages, v_pages = randn(pool, PAGE, D, dtype=dtype, gen=gen), randn(pool, PAGE, D, dtype=dtype, gen=gen)
    q = randn(B, H * G, D, dtype=dtype, gen=gen)
    bias_pages = None
    if bias:
        bias_pages = torch.rand(pool, PAGE, generator=gen) * 2
        bias_pages[torch.rand(pool, PAGE, generator=gen) < 0.1] = float("-inf")
        bias_pages = bias_pages.to(CUDA)
    args = (q, k_pages, v_pages, table.to(CUDA), lengths.to(CUDA), bias_pages, D ** -0.5)
    out = paged_attention(*args, impl="triton")
    expected = paged_attention(*args, impl="torch")
    assert out.dtype == dtype and out.shape == (B, H * G, D)
    assert torch.isfinite(out).all()
    assert_close(out, expected, **TOLERANCE[dtype])
    assert not out.view(B, H, G, D)[0, 0].any()  # the empty head gives zeros


# ----------------------------------------------------------------------------- window scores

@pytest.mark.parametrize("spec", ["snapkv", "adakv", "lava"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_scores_triton_matches_the_torch_lowering(dtype, spec):
    """The shipped specs' scorers (window 32; avg pool 5 / max pool 7; LAVa's value norm and max
    over the group) over 3,000 keys, one sequence left-padded by 700 tokens; R = 40 queries."""
    gen = torch.Generator().manual_seed(1)
    n = 3000
    fused = load_spec(spec).scoring.fused_window()
    queries = 2 * randn(B, H * G, 40, D, dtype=dtype, gen=gen)
    keys, values = 2 * randn(B, H, n, D, dtype=dtype, gen=gen), randn(B, H, n, D, dtype=dtype, gen=gen)
    mask = left_padded_mask(n, (0, 700))
    got = window_scores(queries, keys, values, mask, None, **fused, impl="triton")
    expected = window_scores(queries, keys, values, mask, None, **fused, impl="torch")
    assert got.dtype == torch.float32 and got.shape == (B, H, n)
    assert torch.isneginf(got[1, :, :700]).all() and torch.isfinite(got[mask[:, None].expand(B, H, n)]).all()
    assert_close(got, expected, rtol=1e-3, atol=1e-7)


# ------------------------------------------------------------------------ selection and gather

@pytest.mark.parametrize("spec", ["snapkv", "adakv", "lava", "zsmerge", "dbudgetkv"])
def test_selection_and_gather_triton_equal_the_torch_lowering_and_the_reference(spec):
    """3,000 candidates per head, 8 heads, one sequence left-padded; 128 per head (pooled for adakv and
    lava; dbudgetkv's threshold sets its own): the kept mask equals the torch lowering's and the
    reference's (on the CPU) exactly, and the gather into pages is a bitwise copy."""
    gen = torch.Generator().manual_seed(2)
    n = 3000
    policy = load_spec(spec) if spec == "dbudgetkv" else load_spec(spec, per_head=128)
    mask = torch.arange(n)[None, :] >= torch.tensor([0, 700])[:, None]
    positions = (mask.long().cumsum(-1) - 1)[:, None, :].expand(B, H, n).contiguous()
    valid = mask[:, None, :].expand(B, H, n).contiguous()
    scores = torch.rand(B, H, n, generator=gen).pow(4).masked_fill(~valid, float("-inf"))
    lengths = mask.sum(-1)
    total = None if policy.budget.threshold is not None else torch.full((B,), 128 * H)
    cpu = (scores, positions, valid, lengths, total)
    gpu = tuple(None if x is None else x.to(CUDA) for x in cpu)
    got = select_with(ks.backend("triton"), policy, *gpu, 2)
    assert torch.equal(got, select_with(ks.backend("torch", cuda=True), policy, *gpu, 2))
    assert torch.equal(got.cpu(), reference.select(policy, *cpu, 2))
    assert 0 < int(got.sum()) < int(valid.sum())  # the budget really cut
    k, v = randn(B, H, n, D, dtype=torch.bfloat16, gen=gen), randn(B, H, n, D, dtype=torch.bfloat16, gen=gen)
    rows = Entries(k, v, gpu[0], gpu[1], torch.ones(B, H, n, device=CUDA), got)
    slots = torch.zeros(B, H, dtype=torch.long, device=CUDA)
    pages = LayerStore.build([rows], slots, PAGE, 4, gather=ks.backend("triton").gather_pages)
    expected = LayerStore.build([rows], slots, PAGE, 4, gather=ks.backend("torch", cuda=True).gather_pages)
    for field in dataclasses.fields(pages):
        mine, ref = getattr(pages, field.name), getattr(expected, field.name)
        assert torch.equal(mine, ref) if isinstance(mine, torch.Tensor) else mine == ref, field.name


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_merge_triton_matches_the_torch_lowering(dtype):
    """ZSMerge's prompt merge at its shipped split (12 residual slots of 128), ~900 evicted tokens per
    head, head dim 128. The slot a token joins is the argmax of fp32 dot products, so a near-tie that
    the two sides round apart would show as different counts: examine such a failure before calling
    it a bug (the CPU tests compare bitwise; Triton on a GPU may contract multiply-adds into FMAs)."""
    gen = torch.Generator().manual_seed(3)
    n, slots = 1000, 12
    keys, values = randn(1, H, n, D, dtype=dtype, gen=gen), randn(1, H, n, D, dtype=dtype, gen=gen)
    scores = torch.rand(1, H, n, generator=gen).to(CUDA)
    evicted = (torch.rand(1, H, n, generator=gen) < 0.9).to(CUDA)
    ordered_k, ordered_v, num = km.merge_order(keys, values, scores, evicted)
    empty = (torch.zeros(1, H, slots, D, dtype=dtype, device=CUDA), torch.zeros(1, H, slots, D, dtype=dtype,
                                                                                device=CUDA),
             torch.zeros(1, H, slots, dtype=torch.long, device=CUDA))
    got = km.residual_merge(*empty, ordered_k, ordered_v, num, impl="triton")
    expected = km.residual_merge(*empty, ordered_k, ordered_v, num, impl="torch")
    assert torch.equal(got[2], expected[2])  # the same slot for every token
    assert torch.equal(got[2].sum(-1), num)  # counts sum to the merged tokens
    for mine, ref in zip(got[:2], expected[:2]):
        assert mine.dtype == dtype
        assert_close(mine, ref, **TOLERANCE[dtype])


# ------------------------------------------------------------------------- the two entries

@pytest.mark.parametrize("spec", ["snapkv", "lava", "zsmerge"])
def test_compiled_entry_generates_the_eager_tokens_on_cuda(spec):
    """A tiny random Llama (fp32) on CUDA, a left-padded batch of two: the plan takes the Triton
    kernels, and the compiled entry (Inductor's Triton around the kvcompile op) generates the eager
    entry's tokens and keeps the same entries (snapkv: plain; lava: the cascade; zsmerge: merging and
    online eviction while decoding)."""
    model = tiny_model("llama", layers=3).to(CUDA)
    ids, mask = left_pad([prompt(220, seed=1)[0], prompt(150, seed=2)[0]])
    ids, mask = ids.to(CUDA), mask.to(CUDA)
    runs = {}
    for mode in ("eager", "compiled"):
        with kvcompile.compiled(model, spec, per_head=48, mode=mode):
            plan = model.kvcompile_plan
            assert plan.decode_impl == "triton" and plan.select_impl == "triton", plan.describe()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12,
                                     do_sample=False, return_dict_in_generate=True)
        report = out.past_key_values.memory_report()
        assert out.past_key_values.stores[0].k_pages.is_cuda
        runs[mode] = out.sequences[:, ids.shape[1]:].cpu(), report["kept"].cpu()
    assert torch.equal(runs["compiled"][0], runs["eager"][0])
    assert torch.equal(runs["compiled"][1], runs["eager"][1])


@pytest.mark.parametrize("spec", ["snapkv", "h2o", "zsmerge"])
def test_reduce_overhead_replays_decode_steps_and_generates_the_eager_tokens_on_cuda(spec):
    """mode="reduce-overhead" (kvcompile.graphs): the compiled entry with its decode steps replayed from a CUDA
    graph generates the eager entry's tokens and keeps the same entries; after the first step and the warm-up
    one, a step is recorded and the rest replay, but the plan's named exceptions (Plan.host_syncs), which run
    as without graphs and are counted (tests/test_decode_graph.py proves the replay on the CPU)."""
    model = tiny_model("llama", layers=3).to(CUDA)
    ids, mask = left_pad([prompt(220, seed=1)[0], prompt(150, seed=2)[0]])
    ids, mask = ids.to(CUDA), mask.to(CUDA)
    new = 24
    runs = {}
    for mode in ("eager", "reduce-overhead"):
        with kvcompile.compiled(model, spec, per_head=96, mode=mode):  # h2o protects a window of 64
            graphs = model.forward.graphs
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                     do_sample=False, return_dict_in_generate=True)
        cache = out.past_key_values
        runs[mode] = out.sequences[:, ids.shape[1]:].cpu(), cache.memory_report()["kept"].cpu()
    assert torch.equal(runs["reduce-overhead"][0], runs["eager"][0])
    assert torch.equal(runs["reduce-overhead"][1], runs["eager"][1])
    assert graphs.captures >= 1 and graphs.replays >= 1, (graphs.captures, graphs.replays, graphs.eager)
    named = sum(n for reason, n in graphs.eager.items() if reason in cache.plan.host_syncs)
    assert graphs.replays + graphs.captures + graphs.eager["warm-up"] + named + 1 == new - 1, graphs.eager
    if not cache.plan.host_syncs:
        assert (graphs.captures, graphs.replays) == (1, new - 4), graphs.eager


# ----------------------------------------------------------------------------- flash-attn

def test_flash_attn_prefill_path(monkeypatch):
    """Where flash_attn imports: an unpadded bf16 prompt's attention goes through it, equal to SDPA at
    an 8B layer's shapes, and generate() on a bf16 model on CUDA takes that path in every layer."""
    pytest.importorskip("flash_attn", reason="flash-attn is not installed here (optional: pip install kvcompile[flash])")
    from kvcompile.engine import prefill

    calls = []
    flash = prefill._flash_attn()
    assert flash is not None

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return flash(*args, **kwargs)

    monkeypatch.setattr(prefill, "_flash_attn", lambda: counting)
    gen = torch.Generator().manual_seed(4)
    q = randn(1, H * G, 2048, D, dtype=torch.bfloat16, gen=gen)
    k, v = randn(1, H, 2048, D, dtype=torch.bfloat16, gen=gen), randn(1, H, 2048, D, dtype=torch.bfloat16, gen=gen)
    out = prefill.prompt_attention(q, k, v, None, D ** -0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert len(calls) == 1
    assert_close(out, expected, **TOLERANCE[torch.bfloat16])

    calls.clear()
    model = tiny_model("llama", layers=2).to(CUDA, torch.bfloat16)
    ids = prompt(300).to(CUDA)
    with kvcompile.compiled(model, "snapkv", per_head=48):
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert len(calls) == 2  # the prompt, once per layer
