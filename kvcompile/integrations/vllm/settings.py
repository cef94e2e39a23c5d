"""What the vLLM plugin runs, read from the environment, and what it refuses (docs/VLLM.md).

    KVCOMPILE_VLLM_SPEC=snapkv          a shipped spec name or a YAML path; unset: the plugin is off
    KVCOMPILE_VLLM_PER_HEAD=64          budget override (per_head=), or
    KVCOMPILE_VLLM_RATIO=0.1            budget override (ratio=)

The environment is the one place every vLLM process (the front end, the engine core, its worker)
reads alike: vLLM loads the plugin in each of them, before any configuration exists.

Every prefill-time policy that drops what it evicts runs, with any layer and head allocation (uniform,
pyramid, LAVa's entropy cascade, AdaKV's pooled heads, DBudgetKV's threshold): its kept entries are packed
into the request's last slots (kvcompile.integrations.vllm.packing). Everything else is refused by name.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


SPEC_ENV, PER_HEAD_ENV, RATIO_ENV = "KVCOMPILE_VLLM_SPEC", "KVCOMPILE_VLLM_PER_HEAD", "KVCOMPILE_VLLM_RATIO"
RECORD_ENV = "KVCOMPILE_VLLM_RECORD"  # a file: each compressed request's kept positions, one JSON line (tests)


class PluginError(ValueError):
    """The plugin cannot run this policy or this vLLM configuration exactly: refused up front."""


@dataclass(frozen=True)
class Settings:
    spec: str
    overrides: tuple  # ((key, value), ...) passed to kvcompile.load_spec

    def policy(self):
        from kvcompile.spec import load_spec

        return load_spec(self.spec, **dict(self.overrides))


def active_message(settings: Settings, policy) -> str:
    """The line that says the plugin is on, and with what: the spec as given, the policy it loaded, its budget."""
    budget = policy.budget
    kept = (f"per_head={budget.per_head}" if budget.per_head is not None else f"ratio={budget.ratio}"
            if budget.ratio is not None else "a threshold decides the budget")
    given = "".join(f", {key}={value}" for key, value in settings.overrides)
    where = f" from {policy.source}" if policy.source else ""
    return (f"kvcompile's vLLM plugin is active: spec {settings.spec!r}{given} -> policy {policy.name}{where} "
            f"({kept}); every prompt is compressed once prefilled")


def from_env(environ=os.environ) -> Settings | None:
    """The plugin's settings, or None when KVCOMPILE_VLLM_SPEC is unset (the plugin is off)."""
    spec = environ.get(SPEC_ENV, "").strip()
    if not spec:
        return None
    overrides = []
    if environ.get(PER_HEAD_ENV):
        overrides.append(("per_head", int(environ[PER_HEAD_ENV])))
    if environ.get(RATIO_ENV):
        overrides.append(("ratio", float(environ[RATIO_ENV])))
    if len(overrides) > 1:
        raise PluginError(f"kvcompile: set one of {PER_HEAD_ENV} and {RATIO_ENV}, not both")
    return Settings(spec, tuple(overrides))


def refusal(policy) -> str | None:
    """Why the plugin cannot run `policy` exactly inside vLLM yet, or None."""
    budget, schedule = policy.budget, policy.schedule
    if budget.split is not None:
        return "budget.split (ZSMerge's proximity/residual split) is a decode-time policy"
    if schedule.decode is not None:
        return f"schedule.decode {type(schedule.decode).name} evicts while decoding; only prefill-time policies run"
    if schedule.prefill is not None:
        return ("schedule.prefill: chunk evicts between a prompt's chunks; the plugin compresses once, in the step "
                "that ends the prompt (vLLM's own chunked prefill runs)")
    if policy.merges:
        return f"merge {type(policy.merge).name} keeps merge slots with a logit bias, which vLLM's attention has not"
    if type(policy.storage).name != "model_dtype":
        return f"storage {type(policy.storage).name}: only the model's dtype is stored (vLLM's cache)"
    if getattr(policy.scoring, "reconstructs", False):
        return "scoring kvzip scores by a second model-level reconstruction pass, which vLLM does not run"
    if policy.scoring.needs_rope:
        return f"scoring {type(policy.scoring).name} needs the model's rotary frequencies, not passed from vLLM yet"
    return None
