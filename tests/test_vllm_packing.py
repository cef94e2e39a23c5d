"""kvcompile.integrations.vllm.packing (no vLLM needed): a compressed request's kept entries packed into its last S slots
across heads and layers. Every entry gets one location, no location holds two, all lie in [N − S, N); the
gather order and the padded heads give back each head's entries; and the selection is kvcompile's reference
selection (LAVa's cascade, AdaKV's pooled heads, DBudgetKV's threshold) read from scores alone."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from kvcompile.integrations.vllm.packing import assign, kept_entries, padded, region, slots


@st.composite
def layouts(draw):
    layers, heads = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    n = draw(st.integers(1, 40))
    counts = torch.tensor(draw(st.lists(st.integers(0, n), min_size=layers * heads, max_size=layers * heads)))
    return counts.view(layers, heads), n, draw(st.sampled_from([1, 2, 4, 16]))


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_every_entry_one_location_inside_the_region(layout):
    counts, n, block_size = layout
    layers, heads = counts.shape
    size = region(counts)
    total = int(counts.sum())
    assert size <= n and size * layers * heads >= total  # room for every entry
    assert total == 0 or (size - 1) * layers * heads < total  # and no slot more
    blocks_per_request = -(-n // block_size)
    block_row = torch.randperm(100)[:blocks_per_request]  # any block ids
    seen = set()
    for layer, groups in enumerate(assign(counts)):
        covered = 0
        for g in groups:
            assert g.start == covered  # runs follow the layer's (head, position) order
            covered += len(g.locations)
            assert bool((g.locations >= 0).all()) and bool((g.locations < size * heads).all())
            blocks, columns, offsets = slots(g.locations, n, size, heads, block_row, block_size)
            position = n - size + g.locations % size
            assert torch.equal(columns, g.locations // size) and bool((columns < heads).all())
            assert bool((position >= n - size).all()) and bool((position < n).all())
            assert torch.equal(blocks, block_row[position // block_size])
            for t, b, c, o in zip([g.tensor] * len(blocks), blocks.tolist(), columns.tolist(), offsets.tolist()):
                assert (t, b, c, o) not in seen
                seen.add((t, b, c, o))
        assert covered == int(counts[layer].sum())
        # a layer stores in its own tensor first
        assert not groups or groups[0].tensor == layer or int(counts[layer].sum()) == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=6))
def test_padded_heads_index_their_own_entries(per_head):
    counts = torch.tensor(per_head)
    order = torch.cat([torch.full((k,), h) for h, k in enumerate(per_head)]) if sum(per_head) else torch.zeros(0)
    index, valid = padded(counts)
    assert index.shape == valid.shape == (len(per_head), max(per_head))
    assert torch.equal(valid.sum(-1), counts)
    assert index.numel() == 0 or 0 <= int(index.min()) <= int(index.max()) <= max(sum(per_head) - 1, 0)  # gatherable
    for h in range(len(per_head)):
        got = index[h][valid[h]]
        assert torch.equal(order[got], torch.full((per_head[h],), h, dtype=order.dtype))
        assert torch.equal(got, torch.arange(int(counts[:h].sum()), int(counts[:h + 1].sum())))


def test_head_wise_budgets_hold_the_slots_of_a_uniform_one():
    """AdaKV-like unequal heads and PyramidKV-like unequal layers of the same total need the same slots."""
    uniform = torch.full((4, 3), 16)
    skewed = torch.tensor([[40, 4, 4], [30, 10, 8], [20, 20, 16], [16, 16, 8]])
    assert skewed.sum() == uniform.sum()
    assert region(skewed) == region(uniform) == 16
    assert int(skewed.max()) == 40  # right-aligned per head it would hold 40 slots


def test_selection_is_the_reference_from_scores():
    """kept_entries = kvcompile.reference.compress on full layer states, for a cascade, pooled heads, a
    threshold and int4 storage (their selection reads only the scores), and refuses a merging policy."""
    import kvcompile
    from kvcompile.layer_state import LayerState
    from kvcompile.reference import compress

    g = torch.Generator().manual_seed(0)
    layers, heads, n, d = 4, 2, 160, 8
    states = [LayerState(torch.randn(1, heads, 32, d, generator=g), torch.randn(1, heads, n, d, generator=g),
                         torch.randn(1, heads, n, d, generator=g)) for _ in range(layers)]
    for spec in ("lava", "adakv", "pyramid_pooled", "dbudgetkv", "snapkv", "snapkv_global", "snapkv_int4"):
        policy = kvcompile.load_spec(spec) if spec == "dbudgetkv" else kvcompile.load_spec(spec, per_head=40)
        want = compress(policy, states)
        got = kept_entries(policy, want.scores)
        for a, b in zip(got, want.kept):
            assert torch.equal(a, b), spec
    try:
        kept_entries(kvcompile.load_spec("zsmerge"), want.scores)
    except ValueError as exc:
        assert "merges" in str(exc)
    else:
        raise AssertionError("a merging policy was not refused")


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3), st.integers(20, 90), st.integers(4, 30), st.integers(0, 2 ** 16))
def test_counted_cascade_is_the_literal_cascade(layers, heads, n, per_head, seed):
    """LAVa's cascade as the engine counts it (the lazy cascade: one selection per layer) keeps exactly the entries of the reference's literal
    cascade (every lower layer re-selected after each layer), for skewed score distributions."""
    import kvcompile
    from kvcompile.layer_state import LayerState
    from kvcompile.reference import compress

    g = torch.Generator().manual_seed(seed)
    policy = kvcompile.load_spec("lava", per_head=per_head, ranking={"by_score": {"sinks": 1, "window": 3}})
    # layers of very different entropies: some nearly uniform, some peaked
    scores = [torch.rand(1, heads, n, generator=g) ** float(torch.randint(1, 12, (1,), generator=g))
              for _ in range(layers)]
    shape = (1, heads, n, 0)
    want = compress(policy, [LayerState(None, torch.empty(shape), torch.empty(shape)) for _ in scores],
                    scores=scores).kept
    for got, kept in zip(kept_entries(policy, scores), want):
        assert torch.equal(got, kept)
