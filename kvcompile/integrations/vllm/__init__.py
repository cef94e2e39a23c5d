"""kvcompile inside vLLM: a `vllm.general_plugins` entry point (docs/VLLM.md).

vLLM calls `register` in each of its processes. With KVCOMPILE_VLLM_SPEC unset it does nothing.
With it set, it loads and validates the spec, refuses (PluginError, which vLLM does not catch) what
cannot run exactly yet, and applies the declared patches (kvcompile.integrations.vllm.patches.PATCHES, each
checked against the installed vLLM) so that every request's prompt is compressed by its engine's policy once
prefilled and the blocks no head reads any more go back to the pool; then it logs, on vLLM's logger, that it
is active and with which spec. The plugin's state lives on each engine's objects (its scheduler, its
attention metadata builder), never in this process's modules.
This module imports nothing at import time: vLLM swallows import errors of a plugin, and an
enabled plugin must never fail silently into an uncompressed run.
"""
from __future__ import annotations


def register() -> None:
    """The entry point (pyproject: [project.entry-points."vllm.general_plugins"] kvcompile)."""
    import logging

    from kvcompile.integrations.vllm.settings import active_message, check_policy, from_env

    settings = from_env()
    if settings is None:
        return
    policy = settings.policy()
    check_policy(policy)
    from kvcompile.integrations.vllm import patches

    patches.apply(policy)
    # under vLLM's logger (its format and level), once in each vLLM process; on stderr where that process has
    # not configured logging
    log = logging.getLogger("vllm.kvcompile")
    if log.hasHandlers():
        log.info(active_message(settings, policy))
    else:
        import sys

        print(f"kvcompile: {active_message(settings, policy)}", file=sys.stderr, flush=True)
