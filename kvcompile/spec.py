"""The spec language: YAML policy files → a validated, frozen `Policy` (and back).

Grammar (docs/SPECS.md is the full reference, docs/INTERNALS.md "YAML" the contract):

    name: <string>                  default: the file's stem
    scoring: <part>                 required
    ranking: <part>                 default: by_score
    budget: {per_head: n | ratio: r, layers: <part>, heads: <part>,
             threshold: <part>, split: {proximity, context, residual}}   required
    merge: <part>                   default: drop
    schedule: prefill | cascade | {cascade: bool, decode: <part>, prefill: <part>}   default: prefill
    storage: <part>                 default: model_dtype

    <part> = name                   all fields at their defaults
           | {name: {field: value, ...}}
           | {name: value}          shorthand for a part with exactly one field

A part's fields are the fields of its registered dataclass (`kvcompile.policies.PARTS`):
nothing else is accepted, so a typo is an error, never silently ignored. Every error is a
`SpecError` naming the file, the line, the dotted field and what is allowed; the Policy
is built only when everything is valid (nothing is half-applied).

Line numbers come from PyYAML (already a dependency): `yaml.SafeLoader` composes the
document into nodes whose `start_mark.line` (0-based) locates every key, and constructs
the plain data from those same nodes.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.resources
import math
import numbers
import re
import types
import typing
import unicodedata
from pathlib import Path
from typing import Literal, Union

import yaml

from kvcompile.policies import PARTS
from kvcompile.policies.budgets import Budget, Split
from kvcompile.policies.fields import FieldError, choices_error, field_range
from kvcompile.policies.schedule import Schedule
from kvcompile.policy import Policy, policy_to_mapping, policy_to_yaml  # noqa: F401  (public here too)

SECTIONS = ("name", "scoring", "ranking", "budget", "merge", "schedule", "storage")
REQUIRED = ("scoring", "budget")
BUDGET_KEYS = ("per_head", "ratio", "layers", "heads", "threshold", "split")
SCHEDULE_KEYS = ("cascade", "decode", "prefill")
SCHEDULE_FORMS = "prefill | cascade | {cascade: bool, decode: part, prefill: part}"
SPLIT_TOLERANCE = 1e-6
# A ratio keeps max(1, round(ratio·n)) tokens per head of an n-token prompt: below 1e-6 that is 1 token for
# every prompt under 500,000 tokens, the floor rather than a fraction (per_head: 1 says it).
RATIO_MIN = 1e-6
RATIO_RANGE = ("a number in [1e-06, 1] (a smaller ratio keeps 1 token per head of any prompt under 500,000 "
               "tokens: per_head: 1)")
MAX_NODES = 10_000  # YAML nodes a spec may expand to through aliases (specs/ use < 100)

KeyPath = tuple[str, ...]


class SpecError(ValueError):
    """A spec that cannot be a policy. The message names the file (or "<mapping>",
    "<policy>", "<string>", "override"), the 1-based line, the dotted field, what was
    wrong and what is allowed; the parts are kept as attributes."""

    def __init__(self, file: str, line: int | None, field: str | None, problem: str,
                 allowed: str | None = None):
        self.file, self.line, self.field = file, line, field
        self.problem, self.allowed = problem, allowed
        where = file if line is None else f"{file}:{line}"
        text = f"{where}: {field}: {problem}" if field else f"{where}: {problem}"
        if allowed:
            text += f" (allowed: {allowed})"
        super().__init__(text)

    def __reduce__(self):  # picklable across processes despite the custom signature
        return SpecError, (self.file, self.line, self.field, self.problem, self.allowed)


# Value ranges are declared once, on the part's dataclass fields (kvcompile.policies.fields.bounded),
# and checked here before the part is built, so errors name the file and line; a part's own
# __post_init__ checks (a ValueError) become SpecErrors too.

# PyYAML follows YAML 1.1, where `1e-3` (no dot) is a string: accept it for float fields.
_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader without YAML 1.1's two number forms that turn a typo into another number: base 60
    (`1:00` is 60, `1:30.5` is 90.5) and a leading-zero octal (`010` is 8). Both are plain text here, as in
    YAML 1.2, so a number field refuses them as text (file, line, field) instead of reading another value."""


_SpecLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_SpecLoader.add_implicit_resolver(  # decimal (0 or no leading zero), binary, hexadecimal
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"))
_SpecLoader.add_implicit_resolver(  # YAML 1.1's floats but base 60
    "tag:yaml.org,2002:float", re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
    |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))
_OTHER_NUMBER = re.compile(r"[-+]?(?:[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?|0[0-7_]+)")  # what YAML 1.1 would read


def _number_text(value) -> str:
    """A note for a number field given text that YAML 1.1 reads as a number (base 60, leading-zero octal)."""
    if isinstance(value, str) and _OTHER_NUMBER.fullmatch(value.strip()):
        kind = "a base-60 number (1:00 as 60)" if ":" in value else "an octal number (010 as 8)"
        return f" (YAML 1.1 would read {value!r} as {kind}; a spec reads it as text: write the number in decimal)"
    return ""


# ---------------------------------------------------------------------------------------
# Where a value came from: file lines and overridden paths, for error messages.

@dataclasses.dataclass
class _Source:
    file: str
    lines: dict[KeyPath, int] = dataclasses.field(default_factory=dict)  # path -> 1-based line
    overridden: set[KeyPath] = dataclasses.field(default_factory=set)

    def line(self, path: KeyPath) -> int | None:
        for k in range(len(path), -1, -1):  # the nearest enclosing key the file wrote
            if path[:k] in self.lines:
                return self.lines[path[:k]]
        return None

    def from_override(self, path: KeyPath) -> bool:
        return any(path[:k] in self.overridden for k in range(1, len(path) + 1))

    def error(self, path: KeyPath, problem: str, allowed: str | None = None, *,
              line_at: KeyPath | None = None, blame: tuple[KeyPath, ...] = ()) -> SpecError:
        field = ".".join(path) or None
        if any(self.from_override(p) for p in (path, *blame)):
            return SpecError("override", None, field, problem, allowed)
        return SpecError(self.file, self.line(line_at or path), field, problem, allowed)


def _describe(value) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             dict: "a mapping", list: "a list", type(None): "null"}
    kind = kinds.get(type(value))
    if kind is None:  # numpy scalars and other number types
        kind = ("a boolean" if _is_numpy_bool(value) else "an integer" if isinstance(value, numbers.Integral)
                else "a number" if isinstance(value, numbers.Real) else type(value).__name__)
    return f"{value!r} ({kind})"


# ---------------------------------------------------------------------------------------
# Values and parts

