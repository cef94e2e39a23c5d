"""What the vLLM plugin runs, and what it refuses (docs/VLLM.md).

The environment enables the plugin and names every engine's default policy:

    KVCOMPILE_VLLM_SPEC=snapkv          a shipped spec name or a YAML path; unset: the plugin is off
    KVCOMPILE_VLLM_PER_HEAD=64          budget override (per_head=), or
    KVCOMPILE_VLLM_RATIO=0.1            budget override (ratio=)

The environment is the one place every vLLM process (the front end, the engine core, its worker)
reads alike: vLLM loads the plugin in each of them, before any configuration exists. One engine may name
its own policy in vLLM's `additional_config={"kvcompile": {"spec": ..., "per_head": ...}}`; the engine's
configuration carries its settings to each of its processes (`engine_settings`).

Every prefill-time policy that drops what it evicts runs, with any layer and head allocation (uniform,
pyramid, LAVa's entropy cascade, AdaKV's pooled heads, DBudgetKV's threshold), in the model's dtype or as
int8/int4 codes per entry: its kept entries are packed into the request's last slots
(kvcompile.integrations.vllm.packing, kvcompile.integrations.vllm.codes). Everything else is refused by name,
with the reason, before vLLM starts (`check_policy`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass


SPEC_ENV, PER_HEAD_ENV, RATIO_ENV = "KVCOMPILE_VLLM_SPEC", "KVCOMPILE_VLLM_PER_HEAD", "KVCOMPILE_VLLM_RATIO"
RECORD_ENV = "KVCOMPILE_VLLM_RECORD"  # a file: each compressed request's kept positions, one JSON line (tests)


class PluginError(ValueError):
    """The plugin cannot run this policy or this vLLM configuration exactly: refused up front."""


CONFIG_KEY = "kvcompile"  # vLLM's additional_config[CONFIG_KEY]: one engine's settings (Settings.as_config)


@dataclass(frozen=True)
class Settings:
    spec: str
    overrides: tuple  # ((key, value), ...) passed to kvcompile.load_spec
    record: str | None = None  # RECORD_ENV

    def policy(self):
        from kvcompile.spec import load_spec

        return load_spec(self.spec, **dict(self.overrides))

    def as_config(self) -> dict:
        """The engine's settings as vLLM's additional_config holds them (JSON: vLLM hashes it)."""
        return {"spec": self.spec, **dict(self.overrides), **({"record": self.record} if self.record else {})}

    @classmethod
    def from_config(cls, given) -> Settings:
        """Settings from additional_config["kvcompile"]: {"spec": str, "per_head": int | "ratio": float,
        "record": str}; anything else is refused by name."""
        if not isinstance(given, dict) or not isinstance(given.get("spec"), str) or not given["spec"].strip():
            raise PluginError(f'kvcompile: additional_config["{CONFIG_KEY}"] must be a mapping with "spec" (a spec '
                              f"name or YAML path), got {given!r}")
        unknown = sorted(set(given) - {"spec", "per_head", "ratio", "record"})
        if unknown:
            raise PluginError(f'kvcompile: additional_config["{CONFIG_KEY}"] has unknown field(s) {unknown}; '
                              'allowed: spec, per_head, ratio, record')
        overrides = tuple((k, given[k]) for k in ("per_head", "ratio") if given.get(k) is not None)
        if len(overrides) > 1:
            raise PluginError(f'kvcompile: additional_config["{CONFIG_KEY}"]: give one of per_head and ratio, not both')
        return cls(given["spec"].strip(), overrides, given.get("record") or None)


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
    return Settings(spec, tuple(overrides), environ.get(RECORD_ENV) or None)


def engine_settings(vllm_config, environ=os.environ) -> Settings | None:
    """One engine's settings: its configuration's additional_config["kvcompile"] where given (written there by
    the patched EngineArgs.create_engine_config, so every process of the engine reads the same), else the
    environment's."""
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict) and CONFIG_KEY in extra:
        return Settings.from_config(extra[CONFIG_KEY])
    return from_env(environ)


def check_policy(policy) -> None:
    """Refuse (PluginError, with the reason) a policy the plugin cannot run exactly inside vLLM."""
    why = refusal(policy)
    if why is not None:
        raise PluginError(f"kvcompile: the vLLM plugin cannot run {policy.name}: {why}")


def refusal(policy) -> str | None:
    """Why the plugin cannot run `policy` exactly inside vLLM (every reason, joined by "; "), or None."""
    return "; ".join(refusals(policy)) or None


def refusals(policy) -> list[str]:
    """Every reason the plugin cannot run `policy` exactly inside vLLM, one per family it belongs to, in this
    order: merges (with the split that reserves their slots), decode-time schedules, compression between
    prefill chunks, quantized storage, KVzip's reconstruction scores, scorers reading the rotary frequencies."""
    budget, schedule = policy.budget, policy.schedule
    why = []
    if policy.merges or budget.split is not None:
        split = " (budget.split reserves its proximity and residual slots)" if budget.split is not None else ""
        why.append(f"merge {type(policy.merge).name}{split} folds evicted entries into merge slots that every later "
                   "attention reads with a logit bias of alpha*log(count); the plugin's packed decode attention and "
                   "vLLM's CPU kernel add no per-entry bias, so decode logits would differ")
    if schedule.decode is not None:
        why.append(f"schedule.decode {type(schedule.decode).name} evicts while decoding (re-scoring every so many "
                   "tokens, or one token per step); the plugin selects once, in the step that ends the prompt: its "
                   "packed layout and the blocks it returned to vLLM are fixed after that, and vLLM's decode "
                   "attention gives no scores to re-select with")
    if schedule.prefill is not None:
        why.append("schedule.prefill: chunk evicts between a prompt's chunks; the plugin compresses once, in the "
                   "step that ends the prompt (vLLM's own chunked prefill runs)")
    storage = policy.storage
    if storage.tiered:
        kind = ("each key channel quantized over groups of tokens that decoding completes, the newest tokens in "
                "full precision" if storage.key_axis == "channel" else "the best-scored entries in full precision, "
                "the rest as codes")
        why.append(f"storage {type(storage).name} keeps each head's entries in two tiers ({kind}); the plugin packs "
                   "one format per request into its region (the model's dtype, or per-entry int8/int4 codes) and "
                   "moves nothing between tiers while decoding")
    if getattr(policy.scoring, "reconstructs", False):
        why.append("scoring kvzip scores entries by a reconstruction pass, a second forward pass of the whole model "
                   "that repeats the prompt from its cache; a vLLM attention backend sees one layer of the "
                   "request's own step and vLLM schedules no such pass")
    elif policy.scoring.needs_rope:
        why.append(f"scoring {type(policy.scoring).name} needs the model's rotary frequencies, not passed from vLLM "
                   "yet")
    return why


def check_storage(policy, head_dim: int, dtype) -> None:
    """Refuse a storage part whose codes this model's cache cannot hold as kvcompile stores them."""
    storage = policy.storage
    if not storage.quantizes:
        return
    why = storage.check_head_dim(head_dim)
    if why is None and str(dtype) != "torch.float32":
        why = (f"the model runs in {dtype}, and the plugin writes decode tokens' dequantized keys and values into "
               "the cache in its dtype: checked against kvcompile in float32 only")
    if why is not None:
        raise PluginError(f"kvcompile: the vLLM plugin cannot run {policy.name} (storage {type(storage).name}) on "
                          f"this model: {why}")
