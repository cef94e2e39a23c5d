"""A head's pages after its prompt hold its entries and the entries its decode appends are reserved (Plan.spare_entries),
its partly filled last page counted: no whole spare page beyond them, the same outputs, no page taken while decoding
within the headroom."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import kvcompile
import kvcompile.engine.op  # noqa: F401  (registers torch.ops.kvcompile.attend: the file runs alone)
from kvcompile.cache import KVCompileCache
from kvcompile.plan import SPARE_RUN, build_plan, spare_entries, spare_pages
from kvcompile.store import page_table

B, H, G, D, N, PAGE = 2, 2, 2, 8, 40, 4
CONFIG = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=H, num_attention_heads=H * G, head_dim=D,
                         hidden_size=H * G * D)


def snapkv(per_head: int):
    return kvcompile.load_spec("snapkv", per_head=per_head, ranking={"by_score": {"window": 4}},
                               scoring={"window_attention": {"window": 4}})


def run(per_head: int, headroom: int, steps: int):
    """A cache of snapkv at `per_head` over a random prompt, then `steps` decode steps: the cache and every output."""
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    cache = KVCompileCache(snapkv(per_head), CONFIG, page_size=PAGE, headroom=headroom)
    outs = []
    for layer in range(2):
        outs.append(torch.ops.kvcompile.attend(rand(B, H * G, N, D), rand(B, H, N, D), rand(B, H, N, D), None, layer,
                                               cache.ref, cache.token, 0.3))
    rooms = [store.room for store in cache.stores]
    owned = [store.owned.clone() for store in cache.stores]
    for _ in range(steps):
        for layer in range(2):
            outs.append(torch.ops.kvcompile.attend(rand(B, H * G, 1, D), rand(B, H, 1, D), rand(B, H, 1, D), None,
                                                   layer, cache.ref, cache.token, 0.3))
    return cache, outs, rooms, owned


def test_a_partly_filled_last_page_counts_toward_the_reserve():
    # 10 entries a head: 3 pages of 4, the last with 2 free slots; 2 new tokens fit there
    cache, outs, rooms, owned = run(per_head=10, headroom=2, steps=2)
    assert cache.plan.spare_pages == 1 and cache.plan.spare_entries == 2
    for store, o in zip(cache.stores, owned):
        assert o.tolist() == [[3, 3], [3, 3]]  # ceil((10 + 2) / 4); whole spare pages gave 3 + 1
        assert store.next_page == 12 and store.k_pages.shape[0] == 12
        assert store.lengths.tolist() == [[12, 12], [12, 12]]
    assert rooms == [2, 2] and not cache.host_syncs  # the headroom decoded without taking a page
    report = cache.memory_report()
    assert report["bytes_allocated"] == report["bytes_held"] == report["bytes_entries"]

    # the same prompt and steps in a layout with a whole spare page a head: the same outputs, bit for bit
    wide, wide_outs, _, wide_owned = run(per_head=10, headroom=4, steps=2)
    assert all(o.tolist() == [[4, 4], [4, 4]] for o in wide_owned)
    assert all(torch.equal(a, b) for a, b in zip(outs, wide_outs))


def test_past_the_reserve_a_head_takes_its_next_run():
    cache, outs, rooms, owned = run(per_head=10, headroom=2, steps=5)
    wide, wide_outs, _, _ = run(per_head=10, headroom=8, steps=5)
    assert all(torch.equal(a, b) for a, b in zip(outs, wide_outs))
    assert all(store.lengths.tolist() == [[15, 15], [15, 15]] for store in cache.stores)
    assert all(bool((store.owned * PAGE >= store.lengths).all()) for store in cache.stores)
    assert sum(cache.host_syncs.values()) == 2  # one page allocation per layer, past the headroom
    assert not wide.host_syncs


@pytest.mark.parametrize("headroom", [0, 1, 3, 4, 5, 16, 64, 1024])
def test_spare_pages_cover_the_reserved_entries(headroom):
    policy = snapkv(8)
    plan = build_plan(policy, CONFIG, page_size=PAGE, headroom=headroom)
    reserve = spare_entries(policy, headroom, PAGE)
    assert plan.spare_entries == reserve == (min(headroom, SPARE_RUN * PAGE) if headroom else PAGE)
    assert plan.spare_pages == spare_pages(policy, headroom, PAGE) == -(-reserve // PAGE)
    counts = torch.arange(0, 3 * PAGE + 1).reshape(1, -1)
    table, owned = page_table(counts, PAGE, reserve)
    assert torch.equal(owned, (counts + reserve + PAGE - 1) // PAGE)
    assert bool((owned <= (counts + PAGE - 1) // PAGE + plan.spare_pages).all())
    assert bool((owned * PAGE - counts >= reserve).all())
    assert table.flatten()[:int(owned[0, 0])].tolist() == list(range(int(owned[0, 0])))
