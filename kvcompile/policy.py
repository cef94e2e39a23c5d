"""The validated policy: what a spec file means, as frozen dataclasses (the IR)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field

import yaml

from kvcompile.policies.budgets import Budget
from kvcompile.policies.merge import Drop
from kvcompile.policies.ranking import ByScore
from kvcompile.policies.schedule import Schedule
from kvcompile.policies.scoring import WindowAttention
from kvcompile.policies.storage import ModelDtype


@dataclass(frozen=True)
class Policy:
    """A KV-cache compression policy: scoring, ranking, budget, merge rule, schedule, storage."""

    name: str = "policy"
    scoring: object = field(default_factory=WindowAttention)
    ranking: object = field(default_factory=ByScore)
    budget: Budget = field(default_factory=lambda: Budget(per_head=128))
    merge: object = field(default_factory=Drop)
    schedule: Schedule = field(default_factory=Schedule)
    storage: object = field(default_factory=ModelDtype)  # the precision of kept entries
    description: str = field(default="", compare=False)
    source: str | None = field(default=None, compare=False)  # the spec file it came from

    @property
    def layer_dynamic(self) -> bool:
        """Layer budgets depend on the scores of other layers (cascade during prefill)."""
        return self.budget.layers.needs_scores or self.schedule.cascade

    def acting(self) -> "Policy":
        """The policy with every setting that cannot change what it computes in one form, so two policies that
        compute the same thing compare equal: `schedule.cascade` acts only through `layer_dynamic` (the plan
        cascades exactly when it is true), so where the layers rule moves budgets by scores (needs_scores) the
        schedule's cascade is set, as it runs anyway. The name and description are dropped."""
        schedule = dataclasses.replace(self.schedule, cascade=self.layer_dynamic)
        return dataclasses.replace(self, name="", description="", source=None, schedule=schedule)

    @property
    def merges(self) -> bool:
        """Evicted tokens are kept in merge slots (the merge rule says)."""
        return self.merge.merges

    @property
    def tiered(self) -> bool:
        """Each head's entries in two precisions (kvcompile.store.tiers): a tiered storage part, or codes
        beside merge slots, which keep their running means in the model's dtype."""
        return self.storage.tiered or (self.storage.quantizes and self.merges)

    def to_yaml(self) -> str:
        return policy_to_yaml(self)

    def definition(self) -> str:
        """What the policy computes, as a 12-hex digest of its explicit full form (policy_to_mapping) without
        its name and its size (tokens per head, or ratio: a RULER record's key holds both). Records of one spec
        name with two digests were made under two definitions (a field or a part's default changed between
        them) and are never pooled (kvcompile.tools.ruler_records)."""
        mapping = policy_to_mapping(self)
        del mapping["name"]
        del mapping["budget"]["per_head"]
        # the budget's size as a ratio is a size too (an eval runs a ratio spec at a count per head, ratio None):
        # None, not deleted, so the digests of records made with ratio None stay as they were
        mapping["budget"]["ratio"] = None
        text = json.dumps(mapping, sort_keys=True, default=repr)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def _fields(obj) -> dict:
    return {f.name: _fields(v) if dataclasses.is_dataclass(v) else list(v) if isinstance(v, tuple) else v
            for f in dataclasses.fields(obj) if f.init for v in [getattr(obj, f.name)]}


def _part_mapping(part) -> dict | None:
    return None if part is None else {type(part).name: _fields(part)}


def policy_to_mapping(policy: Policy) -> dict:
    """The explicit full form of a policy as plain data: every section, every field."""
    budget, schedule = policy.budget, policy.schedule
    return {
        "name": policy.name,
        "scoring": _part_mapping(policy.scoring),
        "ranking": _part_mapping(policy.ranking),
        "budget": {
            "per_head": budget.per_head,
            "ratio": budget.ratio,
            "layers": _part_mapping(budget.layers),
            "heads": _part_mapping(budget.heads),
            "threshold": _part_mapping(budget.threshold),
            "split": None if budget.split is None else _fields(budget.split),
        },
        "merge": _part_mapping(policy.merge),
        "schedule": {"cascade": schedule.cascade, "decode": _part_mapping(schedule.decode),
                     "prefill": _part_mapping(schedule.prefill)},
        "storage": _part_mapping(policy.storage),
    }


def policy_to_yaml(policy: Policy) -> str:
    """The policy as a spec file in explicit full form (one flow mapping per section),
    its description as the leading comment. load_spec of the result equals the policy."""
    description = "\n".join(line.rstrip() for line in policy.description.splitlines()).strip("\n")
    out = [f"# {line}".rstrip() for line in description.splitlines()]
    for key, value in policy_to_mapping(policy).items():
        dumped = yaml.safe_dump({key: value}, default_flow_style=True, sort_keys=False,
                                width=math.inf).strip()
        out.append(dumped[1:-1])  # "{key: value}" -> "key: value"
    return "\n".join(out) + "\n"
