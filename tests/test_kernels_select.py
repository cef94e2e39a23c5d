"""Selection kernels (Triton under the interpreter, torch lowering) against
kvcompile.reference.select, and the page store built through the gather kernels against the page layout
written out (kvcompile.store)."""
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.testing import assert_close

from kvcompile import reference
from kvcompile.store import Entries, LayerStore
from kvcompile.kernels import select as ks
from kvcompile.policies.ranking import rank
from kvcompile.selection import select_with
from kvcompile.spec import load_spec
from tiny import on_triton

def kernel_select(policy, scores, *args, impl=None, **kwargs):
    """`reference.select` with its cuts made by the selection backend of `impl` (selection.select_with)."""
    return select_with(ks.backend_for(impl, scores), policy, scores, *args, **kwargs)


SMALL_WINDOW = {"by_score": {"sinks": 1, "window": 2}}
POLICIES = {  # real specs, with windows small enough that the budget matters at N ≤ 12
    "snapkv": load_spec("snapkv", ranking=SMALL_WINDOW),  # heads: uniform
    "streamingllm": load_spec("streamingllm", ranking={"by_position": {"sinks": 2}}),  # uniform, by position
    "adakv": load_spec("adakv", ranking=SMALL_WINDOW),  # pooled, floor 0.2
    "adakv_floor_1": load_spec("adakv", budget={"heads": {"pooled": {"floor": 1.0}}}, ranking=SMALL_WINDOW),
    "lava": load_spec("lava", ranking={"by_score": {"window": 1}}),  # pooled, no floor
    "pyramid_pooled": load_spec("pyramid_pooled", ranking={"by_score": {"window": 0}}),
    "zsmerge": load_spec("zsmerge"),  # uniform with the split's proximity protected, residual slots
    "dbudgetkv": load_spec("dbudgetkv", budget={"threshold": {"attention_norm": {"t": 0.1}}}),
    "dbudgetkv_t0": load_spec("dbudgetkv", budget={"threshold": {"attention_norm": {"t": 0.0}}}),
    "dbudget_lava": load_spec("dbudget_lava", ranking=SMALL_WINDOW,
                              budget={"threshold": {"attention_norm": {"t": 0.3, "keep_layers": 1}}}),
}


@st.composite
def layers(draw):
    """One layer's candidates: a left-padded batch (B ≤ 2, H ≤ 3, N ≤ 12), scores with ties
    (small integers), distinct, or all equal, in fp32 or fp16 (−inf at pads); optionally a
    compressed candidate set (holes, as the cascade re-selects); totals from 0 to more than
    the prompt; a layer index (the threshold keeps its first layers whole)."""
    b, h, n = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, n + 1, (b,), generator=gen)
    mask = torch.arange(n) >= (n - lengths)[:, None]
    positions = (mask.long().cumsum(-1) - 1)[:, None, :].expand(b, h, n)
    valid = mask[:, None, :].expand(b, h, n)
    if draw(st.booleans()):  # a compressed set: some real tokens are no longer candidates
        valid = valid & (torch.rand(b, h, n, generator=gen) < 0.7)
    kind = draw(st.sampled_from(["ties", "distinct", "equal"]))
    scores = {"ties": torch.randint(0, 4, (b, h, n), generator=gen).float() / 4,
              "distinct": torch.rand(b, h, n, generator=gen),
              "equal": torch.ones(b, h, n)}[kind]
    scores = scores.to(draw(st.sampled_from([torch.float32, torch.float16])))
    scores = scores.masked_fill(~valid, float("-inf"))
    total = torch.randint(0, h * n + 4, (b,), generator=gen)
    used = torch.randint(0, 3, (b, h), generator=gen) if draw(st.booleans()) else None
    return scores, positions, valid, lengths, total, draw(st.integers(0, 3)), used


def check_select(impl, name, layer_case):
    policy = POLICIES[name]
    scores, positions, valid, lengths, total, layer, used = layer_case
    if policy.budget.threshold is not None:
        total = None
    used = used if policy.merges else None
    expected = reference.select(policy, scores, positions, valid, lengths, total, layer, used_slots=used)
    inputs = on_triton(impl, scores, positions, valid, lengths, total)
    got = kernel_select(policy, *inputs, layer, used_slots=on_triton(impl, used)[0], impl=impl).cpu()
    assert got.dtype == torch.bool
    assert torch.equal(got, expected)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(POLICIES)), layer_case=layers())
def test_triton_select_matches_reference(name, layer_case):
    check_select("triton", name, layer_case)


@settings(max_examples=120, deadline=None)
@given(name=st.sampled_from(sorted(POLICIES)), layer_case=layers())
def test_torch_select_matches_reference(name, layer_case):
    check_select("torch", name, layer_case)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("name", ["snapkv", "adakv", "lava", "zsmerge", "dbudgetkv"])
