"""FX passes of the compiled entry (docs/INTERNALS.md "The op and its two entries"): find attention,
rewrite it into `kvcompile.attend`, remove what became dead, then Inductor (`backend`)."""
from kvcompile.passes.backend import backend, bind_cache, compile_forward, run_passes
from kvcompile.passes.dead import remove_dead
from kvcompile.passes.find import PassError, find_attention
from kvcompile.passes.rewrite import ACTIVE_HANDLE, rewrite_attention

__all__ = ["ACTIVE_HANDLE", "PassError", "backend", "bind_cache", "compile_forward", "find_attention",
           "remove_dead", "rewrite_attention", "run_passes"]