def _is_number(value) -> bool:
    """A real number: int, float or a numpy scalar (numbers.Real), but never a boolean."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not _is_numpy_bool(value)


def _is_numpy_bool(value) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def _integral(value) -> int | None:
    """`value` as a plain int if it is an integer (numpy's included) or an integral float
    (64.0), else None: 64.5, booleans, strings and non-finite numbers are not integers."""
    if not _is_number(value):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return int(number) if math.isfinite(number) and number.is_integer() else None


def _value(hint, value, path: KeyPath, src: _Source, allowed: str | None = None):
    """Check `value` against a field's type hint; return it converted (int → float)."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        return _value(rest[0], value, path, src, allowed) if len(rest) == 1 else value
    if origin is Literal:
        choices = typing.get_args(hint)
        if any(value == c and type(value) is type(c) for c in choices):
            return value
        raise src.error(path, f"{_describe(value)} is not allowed",
                        " | ".join(str(c) for c in choices))
    if hint is bool:
        if isinstance(value, bool) or _is_numpy_bool(value):
            return bool(value)
        raise src.error(path, f"expected a boolean, got {_describe(value)}", "true | false")
    if hint is int:
        number = _integral(value)
        if number is not None:
            return number
        raise src.error(path, f"expected an integer, got {_describe(value)}{_number_text(value)}",
                        allowed or "an integer")
    if hint is float:
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            value = float(value)
        if _is_number(value):
            try:
                number = float(value)
            except OverflowError:  # an int too large for a float
                number = math.inf
            if math.isfinite(number):
                return number
        raise src.error(path, f"expected a finite number, got {_describe(value)}{_number_text(value)}",
                        allowed or "a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise src.error(path, f"expected a string, got {_describe(value)}", "a string")
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            names = ", ".join(f.name for f in dataclasses.fields(hint) if f.init)
            raise src.error(path, f"expected a mapping, got {_describe(value)}", f"{{{names}}}")
        return _dataclass(hint, value, path, src)
    return value


def _dataclass(cls, fields, path: KeyPath, src: _Source):
    """Build `cls` from a mapping of its fields: unknown keys, types and declared ranges checked."""
    known = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in known]
    if fields is None:
        fields = {}
    if not isinstance(fields, dict):
        raise src.error(path, f"expected a mapping of fields, got {_describe(fields)}",
                        ", ".join(names) or "no fields")
    for key in fields:
        if key not in names:
            raise src.error(path + (str(key),), f"unknown field {key!r}",
                            ", ".join(names) or "none: this part has no fields")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in known:
        fpath = path + (f.name,)
        if f.name not in fields:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise src.error(fpath, f"missing required field {f.name!r}",
                                ", ".join(names), line_at=path)
            continue
        choices = f.metadata.get("choices")
        if choices is not None:  # a list of names among the field's choices (layers' kinds)
            why = choices_error(fields[f.name], choices)
            if why is not None:
                raise src.error(fpath, why, "a list of " + " | ".join(choices))
            kwargs[f.name] = tuple(fields[f.name])
            continue
        rng = field_range(f)
        allowed = rng.describe(hints[f.name] is int) if rng is not None else None
        value = _value(hints[f.name], fields[f.name], fpath, src, allowed)
        if rng is not None and value is not None and not rng.contains(value):
            raise src.error(fpath, f"{value!r} is out of range", allowed)
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except FieldError as exc:  # a rule of the part's that ties a field to another: the field named
        raise src.error(path + (exc.field,), str(exc), exc.allowed) from None
    except (TypeError, ValueError) as exc:  # the part's own __post_init__ checks
        raise src.error(path, str(exc)) from None


def _part(family: str, value, path: KeyPath, src: _Source):
    """A part: `name`, `{name: {field: value}}` or `{name: value}` (one-field parts)."""
    registered = ", ".join(sorted(PARTS[family])) or "none"
    if isinstance(value, str):
        name, fields, line_at = value, {}, path
    elif isinstance(value, dict) and len(value) == 1:
        ((name, fields),) = value.items()
        line_at = path + (str(name),)
    else:
        raise src.error(path, f"expected a {family} part, got {_describe(value)}",
                        f"a name or a one-key mapping {{name: {{field: value}}}}; "
                        f"{family} parts: {registered}")
    cls = PARTS[family].get(name) if isinstance(name, str) else None
    if cls is None:
        raise src.error(path, f"unknown {family} part {name!r}", registered, line_at=line_at)
    known = [f.name for f in dataclasses.fields(cls) if f.init and not f.kw_only]  # (layers' kinds: by name only)
    if fields is not None and not isinstance(fields, dict) and len(known) == 1:
        fields = {known[0]: fields}  # {every: 16} is {every: {n: 16}}
    return _dataclass(cls, fields, path + (name,), src)


def _budget(value, src: _Source) -> Budget:
    path = ("budget",)
    if not isinstance(value, dict):
        raise src.error(path, f"expected a mapping, got {_describe(value)}",
                        "{per_head: n | ratio: r, layers, heads, threshold, split}")
    for key in value:
        if key not in BUDGET_KEYS:
            raise src.error(path + (str(key),), f"unknown budget key {key!r}", ", ".join(BUDGET_KEYS))
    per_head, ratio = value.get("per_head"), value.get("ratio")
    if per_head is not None:
        per_head = _value(int, per_head, path + ("per_head",), src,
                          "an integer > 0 (tokens per KV head per layer)")
        if per_head <= 0:
            raise src.error(path + ("per_head",), f"{per_head} is not a budget",
                            "an integer > 0 (tokens per KV head per layer)")
    if ratio is not None:
        ratio = _value(float, ratio, path + ("ratio",), src, RATIO_RANGE)
        if not RATIO_MIN <= ratio <= 1:
            raise src.error(path + ("ratio",), f"{ratio!r} is out of range", RATIO_RANGE)
    if per_head is not None and ratio is not None:
        raise src.error(path + ("ratio",), "both per_head and ratio are given",
                        "exactly one of per_head | ratio", blame=(path + ("per_head",),))
    layers = _part("layers", value.get("layers", "uniform"), path + ("layers",), src)
    heads = _part("heads", value.get("heads", "uniform"), path + ("heads",), src)
    threshold = value.get("threshold")
    if threshold is not None:
        threshold = _part("threshold", threshold, path + ("threshold",), src)
    split = value.get("split")
    if split is not None:
        split = _dataclass(Split, split, path + ("split",), src)
        total = split.proximity + split.context + split.residual
        if abs(total - 1.0) > SPLIT_TOLERANCE:
            raise src.error(path + ("split",), f"the fractions add up to {total:g}, not 1",
                            "proximity + context + residual = 1")

    tpath = path + ("threshold",)
    if threshold is not None:
        itself = "a threshold decides the budget itself"
        total_path = path + ("per_head" if per_head is not None else "ratio",)
        if per_head is not None or ratio is not None:
            raise src.error(tpath, f"{itself}: per_head / ratio cannot be given with it",
                            "threshold without per_head and ratio", blame=(total_path,))
        default = Budget()  # the allocation parts a budget has when a spec names none
        if layers != default.layers or heads != default.heads:
            raise src.error(tpath, f"{itself}: layers and heads cannot allocate it "
                            f"(got layers: {layers.name}, heads: {heads.name})",
                            f"layers: {default.layers.name}, heads: {default.heads.name}",
                            blame=(path + ("layers",), path + ("heads",)))
        if split is not None:
            raise src.error(tpath, f"{itself}: there is no preset head budget to split",
                            "threshold without split", blame=(path + ("split",),))
    elif per_head is None and ratio is None:
        raise src.error(path, "no budget total", "per_head: n | ratio: r (or a threshold)")
    return Budget(per_head=per_head, ratio=ratio, layers=layers, heads=heads,
                  threshold=threshold, split=split)


def _schedule(value, src: _Source) -> Schedule:
    path = ("schedule",)
    if value == "prefill":
        return Schedule()
    if value == "cascade":
        return Schedule(cascade=True)
    if not isinstance(value, dict):
        raise src.error(path, f"unknown schedule {_describe(value)}", SCHEDULE_FORMS)
    for key in value:
        if key not in SCHEDULE_KEYS:
            raise src.error(path + (str(key),), f"unknown schedule key {key!r}", ", ".join(SCHEDULE_KEYS))
    cascade = _value(bool, value.get("cascade", False), path + ("cascade",), src)
    decode = value.get("decode")
    if decode is not None:
        decode = _part("decode", decode, path + ("decode",), src)
    prefill = value.get("prefill")
    if prefill is not None:
        prefill = _part("prefill", prefill, path + ("prefill",), src)
    return Schedule(cascade=cascade, decode=decode, prefill=prefill)


def _check_together(ranking, budget: Budget, merge, schedule: Schedule, src: _Source, scoring=None) -> None:
    """Rules that involve more than one section."""
    sinks, window = getattr(ranking, "sinks", 0), getattr(ranking, "window", 0)
    rpath = ("ranking", ranking.name, "window" if window else "sinks")
    if budget.per_head is not None and sinks + window > budget.per_head:
        raise src.error(rpath, f"window or sinks larger than the budget: sinks {sinks} + "
                        f"window {window} > per_head {budget.per_head}",
                        f"sinks + window <= per_head ({budget.per_head})",
                        blame=(("budget", "per_head"),))
    split = budget.split
    if split is not None and window > 0:
        raise src.error(("budget", "split"), f"split together with ranking window {window}: "
                        "the split's proximity part is the recent window",
                        "ranking window: 0 with a split", blame=(rpath,))
    residual = split.residual if split is not None else 0.0
    if residual > 0 and not merge.merges:
        raise src.error(("budget", "split", "residual"),
                        f"{residual:g} of the budget are residual slots but merge is "
                        f"{merge.name!r}", "residual: 0, or merge: residual",
                        blame=(("merge",),))
    if merge.merges and residual <= 0:
        raise src.error(("merge",), f"merge: {merge.name} needs residual slots",
                        "budget.split with residual > 0",
                        blame=(("budget", "split"), ("budget",)))
    if schedule.decode is not None and schedule.decode.online and split is None:
        raise src.error(("schedule", "decode"), f"decode: {schedule.decode.name} moves tokens between the "
                        "parts of a split, and there is no budget.split",
                        "budget.split with decode: online", blame=(("budget",),))
    _check_global(budget, merge, schedule, src)
    if scoring is not None and not scoring.nonnegative:  # e.g. key_norm: −‖k‖ is no attention mass
        rule = budget.threshold if budget.threshold is not None else budget.layers
        if budget.threshold is not None or (budget.layers.needs_scores and not budget.layers.ranks_entries):
            where = ("budget", "threshold") if budget.threshold is not None else ("budget", "layers")
            raise src.error(where, f"{where[-1]}: {rule.name} reads the scores as attention mass (>= 0), and "
                            f"scoring: {scoring.name} gives negative scores",
                            "a scorer whose scores are attention mass, or layers: uniform | pyramid, no threshold",
                            blame=(("scoring",),))
    decode = schedule.decode
    if scoring is not None and scoring.whole_prompt and (schedule.chunk_tokens or decode is not None):
        part, what = (("prefill",), "compresses the prompt chunk by chunk") if schedule.chunk_tokens else \
            (("decode",), "re-scores while decoding")
        raise src.error(("schedule", *part), f"scoring: {scoring.name} scores each key by the mean over the whole "
                        f"prompt's queries that see it, and this schedule {what}, which would need each held "
                        "entry's count of queries so far", "schedule: prefill or cascade, without decode", blame=(("scoring",),))
    if decode is not None and decode.prune_every and split is not None:
        raise src.error(("schedule", "decode"), f"decode: {decode.name} prunes back to the budget, and a split's "
                        "parts are kept while decoding by decode: online", "decode: online with a split",
                        blame=(("budget", "split"),))
    if decode is not None and decode.prune_every and scoring is not None and not scoring.running:
        rows = scoring.query_rows(2 ** 30)
        if window < rows:
            raise src.error(("ranking", ranking.name, "window"),
                            f"decode: every re-scores with the queries of the latest {rows} tokens, "
                            f"which must stay cached, but ranking window is {window}",
                            f"ranking window >= {rows} (the scorer's observation window)",
                            blame=(("schedule", "decode"),))


def _check_global(budget: Budget, merge, schedule: Schedule, src: _Source) -> None:
    """layers: global ranks every (layer, head, token) at once: one pooled ranking, nothing beside it."""
    layers = budget.layers
    if not layers.ranks_entries:
        return
    where = ("budget", "layers")
    heads = budget.heads
    if budget.threshold is not None:
        raise src.error(where, f"layers: {layers.name} shares a preset total, and a threshold decides the "
                        "budget itself", "layers: global without a threshold", blame=(("budget", "threshold"),))
    sole = layers.sole_heads  # the one heads part admitted, at its declared defaults
    changed = [] if heads.name != sole else \
        [f.name for f in dataclasses.fields(heads) if getattr(heads, f.name) != getattr(type(heads)(), f.name)]
    if heads.name != sole or changed:
        raise src.error(("budget", "heads"), f"layers: {layers.name} ranks every head's entries together (one "
                        f"ranking over all layers and heads), and heads is {heads.name}"
                        f"{' with a ' + ', '.join(changed) if changed else ''}",
                        f"heads: {sole} (the per-head floor is layers: {{{layers.name}: {{floor: f}}}})",
                        blame=(where,))
    if merge.merges or budget.split is not None:
        raise src.error(where, f"layers: {layers.name} ranks prompt tokens only, without merge slots or a split",
                        "merge: drop and no budget.split", blame=(("merge",), ("budget", "split")))
    if schedule.chunk_tokens:
        raise src.error(where, f"layers: {layers.name} ranks every layer's entries of the whole prompt, which "
                        "a prompt compressed chunk by chunk does not have", "schedule without prefill: chunk",
                        blame=(("schedule", "prefill"),))


def _build(data, src: _Source, default_name: str, description: str, source) -> Policy:
    if not isinstance(data, dict):
        raise src.error((), f"the top level must be a mapping, got {_describe(data)}",
                        "a mapping with " + ", ".join(SECTIONS))
    for key in data:
        if key not in SECTIONS:
            raise src.error((str(key),), f"unknown section {key!r}", ", ".join(SECTIONS))
    for key in REQUIRED:
        if key not in data:
            raise src.error((key,), f"missing required section {key!r}",
                            "a spec with the sections " + " and ".join(REQUIRED))
    name = _value(str, data.get("name", default_name), ("name",), src)
    scoring = _part("scoring", data["scoring"], ("scoring",), src)
    ranking = _part("ranking", data.get("ranking", "by_score"), ("ranking",), src)
    budget = _budget(data["budget"], src)
    merge = _part("merge", data.get("merge", "drop"), ("merge",), src)
    schedule = _schedule(data.get("schedule", "prefill"), src)
    storage = _part("storage", data.get("storage", "model_dtype"), ("storage",), src)
    _check_together(ranking, budget, merge, schedule, src, scoring)
    return Policy(name=name, scoring=scoring, ranking=ranking, budget=budget, merge=merge,
                  schedule=schedule, storage=storage, description=description, source=source)


# ---------------------------------------------------------------------------------------
# Overrides: load_spec("lava", per_head=64, scoring={"lava": {"window": 16}})

def _as_part(value):
    """(name, fields) of a part written in any form; (None, None) if it is not one."""
    if isinstance(value, str):
        return value, {}
    if isinstance(value, dict) and len(value) == 1:
        ((name, fields),) = value.items()
        return name, {} if fields is None else fields
    return None, None


def _deep_merge(old: dict, new: dict, path: KeyPath, touched: set) -> dict:
    merged = dict(old)
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value, path + (str(key),), touched)
        else:
            merged[key] = value
            touched.add(path + (str(key),))
    return merged