def test_select_at_a_longer_prompt(impl, name):
    """N = 300 (several Triton blocks per head for the gather; bisection over 900 ranks),
    B = 2 with padding, float scores."""
    gen = torch.Generator().manual_seed(7)
    b, h, n = 2, 3, 300
    mask = torch.arange(n) >= torch.tensor([0, 37])[:, None]
    positions = (mask.long().cumsum(-1) - 1)[:, None, :].expand(b, h, n)
    valid = mask[:, None, :].expand(b, h, n)
    scores = torch.rand(b, h, n, generator=gen).pow(4).masked_fill(~valid, float("-inf"))
    lengths = mask.sum(-1)
    policy = POLICIES[name] if name != "dbudgetkv" else load_spec("dbudgetkv")
    total = None if policy.budget.threshold is not None else torch.tensor([100, 400])
    expected = reference.select(policy, scores, positions, valid, lengths, total, 2)
    got = kernel_select(policy, *on_triton(impl, scores, positions, valid, lengths, total), 2, impl=impl).cpu()
    assert torch.equal(got, expected)
    assert 0 < int(got.sum()) < int(valid.sum())  # the budget really cut


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_keep_best_pooled_breaks_ties_by_position_then_head(impl):
    """Equal scores over 2 heads, 3 kept in the layer: position 5 of head 0, of head 1, then
    position 4 of head 0 (ranking.rank's order)."""
    scores = torch.ones(1, 2, 6)
    positions = torch.arange(6).expand(1, 2, 6)
    valid = torch.ones(1, 2, 6, dtype=torch.bool)
    ranks = rank(POLICIES["lava"].ranking, scores, positions, valid)
    kept = ks.keep_best(*on_triton(impl, ranks, torch.zeros_like(valid), valid, torch.tensor([3])), pooled=True,
                        impl=impl).cpu()
    assert kept[0].nonzero().tolist() == [[0, 4], [0, 5], [1, 5]]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_threshold_cut_holds_and_fails_one_token_further(impl):
    """DBudgetKV invariant: the norm change at the chosen cut is ≤ t, one more eviction > t."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(2, 2, 40, generator=gen).pow(3)
    valid = torch.ones(2, 2, 40, dtype=torch.bool)
    positions = torch.arange(40).expand(2, 2, 40)
    ranks = rank(POLICIES["dbudgetkv"].ranking, scores, positions, valid)
    protected = positions < 4
    t = 0.05
    kept = ks.keep_threshold(*on_triton(impl, ranks, protected, valid, scores), t, impl=impl).cpu()
    full = scores.double().norm(dim=-1)
    for b in range(2):
        for h in range(2):
            change = 1 - scores[b, h][kept[b, h]].double().norm() / full[b, h]
            assert change <= t
            evicted = (~kept[b, h]).nonzero().flatten()
            best_gone = evicted[ranks[b, h, evicted].argmin()] if len(evicted) else None
            nxt = (kept[b, h] & ~protected[b, h]).nonzero().flatten()
            nxt = nxt[ranks[b, h, nxt].argmax()]  # the next to go: least important kept candidate
            one_more = kept[b, h].clone()
            one_more[nxt] = False
            assert 1 - scores[b, h][one_more].double().norm() / full[b, h] > t
            assert best_gone is None or ranks[b, h, best_gone] > ranks[b, h, nxt]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("t, kept", [(0.5, [0]), (0.49, [0, 3]), (0.0, [0, 1, 2, 3])])
def test_threshold_at_the_exact_boundary(impl, t, kept):
    """Scores 1, 1, 1, 1, sink 0 protected, evicted 1, 2, 3 in that order (by position): evicting
    all three changes the norm from 2 to 1, exactly 0.5, which t = 0.5 still allows (≤ t)."""
    policy = load_spec("dbudgetkv", ranking={"by_position": {"sinks": 1}},
                       budget={"threshold": {"attention_norm": {"t": t}}})
    scores = torch.ones(1, 1, 4)
    positions = torch.arange(4).view(1, 1, 4)
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    args = (scores, positions, valid, torch.tensor([4]), None, 2)
    got = kernel_select(policy, *on_triton(impl, *args), impl=impl).cpu()
    assert got[0, 0].nonzero().flatten().tolist() == kept
    assert torch.equal(got, reference.select(policy, *args))


@pytest.mark.slow
def test_compiled_select_matches_reference():
    for name in ("snapkv", "adakv", "dbudgetkv"):
        policy = POLICIES[name]
        gen = torch.Generator().manual_seed(1)
        scores = torch.rand(1, 2, 20, generator=gen)
        positions = torch.arange(20).expand(1, 2, 20)
        valid = torch.ones(1, 2, 20, dtype=torch.bool)
        lengths, total = torch.tensor([20]), None if name == "dbudgetkv" else torch.tensor([13])
        expected = reference.select(policy, scores, positions, valid, lengths, total, 2)
        assert torch.equal(kernel_select(policy, scores, positions, valid, lengths, total, 2, impl="compiled"),
                           expected)


# --------------------------------------------------------------------------- gather


@st.composite
def page_cases(draw):
    """LayerStore.build's inputs: one or two sources (residual slots, then tokens), fp32 or fp16,
    random `take` (some heads empty, some spanning pages), a page size and spare pages."""
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    d = draw(st.sampled_from([2, 3, 8]))  # the store's pages hold keys and values of one width
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shapes = [(draw(st.integers(1, 20)), draw(st.sampled_from([0.0, 0.4, 1.0])))]  # the tokens
    if draw(st.booleans()):
        shapes.insert(0, (draw(st.integers(0, 3)), 0.6))  # residual slots first
    sources = []
    for e, density in shapes:
        sources.append(Entries(torch.randn(b, h, e, d, generator=gen).to(dtype),
                               torch.randn(b, h, e, d, generator=gen).to(dtype),
                               torch.rand(b, h, e, generator=gen).to(dtype),
                               torch.randint(-1, 50, (b, h, e), generator=gen),
                               torch.randint(0, 4, (b, h, e), generator=gen).float(),
                               torch.rand(b, h, e, generator=gen) < density))
    return sources, draw(st.sampled_from([1, 4, 16])), draw(st.integers(0, 3))


def written_out(sources, slots, page_size, spare):
    """The page layout, entry by entry: head (b, h) (row-major order) owns ceil(n/S) + spare consecutive
    pages after the previous head's; its i-th taken row (the sources one after the other, entry order)
    is slot i % S of its page i // S."""
    b, h = sources[0].take.shape[:2]
    n = sum(src.take.sum(-1) for src in sources)
    owned = (n + page_size - 1) // page_size + spare
    cap, width = int(owned.sum()), max(1, int(owned.max()))
    first = sources[0]
    out = {"k_pages": first.keys.new_zeros(cap, page_size, first.keys.shape[-1]),
           "v_pages": first.values.new_zeros(cap, page_size, first.values.shape[-1]),
           "score_pages": torch.zeros(cap, page_size), "pos_pages": torch.full((cap, page_size), -1),
           "count_pages": torch.zeros(cap, page_size), "block_table": torch.zeros(b, h, width, dtype=torch.long),
           "lengths": n, "owned": owned, "slots": slots}
    base = 0
    for bi in range(b):
        for hi in range(h):
            out["block_table"][bi, hi, :owned[bi, hi]] = torch.arange(base, base + int(owned[bi, hi]))
            i = 0
            for src in sources:
                for e in range(src.take.shape[-1]):
                    if src.take[bi, hi, e]:
                        page, slot = base + i // page_size, i % page_size
                        for field, x in (("k_pages", src.keys), ("v_pages", src.values), ("score_pages", src.scores),
                                         ("pos_pages", src.positions), ("count_pages", src.counts)):
                            out[field][page, slot] = x[bi, hi, e]
                        i += 1
            base += int(owned[bi, hi])
    return out, cap


