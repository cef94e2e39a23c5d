"""docs/DISTRIBUTED.md's memory arithmetic: its table is what benchmarks/tp_memory.py computes, and
the script's formulas are what transformers' tp_plan and a real KVCompileCache hold (a tiny Llama:
the same formulas at another shape)."""
from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest
import torch

import kvcompile
from tiny import left_pad, prompt, tiny_model

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("tp_memory", ROOT / "benchmarks" / "tp_memory.py")
tp_memory = importlib.util.module_from_spec(spec)
sys.modules["tp_memory"] = tp_memory  # its dataclass looks its module up
spec.loader.exec_module(tp_memory)

DOC = (ROOT / "docs" / "DISTRIBUTED.md").read_text()
SEVENTY = tp_memory.LLAMA3_70B


def test_the_doc_table_is_the_scripts():
    assert tp_memory.table(SEVENTY, 8, 128, [32768, 131072], [1, 8]) in DOC


def test_the_doc_weights_are_the_scripts():
    total, mine = tp_memory.weight_params(SEVENTY), tp_memory.weight_params(SEVENTY, 8)
    assert total == 70_553_706_496  # Llama-3-70B's published count
    assert f"{total:,} parameters = {total * 2 / 2**30:.2f} GiB" in DOC
    assert f"= {mine:,} parameters = {mine * 2 / 2**30:.2f} GiB" in DOC
    assert "B · T · 40,960 bytes" in DOC and tp_memory.per_token(SEVENTY, 1, 8) == 40_960
    assert f"{tp_memory.spares(SEVENTY, 1, 8) / 2**20:.1f} MiB per sequence" in DOC


def tiny_shape(model) -> "tp_memory.Shape":
    c = model.config
    return tp_memory.Shape(layers=c.num_hidden_layers, heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                           head_dim=c.head_dim, hidden=c.hidden_size, intermediate=c.intermediate_size,
                           vocab=c.vocab_size, tied=c.tie_word_embeddings, elt=4)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_weights_per_rank_follow_the_tp_plan(ranks):
    """A parameter of a module the model's tp_plan splits is 1/P on a rank, any other is whole."""
    model = tiny_model("llama", layers=3, heads=8, kv_heads=4, head_dim=16)
    plan = model.tp_plan  # what tp_plan="auto" applies (kvcompile.sharding reads it too)
    patterns = [re.compile(k.replace(".", r"\.").replace("*", r"\d+") + r"\.weight$") for k in plan]
    assert set(plan.values()) <= {"colwise", "rowwise", "colwise_gather_output", "embedding_rowwise"}
    held = sum(p.numel() // ranks if any(r.fullmatch(name) for r in patterns) else p.numel()
               for name, p in model.named_parameters())
    assert sum(p.numel() for p in model.parameters()) == tp_memory.weight_params(tiny_shape(model))
    assert held == tp_memory.weight_params(tiny_shape(model), ranks)


@pytest.mark.parametrize("name", ["snapkv", "adakv"])
def test_the_cache_holds_what_the_formulas_say(name):
    model = tiny_model("llama", layers=3, heads=4, kv_heads=2, head_dim=16)
    shape, per_head, page = tiny_shape(model), 48, 16
    ids, mask = left_pad([prompt(150, seed=7)[0], prompt(97, seed=8)[0]])
    policy = kvcompile.load_spec(name, per_head=per_head)
    with torch.no_grad(), kvcompile.compiled(model, policy):
        cache = model(ids, attention_mask=mask).past_key_values  # the prompt only
    report, b = cache.memory_report(), ids.shape[0]
    assert report["bytes_full"] == tp_memory.full_kv(shape, ids.shape[1], b, 1)
    assert report["kept"].sum() == b * shape.layers * shape.kv_heads * per_head  # the budget, on average
    formula = tp_memory.compressed_kv(shape, per_head, b, 1, page)
    if name == "snapkv":  # every head the same budget: exactly ceil(n/S) pages each
        assert report["bytes_held"] == formula
    else:  # head-wise budgets: less than one more page per head, and more than the uniform case here
        assert formula < report["bytes_held"] <= formula + tp_memory.rounding_bound(shape, b, 1, page)
    store = cache.stores[0]
    assert sum(t.element_size() for t in (store.score_pages, store.pos_pages, store.count_pages)) == \
        tp_memory.META_BYTES
    assert report["bytes_entries"] == tp_memory.entry_bytes(shape) * math.prod(report["kept"].shape) * per_head
    from kvcompile.plan import SPARE_RUN

    assert tp_memory.SPARE_RUN == SPARE_RUN
