"""The part registry: every policy part is a frozen dataclass registered by family and name.

A part's dataclass fields are its hyper-parameters (kvpress style); the spec parser
(`kvcompile.spec`) validates YAML against these fields, so adding a part is:
write the dataclass with its docstring (paper, equation), decorate it with
`@part("family", "name")`, implement its reference method, add a test.
"""
from __future__ import annotations

FAMILIES = ("scoring", "ranking", "layers", "heads", "threshold", "merge", "decode")

PARTS: dict[str, dict[str, type]] = {family: {} for family in FAMILIES}


def part(family: str, name: str):
    """Register a dataclass as the part `name` of `family`."""
    if family not in PARTS:
        raise ValueError(f"unknown part family {family!r}; families: {', '.join(FAMILIES)}")

    def register(cls):
        if name in PARTS[family]:
            raise ValueError(f"{family} part {name!r} is registered twice")
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
