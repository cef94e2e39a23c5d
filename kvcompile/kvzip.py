"""The model-level pass of a reconstruction scorer (scoring: kvzip, arXiv:2505.23416).

Per-layer scorers score a layer as soon as its prefill attention is done. KVzip cannot: its scores
are the attention the model gives the cached context while it reads the context again, which needs
every layer's full keys and values first. So a compiled model's forward runs a fresh prompt in three
steps (`prefill`, called by compile()'s forward, hence by generate()):

1. the prompt's forward with every entry of every layer kept (`Reconstruction.keys / values`: the full
   cache, held while scoring, as KVzip holds it); its outputs are the model's, unchanged;
2. one reconstruction forward per chunk of `scoring.chunk` context tokens: the repeat prompt, the chat
   template's turn end and the chunk's tokens, at the positions after the prompt. Each layer's op
   (`engine.reconstruction.reconstruction_step`) attends over the full cache and the input's own keys (what the model
   computes) and records, for the chunk's cached entries, the largest attention any reconstruction
   query of the head's group gives them (`KVzip.score_reconstruction`; on fp32 CPUs from the logits the
   attention kernel computes, in the same pass); it stores nothing, and the cache's length does not move;
3. every layer's prompt entries selected by those scores with the policy's ranking, budget (layers,
   heads, threshold, split) and merge rule: `engine.prefill.compress_prompt_layer`, the per-layer selection
   every other scorer goes through (a cascade of layer budgets runs over the layers in order).

A captured prefill (kvcompile.tools.sweep.capture: the same forward as step 1) replays under a reconstruction
scorer: `scores_of` runs step 2 alone over the captured keys and values, and sweep.replay runs step 3 with
those scores for any allocation, ranking, merge or storage (the scores depend on none of them).

Extra work: a forward over n + k·(p + overlap) tokens (n context tokens, k = ⌈n / chunk⌉ chunks, p the
repeat prompt and turn end), its attention over the n cached entries and its own keys (the C++ attention
kernel on fp32 CPUs, else SDPA), and the score's softmax over each chunk's keys (the first sinks, the
chunk's, the input's own: on fp32 CPUs from the kernel's logits, one more exp per key of the chunk and own
keys, else a second pass); the model's logits are taken at one position (`logits_to_keep=1`). Peak memory: the full cache of
every layer while scoring, plus one block of reconstruction rows' logits (about 2^23 floats).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from kvcompile import cache as cache_arg
from kvcompile.engine.state import Phase
from kvcompile.errors import CompileError

FIRST = "\n\nRepeat the previous context exactly."
LATER = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclass(frozen=True)
class RepeatPrompt:
    """The token ids of KVzip's reconstruction input around each chunk: `first` before the first
    chunk, `later` before the others (then the previous chunk's last `overlap` tokens), `suffix`
    (the chat template's end of the user turn and start of the answer) right before the chunk. `prefix`: the
    chat template's text before a user message's content (system prompt, user header), which
    `scoring: {kvzip: {reconstruct: context}}` leaves out of the reconstruction where a prompt starts with it."""

    first: tuple[int, ...]
    later: tuple[int, ...]
    suffix: tuple[int, ...]
    prefix: tuple[int, ...] = ()

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "RepeatPrompt":
        """KVzip's prompts, in the tokenizer's chat template where it has one (as KVzip and kvpress
        build them: the text between a user message and the assistant's answer), else a newline."""
        suffix, prefix = "\n", ""
        if getattr(tokenizer, "chat_template", None):
            dummy = "dummy context"
            separator = "\n" + "#" * len(dummy)
            text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                                 add_generation_prompt=True, tokenize=False)
            suffix = text.split(separator)[-1]
            prefix = text.split(dummy)[0]  # what precedes a user message's content

        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return cls(ids(FIRST), ids(LATER), ids(suffix), ids(prefix))

    def inputs(self, ids: Tensor, spans: list[tuple[int, int]], overlap: int, offset: int = 0,
               origin: int = 0) -> list[Tensor]:
        """The reconstruction input (B, T_k) of every span [s, e) of the prompt, whose token ids `ids`
        (B, ·) start at position `offset` (from at least `overlap` tokens before the first span, where
        there are that many): `first` before the span at `origin` (where the reconstruction starts), else
        `later` and the `overlap` tokens before s (none before `origin`)."""
        out = []
        for s, e in spans:
            lead = self.first if s == origin else self.later
            head = torch.tensor(lead, dtype=ids.dtype, device=ids.device).expand(ids.shape[0], -1)
            quoted = ids[:, max(origin, s - overlap) - offset:s - offset] if s != origin else ids[:, :0]
            tail = torch.tensor(self.suffix, dtype=ids.dtype, device=ids.device).expand(ids.shape[0], -1)
            out.append(torch.cat([head, quoted, tail, ids[:, s - offset:e - offset]], dim=1))
        return out


def repeat_prompt_for(model, tokenizer=None, repeat_prompt: RepeatPrompt | None = None) -> RepeatPrompt:
    """The repeat prompt compile() gives a reconstruction scorer: the one given, else the given
    tokenizer's, else the tokenizer saved with the model (a local checkpoint folder). CompileError
    when there is none (the prompt is text: its ids are the tokenizer's)."""
    if repeat_prompt is not None:
        return repeat_prompt
    if tokenizer is None:
        path = getattr(model.config, "_name_or_path", "") or ""
        if os.path.isdir(path):
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            except (OSError, ValueError):
                tokenizer = None
    if tokenizer is None:
        raise CompileError("kvcompile: scoring kvzip makes the model read a repeat prompt (text), and no tokenizer "
                           "was found with the model: pass tokenizer=tokenizer (to kvcompile.compile(model, spec, ...), "
                           "kvcompile.compiled or kvcompile.compress_context), or "
                           "repeat_prompt=kvcompile.kvzip.RepeatPrompt(...) with its token ids")
    return RepeatPrompt.from_tokenizer(tokenizer)


@dataclass
class Reconstruction:
    """A reconstruction scorer's state while the prompt runs (`KVCompileCache.reconstruction`)."""

    keys: list[Tensor | None]  # per layer: the prompt's full keys (B, H, N, d), after RoPE
    values: list[Tensor | None]
    scales: list[float | None]
    scores: list[Tensor | None]  # per layer: (B, H, N) float32, filled chunk by chunk
    span: tuple[int, int] | None = None  # the chunk being reconstructed; None while the prompt itself runs
    query_heads: int = 0  # the model's query heads (read at the prompt's first layer)
    chunk: tuple[int, int] | None = None  # under a chunked prefill: the prompt chunk [start, end) this pass
    #   compresses (keys, values and scores then hold that chunk's entries only); None: the prompt in one pass

    @property
    def nbytes(self) -> int:
        """The bytes of the keys and values it holds (the full cache, or the chunk's entries)."""
        return sum(x.nbytes for x in self.keys + self.values if x is not None)

    @property
    def scoring(self) -> bool:
        """A reconstruction forward runs (it adds nothing to the cache)."""
        return self.span is not None


def _ids_and_mask(args, kwargs) -> tuple[Tensor, Tensor | None]:
    ids = args[0] if args else kwargs.get("input_ids")
    if ids is None:
        raise CompileError("kvcompile: scoring kvzip makes the model read the prompt's tokens again; give "
                           "input_ids (inputs_embeds cannot be repeated)")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.bool().all()):
        raise CompileError("kvcompile: scoring kvzip runs unpadded batches only (every sequence of the batch the "
                           "same length, no attention_mask zeros): pass sequences of one length, or one at a time")
    return ids, mask


def _reconstruct(forward, cache, repeat: RepeatPrompt, ids: Tensor, spans: list[tuple[int, int]], overlap: int,
                 at: int, offset: int = 0, origin: int = 0) -> None:
    """KVzip's reconstruction forwards, one per span [s, e) of the prompt (`ids` (B, ·) its tokens from position
    `offset`): the span's repeat input at positions at, at + 1, …, each layer's op recording the span's scores
    in `cache.reconstruction` and storing nothing."""
    rec, b = cache.reconstruction, ids.shape[0]
    for span, inputs in zip(spans, repeat.inputs(ids, spans, overlap, offset=offset, origin=origin)):
        rec.span = span
        positions = torch.arange(at, at + inputs.shape[1], device=ids.device)[None].expand(b, -1)
        forward(inputs, position_ids=positions, **cache_arg.given(cache), kvcompile_cache=cache, use_cache=True,
                logits_to_keep=1)
    rec.span = None


def _score_prompt(forward, cache, repeat: RepeatPrompt, ids: Tensor) -> None:
    """Step 2 of `prefill`: the reconstruction forwards of the whole prompt `ids` (B, N), its chunks cut from
    where the reconstruction starts (`KVzip.context_start`), at the positions after the prompt."""
    scorer = cache.plan.policy.scoring
    n = ids.shape[1]
    start = scorer.context_start(ids, repeat.prefix)  # 0, or after the chat template's prefix
    _reconstruct(forward, cache, repeat, ids, scorer.chunks(n, start), scorer.overlap, at=n, origin=start)


def prefill(forward, cache, repeat: RepeatPrompt, args: tuple, kwargs: dict):
    """A fresh prompt under a reconstruction scorer (steps 1–3 of the module's docstring), through the
    model's `forward` (the compiled model's, with `kvcompile_cache` in kwargs). Returns the prompt's
    forward output (the model's own: its attention saw every entry)."""
    from kvcompile.engine.prefill import compress_prompt_layer

    ids, _ = _ids_and_mask(args, kwargs)
    layers = cache.plan.num_layers
    rec = Reconstruction([None] * layers, [None] * layers, [None] * layers, [None] * layers)
    cache.enter(Phase.PROMPT, reconstruction=rec, compressing=None)  # (the whole prompt in one pass)
    try:
        out = forward(*args, **cache_arg.given(cache), **kwargs)
        b = ids.shape[0]
        _score_prompt(forward, cache, repeat, ids)
        for layer in range(layers):
            k, v = rec.keys[layer], rec.values[layer]
            queries = k.new_empty(b, rec.query_heads, 0, k.shape[-1])  # the scores are given: no query rows
            compress_prompt_layer(cache, queries, k, v, layer, rec.scales[layer], scores=rec.scores[layer])
            rec.keys[layer] = rec.values[layer] = rec.scores[layer] = None  # each layer's full cache freed in turn
    finally:  # (the last layer's compression ended the prompt: engine.prefill.compress_prompt_layer)
        if cache.phase is Phase.PROMPT:
            cache.enter(Phase.PROMPT, reconstruction=None)
    return out


def scores_of(forward, cache, repeat: RepeatPrompt, ids: Tensor, keys: list[Tensor], values: list[Tensor],
              scales: list[float], query_heads: int) -> list[Tensor]:
    """Step 2 of `prefill` alone, for a prompt `ids` (B, N) whose forward already ran with every entry kept (a
    captured prefill, kvcompile.tools.sweep: the same forward, so the same keys and values): every layer's full
    keys and values (B, H, N, d) and softmax scale given, `cache` fresh (the compiled model's, of the scoring
    policy). The cache is put where step 1 leaves it (the prompt started, its length N, every layer's full cache
    held), the reconstruction forwards run as in `prefill` through the model's `forward`, and every layer's
    scores (B, H, N) float32 are returned; nothing is stored and nothing is selected. A hybrid model's local
    layers read the windows the cache holds (the prompt's: set them first)."""
    from kvcompile.engine.prefill import start_prompt

    b, n = ids.shape
    layers = cache.plan.num_layers
    rec = Reconstruction(list(keys), list(values), list(scales), [None] * layers, query_heads=query_heads)
    cache.enter(Phase.PROMPT, reconstruction=rec, compressing=None)
    try:
        start_prompt(cache, None, b, n, keys[0])  # what the prompt's first layer does (reconstruction_step)
        cache.advance(n)  # what the prompt's last layer does
        _score_prompt(forward, cache, repeat, ids)
    finally:
        cache.enter(Phase.PROMPT, reconstruction=None)
    return rec.scores


def prefill_chunk(forward, cache, repeat: RepeatPrompt, args: tuple, kwargs: dict):
    """One chunk [start, end) of a prompt that a reconstruction scorer compresses chunk by chunk
    (schedule.prefill: chunk; reference.ChunkedKVzip is the specification), through the model's `forward`:

    1. the chunk's forward: each layer's queries attend over the entries the layer holds and the chunk
       (causal), and the chunk's keys and values are held (`engine.reconstruction._chunk_attention`);
    2. one reconstruction forward per span of `scoring.chunk` tokens of the chunk (from the end of the chat
       template's prefix under reconstruct: context, where the first chunk starts with it; the repeat prompt:
       `first` at the first span, else `later` and the `overlap` tokens before the span, from this call or the
       previous one; the turn end; the span), at the positions after the chunk; its queries attend over the
       held entries, the chunk and their own keys, and record the span's scores; nothing is stored;
    3. every layer selects among its held entries and the chunk back to the budget of the tokens seen
       (`engine.reconstruction.select_reconstructed`, a chunked prompt's selection).

    The cache was told the prompt's length (`expect_prompt`: generate(), compile()'s forward); the call
    brings the next chunk: it starts where the cache ends and ends at a multiple of c or at the prompt's
    end. Returns the chunk's forward output."""
    from kvcompile.engine.reconstruction import select_reconstructed

    ids, _ = _ids_and_mask(args, kwargs)
    plan = cache.plan
    scorer = plan.policy.scoring
    prompt = cache.compressing
    c = plan.prefill_chunk
    t = ids.shape[1]
    start = cache.seq_length
    end = start + t
    if start % c or t > c or end > prompt.length or (end % c and end != prompt.length):
        raise CompileError(f"kvcompile: {plan.policy.name} reconstructs its prompt chunk by chunk (every {c} "
                           f"tokens); a call of the prompt ({prompt.length} tokens) must bring the next chunk, "
                           f"[{start}, {min(start + c, prompt.length)}), not {t} tokens: give the prompt in one "
                           f"call, or generate(prefill_chunk_size={c})")
    layers = plan.num_layers
    cache.enter(Phase.PROMPT, reconstruction=Reconstruction([None] * layers, [None] * layers, [None] * layers,
                                                            [None] * layers, chunk=(start, end)))
    try:
        out = forward(*args, **cache_arg.given(cache), **kwargs)
        known = ids if prompt.ids is None else torch.cat([prompt.ids, ids], dim=1)  # from position end - its width
        if start == 0:  # reconstruct: context: after the chat template's prefix, where the first chunk starts with it
            prompt.origin = scorer.context_start(ids, repeat.prefix)
        spans = [(s, min(s + scorer.chunk, end)) for s in range(max(start, prompt.origin), end, scorer.chunk)]
        _reconstruct(forward, cache, repeat, known, spans, scorer.overlap, at=end, offset=end - known.shape[1],
                     origin=prompt.origin)
        for layer in range(layers):
            select_reconstructed(cache, layer)
        prompt.ids = known[:, known.shape[1] - min(scorer.overlap, known.shape[1]):]
    finally:
        cache.enter(Phase.PROMPT, reconstruction=None)
    if end == prompt.length:
        cache.enter(Phase.COMPRESSED)
    return out


def chunk_forward(forward, repeat: RepeatPrompt):
    """`forward` for compile()'s `_forward_in_chunks`: each chunk through `prefill_chunk`."""
    def run(*args, **kwargs):
        cache = cache_arg.take(kwargs)
        return prefill_chunk(forward, cache, repeat, args, kwargs)

    return run


def check(plan, mode: str) -> None:
    """Refuse, at compile(), what a reconstruction scorer cannot run (CompileError, with the reason)."""
    name = plan.policy.name
    if mode == "compiled":
        raise CompileError(f"kvcompile: {name} scores by a second, model-level forward (scoring kvzip) that the "
                           "compiled entry's traced graph does not run; compile with mode='eager'")
    if plan.shard is not None:
        raise CompileError(f"kvcompile: {name} (scoring kvzip) under tensor parallelism is not supported yet: its "
                           "scores are per KV head (a rank would gather nothing beyond what its allocator gathers), "
                           "but the reconstruction pass has not been run sharded; load the model without tp_plan")
    schedule = plan.policy.schedule
    if schedule.decode is not None:
        raise CompileError(f"kvcompile: {name}: scoring kvzip scores the prompt by reconstruction, once per chunk; "
                           "it cannot re-score while decoding (schedule.decode): drop schedule.decode")
