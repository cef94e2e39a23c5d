"""Prefill once, compress many (issue 6): prefill-time policies do not change the prompt's
forward pass, so each layer's queries, keys and values are captured once per prompt and
every spec and budget is applied to them; then each policy decodes its own answer.

    states, logits = capture(model, ids)                 # one forward pass, nothing evicted
    for spec in ("snapkv", "lava"):
        cache = replay(kvcompile.load_spec(spec, per_head=64), model.config, states)
        tokens = greedy(model, cache, logits, max_new_tokens=16)

Each scorer's prompt scores depend on the scorer and the captured layers only, so `replay` computes them
once per scorer configuration and keeps them with the states: a second policy with the same scorer (another
allocation, ranking, schedule or storage) costs only its selection. A reconstruction scorer (kvzip) replays
too: its scores are the model's reconstruction forwards over the prompt's full keys and values, which the
capture holds, and they do not depend on the policy's other parts; they are computed once per scorer
configuration (`reconstruction_scores`, kept with the states), so every allocation,
ranking, merge and storage over them costs a replay (`replay(..., model=model, tokenizer=tokenizer)`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvcompile import cache as cache_arg
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
    policy leaves there, since a policy does not touch a local layer's window), the model's learned attention
    sinks (`sinks`, Plan.sinks: gpt-oss's, which a config does not hold; None where it has none), the prompt's
    token ids (`ids`, what a reconstruction scorer reads again) and the scores computed so far (`scores`: a
    reconstruction scorer's, `reconstruction_scores`, and every other scorer's prompt scores, `replay`; one entry
    per scorer configuration; a caller may give a dict of its own that outlives the states, as tune's Evaluator
    does)."""

    def __init__(self, states, windows=None, sinks=None, ids=None, scores=None):
        super().__init__(states)
        self.windows = windows
        self.sinks = sinks
        self.ids = ids
        self.scores = {} if scores is None else scores


