"""FX passes of the compiled entry (docs/INTERNALS.md "The op and its two entries"): find attention (SDPA, or
kvcompile's own call site on a model transformers runs without SDPA: `site`), rewrite it into `kvcompile.attend`,
remove what became dead, then Inductor (`backend`)."""
from kvcompile.passes.backend import backend, compile_forward, run_passes
from kvcompile.passes.dead import remove_dead
from kvcompile.passes.find import PassError, find_attention
from kvcompile.passes.rewrite import cache_inputs, rewrite_attention

__all__ = ["PassError", "backend", "cache_inputs", "compile_forward", "find_attention", "remove_dead",
           "rewrite_attention", "run_passes"]