def _merge_part(old, new, path: KeyPath, touched: set):
    """Same part name: merge the fields; another part (or None): replace."""
    old_name, old_fields = _as_part(old)
    new_name, new_fields = _as_part(new)
    if (new is not None and old_name is not None and old_name == new_name
            and isinstance(old_fields, dict) and isinstance(new_fields, dict)):
        return {new_name: _deep_merge(old_fields, new_fields, path + (str(new_name),), touched)}
    touched.add(path)
    return new


def _merge_budget(old, new, touched: set):
    if not (isinstance(old, dict) and isinstance(new, dict)):
        touched.add(("budget",))
        return new
    merged = dict(old)
    for key, value in new.items():
        path = ("budget", str(key))
        if key in ("per_head", "ratio") and value is not None:
            merged.pop("ratio" if key == "per_head" else "per_head", None)
        if value is None:  # None removes the key: back to its default
            merged.pop(key, None)
            touched.add(path)
        elif key in ("layers", "heads", "threshold"):
            merged[key] = _merge_part(merged.get(key), value, path, touched)
        elif key == "split" and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value, path, touched)
        else:
            merged[key] = value
            touched.add(path)
    return merged


def _schedule_mapping(value):
    forms = {"prefill": {}, "cascade": {"cascade": True}}
    if isinstance(value, str):
        return forms.get(value)
    return dict(value) if isinstance(value, dict) else None


