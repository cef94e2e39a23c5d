"""One compressed context, many questions and turns (query-agnostic compression).

A context (a document, a system prompt) is prefilled once with a policy compiled in, and kept
compressed; each question continues from its own copy of that cache, so the context is never
recomputed and a copy costs memory proportional to what the policy kept.

    ctx = kvcompile.compress_context(model, context_ids, "expected_attention", per_head=64)
    a1 = ctx.answer(question1_ids, max_new_tokens=32)     # (B, ≤ 32) new tokens
    a2 = ctx.answer(question2_ids, max_new_tokens=32)     # from the same compressed context
    chat = ctx.conversation()
    r1 = chat.say(turn1_ids, max_new_tokens=32)           # the turn and its answer join the cache
    r2 = chat.say(turn2_ids, max_new_tokens=32)

Semantics (docs/SPECS.md "One compressed context, many questions and turns"): the context is
compressed by the policy exactly as a prompt is (its prefill schedule: one pass, or chunk by chunk);
a question's tokens and the generated answer are appended to a copy of the compressed cache as
generated tokens are (each attends to every entry held and to the tokens before it; the policy's
decode schedule runs on them as in generate()). A conversation keeps one cache: each turn's tokens,
then its answer, are appended to it, and the next turn continues from there. Only a query-agnostic
scorer makes this meaningful (its scores of the context do not depend on what follows), but any
policy runs: with a query-aware one (snapkv, lava) the context's last window votes instead.
"""
from __future__ import annotations

import copy
import itertools
import threading
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvcompile import cache as cache_arg
from kvcompile.cache import KVCompileCache
from kvcompile.integrations.generate import compile as compile_model
from kvcompile.policy import Policy


def _ids(x, name: str, batch: int | None = None, vocab: int | None = None) -> Tensor:
    """Token ids (N,) or (B, N) as a (B, N) long tensor; refused: ids that are not integers (a float id is
    not truncated), an empty or other shape, another number of rows than `batch`, ids outside the vocabulary."""
    ids = torch.as_tensor(x)
    if ids.numel() and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
        raise TypeError(f"kvcompile: {name} must be integer token ids, got {ids.dtype} (ids are not rounded or "
                        "truncated: convert them yourself if that is what they mean)")
    ids = ids.long()
    ids = ids.reshape(1, -1) if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"kvcompile: {name}: expected token ids of shape (N,) or (B, N) with N >= 1, got "
                         f"{tuple(ids.shape)}")
    if batch is not None and ids.shape[0] != batch:
        raise ValueError(f"kvcompile: {name}: the context has {batch} sequences, these ids {ids.shape[0]}")
    if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"kvcompile: {name}: token ids must lie in [0, {vocab}) (the model's vocabulary), got "
                         f"{int(ids.min())} … {int(ids.max())}")
    return ids


def _mask(mask, shape: tuple[int, ...], what: str) -> Tensor:
    """An attention mask of `shape` ((N,) given for one sequence is (1, N)), 1 at real tokens and 0 at pads."""
    mask = torch.as_tensor(mask)
    mask = mask.reshape(1, -1) if mask.dim() == 1 and len(shape) == 2 and shape[0] == 1 else mask
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"kvcompile: attention_mask has shape {tuple(mask.shape)}, and {what} {tuple(shape)}: one "
                         "entry per token (1 a real token, 0 a pad)")
    if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("kvcompile: attention_mask must hold 1 (a real token) or 0 (a pad) only")
    return mask.long()


def _vocab(model) -> int:
    return model.get_input_embeddings().weight.shape[0]


# generate() arguments a compressed context gives itself (the tokens so far, and their cache)
_GIVEN = ("inputs", "input_ids", "inputs_embeds", "past_key_values", "cache")


