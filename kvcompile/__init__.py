"""kvcompile: compile declarative KV-cache compression policies into a running model.

    import kvcompile
    model = kvcompile.compile(model, "lava", per_head=128)   # a spec name, path, mapping or Policy
    out = model.generate(ids, max_new_tokens=64, return_dict_in_generate=True)
    out.past_key_values.memory_report()

The public names below are imported on first use (PEP 562 module `__getattr__`), so that
`import kvcompile` and `kvcompile --help` do not pay for importing torch and transformers.
"""
from __future__ import annotations

import importlib
import typing

# public name -> the module that defines it
_EXPORTS = {
    "CompileError": "kvcompile.integrations.generate",
    "KVCompileCache": "kvcompile.cache",
    "Policy": "kvcompile.policy",
    "SpecError": "kvcompile.spec",
    "compile": "kvcompile.integrations.generate",
    "compress_context": "kvcompile.integrations.context",
    "compiled": "kvcompile.integrations.generate",
    "load_spec": "kvcompile.spec",
    "uncompile": "kvcompile.integrations.generate",
}

__all__ = sorted(_EXPORTS)

if typing.TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load lazily
    from kvcompile.cache import KVCompileCache
    from kvcompile.integrations.generate import CompileError, compile, compiled, uncompile
    from kvcompile.integrations.context import compress_context
    from kvcompile.policy import Policy
    from kvcompile.spec import SpecError, load_spec


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcompile' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
