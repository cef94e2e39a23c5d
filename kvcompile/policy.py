"""The validated policy: what a spec file means, as frozen dataclasses (the IR)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvcompile.policies.budgets import Budget
from kvcompile.policies.merge import Drop
from kvcompile.policies.ranking import ByScore
from kvcompile.policies.schedule import Schedule
from kvcompile.policies.scoring import WindowAttention


@dataclass(frozen=True)
class Policy:
    """A KV-cache compression policy: scoring, ranking, budget, merge rule, schedule."""

    name: str = "policy"
    scoring: object = field(default_factory=WindowAttention)
    ranking: object = field(default_factory=ByScore)
    budget: Budget = field(default_factory=lambda: Budget(per_head=128))
    merge: object = field(default_factory=Drop)
    schedule: Schedule = field(default_factory=Schedule)
    description: str = field(default="", compare=False)
    source: str | None = field(default=None, compare=False)  # the spec file it came from

    @property
    def layer_dynamic(self) -> bool:
        """Layer budgets depend on the scores of other layers (cascade during prefill)."""
        return self.budget.layers.name == "entropy" or self.schedule.cascade

    @property
    def merges(self) -> bool:
        return self.merge.name == "residual"

    def to_yaml(self) -> str:
        from kvcompile.spec import policy_to_yaml

        return policy_to_yaml(self)
