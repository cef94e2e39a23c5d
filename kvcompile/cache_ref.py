"""How a KVCompileCache reaches `torch.ops.kvcompile.attend`: its `CacheRef` and its `token`.

An op's arguments are tensors, scalars and, since torch 2.13, registered opaque Python objects
(`torch._library.opaque_object`). Every KVCompileCache carries two things the op takes
(docs/INTERNALS.md "The op and its two entries"):

- `cache.ref`, a `CacheRef`: an opaque *reference* object naming the cache. It holds the cache
  weakly, so a compiled graph, a guard or an example input that keeps the reference does not keep
  the cache alive (a call through a collected cache's reference raises). Under torch.compile a
  reference object is a graph input, never a constant, and dynamo guards only on its type: one
  graph serves every cache. It pickles (`__reduce__`) to a reference naming nothing, the same bytes
  for every cache: Inductor's FX graph cache and AOTAutograd's cache pickle a graph's example
  inputs into their keys, so a second process (another cache) finds the first one's graphs.
- `cache.token`, a (1,) int64 CPU tensor: the op's declared mutation. The op writes the cache
  (pages, lengths, scores), which no schema can name; it bumps `token` in place instead, which the
  schema declares (`Tensor(a!) token`), so functionalization and Inductor see every call as a
  write of that cache's state and never reorder, merge or drop one.

`cache_input(ref, token)` is the compiled entry's marker: its traced function
(`kvcompile.passes.backend`) calls it first, so that dynamo makes the reference and the token graph
inputs (dynamo drops inputs nothing in the traced code reads, and the attention calls that read them
are only inserted later, by the rewrite pass); the rewrite wires its arguments into every
`kvcompile.attend` call and erases it. It never runs in a compiled graph: run eagerly, it raises
`NotTraced`, which is how the compiled entry learns that no compiled graph fits a call.
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase


class CacheRef(OpaqueBase):
    """The op's handle on one KVCompileCache: a weak reference, opaque to torch.compile."""

    __slots__ = ("_cache",)

    def __init__(self, cache=None):
        self._cache = None if cache is None else weakref.ref(cache)

    @property
    def cache(self):
        """The KVCompileCache this reference names; RuntimeError once it was collected (or for a reference that
        was pickled: it names nothing)."""
        cache = None if self._cache is None else self._cache()
        if cache is None:
            raise RuntimeError("kvcompile: this CacheRef names no live KVCompileCache (the cache was collected, or "
                               "the reference was unpickled, which names nothing): pass a live cache's own "
                               "`cache.ref`")
        return cache

    def __reduce__(self):
        # nothing of the cache: graph cache keys pickle example inputs (module doc)
        return CacheRef, ()

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self  # a reference; a copied KVCompileCache makes its own (KVCompileCache.__deepcopy__)

    def __repr__(self) -> str:
        live = self._cache is not None and self._cache() is not None
        return f"CacheRef({'live' if live else 'dead'})"


register_opaque_type(CacheRef, typ="reference")


def new_token() -> Tensor:
    """A cache's token: (1,) int64 on the CPU, made outside inference mode so that the op may bump it in
    any mode (a cache made under torch.inference_mode is used outside it too)."""
    with torch.inference_mode(False):
        return torch.zeros(1, dtype=torch.int64)


class NotTraced(RuntimeError):
    """`cache_input` ran eagerly: the compiled entry's traced function ran without a compiled graph."""


@torch.library.custom_op("kvcompile::cache_input", mutates_args=())
def cache_input(cache: CacheRef, token: Tensor) -> None:
    """The compiled entry's marker of its cache inputs (module doc); erased from every graph."""
    raise NotTraced("kvcompile: no compiled graph of this model fits the call")


@cache_input.register_fake
def _(cache, token):
    return None