def _merge_schedule(old, new, touched: set):
    """A mapping merges into the file's schedule; a name (prefill, cascade) replaces it."""
    old_map = _schedule_mapping(old if old is not None else "prefill")
    new_map = dict(new) if isinstance(new, dict) else None
    if old_map is None or new_map is None:
        touched.add(("schedule",))
        return new
    for key, value in new_map.items():
        if key in ("decode", "prefill"):
            old_map[key] = _merge_part(old_map.get(key), value, ("schedule", key), touched)
        else:
            old_map[key] = value
            touched.add(("schedule", str(key)))
    return old_map


def _apply_overrides(data: dict, overrides: dict) -> tuple[dict, set]:
    """A new mapping with the overrides merged in, and the paths they wrote."""
    data, touched = copy.deepcopy(data), set()
    if "per_head" in overrides and "ratio" in overrides:
        raise SpecError("override", None, "budget", "both per_head= and ratio= are given",
                        "one of per_head= | ratio=")
    for key, value in overrides.items():
        value = copy.deepcopy(value)
        if key in ("per_head", "ratio"):
            budget = data.get("budget", {})
            if isinstance(budget, dict):
                data["budget"] = _merge_budget(budget, {key: value}, touched)
            else:  # leave the file's malformed budget for _build to report
                continue
        elif key == "name":
            data[key] = value
            touched.add((key,))
        elif key in ("scoring", "ranking", "merge", "storage"):
            data[key] = _merge_part(data.get(key), value, (key,), touched)
        elif key == "budget":
            data[key] = _merge_budget(data.get(key), value, touched)
        elif key == "schedule":
            data[key] = _merge_schedule(data.get(key), value, touched)
        else:
            raise SpecError("override", None, key, f"unknown override {key!r}",
                            "per_head, ratio, " + ", ".join(SECTIONS))
    return data, touched


