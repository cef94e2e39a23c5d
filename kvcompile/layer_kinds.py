"""The kinds of a model's layers (transformers' `config.layer_types`) and which of them a policy compresses.

A hybrid model mixes layers that attend to every earlier token (`full_attention`) with local ones that see a
window of recent positions (`sliding_attention`: Gemma 2 and 3, gpt-oss) or the positions of their own chunk
(`chunked_attention`: Llama 4). A policy applies to the kinds its
`layers` part names (`kinds`, default `full_attention` only, docs/SPECS.md); every other layer is left to its
window (kvcompile.engine.window). The plan's engine (pages, budgets, scores) then runs over the layers the
policy applies to only, numbered 0.. in the model's order: `LayerKinds.engine[i]` is model layer i's number
there, None for a layer left to its window.
"""
from __future__ import annotations

from dataclasses import dataclass

# the layer kinds a spec may name (transformers' names); kvcompile's engine compresses full_attention layers
KINDS = ("full_attention", "sliding_attention", "chunked_attention")
# the local kinds kvcompile runs, left to their window, and the config field that gives each its span
WINDOWED = ("sliding_attention", "chunked_attention")
SPAN = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}


class LayerKindError(ValueError):
    """The policy's kinds do not fit the model's layers (said before anything runs)."""


def model_kinds(config) -> tuple[str, ...]:
    """Each layer's kind: config.layer_types, else every layer full_attention."""
    types = getattr(config, "layer_types", None)
    return tuple(types) if types else ("full_attention",) * config.num_hidden_layers


@dataclass(frozen=True)
class LayerKinds:
    """A hybrid model's layers under a policy: each model layer's kind, its window where it is left to it, and
    its number among the layers the policy compresses."""

    kinds: tuple[str, ...]  # per model layer
    windows: tuple[int | None, ...]  # per model layer: the window (chunked: the chunk) of a layer left to it, else
    #   None
    engine: tuple[int | None, ...]  # per model layer: its index among the compressed layers, else None

    @property
    def num_layers(self) -> int:
        """The model's layers."""
        return len(self.kinds)

    def chunked(self, layer: int) -> bool:
        """Whether model layer `layer` is a chunked one (its window is its chunk: kvcompile.engine.window)."""
        return self.kinds[layer] == "chunked_attention"

    @property
    def compressed(self) -> int:
        """The layers the policy compresses."""
        return sum(i is not None for i in self.engine)


def layer_kinds(config, applies: tuple[str, ...]) -> LayerKinds | None:
    """The model's layers under a policy applying to the kinds `applies`; None where every layer is a
    full_attention layer the policy compresses (the plain case). LayerKindError for a kind the model does not
    have, a local kind named (its window or chunk bounds it; kvcompile does not compress inside one), a local
    kind kvcompile does not run, or a local kind without its span in the config."""
    kinds = model_kinds(config)
    missing = [k for k in applies if k not in kinds]
    if missing:
        raise LayerKindError(f"kvcompile: the policy applies to {' and '.join(missing)} layers (layers: kinds), "
                             f"which this model does not have; its layers are {_count(kinds)}")
    local = [k for k in applies if k != "full_attention"]
    if local:
        raise LayerKindError(f"kvcompile: the policy applies to {' and '.join(local)} layers (layers: kinds); a "
                             "local layer's window already bounds its cache (a chunked layer's, its chunk) and "
                             "kvcompile leaves it to its window (compressing inside a window or a chunk is not "
                             "implemented): name full_attention only")
    if set(kinds) == {"full_attention"}:
        return None
    other = sorted(set(kinds) - {"full_attention"} - set(WINDOWED))
    if other:
        raise LayerKindError(f"kvcompile: this model has {' and '.join(other)} layers (config.layer_types), which "
                             f"kvcompile does not run; it runs full_attention and {', '.join(WINDOWED)} layers")
    spans = {}
    for kind in set(kinds) - {"full_attention"}:
        span = getattr(config, SPAN[kind], None)
        if not span or span < 1:
            raise LayerKindError(f"kvcompile: this model has {kind} layers but no {SPAN[kind]} ({span!r}) in its "
                                 "config")
        spans[kind] = int(span)
    engine, n = [], 0
    for kind in kinds:
        engine.append(n if kind in applies else None)
        n += kind in applies
    return LayerKinds(kinds, tuple(None if k in applies else spans[k] for k in kinds), tuple(engine))


def _count(kinds) -> str:
    return ", ".join(f"{kinds.count(k)} {k}" for k in dict.fromkeys(kinds))
