"""The part registry: every policy part is a frozen dataclass registered by family and name.

A part's dataclass fields are its hyper-parameters (kvpress style); the spec parser
(`kvcompile.spec`) validates YAML against these fields and the ranges declared on them
(`kvcompile.policies.fields.bounded`). Adding a part is one decorator on a class that
derives from its family's base (`Scorer`, `HeadsRule`, `ThresholdRule`, `MergeRule`, …):

    @part("scoring", "value_norm")
    class ValueNorm(Scorer):
        \"\"\"s[i] = ‖V[i]‖₂ (paper, equation).\"\"\"
        def query_rows(self, n): return 0
        def score(self, state): ...

`part` makes the class a frozen dataclass when it is not one already, and checks that it
has what its family needs. The base classes hold the behaviour every part of the family
shares (a scorer's running update, a merge rule's slots and logit bias, a heads rule's
selection over ranks); a part overrides what it does differently, and the runtime asks
the part, never its name.
"""
from __future__ import annotations

import dataclasses

FAMILIES = ("scoring", "ranking", "layers", "heads", "threshold", "merge", "decode", "prefill", "storage")

# What each family's parts must implement (the base classes provide the rest).
REQUIRED = {
    "scoring": ("query_rows", "score"),
    "ranking": ("key", "protected"),
    "layers": ("shares",),
    "heads": ("keep",),
    "threshold": ("keep",),
    "merge": ("merge", "shrink", "bias"),
    "decode": ("spare_growth",),
    "prefill": (),
    "storage": (),
}

PARTS: dict[str, dict[str, type]] = {family: {} for family in FAMILIES}


def part(family: str, name: str):
    """Register a class as the part `name` of `family` (a frozen dataclass)."""
    if family not in PARTS:
        raise ValueError(f"unknown part family {family!r}; families: {', '.join(FAMILIES)}")

    def register(cls):
        if name in PARTS[family]:
            raise ValueError(f"{family} part {name!r} is registered twice")
        if "__dataclass_fields__" not in cls.__dict__:
            cls = dataclasses.dataclass(frozen=True)(cls)
        missing = [m for m in REQUIRED[family] if not callable(getattr(cls, m, None))]
        if missing:
            raise TypeError(f"{family} part {name!r} ({cls.__name__}) lacks {', '.join(missing)}")
        cls.family = family
        cls.name = name
        PARTS[family][name] = cls
        return cls

    return register


def lookup(family: str, name: str) -> type:
    try:
        return PARTS[family][name]
    except KeyError:
        known = ", ".join(sorted(PARTS[family])) or "none"
        raise KeyError(f"unknown {family} part {name!r}; registered: {known}") from None