# ---------------------------------------------------------------------------------------
# Reading YAML

def _line_map(node, path: KeyPath, lines: dict, file: str) -> None:
    """Record the 1-based line of every mapping key; a duplicate key is an error."""
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            line = key_node.start_mark.line + 1
            if key in seen:
                field = ".".join(path + (key,))
                raise SpecError(file, line, field, f"duplicate key {key!r}", "each key once")
            seen.add(key)
            lines[path + (key,)] = line
            _line_map(value_node, path + (key,), lines, file)


def _leading_comment(text: str) -> str:
    """The description: the `#` comment lines at the top of the file, without the `# `."""
    out = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped.startswith("#"):
            break
        body = stripped[1:]
        out.append(body[1:] if body.startswith(" ") else body)
    return "\n".join(out).strip("\n")


def _check_expansion(root, file: str) -> None:
    """Refuse a document whose aliases expand it beyond MAX_NODES nodes (a "billion laughs"
    alias bomb: each level of `&a [*b, *b, ...]` multiplies the size) or make it recursive.

    PyYAML composes an alias as the very node of its anchor, so the composed graph stays
    small while everything that walks the plain data (line map, deep copy, messages) would
    pay for the expanded tree. Sizes are counted once per node (linear in the text); the
    error names the line of the first collection that alone expands past the limit."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if isinstance(node, yaml.ScalarNode) or (not done and id(node) in size):
            continue
        children = (node.value if isinstance(node, yaml.SequenceNode)
                    else [n for pair in node.value for n in pair])
        if not done:
            if id(node) in on_path:
                raise SpecError(file, node.start_mark.line + 1, None,
                                "a recursive alias: the node contains itself",
                                "aliases to nodes defined before and outside them")
            on_path.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in reversed(children))
            continue
        on_path.discard(id(node))
        size[id(node)] = 1 + sum(size.get(id(c), 1) for c in children)
        if size[id(node)] > MAX_NODES:
            raise SpecError(file, node.start_mark.line + 1, None,
                            f"this node expands to more than {MAX_NODES} nodes through aliases "
                            "(a YAML alias bomb?)", f"a spec of at most {MAX_NODES} nodes, aliases expanded")


def _reader_error(exc: yaml.reader.ReaderError, text: str, file: str) -> SpecError:
    """A character YAML refuses (NUL, BEL, other control characters): its line and column."""
    before = text[:exc.position] if isinstance(text, str) else ""
    line = before.count("\n") + 1
    column = exc.position - (before.rfind("\n") + 1) + 1
    char = exc.character if isinstance(exc.character, str) else chr(exc.character)
    kind = "control character" if unicodedata.category(char) == "Cc" else "non-printable character"
    return SpecError(file, line, None, f"column {column}: the {kind} U+{ord(char):04X} ({char!r}) "
                     "cannot appear in YAML", "printable characters, tab and line breaks")


def _load_text(text: str, file: str, default_name: str, source, overrides: dict) -> Policy:
    loader = None
    try:
        loader = _SpecLoader(text)  # the reader checks every character here
        node = loader.get_single_node()
        if node is not None:
            _check_expansion(node, file)
        data = loader.construct_document(node) if node is not None else None
    except yaml.reader.ReaderError as exc:
        raise _reader_error(exc, text, file) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        problem = f"YAML syntax error: {exc.problem or exc.context}"
        raise SpecError(file, mark.line + 1 if mark else None, None, problem,
                        "valid YAML (see docs/SPECS.md)") from None
    except yaml.YAMLError as exc:
        raise SpecError(file, None, None, f"YAML error: {exc}", "valid YAML") from None
    except RecursionError:
        raise SpecError(file, None, None, "the document is nested too deeply",
                        "a spec nested a few levels deep") from None
    finally:
        if loader is not None:
            loader.dispose()
    src = _Source(file, {(): 1})  # an empty file: line 1
    if node is not None:
        src.lines[()] = node.start_mark.line + 1
        _line_map(node, (), src.lines, file)
    if overrides and isinstance(data, dict):
        data, src.overridden = _apply_overrides(data, overrides)
    return _build(data, src, default_name, _leading_comment(text), source)


def specs_dir():
    """The shipped specs: `specs/` of a source checkout, else package data kvcompile.specs."""
    checkout = Path(__file__).resolve().parents[1] / "specs"  # kvcompile/spec.py -> the checkout
    if checkout.is_dir():
        return checkout
    return importlib.resources.files("kvcompile.specs")


def available_specs() -> list[str]:
    """Names of the shipped specs (what load_spec accepts as a bare name)."""
    return sorted(p.name[:-5] for p in specs_dir().iterdir() if p.name.endswith(".yaml"))


def _read(spec) -> tuple[str, str, str]:
    """(text, file label, stem) of a path or a bare spec name."""
    path = Path(spec)
    if path.is_file():
        raw = path.read_bytes()
        try:
            return raw.decode("utf-8"), str(path), path.stem
        except UnicodeDecodeError as exc:
            line = raw[:exc.start].count(b"\n") + 1
            column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
            raise SpecError(str(path), line, None, f"column {column}: the byte 0x{raw[exc.start]:02X} "
                            "is not UTF-8 text", "a UTF-8 text file") from None
    if isinstance(spec, str) and re.fullmatch(r"[A-Za-z0-9_\-]+", spec):
        shipped = specs_dir() / f"{spec}.yaml"
        if shipped.is_file():
            return shipped.read_text(encoding="utf-8"), str(shipped), spec
        raise SpecError(spec, None, None, f"no spec named {spec!r}",
                        "a path to a .yaml file or a shipped spec: " + ", ".join(available_specs()))
    raise SpecError(str(spec), None, None, "no such spec file",
                    "a path to an existing .yaml file or a shipped spec name")


# ---------------------------------------------------------------------------------------
# Public API

def load_spec(spec, **overrides) -> Policy:
    """A validated Policy from a YAML file path, a shipped spec name ("lava"), a mapping,
    or a Policy; `overrides` (per_head=, ratio=, or any section) are merged in first.

    per_head= / ratio= replace the budget total (the other one is dropped); a section
    override deep-merges: the same part name merges fields, another part replaces it.
    """
    if isinstance(spec, Policy):
        if not overrides:
            return spec
        src = _Source("<policy>")
        data, src.overridden = _apply_overrides(policy_to_mapping(spec), overrides)
        return _build(data, src, spec.name, spec.description, spec.source)
    if isinstance(spec, dict):
        src = _Source("<mapping>")
        data = spec
        if overrides:
            data, src.overridden = _apply_overrides(spec, overrides)
        return _build(data, src, "policy", "", None)
    if isinstance(spec, (str, Path)):
        text, file, stem = _read(spec)
        return _load_text(text, file, stem, file, overrides)
    raise TypeError(f"load_spec takes a path, a spec name, a mapping or a Policy, "
                    f"not {type(spec).__name__}")


def loads_spec(text: str, **overrides) -> Policy:
    """A validated Policy from YAML text (errors name the file "<string>")."""
    return _load_text(text, "<string>", "policy", None, overrides)