def check_pages(impl, case):
    sources, page_size, spare = case
    slots = sources[0].take.sum(-1)
    expected, cap = written_out(sources, slots, page_size, spare)
    moved = on_triton(impl, *sources)
    got = LayerStore.build(list(moved), on_triton(impl, slots)[0], page_size, spare,
                           gather=ks.backend_for(impl, moved[0].keys).gather_pages)
    assert got.next_page == cap
    for field, ref in expected.items():
        mine = getattr(got, field).cpu()
        assert mine.dtype == ref.dtype, field
        assert_close(mine, ref, rtol=0, atol=0, msg=field)  # a copy: bitwise


@settings(max_examples=30, deadline=None)
@given(case=page_cases())
def test_triton_gather_matches_the_page_layout(case):
    check_pages("triton", case)


@settings(max_examples=60, deadline=None)
@given(case=page_cases())
def test_torch_gather_matches_the_page_layout(case):
    check_pages("torch", case)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_gather_follows_any_block_table(impl):
    """Pages need not be consecutive: entry e of a head goes to block_table[b, h, e // S]."""
    keys = torch.arange(10.0).view(1, 1, 10, 1)
    take = torch.tensor([[[True, False, True, True, False, True, False, False, False, True]]])
    pages = [torch.zeros(4, 2, 1), torch.zeros(4, 2, 1), torch.zeros(4, 2), torch.full((4, 2), -1),
             torch.zeros(4, 2)]
    table = torch.tensor([[[3, 0, 2]]])
    start = torch.tensor([[1]])  # one entry already stored
    pages, rows = on_triton(impl, pages, (table, start, keys, keys, keys[..., 0], torch.arange(10).view(1, 1, 10),
                                          torch.ones(1, 1, 10), take))
    ks.gather_pages(*pages, *rows, impl=impl)
    pages = [p.cpu() for p in pages]
    # taken rows 0 2 3 5 9 → entries 1 … 5 → (page, slot) (3, 1) (0, 0) (0, 1) (2, 0) (2, 1)
    assert pages[3].tolist() == [[2, 3], [-1, -1], [5, 9], [-1, 0]]
    assert pages[0][:, :, 0].tolist() == [[2, 3], [0, 0], [5, 9], [0, 0]]
