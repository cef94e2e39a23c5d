"""The part library. Importing it registers every part (see registry.PARTS)."""
from kvcompile.policies import budgets, merge, ranking, schedule, scoring, storage  # noqa: F401  (registration)
from kvcompile.policies.registry import FAMILIES, PARTS, lookup, part

__all__ = ["FAMILIES", "PARTS", "lookup", "part", "budgets", "merge", "ranking", "schedule", "scoring", "storage"]
