"""A GGUF file parsed once per load in the tests that compare a converted folder with its GGUF.

transformers' `from_pretrained(gguf_file=...)` and `AutoTokenizer.from_pretrained(gguf_file=...)` call
`load_gguf_checkpoint` three times on the same file (the config, the weights, the tokenizer's config), and each
call builds a new `gguf.GGUFReader`, whose parse of the metadata (every token of the vocabulary, one numpy view
each) is most of a load's time. Inside `parsed_once()` the readers of one path are one reader: the same
read-only memory map, parsed once, so the values transformers reads are those three parses would give.
"""
from __future__ import annotations

from contextlib import contextmanager
from unittest import mock


@contextmanager
def parsed_once():
    """While the block runs, `gguf.GGUFReader(path)` (read-only) returns one reader per path."""
    import gguf

    readers = {}
    new = gguf.GGUFReader

    def reader(path, mode="r"):
        if mode != "r":
            return new(path, mode)
        key = str(path)
        if key not in readers:
            readers[key] = new(path, mode)
        return readers[key]

    with mock.patch.object(gguf, "GGUFReader", reader):
        yield
    readers.clear()
