"""Prefill once, compress many (issue 6): prefill-time policies do not change the prompt's
forward pass, so each layer's queries, keys and values are captured once per prompt and
every spec and budget is applied to them; then each policy decodes its own answer.

    states, logits = capture(model, ids)                 # one forward pass, nothing evicted
    for spec in ("snapkv", "lava"):
        cache = replay(kvcompile.load_spec(spec, per_head=64), model.config, states)
        tokens = greedy(model, cache, logits, max_new_tokens=16)
"""
from __future__ import annotations

import torch
from torch import Tensor

from kvcompile import cache_arg
from kvcompile.cache import KVCompileCache
from kvcompile.integrations.generate import compiled, model_sinks
from kvcompile.plan import build_plan
from kvcompile.policy import Policy
from kvcompile.layer_state import LayerState
from kvcompile.engine.prefill import compress_prompt_layer, start_prompt

KEEP_ALL = {"name": "capture", "scoring": "recency", "budget": {"ratio": 1.0}}


class Captured(list):
    """The captured prefill states of the layers a policy compresses (a list of LayerState), a hybrid
    model's local layers as the prompt left them (`windows`, by model layer: kvcompile.engine.window; what every
    policy leaves there, since a policy does not touch a local layer's window), and the model's learned attention
    sinks (`sinks`, Plan.sinks: gpt-oss's, which a config does not hold; None where it has none)."""

    def __init__(self, states, windows=None, sinks=None):
        super().__init__(states)
        self.windows = windows
        self.sinks = sinks


