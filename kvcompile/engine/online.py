"""ZSMerge's online eviction (Alg. 1) while decoding: every head over its budget sends its lowest running
score outside the proximity window into the residual slots, all heads at once, with fixed shapes and no
host read once the heads are within their budgets."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kvcompile.allocation import latest

if TYPE_CHECKING:
    from kvcompile.cache import KVCompileCache


def evict_online(cache: KVCompileCache, store, layer: int) -> None:
    """ZSMerge Alg. 1, every (sequence, head) at once: while a head holds more tokens than
    proximity + context, its lowest running score outside the latest B_p tokens (ties: the
    earliest position, as reference.decode_step) leaves into the residual slots. Each round
    takes one victim from every head over its budget; a decode step appends one token per
    head, so one round is the rule once every head is within its budget (`store.settled`: no host
    read then); right after a prompt that filled the cache, the rounds are counted on the host."""
    prox, context, slots = cache.decoding.split[:, layer].unbind(-1)  # (B, H) each
    flat, stored = store.entries()
    pos = store.pos_pages.reshape(-1)[flat]
    tokens = stored & (pos >= 0)
    excess = tokens.sum(-1) - prox - context  # (B, H) tokens to evict: at most 1 after a full step
    rounds = 1 if store.settled else int(excess.max())
    for done in range(rounds):
        if done:  # entries moved: look again
            flat, stored = store.entries()
            pos = store.pos_pages.reshape(-1)[flat]
            tokens = stored & (pos >= 0)
        candidates = tokens & ~latest(pos, tokens, prox)
        scores = store.score_pages.reshape(-1)[flat].masked_fill(~candidates, float("inf"))
        lowest = candidates & (scores == scores.amin(-1, keepdim=True))
        victim = pos.masked_fill(~lowest, torch.iinfo(pos.dtype).max).argmin(-1)  # (B, H) entry index
        merge_victims(cache, store, excess > done, victim, slots, flat, pos, stored, check=not store.settled)
    if not store.settled:  # every head within its budget from now on: its length stays at most budget + 1
        store.settle(prox + context + slots)


def merge_victims(cache: KVCompileCache, store, leaving: Tensor, victim: Tensor, slots: Tensor, flat: Tensor,
                   pos: Tensor, stored: Tensor, check: bool = True) -> None:
    """Entry victim[b, h] of every head with leaving[b, h] leaves (reference._merge_one, ZSMerge
    Alg. 1 lines 11–15), all heads at once: with no slot it is dropped; with a free slot it
    becomes that slot in place (its key and value are the slot's mean, count 1); else it folds
    into the slot r of largest k_r·k (ties: lowest r), k_r ← (w·k_r + k)/(w + 1), the same for
    v, w ← w + 1 (Eq. 6–7, computed as Residual.merge does), and is removed. (The plan admits
    online eviction only for the merge rules this implements: Residual, and Drop with no slots.) slots (B, H) is each
    head's B_r; slot r of a head is its entry at position −1 − r. Branch-free, with fixed shapes and no
    host read: every head computes all three cases, and a head writes only its own (its victim and
    its slot lie in its own pages, so the writes of different heads never meet); `check` reads the
    slot invariant back to the host (the host-counted rounds after the prompt)."""
    is_slot = stored & (pos < 0)
    held = is_slot.sum(-1)  # (B, H) occupied slots
    if check and bool((leaving & (held > slots)).any()):
        raise RuntimeError("kvcompile: a head holds more residual slots than its ZSMerge split allows")
    entry = flat.gather(-1, victim[..., None]).squeeze(-1)  # (B, H) page·S + slot of each victim
    fresh = leaving & (slots > 0) & (held < slots)
    store.to_slots(entry, fresh, held)
    fold = leaving & (slots > 0) & (held == slots)
    kf, vf = (t.reshape(-1, t.shape[-1]) for t in (store.k_pages, store.v_pages))
    compute = torch.promote_types(kf.dtype, torch.float32)
    key = kf[entry].to(compute)  # (B, H, d)
    dots = torch.matmul(kf[flat].to(compute), key[..., None]).squeeze(-1).masked_fill(~is_slot, float("-inf"))
    closest = is_slot & (dots == dots.amax(-1, keepdim=True))
    target = pos.masked_fill(~closest, torch.iinfo(pos.dtype).min).argmax(-1)  # highest −1 − r: lowest r
    slot = flat.gather(-1, target[..., None]).squeeze(-1)  # (B, H)
    w = store.count_pages.reshape(-1)[slot][..., None]  # the slot's count, exact in float32
    store.fold_into(slot, fold, (w * kf[slot].to(compute) + key) / (w + 1),
                    (w * vf[slot].to(compute) + vf[entry].to(compute)) / (w + 1), w.squeeze(-1) + 1)
    store.remove_where(leaving & ~fresh, victim)  # dropped (no slot) or folded into a slot

