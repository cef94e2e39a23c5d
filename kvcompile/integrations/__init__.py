"""Integrations: what adapts a framework to kvcompile's core (docs/INTERNALS.md "Layers").

generate (transformers' generate and forward: `kvcompile.compile`), context (reused contexts),
batching (transformers' continuous batching), server (the OpenAI server), vllm (the vLLM plugin).
They import the core, never the tools or the reference (tests/test_layering.py)."""