@torch.no_grad()
def capture(model, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Captured, Tensor]:
    """Every compressed layer's prefill state (all query rows, keys, values, padding; a hybrid model's local
    layers as the prompt left them, `Captured.windows`) and the logits of the last prompt position, from one
    forward pass that keeps everything."""
    from kvcompile.spec import load_spec

    policy = load_spec(KEEP_ALL)
    positions = None if attention_mask is None else (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with compiled(model, policy):  # positions as generate() gives them to a left-padded batch
        cache = KVCompileCache.from_plan(model.kvcompile_plan, record=True)  # (the model's sinks in its plan)
        out = model(input_ids, attention_mask=attention_mask, position_ids=positions, **cache_arg.given(cache))
    hybrid = cache.plan.layer_kinds is not None
    return Captured(cache.states, list(cache.windows) if hybrid else None, model_sinks(model)), out.logits[:, -1]


def not_replayable(policy: Policy) -> str | None:
    """Why `replay` cannot give what a compiled model's own prefill of the prompt keeps, or None.
    Replay applies a policy to one captured one-pass prefill, layer by layer; a policy whose prefill
    is not that (chunked prefill: each chunk attends to what the previous chunks kept, so the forward
    itself changes; a reconstruction scorer: a second model-level pass) needs the model's forward."""
    if policy.schedule.prefill is not None:
        return ("its schedule compresses while prefilling in chunks (schedule.prefill), so each chunk's forward "
                "attends to what the earlier chunks kept: a one-pass capture cannot be replayed into it")
    if getattr(policy.scoring, "reconstructs", False):
        return ("scoring kvzip scores a prompt by running the model again on its reconstruction; a captured "
                "layer state has no model to reconstruct with")
    return None


@torch.no_grad()
def prefilled(model, policy: Policy, input_ids: Tensor, headroom: int = 0,
              **options) -> tuple[KVCompileCache, Tensor]:
    """The cache a compiled model's own forward over `input_ids` leaves under `policy` (what generate()'s
    prefill keeps) and the logits of the last prompt position, as `capture` + `replay` give them: for
    the policies `replay` cannot reproduce (`not_replayable`). `options` go to compile()."""
    with compiled(model, policy, **options):
        cache = KVCompileCache.from_plan(model.kvcompile_plan.with_headroom(headroom))
        out = model(input_ids, **cache_arg.given(cache))
    return cache, out.logits[:, -1]


def replay(policy: Policy, config, states: list[LayerState], page_size: int = 16, headroom: int = 0,
           kernels: str | None = None) -> KVCompileCache:
    """A KVCompileCache holding what `policy` keeps of the captured prompt, exactly as if the
    prompt had been prefilled with the policy compiled in (the same per-layer code runs).
    Refused (ValueError) for a policy whose prefill is not one pass compressed layer by layer
    (`not_replayable`): use `prefilled` with the model."""
    why = not_replayable(policy)
    if why is not None:
        raise ValueError(f"kvcompile: {policy.name} cannot be replayed from a captured prefill: {why}; "
                         "prefill it through the compiled model (kvcompile.tools.sweep.prefilled)")
    # the captured model's learned sinks (a config alone has none): the scores and the decode attention count them
    cache = KVCompileCache(plan=build_plan(policy, config, kernels=kernels, page_size=page_size, headroom=headroom,
                                           sinks=getattr(states, "sinks", None)))
    if cache.plan.layer_kinds is not None:  # a hybrid model: its local layers as the captured prompt left them
        windows = getattr(states, "windows", None)
        if windows is None or len(windows) != cache.plan.model_layers:
            raise ValueError("kvcompile: replaying onto a hybrid model (sliding_attention layers) needs its local "
                             "layers' windows: give the states `capture` returned (Captured.windows)")
        cache.hold_windows(windows)  # a decode step replaces a layer's window, never changes it in place
    first = states[0]
    b, _, n, _ = first.keys.shape
    start_prompt(cache, first.mask, b, n, first.keys)
    for layer, state in enumerate(states):
        compress_prompt_layer(cache, state.queries, state.keys, state.values, layer, state.scale)
    cache.advance(n)
    return cache


@torch.no_grad()
def greedy(model, cache: KVCompileCache, last_logits: Tensor, max_new_tokens: int, eos_token_id=None,
           until=None, **options) -> Tensor:
    """Greedy continuation (B, max_new_tokens) from a prefilled cache: the first token is the
    argmax of the prompt's last logits, then one token per step through the compiled model.
    Sequences that produced `eos_token_id` (one id or a list), or whose tokens so far `until(b, ids)`
    (b the sequence, ids a list) says are a complete answer, continue with their last token (as generate()
    pads); the steps end when every sequence is done. options: compile()'s keywords (a kvzip policy's
    tokenizer)."""
    policy = cache.policy
    out = []
    token = last_logits.argmax(-1, keepdim=True)
    done = torch.zeros(token.shape[0], dtype=torch.bool, device=token.device)
    stop = None if eos_token_id is None else torch.as_tensor(eos_token_id).reshape(-1)
    with compiled(model, policy, **options):
        for step in range(max_new_tokens):
            out.append(token)
            if stop is not None and stop.numel():
                done |= torch.isin(token[:, 0], stop.to(token.device))
            if until is not None:
                so_far = torch.cat(out, dim=1).tolist()
                done |= torch.tensor([until(b, ids) for b, ids in enumerate(so_far)], device=done.device)
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            position = (cache.seq_length - cache.pad)[:, None]
            logits = model(token, position_ids=position, **cache_arg.given(cache)).logits[:, -1]
            token = torch.where(done[:, None], token, logits.argmax(-1, keepdim=True))
    return torch.cat(out, dim=1)


@torch.no_grad()
def feed(model, cache: KVCompileCache, ids: Tensor, **options) -> Tensor:
    """Feed T tokens `ids` (B, T) through a prefilled cache in one forward pass (a question after
    a compressed context, kvpress's query-agnostic setting): their entries are appended, not
    compressed (each attends to what the cache holds and to the new tokens up to itself), at the
    positions that follow the prompt; the logits (B, V) of the last one."""
    positions = ((cache.seq_length - cache.pad)[:, None] + torch.arange(ids.shape[1])[None]).to(ids.device)
    with compiled(model, cache.policy, **options):  # options: compile()'s (a kvzip policy's tokenizer)
        return model(ids, position_ids=positions, **cache_arg.given(cache)).logits[:, -1]


@torch.no_grad()
def teacher_forced(model, cache: KVCompileCache, last_logits: Tensor, continuation: Tensor, **options) -> Tensor:
    """Logits (B, T, V) predicting each token of `continuation` (B, T) from a prefilled cache:
    the first row is the prompt's last logits, then the continuation is fed one token at a
    time through the compiled model (teacher forcing; the policy's decode rules run).
    options: compile()'s keywords (a kvzip policy's tokenizer)."""
    rows = [last_logits]
    with compiled(model, cache.policy, **options):
        for t in range(continuation.shape[1] - 1):
            position = (cache.seq_length - cache.pad)[:, None]
            out = model(continuation[:, t:t + 1], position_ids=position, **cache_arg.given(cache))
            rows.append(out.logits[:, -1])
    return torch.stack(rows, dim=1)