def _continuation(ids: Tensor, mask: Tensor, new, name: str, kwargs: dict, vocab: int):
    """The ids and mask of generate() for `new` tokens after `ids` / `mask` (a compressed context, or a
    conversation so far), and its other kwargs; refused before anything runs: what the context gives itself,
    and an attention mask that is not the new tokens' (all real: a pad after the context would be a hole,
    which kvcompile does not mask) or the whole sequence's ending in those."""
    given = [key for key in _GIVEN if key in kwargs]
    if given:
        raise TypeError(f"kvcompile: {name.removesuffix('_ids')} generation continues the compressed context's own "
                        f"ids and cache: {', '.join(given)} cannot be given (pass only {name} and generate() "
                        "options; a fresh sequence is model.generate's)")
    if kwargs.get("use_cache") is False:
        raise TypeError(f"kvcompile: {name.removesuffix('_ids')} generation continues the compressed context's "
                        "cache: use_cache=False would run without it (leave use_cache unset)")
    question = _ids(new, name, ids.shape[0], vocab).to(ids.device)
    kwargs = dict(kwargs)
    whole = torch.cat([mask, torch.ones_like(question)], dim=1)
    given_mask = kwargs.pop("attention_mask", None)
    if given_mask is not None:
        given_mask = torch.as_tensor(given_mask)
        full = given_mask.dim() == 2 and given_mask.shape[-1] == whole.shape[1] != question.shape[1]
        part = _mask(given_mask, whole.shape if full else question.shape,
                     f"the sequence so far and {name} have" if full else f"{name} have").to(ids.device)
        if full and not torch.equal(part[:, :mask.shape[1]], mask):
            raise ValueError("kvcompile: attention_mask: its first entries differ from the compressed context's "
                             "mask (give the mask of the new tokens alone, or the whole sequence's)")
        if not bool(part[:, -question.shape[1]:].bool().all()):
            raise ValueError(f"kvcompile: attention_mask marks a pad in {name}: a pad after the context would be "
                             "a hole, and kvcompile masks only left padding (give each row's tokens without pads, "
                             "rows of equal length)")
    kwargs.setdefault("do_sample", False)
    return torch.cat([ids, question], dim=1), whole, kwargs


def _twin(model):
    """`model` again, sharing its weights: its modules, config and generation config are copies (a deep copy
    whose memo maps every parameter and buffer, and accelerate's offloaded weights, to themselves), so
    compiling the twin changes nothing the user's model runs and copies no weight."""
    memo = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    for module in model.modules():
        hooks = [getattr(module, "_hf_hook", None)]
        hooks += list(getattr(hooks[0], "hooks", ()))  # accelerate's SequentialHook
        for hook in hooks:
            for name in ("weights_map", "tied_params_map"):  # offloaded weights, read where a layer runs
                shared = getattr(hook, name, None)
                if shared is not None:
                    memo[id(shared)] = shared
    manager = getattr(model, "_cached_continuous_batching_manager", None)
    if manager is not None:  # a running engine (its threads) belongs to the user's model
        memo[id(manager)] = None
    return copy.deepcopy(model, memo)


@dataclass
class CompressedContext:
    """A context prefilled once and held compressed (`compress_context`). `cache`: the compressed
    KVCompileCache (never written after compress_context: each answer works on a deep copy);
    `ids` (B, N) and `attention_mask` (B, N) the context's tokens; `logits` (B, V) the logits of
    its last position; `policy` what compressed it; `model` the user's model, never changed;
    `runner` the twin of it compiled with `policy` (the model's weights, its own modules) that runs
    the context and every answer.

    Thread-safe: answers, generate() calls and conversations on several threads each work on a copy
    of the cache with the runner, which no call changes (as concurrent generate() calls on a compiled
    model); one Conversation is one sequence of turns: a second say() while one runs is refused."""

    model: object
    policy: Policy
    cache: KVCompileCache
    ids: Tensor
    attention_mask: Tensor
    logits: Tensor = field(repr=False)
    runner: object = field(repr=False, default=None)

    def copy_cache(self) -> KVCompileCache:
        """An independent copy of the compressed cache (its own pages: memory ∝ the kept entries)."""
        return copy.deepcopy(self.cache)

    def generate(self, question_ids, **kwargs):
        """`model.generate` of the context followed by `question_ids` (B, T), continuing from a copy of
        the compressed cache (the context is not recomputed); its sequences hold the context too.

        kwargs go to generate(): max_new_tokens, sampling (do_sample, temperature, top_k, top_p, ...), logits
        processors and stopping criteria, min_new_tokens, return_dict_in_generate, output_scores /
        output_logits, prompt_lookup_num_tokens or assistant_model (where the policy allows them,
        docs/GENERATE.md), prefill_chunk_size, and `attention_mask` (the question's: all ones, or the
        whole sequence's). Refused before anything runs: num_beams or num_return_sequences above 1 (a
        compressed context holds one row per sequence), use_cache=False, and the ids, embeddings or cache
        the context gives itself."""
        ids, mask, kwargs = _continuation(self.ids, self.attention_mask, question_ids, "question_ids", kwargs,
                                          _vocab(self.runner))
        with torch.no_grad():
            return self.runner.generate(ids, attention_mask=mask, **cache_arg.given(self.copy_cache()), **kwargs)

    def answer(self, question_ids, max_new_tokens: int = 32, **kwargs) -> Tensor:
        """The greedy answer to `question_ids` (B, T): the new tokens (B, ≤ max_new_tokens)."""
        out = self.generate(question_ids, max_new_tokens=max_new_tokens, **kwargs)
        sequences = out.sequences if hasattr(out, "sequences") else out
        return sequences[:, self.ids.shape[1] + _ids(question_ids, "question_ids").shape[1]:]

    def conversation(self) -> "Conversation":
        """A multi-turn conversation over this context, on its own copy of the cache."""
        return Conversation(self, self.copy_cache(), self.ids, self.attention_mask)


