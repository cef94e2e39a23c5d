"""The cache's phases and the state a prompt carries across layers and calls, in declared dataclasses that the
cache (kvcompile.cache.KVCompileCache) holds and the engine's phases read and write (docs/INTERNALS.md "The
cache's phases"; a generation's, `DecodeState`, is its owner's: kvcompile.engine.decode)."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch
from torch import Tensor


class Phase(enum.Enum):
    """What a cache holds; it moves only along NEXT (`KVCompileCache.enter`), or back to EMPTY by reset()."""

    EMPTY = "empty"  # nothing: a fresh or reset cache
    PROMPT = "taking a prompt"  # a prompt arrives (held or compressed chunk by chunk, reconstructed) and compresses
    COMPRESSED = "holding a compressed prompt"  # every layer compressed, nothing generated yet
    DECODING = "decoding"  # tokens after the prompt


NEXT = {Phase.EMPTY: (Phase.PROMPT,), Phase.PROMPT: (Phase.PROMPT, Phase.COMPRESSED),
        Phase.COMPRESSED: (Phase.DECODING,), Phase.DECODING: ()}
# the state each phase holds, each written by its owning module (docs/INTERNALS.md, tests/test_cache_states.py)
HOLDS = {Phase.EMPTY: (), Phase.PROMPT: ("prompt", "chunks", "compressing", "reconstruction"),
         Phase.COMPRESSED: ("prompt",), Phase.DECODING: ("prompt", "decoding")}


def device_of(state) -> torch.device | None:
    """The device of a state dataclass's tensors (its first tensor field's: they all live on one)."""
    for f in dataclasses.fields(state):
        x = getattr(state, f.name)
        if isinstance(x, Tensor):
            return x.device
    return None


def rows_of(state, index: Tensor):
    """A copy of a state dataclass with every batch-first tensor (lists of them too) indexed by rows."""
    return map_tensors(state, lambda x: x[index.to(x.device)] if x.dim() >= 1 else x)


def map_tensors(state, fn):
    """A copy of a state dataclass with fn applied to every tensor field (and to the tensors of list fields)."""
    def apply(x):
        if isinstance(x, Tensor):
            return fn(x)
        if isinstance(x, list):
            return [apply(y) for y in x]
        return x

    return dataclasses.replace(state, **{f.name: apply(getattr(state, f.name)) for f in dataclasses.fields(state)})


@dataclass
class PromptState:
    """What every layer's prompt compression reads; made by `engine.prefill.start_prompt` at layer 0."""

    valid: Tensor  # (B, N) bool: real prompt tokens (left pads False)
    lengths: Tensor  # (B,) real prompt lengths n_b
    pad: Tensor  # (B,) left pads
    width: int  # N: prompt length with pads
    totals: Tensor | None  # (B, L) layer totals known from the lengths (None: threshold or cascade)
    entropy: list[Tensor]  # cascade: the (B,) entropy of every layer compressed so far
    progress: object | None = None  # a tqdm bar over the layers, or None
    held: list[Tensor] = dataclasses.field(default_factory=list)  # cascade: (B,) entries each layer holds
    #   as the cascade defines it (a lazy cascade's pages may still hold more, see Plan.lazy_cascade)
    protected: Tensor | None = None  # cascade: (B,) protected entries of a layer (the same in every layer)
    reserved: list[Tensor] = dataclasses.field(default_factory=list)  # layers: global: (B,) entries each layer
    #   keeps outside the ranking (protected, floors)
    pools: list[list] = dataclasses.field(default_factory=list)  # layers: global: per layer, per sequence the
    #   allocation.Pool of its ranked entries among the best of the layers seen so far


@dataclass
class PromptChunks:
    """A prompt that arrives in chunks (generate(prefill_chunk_size=...)): every layer's keys
    and values (and the queries the scorer will read) are held until the chunk that ends the
    prompt, which then compresses the layer exactly as one pass over the prompt would."""

    length: int  # the whole prompt's length, pads included
    queries: list[Tensor | None]  # per layer: the latest query rows so far (B, Hq, ≤R, d)
    keys: list[Tensor | None]  # per layer: (B, H, seen, d)
    values: list[Tensor | None]


@dataclass
class ChunkedPrompt:
    """A prompt compressed while it arrives in chunks (schedule.prefill: chunk; engine.chunked.chunked_prefill):
    every call brings the next chunk of at most `plan.prefill_chunk` tokens, compressed back to the
    budget before the next one; the calls after `length` tokens decode."""

    length: int  # the whole prompt's length, pads included
    ids: Tensor | None = None  # a reconstruction scorer (kvcompile.kvzip.prefill_chunk): the prompt's last token
    #   ids so far (B, ≤ overlap), which the next chunk's repeat prompt quotes
    origin: int = 0  # a reconstruction scorer: where its reconstruction starts (after the chat template's prefix
    #   under reconstruct: context, found in the first chunk)
