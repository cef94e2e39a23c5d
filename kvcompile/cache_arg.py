"""The name under which transformers passes a model's cache.

transformers 5.24 renamed the cache argument of `generate()`, of every model's `forward()` and of the mask
functions from `past_key_values` to `cache` (the old name is deprecated, renamed by a decorator, and dropped
when both are given), and model outputs carry it as `cache` (`past_key_values` stays readable). kvcompile's
entries wrap `forward()` and `generate()`, so they must take the cache under either name and hand it on under
the name the installed version reads; otherwise generate()'s own `cache` and kvcompile's `past_key_values`
arrive together and the compressed cache is ignored.
"""
from __future__ import annotations

import transformers
from packaging.version import Version

# what the installed transformers' generate() and forward() read
NAME = "cache" if Version(transformers.__version__).release >= (5, 24) else "past_key_values"


def take(kwargs: dict):
    """Remove and return the cache a caller gave in `kwargs` under either name (None if none). Given under
    both names, they must be the same object (transformers would keep one and drop the other silently)."""
    new = kwargs.pop("cache", None) if NAME == "cache" else None
    old = kwargs.pop("past_key_values", None)
    if new is not None and old is not None and new is not old:
        raise ValueError("kvcompile: two caches given, as `cache` and as `past_key_values` (the name transformers "
                         "used before 5.24): give one")
    return new if new is not None else old


def given(cache) -> dict:
    """Keyword arguments that hand `cache` on to the installed transformers."""
    return {NAME: cache}


def of(output):
    """The cache a model's or generate()'s output carries (`output.cache` from 5.24, `past_key_values` before)."""
    return getattr(output, NAME)


def is_engine_cache(cache) -> bool:
    """Whether `cache` is continuous batching's paged cache. The engine passes it as `cache`, which up to 5.23 went
    through the model's keyword arguments to the attention function, and from 5.24 is the model's cache argument:
    kvcompile.integrations.batching's attention reads the requests' own caches from it, so it goes on unchanged."""
    if cache is None or NAME != "cache":
        return False
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    return isinstance(cache, PagedAttentionCache)