@dataclass
class Conversation:
    """Turns after a compressed context, on one cache: each turn's tokens and its answer are appended
    to it (see the module docstring). `ids`/`attention_mask`: every token so far."""

    context: CompressedContext
    cache: KVCompileCache
    ids: Tensor
    attention_mask: Tensor
    _turn: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def say(self, turn_ids, max_new_tokens: int = 32, **kwargs) -> Tensor:
        """Append the turn `turn_ids` (B, T), generate greedily; returns the answer (B, ≤ max_new_tokens),
        which joins the conversation (the next turn follows it). kwargs: as CompressedContext.generate's.
        A conversation is one sequence of turns: a say() while another runs (another thread) is refused
        (RuntimeError; the turns of several conversations, or answers of their context, run at once)."""
        ids, mask, kwargs = _continuation(self.ids, self.attention_mask, turn_ids, "turn_ids", kwargs,
                                          _vocab(self.context.runner))
        if not self._turn.acquire(blocking=False):
            raise RuntimeError("kvcompile: this conversation's previous turn is still running (say() on another "
                               "thread): a conversation is one sequence of turns, each continuing the last; give "
                               "each thread its own ctx.conversation(), or wait for the turn")
        try:
            with torch.no_grad():
                out = self.context.runner.generate(ids, attention_mask=mask, **cache_arg.given(self.cache),
                                                  max_new_tokens=max_new_tokens, **kwargs)
            sequences = out.sequences if hasattr(out, "sequences") else out
            self.ids, self.attention_mask = sequences, torch.cat(
                [mask, torch.ones_like(sequences[:, ids.shape[1]:])], dim=1)
        finally:
            self._turn.release()
        return sequences[:, ids.shape[1]:]


def compress_context(model, context_ids, spec, attention_mask=None, *, tokenizer=None, repeat_prompt=None,
                     **overrides) -> CompressedContext:
    """Prefill `context_ids` ((N,) or (B, N), left-padded with `attention_mask`) once with `spec`
    (a name, path, mapping or Policy; overrides as in load_spec) and keep it compressed.
    tokenizer / repeat_prompt: as in kvcompile.compile, for a reconstruction scorer (scoring: kvzip). `model` is left
    as it is (plain, or compiled with its own policy): a twin of it that shares its weights is compiled
    with `spec` and runs the context and its answers (`CompressedContext.runner`; its generation defaults
    are model.generation_config as it is now: pass generate() options per call). Works for any policy;
    meant for query-agnostic ones (expected_attention, knorm), whose compression does not depend on the
    question."""
    from kvcompile.spec import load_spec

    policy = spec if isinstance(spec, Policy) and not overrides else load_spec(spec, **overrides)
    ids = _ids(context_ids, "context_ids", vocab=_vocab(model))
    mask = torch.ones_like(ids) if attention_mask is None else _mask(attention_mask, ids.shape, "context_ids have")
    mask = mask.to(ids.device)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # as generate() positions a left-padded batch
    runner = compile_model(_twin(model), policy, tokenizer=tokenizer, repeat_prompt=repeat_prompt)
    with torch.no_grad():
        cache = KVCompileCache.from_plan(runner.kvcompile_plan)
        out = runner(ids, attention_mask=mask, position_ids=positions, **cache_arg.given(cache))
    return CompressedContext(model, policy, cache, ids, mask, out.logits[:, -1], runner)


