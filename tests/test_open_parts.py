"""The part families are open: a scorer, a heads rule and a merge rule written here, one
registration decorator each, load from YAML and run through the runtime (prefill and decode)
exactly as the reference engine defines them. No kvcompile module knows their names."""
from __future__ import annotations


import pytest
import torch
from torch import Tensor

import kvcompile
from kvcompile import reference
from kvcompile.cache import KVCompileCache
from kvcompile.policies import PARTS, part
from kvcompile.policies.budgets import HeadsRule
from kvcompile.policies.merge import MergeRule
from kvcompile.policies.scoring import Scorer, mask_pads
from kvcompile.spec import loads_spec
from test_decode import token_by_token
from tiny import prompt, tiny_model

NEW = {"scoring": "value_norm_test", "heads": "round_robin_test", "merge": "fill_then_drop_test"}


@pytest.fixture(scope="module", autouse=True)
def new_parts():
    """Register the three parts for this module only (other tests enumerate the registry)."""

    @part("scoring", "value_norm_test")
    class ValueNorm(Scorer):
        """s[i] = ‖V[i]‖₂, and while decoding s ← s/2 + a (a running score)."""

        running = True

        def query_rows(self, n: int) -> int:
            return 0

        def score(self, state) -> Tensor:
            return mask_pads(state.values.float().norm(dim=-1), state)

        def running_update(self, scores: Tensor, attention: Tensor) -> Tensor:
            return 0.5 * scores + attention

    @part("heads", "round_robin_test")
    class RoundRobin(HeadsRule):
        """Heads take turns, head h picking its h + 1 best remaining tokens per turn, until the
        layer's tokens (the sum of the head budgets) are spent: later heads get more."""

        def keep(self, rank: Tensor, protected: Tensor, valid: Tensor, tokens: Tensor, total) -> Tensor:
            kept = protected & valid
            left = int(tokens.sum()) - int(kept.sum())
            queues = [sorted((valid[h] & ~kept[h]).nonzero().squeeze(1).tolist(), key=lambda e: int(rank[h, e]))
                      for h in range(rank.shape[0])]
            while left > 0 and any(queues):
                for h, queue in enumerate(queues):
                    for _ in range(h + 1):
                        if queue and left > 0:
                            kept[h, queue.pop(0)] = True
                            left -= 1
            return kept

    @part("merge", "fill_then_drop_test")
    class FillThenDrop(MergeRule):
        """Evicted tokens fill the empty slots in merge order; once all are full the rest are dropped."""

        def merge(self, slot_keys, slot_values, counts, keys, values):
            slot_keys, slot_values, counts = slot_keys.clone(), slot_values.clone(), counts.clone()
            for key, value in zip(keys, values):
                empty = (counts == 0).nonzero()
                if len(empty):
                    r = int(empty[0])
                    slot_keys[r], slot_values[r], counts[r] = key, value, 1
            return slot_keys, slot_values, counts

        def shrink(self, slot_keys, slot_values, counts, size: int):
            return slot_keys[:size].clone(), slot_values[:size].clone(), counts[:size].clone()

    yield
    for family, name in NEW.items():
        PARTS[family].pop(name)


MERGING = """
scoring: value_norm_test
ranking: {by_score: {sinks: 1}}
budget: {per_head: 12, heads: round_robin_test, split: {proximity: 0.25, context: 0.5, residual: 0.25}}
merge: fill_then_drop_test
"""
PRUNING = """
scoring: value_norm_test
ranking: {by_score: {window: 2}}
budget: {per_head: 10, heads: round_robin_test}
schedule: {decode: {every: 3}}
"""


def test_the_new_parts_load_from_yaml():
    policy = loads_spec(MERGING)
    assert (policy.scoring.name, policy.budget.heads.name, policy.merge.name) == tuple(NEW.values())
    assert policy.merges and policy.scoring.running
    with pytest.raises(kvcompile.SpecError, match="sinks"):
        loads_spec(MERGING.replace("sinks: 1", "sinks: -1"))


@pytest.mark.parametrize("spec", [MERGING, PRUNING], ids=["merging", "pruning"])
@pytest.mark.parametrize("pad", [0, 3])
def test_runtime_equals_reference_prefill_and_decode(spec, pad):
    """One layer through the op, token by token: the pages after the prompt and after every
    decode step hold what reference.compress / decode_step / decode_prune hold, and the
    attention outputs agree."""
    policy = loads_spec(spec)
    b, h, g, d, n, steps = 2, 3, 2, 8, 30, 10
    gen = torch.Generator().manual_seed(7)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 2  # noqa: E731
    q, k, v = rand(b, h * g, n, d), rand(b, h, n, d), rand(b, h, n, d)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, :pad] = False
    _, selection, _ = token_by_token(policy, q, k, v, mask if pad else None, steps, rand, page=4)
    assert int((~selection.kept[0] & mask[:, None, :]).sum()) > 0, "the budget should evict"
    kept = selection.kept[0].sum(-1)
    assert bool((kept[:, 0] < kept[:, -1]).all()), "round robin gives later heads more"


@pytest.mark.parametrize("spec", [MERGING, PRUNING], ids=["merging", "pruning"])
def test_generate_keeps_what_the_reference_keeps(spec):
    """End to end on a tiny Llama through generate(): each layer keeps the reference's tokens
    (and merge slots), and the eager and compiled entries agree token for token."""
    model = tiny_model("llama")
    policy = loads_spec(spec)
    ids = prompt(50, batch=2, seed=3)
    cache = KVCompileCache(policy, model.config, record=True)
    with kvcompile.compiled(model, policy), torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=1,
                             do_sample=False)
    selection = reference.compress(policy, cache.states)
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(cache.kept_positions(layer), selection.kept[layer]), f"layer {layer}"
        if policy.merges:
            assert torch.equal(cache.stores[layer].slots, (selection.merged[layer].counts > 0).sum(-1))
    with torch.no_grad():
        with kvcompile.compiled(model, policy):
            eager = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        with kvcompile.compiled(model, policy, mode="compiled"):
            compiled = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 1
    assert eager.tolist() == compiled.tolist()
