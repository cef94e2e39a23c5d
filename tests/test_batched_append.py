"""The batched decode step's C++ append (kvcompile.store.pages `CppAppend`, `append_cpp`; its C++:
kvcompile/kernels/append_step.cpp built with KVCOMPILE_APPEND_ONLY): every row's and head's new entry written into its
next slot in one call, against the store's torch append (`LayerStore.append` with no kernel: copies for fp32 pages,
the torch quantizer for codes), over rows of ragged lengths whose heads cross page boundaries and take fresh pages
(`make_room`) as the steps go; and a head without a page is refused before anything changes."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.testing import assert_close

import kvcompile
from kvcompile.kernels import paged_attention_cpp
from kvcompile.store import CodeStore, LayerStore
from kvcompile.store.pages import CppAppend, CppAppendStep, Entries
from kvcompile.store.pool import PagePools

needs_cpp = pytest.mark.skipif(not paged_attention_cpp.supports(torch.device("cpu"), torch.float32, 16),
                               reason="no C++ toolchain")
PAGE = 4
FIELDS = ("k_pages", "v_pages", "k_scale", "k_zero", "v_scale", "v_zero", "score_pages", "pos_pages", "count_pages",
          "block_table", "lengths", "owned")


def entries(lengths: list[int], heads: int, d: int, seed: int) -> Entries:
    """One row of `heads` heads, head j holding lengths[j] random entries (ragged)."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    take = torch.arange(n)[None, None] < torch.tensor(lengths)[None, :, None]
    return Entries(torch.randn(1, heads, n, d, generator=g), torch.randn(1, heads, n, d, generator=g),
                   torch.rand(1, heads, n, generator=g), torch.arange(n).expand(1, heads, n).clone(),
                   torch.ones(1, heads, n), take)


def stores(cls, storage, d: int) -> list:
    """Three requests' layers of 2 heads each, entries ragged over rows and heads, some heads on a full last page
    (so the next append takes a fresh page), one spare page each."""
    rows = ([3, 8], [5, 1], [12, 7])
    return [cls.build([entries(n, 2, d, seed)], torch.zeros(1, 2, dtype=torch.long), PAGE, 1, storage=storage)
            for seed, n in enumerate(rows)]


CASES = {"fp32": (LayerStore, None), "int8": (CodeStore, "int8"), "int4": (CodeStore, "int4")}


def storage(name):
    return None if name is None else kvcompile.load_spec("snapkv", storage=name).storage


def assert_same(got, want, exact: bool = True) -> None:
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        if a is None or b is None:
            assert a is None and b is None, name
        else:
            assert a.shape == b.shape, name
            assert_close(a, b, rtol=0, atol=0) if exact else assert_close(a, b)
    assert got.room == want.room


@needs_cpp
@pytest.mark.parametrize("case", list(CASES))
def test_the_cpp_append_of_a_batch_equals_the_torch_append(case):
    """The batch of three requests in one pool (`PagePools.batch`, the batched step's store) appended to by the C++
    append, step after step across page boundaries (each member making room first, as the batched step does), holds
    bit for bit what the torch append writes into a copy of the same pool: keys, values (or codes, scales and zero
    points), positions, scores, counts, lengths."""
    cls, part = CASES[case]
    d = 32
    part = storage(part)
    kernel = CppAppend() if part is None else CppAppend(part.bits, part.group_size(d))
    own = stores(cls, part, d)
    pools = {name: PagePools(1) for name in ("cpp", "torch")}
    members = {name: [pools[name].adopt(0, copy.deepcopy(s)) for s in own] for name in pools}
    g = torch.Generator().manual_seed(7)
    for step in range(2 * PAGE + 1):  # every head crosses at least two page boundaries
        k, v = torch.randn(3, 2, d, generator=g), torch.randn(3, 2, d, generator=g)
        positions = torch.tensor([40, 60, 80]) + step
        for name, rows in members.items():
            for member in rows:
                member.make_room(1)
            batch = PagePools.batch(rows)
            batch.append(k, v, positions, kernel=kernel if name == "cpp" else None)
            batch.finish(evicted=False)
        for a, b in zip(members["cpp"], members["torch"]):
            assert_same(a, b)
        pool = {name: pools[name].layers[0] for name in pools}
        for field in pool["cpp"].fields:
            assert torch.equal(getattr(pool["cpp"], field), getattr(pool["torch"], field)), field
    for a, s in zip(members["cpp"], own):  # every head holds its entries and the 2·PAGE + 1 new ones
        assert torch.equal(a.lengths, s.lengths + 2 * PAGE + 1)


@needs_cpp
def test_the_cpp_append_of_a_ragged_single_store_equals_the_torch_append():
    """A store of its own (no pool), rows of ragged lengths, fp32 pages: the C++ append and the torch append leave the
    same tensors after every step, a fresh page taken (`append`'s own allocation) where a head's pages are full."""
    own = LayerStore.build([Entries(*_rows(seed=3))], torch.zeros(2, 3, dtype=torch.long), PAGE, 0)
    cpp, ref = copy.deepcopy(own), copy.deepcopy(own)
    g = torch.Generator().manual_seed(11)
    for step in range(PAGE + 2):
        k, v = torch.randn(2, 3, 16, generator=g), torch.randn(2, 3, 16, generator=g)
        positions = torch.tensor([9, 30]) + step
        cpp.append(k, v, positions, step=2, kernel=CppAppend())
        ref.append(k, v, positions, step=2)
        assert_same(cpp, ref)
        flat, stored = cpp.entries()
        assert torch.equal(cpp.k_pages.view(-1, 16)[flat[stored]], ref.k_pages.view(-1, 16)[flat[stored]])


def _rows(seed: int):
    g = torch.Generator().manual_seed(seed)
    n = 9
    lengths = torch.tensor([[4, 9, 1], [8, 3, 0]])
    take = torch.arange(n)[None, None] < lengths[..., None]
    return (torch.randn(2, 3, n, 16, generator=g), torch.randn(2, 3, n, 16, generator=g), torch.rand(2, 3, n, generator=g),
            torch.arange(n).expand(2, 3, n).clone(), torch.ones(2, 3, n), take)


@needs_cpp
def test_a_head_without_a_page_is_refused_before_anything_changes():
    """The C++ append of a store whose head has no page for its next entry (room not made) raises and writes
    nothing."""
    own = LayerStore.build([entries([4, 2], 2, 16, seed=1)], torch.zeros(1, 2, dtype=torch.long), PAGE, 0)
    before = copy.deepcopy(own)
    assert own.room == 0
    with pytest.raises(RuntimeError, match="without a page"):
        CppAppend()(own.tensors(), torch.randn(1, 2, 16), torch.randn(1, 2, 16), torch.tensor([5]))
    assert_same(own, before)


def test_the_append_follows_the_plans_step():
    """The batch's C++ append is the plan's fused step's own (its bits and group), and none where that step adds a
    merge bias or is another step."""
    assert CppAppend.of(CppAppendStep(32, 0)) == CppAppend(32, 0)
    assert CppAppend.of(CppAppendStep(4, 16)) == CppAppend(4, 16)
    assert CppAppend.of(CppAppendStep(32, 0, alpha=1.0)) is None
    assert CppAppend.of(object()) is None