# --- compressed sequences kept for the requests that continue them (kvcompile serve --reuse-context) ---------

@dataclass
class KeptSequence:
    """A finished request's compressed cache, kept for a later request that continues it. `ids`: its prompt then
    its answer (every token, as generated); `cache` holds `ids[:-1]` as the policy left them (generate()'s
    cache: the last answer token was never fed), so a continuation feeds `prompt[len(ids) - 1:]`, exactly as
    `Conversation.say` (and `generate(past_key_values=...)`) continue; `nbytes` what the cache holds; `key`
    names the pool blocks that account for it."""

    ids: tuple[int, ...]
    cache: KVCompileCache = field(repr=False)
    nbytes: int
    key: str
    lent: int = field(default=0, compare=False)  # continuations using it now (`match(lend=True)`, `give_back`)


class KeptSequences:
    """Kept compressed sequences, least recently used dropped first so that their bytes stay within `max_bytes`.

    A request's token ids reuse the longest kept sequence they start with (`match`): every token of it, answer
    included; a prompt that diverges anywhere inside a kept sequence does not match it. Thread-safe.

    A sequence lent to a continuation (`match(..., lend=True)`, until `give_back`) holds its memory while the
    continuation runs, so it counts against the bound until it is given back: it is never the one dropped to make
    room, and one replaced while lent leaves the kept sequences but stays counted (`nbytes`) and is handed back for
    its memory to be released only by the last `give_back`. A new sequence that cannot fit beside the lent ones
    is not kept."""

    def __init__(self, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"kvcompile: the bound of kept sequences must be at least 1 byte, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: dict[tuple[int, ...], KeptSequence] = {}  # least recently used first
        self._replaced: list[KeptSequence] = []  # replaced while lent: counted until given back
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """The bytes of the kept sequences and of those replaced while a continuation still uses them."""
        with self._lock:
            return self._nbytes()

    def _nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values()) + sum(e.nbytes for e in self._replaced)

    def match(self, ids, lend: bool = False) -> KeptSequence | None:
        """The longest kept sequence `ids` start with (now the most recently used), or None; `lend`: lent to the
        caller until its `give_back`."""
        ids = tuple(ids)
        with self._lock:
            best = None
            for entry in self._entries.values():
                n = len(entry.ids)
                if n <= len(ids) and ids[:n] == entry.ids and (best is None or n > len(best.ids)):
                    best = entry
            if best is not None:
                self._entries[best.ids] = self._entries.pop(best.ids)
                best.lent += lend
            return best

    def give_back(self, entry: KeptSequence) -> list[KeptSequence]:
        """A continuation is done with `entry` (lent by `match`); returns it if it was replaced meanwhile and no
        other continuation uses it, for its memory to be given back."""
        with self._lock:
            if entry.lent < 1:
                raise RuntimeError(f"kvcompile: kept sequence {entry.key} given back more often than lent")
            entry.lent -= 1
            if entry.lent == 0 and any(e is entry for e in self._replaced):
                self._replaced = [e for e in self._replaced if e is not entry]
                return [entry]
            return []

    def put(self, entry: KeptSequence) -> list[KeptSequence]:
        """Keep `entry` (replacing one of the same ids), dropping the least recently used sequences no continuation
        uses until the bytes fit; returns what was dropped (`entry` itself when it cannot fit), for its memory to
        be given back."""
        with self._lock:
            held = sum(e.nbytes for e in self._entries.values() if e.lent) + sum(e.nbytes for e in self._replaced)
            if held + entry.nbytes > self.max_bytes:  # beside what continuations hold (or alone) it cannot fit
                return [entry]
            dropped, old = [], self._entries.pop(entry.ids, None)
            if old is not None:
                (self._replaced if old.lent else dropped).append(old)
            self._entries[entry.ids] = entry
            while self._nbytes() > self.max_bytes:  # ends: what is lent fits beside `entry`
                dropped.append(self._entries.pop(next(e.ids for e in self._entries.values() if not e.lent)))
            return dropped

    def clear(self) -> list[KeptSequence]:
        """Drop every sequence (the server stops): all of them, lent or replaced, for their memory to be given
        back."""
        with self._lock:
            dropped = list(self._entries.values()) + self._replaced
            self._entries.clear()
            self._replaced = []
            return dropped
