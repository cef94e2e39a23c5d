"""The decode step in torch ops (`TorchStep`, the torch member of the decode-step family the plan chooses from,
kvcompile.kernels.online_step): the new entry appended to its head's pages, attention over them with the merge
rule's per-entry bias (ZSMerge Eq. 8: α·log w) by the plan's decode attention backend, and where the policy has
them the running scores (H2O, ZSMerge) and ZSMerge's online eviction (Alg. 1): every head over its budget sends
its lowest running score outside the proximity window into the residual slots, all heads at once, with fixed
shapes and no host read once the heads are within their budgets."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kvcompile.allocation import latest
from kvcompile.kernels.online_step import DecodeStep
from kvcompile.policies.scoring import capped, model_softmax


@dataclass(frozen=True)
class TorchStep(DecodeStep):
    """Every policy's decode step in torch ops, over every store (LayerStore.append, or a store of codes' or two
    tiers'; then the plan's decode attention backend, whichever implementation it is; running scores and online
    eviction here). The plan's step wherever no fused C++ step computes the policy on its tensors."""

    name: ClassVar[str] = "torch"
    stores: ClassVar[tuple[str, ...]] = ("LayerStore", "CodeStore", "TieredStore")
    append: object = None  # the store's append as one kernel call (store.pages.CppAppend: a batched step's), or
    #                        None: its torch ops

    def __call__(self, plan, store, layer: int, q: Tensor, k: Tensor, v: Tensor, position: Tensor,
                 split: Tensor | None, scale: float) -> Tensor:
        store.append(k, v, position, step=plan.spare_pages, kernel=self.append)
        if not (plan.running_scores or plan.online_eviction):  # the plan's decode attention (the layer's sinks)
            return store.attend(plan.decode_backend(layer, q.device), q, plan.merge_bias, scale)
        out, probs = _attend_with_probs(plan, store, q, scale, layer)
        if plan.running_scores:
            _update_scores(plan, store, probs)
        if plan.online_eviction:
            evict_online(store, split)
        return out

    def describe(self) -> str:
        return "torch (the store's append, then decode_impl; running scores and online eviction in torch)"


def _attend_with_probs(plan, store, q: Tensor, scale: float, layer: int):
    """Decode attention over the gathered entries, also returning the attention of every entry
    reduced over each GQA group as the scorer reduces it (B, H, E): the running scores need it. The model's
    soft-cap and the layer's learned sinks apply (the same weights as the model's attention)."""
    flat, stored = store.entries()
    keys, values = store.kv_rows(flat)
    b, hq, d = q.shape
    h = keys.shape[1]
    g = hq // h
    logits = capped(torch.einsum("bhgd,bhed->bhge", q.float().view(b, h, g, d), keys.float()) * scale, plan.softcap)
    bias = plan.merge_bias(store.count_pages.reshape(-1)[flat])
    if bias is not None:
        logits = logits + bias[:, :, None, :]
    logits = logits.masked_fill(~stored[:, :, None, :], float("-inf"))
    sinks = plan.layer_sinks(layer, q.device)
    probs = model_softmax(logits, None if sinks is None else sinks.view(1, h, g, 1))
    out = torch.einsum("bhge,bhed->bhgd", probs, values.float()).reshape(b, hq, d).to(q.dtype)
    return out, plan.policy.scoring.reduce_group(probs, 2)


def _update_scores(plan, store, probs: Tensor) -> None:
    """Each token entry's running score ← scoring.running_update(score, attention), written with no host
    read (`LayerStore.rescore`)."""
    flat, stored = store.entries()
    pos = store.pos_pages.reshape(-1)[flat]
    new = plan.policy.scoring.running_update(store.score_pages.reshape(-1)[flat], probs)
    store.rescore(flat, stored & (pos >= 0), new)


def evict_online(store, split: Tensor) -> None:
    """ZSMerge Alg. 1, every (sequence, head) at once: while a head holds more tokens than
    proximity + context, its lowest running score outside the latest B_p tokens (ties: the
    earliest position, as reference.decode_step) leaves into the residual slots. Each round
    takes one victim from every head over its budget; a decode step appends one token per
    head, so one round is the rule once every head is within its budget (`store.settled`: no host
    read then); right after a prompt that filled the cache, the rounds are counted on the host. split (B, H, 3):
    each head's (proximity, context, residual slots)."""
    prox, context, slots = split.unbind(-1)  # (B, H) each
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
        merge_victims(store, excess > done, victim, slots, flat, pos, stored, check=not store.settled)
    if not store.settled:  # every head within its budget from now on: its length stays at most budget + 1
        store.settle(prox + context + slots)


def merge_victims(store, leaving: Tensor, victim: Tensor, slots: Tensor, flat: Tensor,
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

