"""What the vLLM plugin runs, read from the environment, and what it refuses (docs/VLLM.md).

    KVCOMPILE_VLLM_SPEC=snapkv          a shipped spec name or a YAML path; unset: the plugin is off
    KVCOMPILE_VLLM_PER_HEAD=64          budget override (per_head=), or
    KVCOMPILE_VLLM_RATIO=0.1            budget override (ratio=)

The environment is the one place every vLLM process (the front end, the engine core, its worker)
reads alike: vLLM loads the plugin in each of them, before any configuration exists.

Only policies whose per-(layer, head) counts are a function of the prompt length alone run: then the
scheduler knows, from N and the policy, which whole blocks no head of any layer reads any more
(`kept_counts`), with nothing sent back from the worker. Everything else is refused by name.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

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
    if type(budget.heads).name != "uniform":
        return (f"budget.heads {type(budget.heads).name} gives heads of a layer different, score-dependent budgets "
                "(head-wise budgets need per-head lengths inside vLLM's blocks, not built yet)")
    if budget.threshold is not None:
        return ("budget.threshold decides each head's budget from its scores (data-dependent): the scheduler "
                "cannot know which blocks are free without the worker's answer")
    if policy.layer_dynamic:
        return ("its layer budgets depend on the layers' scores (layers: entropy / a cascade): the scheduler "
                "cannot know which blocks are free without the worker's answer")
    if budget.split is not None:
        return "budget.split (ZSMerge's proximity/residual split) is a decode-time policy"
    if schedule.decode is not None:
        return f"schedule.decode {type(schedule.decode).name} evicts while decoding; only prefill-time policies run"
    if schedule.prefill is not None:
        return "schedule.prefill compresses while prefilling in chunks; only one-pass prompt compression runs"
    if policy.merges:
        return f"merge {type(policy.merge).name} keeps merge slots with a logit bias, which vLLM's attention has not"
    if type(policy.storage).name != "model_dtype":
        return f"storage {type(policy.storage).name}: only the model's dtype is stored (vLLM's cache)"
    if getattr(policy.scoring, "reconstructs", False):
        return "scoring kvzip scores by a second model-level reconstruction pass, which vLLM does not run"
    if policy.scoring.needs_rope:
        return f"scoring {type(policy.scoring).name} needs the model's rotary frequencies, not passed from vLLM yet"
    return None


@functools.lru_cache(maxsize=256)
def kept_counts(policy, n: int, num_layers: int, num_heads: int) -> torch.Tensor:
    """(L, H) long: entries each (layer, KV head) keeps of an n-token prompt, from the prompt length and
    the policy alone (kvcompile.allocation: the budgets kvcompile's own engine uses): a head keeps its
    token budget, or its protected set (sinks, window) where that is larger, or the whole prompt."""
    from kvcompile.allocation import head_budgets_of, layer_totals

    totals = layer_totals(policy, torch.tensor([n]), num_layers, num_heads)[0]
    tokens = torch.full((1, num_heads), n, dtype=torch.long)
    positions = torch.arange(n)
    protected = int(policy.ranking.protected(positions, torch.tensor(n)).sum())
    rows = []
    for total in totals.tolist():
        budget = head_budgets_of(policy, tokens, torch.tensor([total]), torch.zeros_like(tokens)).tokens[0]
        rows.append(torch.clamp(budget, min=min(protected, n)))
    return torch.stack(rows)


def first_kept(policy, n: int, num_layers: int, num_heads: int) -> int:
    """The first logical position any (layer, head) still reads after compression: min over heads of
    n − K_{l,h} (the kept entries are right-aligned at [n − K_{l,h}, n))."""
    return n - int(kept_counts(policy, n, num_layers, num_heads).max())
