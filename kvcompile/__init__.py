"""kvcompile: compile declarative KV-cache compression policies into a running model.

    import kvcompile
    model = kvcompile.compile(model, "lava", per_head=128)   # a spec name, path, mapping or Policy
    out = model.generate(ids, max_new_tokens=64, return_dict_in_generate=True)
    out.past_key_values.memory_report()
"""
from kvcompile.cache import KVCompileCache
from kvcompile.compile import CompileError, compile, compiled, uncompile
from kvcompile.policy import Policy
from kvcompile.spec import SpecError, load_spec

__all__ = ["CompileError", "KVCompileCache", "Policy", "SpecError", "compile", "compiled", "load_spec",
           "uncompile"]
