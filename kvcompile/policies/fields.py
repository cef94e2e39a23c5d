"""Value ranges of part fields, declared once on the field and read by everyone who checks.

    @part("scoring", "decayed")
    class Decayed(Scorer):
        decay: float = bounded(0.98, low=0, high=1, low_open=True)   # λ ∈ (0, 1]

`bounded` puts a `Range` into the field's metadata; a part's `__post_init__`
(`check_ranges`) and the spec validator (`kvcompile.spec`, which adds file and line)
both read it, so the two can never disagree.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """low ≤ v ≤ high (either side open or absent); `odd`: odd integers only."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    odd: bool = False
    why: str = ""  # why the range is what it is, for a constructor's error message
    noun: str = ""  # what a value is called ("a fraction"), default "a number" / "an integer"

    def contains(self, value) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return not self.odd or value % 2 == 1

    def describe(self, integer: bool) -> str:
        """What is allowed, as error messages say it: "an integer >= 1", "a number in (0, 1]"."""
        kind = self.noun or ("an odd integer" if self.odd else ("an integer" if integer else "a number"))
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"{kind} in {left}{_num(self.low)}, {_num(self.high)}{right}"
        if self.low is not None:
            return f"{kind} {'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"{kind} {'<' if self.high_open else '<='} {_num(self.high)}"
        return kind


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


FRACTION = dict(low=0, high=1)  # a fraction in [0, 1]


def bounded(default=dataclasses.MISSING, *, low=None, high=None, low_open=False, high_open=False, odd=False,
            why: str = "", noun: str = ""):
    """A dataclass field with a default (none: a required field) and its declared value range."""
    return dataclasses.field(default=default,
                             metadata={"range": Range(low, high, low_open, high_open, odd, why, noun)})


def field_range(f: dataclasses.Field) -> Range | None:
    return f.metadata.get("range")


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


class FieldError(ValueError):
    """A part's field refused by the part's checks (its range, or a rule that ties it to another field):
    `field` names it, `allowed` says what is, so the spec validator can point at its file, line and field."""

    def __init__(self, field: str, message: str, allowed: str | None = None):
        super().__init__(message)
        self.field, self.allowed = field, allowed


def check_ranges(obj) -> None:
    """Raise FieldError (a ValueError) for the first field of `obj` outside its declared range (or of the
    wrong kind: a bool, or a non-integer for an int field), or not among its Literal choices."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        hint = hints.get(f.name)
        names = f.metadata.get("choices")
        if names is not None:  # a list of names, each among the field's choices (layers' kinds)
            if isinstance(value, list):
                value = tuple(value)
                object.__setattr__(obj, f.name, value)
            why = choices_error(value, names)
            if why is not None:
                raise FieldError(f.name, f"{f.name}: {why}", " | ".join(names))
            continue
        if typing.get_origin(hint) is typing.Literal and value not in typing.get_args(hint):
            choices = " | ".join(repr(c) for c in typing.get_args(hint))
            raise FieldError(f.name, f"{f.name} must be one of {choices}, got {value!r}", choices)
        rng = field_range(f)
        if rng is None:
            continue
        integer = hint is int
        ok_type = (isinstance(value, int) if integer else isinstance(value, (int, float))) \
            and not isinstance(value, bool)
        if not ok_type or not rng.contains(value):
            why = f" ({rng.why})" if rng.why else ""
            raise FieldError(f.name, f"{f.name} must be {rng.describe(integer)}{why}, got {value!r}",
                             rng.describe(integer))


def choices_error(value, names: tuple[str, ...]) -> str | None:
    """Why `value` is not a non-empty list of distinct names among `names`, or None."""
    if not isinstance(value, (list, tuple)) or not value:
        return f"expected a non-empty list of names, got {value!r}"
    for item in value:
        if item not in names:
            return f"{item!r} is not one of {' | '.join(names)}"
    if len(set(value)) != len(value):
        return f"a name is given twice in {list(value)}"
    return None


class Part:
    """Base of every part: its fields are checked against their declared ranges and choices."""

    def __post_init__(self):
        check_ranges(self)
