"""Errors shared by kvcompile.compile and the modules it builds on (kvcompile.integrations.batching)."""


class CompileError(ValueError):
    """The model cannot be compiled (unsupported architecture or attention)."""