@torch.no_grad()
def capture(model, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Captured, Tensor]:
    """Every compressed layer's prefill state (all query rows, keys, values, padding; a hybrid model's local
    layers as the prompt left them, `Captured.windows`) and the logits of the last prompt position, from one
    forward pass that keeps everything. Only the last position's logits are computed (`logits_to_keep=1`, as
    generate() prefills): the LM head over every prompt row would be a sixth of a 4k-token prefill of SmolLM2."""
    from kvcompile.spec import load_spec

    policy = load_spec(KEEP_ALL)
    positions = None if attention_mask is None else (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    with compiled(model, policy):  # positions as generate() gives them to a left-padded batch
        cache = KVCompileCache.from_plan(model.kvcompile_plan, record=True)  # (the model's sinks in its plan)
        out = model(input_ids, attention_mask=attention_mask, position_ids=positions, **cache_arg.given(cache),
                    logits_to_keep=1)
    hybrid = cache.plan.layer_kinds is not None
    return (Captured(cache.states, list(cache.windows) if hybrid else None, model_sinks(model), input_ids),
            out.logits[:, -1])


def dynamic_cache(states: Captured):
    """The plain model's DynamicCache after the captured prompt: `capture`'s forward is the model's own, so its
    keys and values are the ones the model's prefill puts there (tests/test_ruler.py compares the answers). None
    for a hybrid model (its local layers' windows are not all of a layer's entries) or a padded batch."""
    from transformers import DynamicCache

    if states.windows is not None or any(s.mask is not None and not bool(s.mask.all()) for s in states):
        return None
    cache = DynamicCache()
    for layer, state in enumerate(states):
        cache.update(state.keys, state.values, layer)
    return cache


def not_replayable(policy: Policy) -> str | None:
    """Why `replay` cannot give what a compiled model's own prefill of the prompt keeps, or None.
    Replay applies a policy to one captured one-pass prefill, layer by layer; a policy whose prefill
    is not that (chunked prefill: each chunk attends to what the previous chunks kept, so the forward
    itself changes) needs the model's forward. A reconstruction scorer (kvzip) is replayable: its
    reconstruction forwards read the prompt's full keys and values, which the capture holds, and its scores
    do not depend on the other parts (`reconstruction_scores`; replay then needs the model)."""
    if policy.schedule.prefill is not None:
        return ("its schedule compresses while prefilling in chunks (schedule.prefill), so each chunk's forward "
                "attends to what the earlier chunks kept: a one-pass capture cannot be replayed into it")
    return None


@torch.no_grad()
def reconstruction_scores(model, policy: Policy, states: Captured, tokenizer=None, repeat_prompt=None) -> list[Tensor]:
    """Every layer's scores (B, H, N) float32 of `policy`'s reconstruction scorer (scoring: kvzip) for the captured
    prompt, as the compiled model's own prefill computes them (kvcompile.kvzip.prefill, step 2): the
    reconstruction forwards of the model over the captured full keys and values (the prompt's forward is not run
    again: the capture ran the same forward). They depend on the scorer's fields, the repeat prompt and the
    layers compressed only, not on the ranking, budget, allocation, merge or storage parts: computed once per such
    configuration and kept in `states.scores`. tokenizer / repeat_prompt: compile()'s (the repeat prompt's ids).
    Refused (ValueError) without the prompt's ids (`capture`'s states carry them) and for a padded batch (the
    reconstruction runs unpadded batches only, as compile()'s does)."""
    from kvcompile import kvzip

    ids = getattr(states, "ids", None)
    if ids is None:
        raise ValueError(f"kvcompile: {policy.name} scores the prompt by reading it again (scoring kvzip): give the "
                         "states `capture` returned, which carry the prompt's token ids")
    if any(s.mask is not None and not bool(s.mask.all()) for s in states):
        raise ValueError(f"kvcompile: {policy.name}: scoring kvzip runs unpadded batches only (every sequence of the "
                         "batch the same length): capture sequences of one length, or one at a time")
    repeat = kvzip.repeat_prompt_for(model, tokenizer, repeat_prompt)
    key = (policy.scoring, repeat, policy.budget.layers.kinds)
    if key not in states.scores:
        first = states[0]
        with compiled(model, policy, repeat_prompt=repeat):  # (compile() refuses what kvzip cannot run)
            cache = model.forward.new_cache()
            if cache.plan.layer_kinds is not None:  # the local layers' windows as the prompt left them
                cache.hold_windows(list(states.windows))
            states.scores[key] = kvzip.scores_of(
                model.forward.wrapped, cache, repeat, ids.to(first.keys.device), [s.keys for s in states],
                [s.values for s in states], [s.scale for s in states], first.queries.shape[1])
    return states.scores[key]


@torch.no_grad()
def prefilled(model, policy: Policy, input_ids: Tensor, headroom: int = 0,
              **options) -> tuple[KVCompileCache, Tensor]:
    """The cache a compiled model's own forward over `input_ids` leaves under `policy` (what generate()'s
    prefill keeps) and the logits of the last prompt position, as `capture` + `replay` give them: for
    the policies `replay` cannot reproduce (`not_replayable`). `options` go to compile(). The last position's
    logits alone (`logits_to_keep=1`, as `capture` and generate()) where the prompt runs in one forward; a
    prompt compressed in chunks runs one forward a chunk, which refuses the keyword."""
    keep = {} if policy.schedule.prefill is not None else {"logits_to_keep": 1}
    with compiled(model, policy, **options):
        cache = KVCompileCache.from_plan(model.kvcompile_plan.with_headroom(headroom))
        out = model(input_ids, **cache_arg.given(cache), **keep)
    return cache, out.logits[:, -1]


def replay(policy: Policy, config, states: list[LayerState], page_size: int = 16, headroom: int = 0,
           kernels: str | None = None, model=None, tokenizer=None, repeat_prompt=None) -> KVCompileCache:
    """A KVCompileCache holding what `policy` keeps of the captured prompt, exactly as if the
    prompt had been prefilled with the policy compiled in (the same per-layer code runs).
    Refused (ValueError) for a policy whose prefill is not one pass compressed layer by layer
    (`not_replayable`): use `prefilled` with the model. A reconstruction scorer (scoring: kvzip) needs the
    `model` that was captured (and compile()'s tokenizer or repeat_prompt where the model has no tokenizer saved
    with it): its scores come from `reconstruction_scores`, computed once per scorer configuration and kept with
    the states, then every layer is selected with them as the model's own prefill selects (kvzip.prefill, step 3)."""
    why = not_replayable(policy)
    if why is not None:
        raise ValueError(f"kvcompile: {policy.name} cannot be replayed from a captured prefill: {why}; "
                         "prefill it through the compiled model (kvcompile.tools.sweep.prefilled)")
    scores = None
    if getattr(policy.scoring, "reconstructs", False):
        if model is None:
            raise ValueError(f"kvcompile: {policy.name} cannot be replayed from a captured prefill without its model: "
                             "scoring kvzip scores the prompt by running the model again on its reconstruction; give "
                             "replay(..., model=model) the model that was captured (and tokenizer= where the model "
                             "has none saved with it)")
        scores = reconstruction_scores(model, policy, states, tokenizer, repeat_prompt)
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
    # a scorer's prompt scores depend on the scorer, its backend and the captured layer only, not on the
    # allocation, ranking, merge, schedule or storage: computed once per scorer and kept with the states (copies
    # both ways: a selection may keep what it is given), so the next policy with that scorer replays without them
    kept = None
    if scores is None and isinstance(getattr(states, "scores", None), dict):
        key = ("prompt", policy.scoring, cache.plan.score_impl, policy.budget.layers.kinds)
        kept = states.scores.setdefault(key, [None] * len(states))
    for layer, state in enumerate(states):
        if scores is not None:  # reconstruction scores: no query rows, as the model's own prefill passes them
            compress_prompt_layer(cache, state.queries[:, :, :0], state.keys, state.values, layer, state.scale,
                                  scores=scores[layer])
            continue
        given = None if kept is None or kept[layer] is None else kept[layer].clone()
        used = compress_prompt_layer(cache, state.queries, state.keys, state.values, layer, state.scale, given)
        if kept is not None and given is None:
            kept[layer] = used.clone()
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
    return fed(model, cache, ids, **options)[:, -1]


@torch.no_grad()
def fed(model, cache: KVCompileCache, ids: Tensor, **options) -> Tensor:
    """`feed`, with the logits (B, T, V) of every fed token. The op runs a multi-token decode call token by token
    (each new token its decode step: append, attention, running scores, online eviction, pruning), so these are
    the logits `teacher_forced` gives token by token, in one forward (up to float summation order)."""
    positions = ((cache.seq_length - cache.pad)[:, None] + torch.arange(ids.shape[1])[None]).to(ids.device)
    with compiled(model, cache.policy, **options):  # options: compile()'s (a kvzip policy's tokenizer)
        return model(ids, position_ids=positions, **cache_arg.given(cache)).logits


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


# --- many compressed contexts decoded as one batch --------------------------------------------------------------
#
# An eval decodes one answer per (policy, budget, question) of a context, each from its own compressed cache. On a
# CPU a decode step of a small model is the read of its weights (SmolLM2-135M: about 46 of 63 ms a token in the
# projections), so the answers of a sample decode together: one forward of R tokens a step, one token per cache,
# each layer's attention one call of the engine's batched decode step per batch of caches (kvcompile.engine.batch:
# a batch's pages in one page pool, `DecodeBatch.run`). Caches whose plans' batched steps differ (`batch_key`: a
# storage, a decode step) are separate batches in the same forward; a plan whose steps do not batch decodes alone
# (greedy).

BATCH_ATTENTION = "kvcompile_decode_batch"


def _batch_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, kvcompile_batch=None,
                     **kwargs):
    """transformers AttentionInterface entry of `greedy_together`'s forwards: the packed tokens (1, H, R, d), one
    per cache, through the step's batches (`_StepBatches`)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return kvcompile_batch.run(module.layer_idx, query, key, value, scale).unsqueeze(0), None


def _no_mask(*args, **kwargs):
    return None  # each packed token attends over its own cache only: the batch's step knows which


@dataclass
class _StepBatches:
    """One forward's batches (`DecodeBatch`, one per `batch_key`), each over its rows of the packed tokens."""

    batches: list  # DecodeBatch of each batch with a token this step
    rows: int  # the packed forward's tokens

    def run(self, layer: int, query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
        """Layer `layer` for every batch, its outputs (R, Hq, d) at its requests' rows."""
        if len(self.batches) == 1 and self.batches[0].whole:
            return self.batches[0].run(layer, query, key, value, scale)
        out = None
        for batch in self.batches:
            rows = batch.run(layer, query, key, value, scale)
            if out is None:
                out = rows.new_empty((self.rows, *rows.shape[1:]))
            out[batch.index] = rows
        return out

    def positions(self) -> Tensor:
        first = self.batches[0]
        out = first.positions.new_empty(self.rows)
        for batch in self.batches:
            out[batch.index] = batch.positions
        return out


def _groups(caches: list[KVCompileCache]) -> list[tuple[bool, list[int]]]:
    """(batched, the caches' indices) per batch (`batch_key`), in first-seen order; a cache whose plan's steps do
    not batch is a group of its own, not batched."""
    from kvcompile.engine.batch import batch_key

    groups: dict = {}
    for i, cache in enumerate(caches):
        if cache.seq_length is None or cache.pad.shape[0] != 1:
            raise ValueError("kvcompile: a batched decode takes caches of one sequence each")
        key = batch_key(cache.plan)
        groups.setdefault(("alone", i) if key is None else ("batched", key), []).append(i)
    return [(kind == "batched", members) for (kind, _), members in groups.items()]


def _stepped(model, caches: list[KVCompileCache], groups: list[list[int]], next_token, take, seconds: list) -> None:
    """Steps of the caches of `groups` (each the caches of one batch_key), one forward a step for all of them,
    each group a batch of its own decode path in it: `next_token(i)` is the token cache i is fed next, or None
    once it is done; `take(i, logits)` its logits (V,). A step's (wall, CPU) seconds are shared equally by the caches it fed
    (`seconds[i]`). Each cache holds its own pages again after."""
    import time

    from transformers import AttentionInterface, AttentionMaskInterface

    from kvcompile.engine.batch import decode_path

    AttentionInterface.register(BATCH_ATTENTION, _batch_attention)
    AttentionMaskInterface.register(BATCH_ATTENTION, _no_mask)
    paths = [decode_path(caches[members[0]].plan) for members in groups]
    owned = [set(members) for members in groups]
    adopted = []
    before = model.config._attn_implementation
    try:
        for path, members in zip(paths, groups):
            adopted.append((path, members))
            path.adopt_all([caches[i] for i in members])
        model.set_attn_implementation(BATCH_ATTENTION)
        while True:
            wall, cpu = time.perf_counter(), time.process_time()
            fed = [(i, token) for members in groups for i in members if (token := next_token(i)) is not None]
            if not fed:
                return
            batches = []
            for path, mine in zip(paths, owned):
                if not any(i in mine for i, _ in fed):
                    continue
                step = path.plan([(caches[i] if i in mine else None, 1) for i, _ in fed])
                others = [r for r, (i, _) in enumerate(fed) if i not in mine]
                if step.alone != others or step.failed:  # every cache here decodes in its batch, or the step fails
                    raise RuntimeError("kvcompile: a cache left the batched decode: "
                                       f"{step.failed or sorted(set(step.alone) - set(others))}")
                batches.append(step.batch)
            together = _StepBatches(batches, len(fed))
            ids = torch.tensor([[token for _, token in fed]], device=batches[0].positions.device)
            logits = model(ids, position_ids=together.positions()[None], use_cache=False,
                           kvcompile_batch=together).logits[0]
            faults = [fault for batch in batches for fault in batch.faults]
            if faults:
                raise RuntimeError(f"kvcompile: a cache could not count its token: {faults[0][1]}")
            for (i, _), row in zip(fed, logits):
                take(i, row)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            for i, _ in fed:
                seconds[i][0] += wall / len(fed)
                seconds[i][1] += cpu / len(fed)
    finally:
        model.set_attn_implementation(before)
        for path, members in adopted:
            for i in members:
                path.detach(caches[i])


def _alone(seconds: list, i: int, compute):
    import time

    wall, cpu = time.perf_counter(), time.process_time()
    out = compute()
    seconds[i] = [time.perf_counter() - wall, time.process_time() - cpu]
    return out


@torch.no_grad()
def greedy_together(model, caches: list[KVCompileCache], last_logits: list[Tensor], max_new_tokens: int,
                    eos_token_id=None, until=None, options_of=None,
                    **options) -> tuple[list[list[int]], list[tuple[float, float]]]:
    """`greedy` of many one-sequence caches (each after its prompt, or its question fed), one forward a step for
    all whose plans batch (a batch per `batch_key`): the tokens each would give alone, up to the last bits of the
    forward's matrix products (a product's row can depend on its number of rows). last_logits: each cache's
    prompt logits (1, V) or (V,); `until(i, tokens)`: cache i's answer is complete. Returns each cache's tokens
    and its (wall, CPU) seconds (a batched step's shared equally by the caches it decoded). Each cache holds its
    own pages again after (options, or `options_of(cache)`: compile()'s keywords, for a cache decoded alone).
    (The questions are fed before, one forward each (`feed`): a question of Q tokens is one forward of Q rows,
    the model's weights read once; fed here it would be Q batched forwards of one row per cache, the weights read
    Q times, which measured slower for RULER's 40-token questions.)"""
    stop = set() if eos_token_id is None else set(torch.as_tensor(eos_token_id).reshape(-1).tolist())
    tokens = [[int(logits.reshape(-1, logits.shape[-1])[0].argmax())] for logits in last_logits]
    seconds = [[0.0, 0.0] for _ in caches]

    def next_token(i: int) -> int | None:
        done = len(tokens[i]) >= max_new_tokens or tokens[i][-1] in stop or bool(until and until(i, tokens[i]))
        return None if done else tokens[i][-1]

    groups = _groups(caches)
    for batched, members in groups:
        if not batched:
            i, = members
            tokens[i] = _alone(seconds, i, lambda: greedy(
                model, caches[i], last_logits[i].reshape(1, -1), max_new_tokens, eos_token_id,
                until=None if until is None else (lambda b, ids: until(i, ids)),
                **(options if options_of is None else options_of(caches[i])))[0].tolist())
    batched = [members for is_batched, members in groups if is_batched]
    if batched:  # every batch in one forward a step
        _stepped(model, caches, batched, next_token, lambda i, row: tokens[i].append(int(row.argmax())), seconds)
    return tokens, [tuple(s) for s in seconds]
