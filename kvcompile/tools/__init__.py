"""Tools: the command line, the evals (needle, RULER), tune, and what they load (models, data)
(docs/INTERNALS.md "Layers"). They may import everything; nothing outside tools/ imports them
(tests/test_layering.py)."""
