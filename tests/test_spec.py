"""The spec language (kvcompile/spec.py): every SpecError case names file, line and field;
defaults, overrides, and the YAML round trip (hypothesis over random valid policies)."""
from __future__ import annotations

import dataclasses
import re
import string
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcompile.policies import PARTS
from kvcompile.policies.budgets import AttentionNorm, PooledHeads, Split
from kvcompile.policies.schedule import Every, Online
from kvcompile.policies.scoring import Pooling, WindowAttention
from kvcompile.policy import Policy
from kvcompile.spec import SpecError, load_spec, loads_spec, policy_to_yaml

ROOT = Path(__file__).resolve().parent.parent

GOOD = """\
# A test policy.
name: t
scoring: {window_attention: {window: 8}}
ranking: {by_score: {sinks: 0, window: 8}}
budget: {per_head: 64}
merge: drop
schedule: prefill
"""


def write(tmp_path: Path, text: str, name: str = "p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def assert_names(err: SpecError, file: str, line: int | None, field: str | None, *fragments):
    """The message names the file, the line and the field, says what is wrong and allowed."""
    where = file if line is None else f"{file}:{line}"
    head = f"{where}: {field}:" if field else f"{where}:"
    assert str(err).startswith(head), str(err)
    assert (err.file, err.line, err.field) == (file, line, field)
    for fragment in fragments:
        assert fragment in str(err), (fragment, str(err))


# ---------------------------------------------------------------------------------------
# One case per SpecError: (id, spec text, line, field, fragments of the message).

S = "scoring: recency\n"
B = "budget: {per_head: 64}\n"
MINI = {"scoring": "recency", "budget": {"per_head": 64}}

CASES = [
    ("unknown scoring part", "scoring: snap\n" + B, 1, "scoring",
     ["unknown scoring part 'snap'", "window_attention", "lava"]),
    ("unknown heads part (mapping form)", S + "budget:\n  per_head: 64\n  heads: {poold: {floor: 0.2}}\n",
     4, "budget.heads", ["unknown heads part 'poold'", "allowed: pooled, uniform"]),
    ("unknown field of a part", S + "budget:\n  per_head: 64\n  heads: {pooled: {flor: 0.2}}\n",
     4, "budget.heads.pooled.flor", ["unknown field 'flor'", "allowed: floor"]),
    ("unknown field of pooling", "scoring:\n  window_attention:\n    pooling: {kind: max, kernal: 7}\n" + B,
     3, "scoring.window_attention.pooling.kernal", ["unknown field 'kernal'", "kind, kernel"]),
    ("field on a part without fields", S + B + "merge: {drop: {slots: 4}}\n", 3, "merge.drop.slots",
     ["unknown field 'slots'", "no fields"]),
    ("unknown section", S + B + "schedul: prefill\n", 3, "schedul",
     ["unknown section 'schedul'", "schedule"]),
    ("unknown budget key", S + "budget: {per_haed: 64}\n", 2, "budget.per_haed",
     ["unknown budget key 'per_haed'", "per_head"]),
    ("unknown schedule key", S + B + "schedule: {cascade: true, decod: online}\n", 3, "schedule.decod",
     ["unknown schedule key 'decod'", "cascade, decode"]),
    ("part with two keys", "scoring: {lava: {}, tova: {}}\n" + B, 1, "scoring",
     ["expected a scoring part", "one-key mapping"]),
    ("string for an int", "scoring: {window_attention: {window: abc}}\n" + B, 1,
     "scoring.window_attention.window", ["expected an integer, got 'abc'", "an integer >= 1"]),
    ("bool is not an int", "scoring: {window_attention: {window: true}}\n" + B, 1,
     "scoring.window_attention.window", ["expected an integer, got True (a boolean)"]),
    ("bool is not a number", S + "budget: {per_head: 64, heads: {pooled: {floor: true}}}\n", 2,
     "budget.heads.pooled.floor", ["expected a finite number, got True", "[0, 1]"]),
    ("float is not an int", "scoring: {window_attention: {window: 8.5}}\n" + B, 1,
     "scoring.window_attention.window", ["expected an integer, got 8.5"]),
    ("string for a bool", S + B + "schedule: {cascade: maybe}\n", 3, "schedule.cascade",
     ["expected a boolean", "true | false"]),
    ("name not a string", "name: 12\n" + S + B, 1, "name", ["expected a string"]),
    ("missing scoring", B, 1, "scoring", ["missing required section 'scoring'", "scoring and budget"]),
    ("missing budget", S, 1, "budget", ["missing required section 'budget'"]),
    ("budget not a mapping", S + "budget: 128\n", 2, "budget", ["expected a mapping", "per_head"]),
    ("per_head zero", S + "budget: {per_head: 0}\n", 2, "budget.per_head",
     ["0 is not a budget", "an integer > 0"]),
    ("per_head negative", S + "budget: {per_head: -8}\n", 2, "budget.per_head", ["-8 is not a budget"]),
    ("per_head not an int", S + "budget: {per_head: 12.5}\n", 2, "budget.per_head",
     ["expected an integer, got 12.5"]),
    ("ratio zero", S + "budget: {ratio: 0}\n", 2, "budget.ratio", ["out of range", "[1e-06, 1]"]),
    ("ratio above one", S + "budget: {ratio: 1.5}\n", 2, "budget.ratio", ["1.5 is out of range"]),
    ("both per_head and ratio", S + "budget:\n  per_head: 64\n  ratio: 0.5\n", 4, "budget.ratio",
     ["both per_head and ratio", "exactly one of per_head | ratio"]),
    ("neither per_head nor ratio", S + "budget: {layers: uniform}\n", 2, "budget",
     ["no budget total", "per_head: n | ratio: r (or a threshold)"]),
    ("negative sinks", S + "ranking: {by_position: {sinks: -1}}\n" + B, 2, "ranking.by_position.sinks",
     ["-1 is out of range", "an integer >= 0"]),
    ("negative window", S + "ranking: {by_score: {window: -4}}\n" + B, 2, "ranking.by_score.window",
     ["-4 is out of range"]),
    ("window larger than the budget", S + "ranking: {by_score: {sinks: 4, window: 64}}\n" + B, 2,
     "ranking.by_score.window", ["window or sinks larger than the budget", "sinks + window <= per_head (64)"]),
    ("sinks larger than the budget", S + "ranking: {by_position: {sinks: 100}}\n" + B, 2,
     "ranking.by_position.sinks", ["window or sinks larger than the budget"]),
    ("window_attention window < 1", "scoring: {window_attention: {window: 0}}\n" + B, 1,
     "scoring.window_attention.window", ["0 is out of range", "an integer >= 1"]),
    ("lava window < 1", "scoring:\n  lava:\n    window: -3\n" + B, 3, "scoring.lava.window",
     ["-3 is out of range"]),
    ("pooling kind", "scoring: {lava: {pooling: {kind: mean}}}\n" + B, 1, "scoring.lava.pooling.kind",
     ["'mean' (a string) is not allowed", "avg | max | none"]),
    ("pooling kernel even", "scoring: {lava: {pooling: {kind: avg, kernel: 4}}}\n" + B, 1,
     "scoring.lava.pooling.kernel", ["4 is out of range", "an odd integer >= 1"]),
    ("pooling kernel zero", "scoring: {window_attention: {pooling: {kernel: 0}}}\n" + B, 1,
     "scoring.window_attention.pooling.kernel", ["0 is out of range"]),
    ("pooling not a mapping", "scoring: {window_attention: {pooling: max}}\n" + B, 1,
     "scoring.window_attention.pooling", ["expected a mapping", "kind, kernel"]),
    ("gqa", "scoring: {last_token: {gqa: sum}}\n" + B, 1, "scoring.last_token.gqa",
     ["'sum' (a string) is not allowed", "mean | max"]),
    ("decay zero", "scoring: {decayed: {decay: 0}}\n" + B, 1, "scoring.decayed.decay",
     ["out of range", "(0, 1]"]),
    ("decay above one", "scoring: {decayed: {decay: 1.01}}\n" + B, 1, "scoring.decayed.decay",
     ["1.01 is out of range"]),
    ("pyramid beta < 1", S + "budget: {per_head: 64, layers: {pyramid: {beta: 0.5}}}\n", 2,
     "budget.layers.pyramid.beta", ["0.5 is out of range", "a number >= 1"]),
    ("layers kinds unknown", S + "budget: {per_head: 64, layers: {uniform: {kinds: [global_attention]}}}\n", 2,
     "budget.layers.uniform.kinds", ["'global_attention' is not one of full_attention | sliding_attention",
                                     "a list of full_attention | sliding_attention | chunked_attention"]),
    ("layers kinds empty", S + "budget: {per_head: 64, layers: {pyramid: {kinds: []}}}\n", 2,
     "budget.layers.pyramid.kinds", ["expected a non-empty list of names, got []"]),
    ("layers kinds twice", S + "budget: {per_head: 64, layers: {entropy: {kinds: [full_attention, full_attention]}}}\n",
     2, "budget.layers.entropy.kinds", ["a name is given twice"]),
    ("layers kinds not a list", S + "budget:\n  per_head: 64\n  layers: {uniform: {kinds: full_attention}}\n", 4,
     "budget.layers.uniform.kinds", ["expected a non-empty list of names, got 'full_attention'"]),
    ("pooled floor above one", S + "budget: {per_head: 64, heads: {pooled: {floor: 1.5}}}\n", 2,
     "budget.heads.pooled.floor", ["1.5 is out of range", "[0, 1]"]),
    ("pooled floor negative", S + "budget: {per_head: 64, heads: {pooled: {floor: -0.1}}}\n", 2,
     "budget.heads.pooled.floor", ["-0.1 is out of range"]),
    ("attention_norm t = 1", S + "budget: {threshold: {attention_norm: {t: 1.0}}}\n", 2,
     "budget.threshold.attention_norm.t", ["1.0 is out of range", "[0, 1)"]),
    ("attention_norm t negative", S + "budget: {threshold: {attention_norm: {t: -0.01}}}\n", 2,
     "budget.threshold.attention_norm.t", ["-0.01 is out of range"]),
    ("keep_layers negative", S + "budget: {threshold: {attention_norm: {keep_layers: -1}}}\n", 2,
     "budget.threshold.attention_norm.keep_layers", ["-1 is out of range", "an integer >= 0"]),
    ("residual alpha", S + "budget: {per_head: 64, split: {proximity: 0.5, context: 0.25, residual: 0.25}}\n"
     "merge: {residual: {alpha: 1.5}}\n", 3, "merge.residual.alpha", ["1.5 is out of range", "[0, 1]"]),
    ("every n < 1", S + B + "schedule: {decode: {every: {n: 0}}}\n", 3, "schedule.decode.every.n",
     ["0 is out of range", "an integer >= 1"]),
    ("split fraction above one", S + "budget: {per_head: 64, split: {proximity: 1.5, context: -0.5}}\n", 2,
     "budget.split.proximity", ["1.5 is out of range", "a fraction in [0, 1]"]),
    ("split fraction negative", S + "budget: {per_head: 64, split: {proximity: 0.5, context: -0.1}}\n", 2,
     "budget.split.context", ["-0.1 is out of range"]),
    ("split does not add up", S + "budget:\n  per_head: 64\n  split: {proximity: 0.5, context: 0.4}\n", 4,
     "budget.split", ["add up to 0.9, not 1", "proximity + context + residual = 1"]),
    ("split missing a fraction", S + "budget:\n  per_head: 64\n  split: {proximity: 1.0}\n", 4,
     "budget.split.context", ["missing required field 'context'"]),
    ("residual slots without merge residual",
     S + "budget:\n  per_head: 64\n  split:\n    proximity: 0.5\n    context: 0.3\n    residual: 0.2\n", 7,
     "budget.split.residual", ["residual slots but merge is 'drop'", "merge: residual"]),
    ("merge residual without a split", S + B + "merge: {residual: {alpha: 0.6}}\n", 3, "merge",
     ["merge: residual needs residual slots", "budget.split with residual > 0"]),
    ("merge residual with zero residual",
     S + "budget: {per_head: 64, split: {proximity: 0.5, context: 0.5, residual: 0}}\nmerge: residual\n",
     3, "merge", ["merge: residual needs residual slots"]),
    ("split with a ranking window",
     S + "ranking: {by_score: {window: 8}}\nbudget:\n  per_head: 64\n  split: {proximity: 0.5, context: 0.5}\n",
     5, "budget.split", ["split together with ranking window 8", "proximity part is the recent window"]),
    ("threshold with per_head", S + "budget:\n  per_head: 64\n  threshold: attention_norm\n", 4,
     "budget.threshold", ["a threshold decides the budget itself", "per_head / ratio"]),
    ("threshold with ratio", S + "budget: {ratio: 0.5, threshold: attention_norm}\n", 2,
     "budget.threshold", ["a threshold decides the budget itself"]),
    ("threshold with pyramid layers", S + "budget: {threshold: attention_norm, layers: pyramid}\n", 2,
     "budget.threshold", ["a threshold decides the budget itself", "layers: pyramid"]),
    ("threshold with pooled heads", S + "budget: {threshold: attention_norm, heads: pooled}\n", 2,
     "budget.threshold", ["a threshold decides the budget itself", "heads: pooled"]),
    ("threshold with a split",
     S + "budget: {threshold: attention_norm, split: {proximity: 0.5, context: 0.5}}\n", 2,
     "budget.threshold", ["a threshold decides the budget itself", "split"]),
    ("online decode without a split", S + B + "schedule:\n  decode: online\n", 4, "schedule.decode",
     ["decode: online", "budget.split"]),
    ("chunk null", S + B + "schedule:\n  prefill: {chunk: null}\n", 4, "schedule.prefill.chunk.size",
     ["missing required field 'size'"]),
    ("chunk without a size", S + B + "schedule: {prefill: chunk}\n", 3, "schedule.prefill.chunk.size",
     ["missing required field 'size'"]),
    ("chunk 10^30", S + B + "schedule:\n  prefill: {chunk: 1000000000000000000000000000000}\n", 4,
     "schedule.prefill.chunk.size", ["out of range", "an integer in [1, 16777216]"]),
    ("chunk zero", S + B + "schedule: {prefill: {chunk: {size: 0}}}\n", 3, "schedule.prefill.chunk.size",
     ["0 is out of range"]),
    ("chunk not an integer", S + B + "schedule: {prefill: {chunk: 1.0e3}}\n", 3, "schedule.prefill.chunk.size",
     ["expected an integer"]),
    ("unknown schedule", S + B + "schedule: sometimes\n", 3, "schedule",
     ["unknown schedule 'sometimes'", "prefill | cascade"]),
    ("unknown decode part", S + B + "schedule: {decode: {evry: 8}}\n", 3, "schedule.decode",
     ["unknown decode part 'evry'", "every, online"]),
    ("duplicate key", S + B + "scoring: lava\n", 3, "scoring", ["duplicate key 'scoring'"]),
    ("mean attention chunked", "scoring: mean_attention\n" + B + "schedule: {prefill: {chunk: {size: 64}}}\n", 3,
     "schedule.prefill", ["scoring: mean_attention", "compresses the prompt chunk by chunk", "count of queries"]),
    ("mean attention decode", "scoring: mean_attention\n" + B + "schedule: {decode: {every: 8}}\n", 3,
     "schedule.decode", ["scoring: mean_attention", "re-scores while decoding", "schedule: prefill or cascade"]),
    ("yaml syntax error", S + "budget: {per_head: 64\nmerge: drop\n", 3, None,
     ["YAML syntax error"]),
    ("yaml bad indentation", S + "budget:\n  per_head: 64\n layers: uniform\n", 4, None,
     ["YAML syntax error"]),
    ("top level a list", "- scoring\n- budget\n", 1, None,
     ["the top level must be a mapping", "a list"]),
    ("top level a scalar", "snapkv\n", 1, None, ["the top level must be a mapping"]),
    ("empty file", "", 1, None, ["the top level must be a mapping, got None"]),
]


@pytest.mark.parametrize("text, line, field, fragments", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_spec_error_names_file_line_and_field(tmp_path, text, line, field, fragments):
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert_names(info.value, str(path), line, field, *fragments)
    assert "(allowed: " in str(info.value)


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(missing)
    assert_names(info.value, str(missing), None, None, "no such spec file")


def test_unknown_spec_name_lists_the_shipped_ones():
    with pytest.raises(SpecError) as info:
        load_spec("snapkvv")
    assert_names(info.value, "snapkvv", None, None, "no spec named 'snapkvv'", "snapkv", "lava")


def test_errors_in_a_mapping_name_the_mapping():
    with pytest.raises(SpecError) as info:
        load_spec({"scoring": "recency", "budget": {"per_head": 64, "heads": {"pooled": {"floor": 2}}}})
    assert_names(info.value, "<mapping>", None, "budget.heads.pooled.floor", "2.0 is out of range")


def test_part_post_init_errors_become_spec_errors(tmp_path, monkeypatch):
    """A part's own __post_init__ check is reported with file, line and field."""

    @dataclasses.dataclass(frozen=True)
    class Clip:
        low: float = 0.0
        high: float = 1.0

        def __post_init__(self):
            if self.low > self.high:
                raise ValueError(f"low {self.low} > high {self.high}")

    Clip.family, Clip.name, Clip.merges = "merge", "clip", False  # a part says whether it merges
    monkeypatch.setitem(PARTS["merge"], "clip", Clip)  # a part nobody wrote a RULES entry for
    assert load_spec({**MINI, "merge": {"clip": {"low": 0.5}}}).merge == Clip(low=0.5)
    path = write(tmp_path, S + B + "merge:\n  clip: {low: 2, high: 1}\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert_names(info.value, str(path), 4, "merge.clip", "low 2.0 > high 1.0")


# ---------------------------------------------------------------------------------------
# What valid specs mean

def test_defaults_are_filled(tmp_path):
    path = write(tmp_path, "scoring: window_attention\nbudget: {ratio: 0.25}\n", name="mini.yaml")
    policy = load_spec(path)
    assert policy == Policy(name="mini", scoring=WindowAttention(), budget=policy.budget)
    assert policy.ranking == PARTS["ranking"]["by_score"]()
    assert policy.merge == PARTS["merge"]["drop"]()
    assert policy.schedule.cascade is False and policy.schedule.decode is None
    assert policy.budget.ratio == 0.25 and policy.budget.per_head is None
    assert policy.budget.layers.name == "uniform" and policy.budget.heads.name == "uniform"
    assert policy.source == str(path) and policy.description == ""


def test_full_file_and_description(tmp_path):
    policy = load_spec(write(tmp_path, GOOD))
    assert policy.name == "t" and policy.description == "A test policy."
    assert policy.scoring == WindowAttention(window=8)
    assert (policy.ranking.sinks, policy.ranking.window, policy.budget.per_head) == (0, 8, 64)


def test_part_forms_are_equivalent():
    forms = ["pooled", {"pooled": None}, {"pooled": {}}, {"pooled": {"floor": 0.0}}, {"pooled": 0}]
    heads = {load_spec({"scoring": "recency", "budget": {"per_head": 8, "heads": f}}).budget.heads
             for f in forms}
    assert heads == {PooledHeads(floor=0.0)}


def test_one_field_shorthand_and_schedule_forms():
    base = {"scoring": "recency", "budget": {"per_head": 8}}
    assert load_spec({**base, "schedule": {"decode": {"every": 8}}}).schedule.decode == Every(n=8)
    assert load_spec({**base, "schedule": {"decode": "every"}}).schedule.decode == Every()
    assert load_spec({**base, "schedule": "cascade"}).schedule.cascade is True
    assert load_spec({**base, "schedule": {"cascade": True, "decode": None}}).schedule.cascade is True


def test_numbers_int_for_float_and_exponent_form():
    policy = loads_spec("scoring: {decayed: {decay: 1}}\nbudget: {ratio: 1, heads: {pooled: {floor: 1e-1}}}\n")
    assert policy.scoring.decay == 1.0 and isinstance(policy.scoring.decay, float)
    assert policy.budget.ratio == 1.0 and policy.budget.heads.floor == pytest.approx(0.1)


def test_threshold_decides_the_budget():
    policy = loads_spec("scoring: last_token\nbudget:\n  threshold: {attention_norm: {t: 0.05}}\n")
    assert policy.budget.threshold == AttentionNorm(t=0.05, keep_layers=2)
    assert policy.budget.per_head is None and policy.budget.ratio is None


def test_split_with_residual_merge_and_online_decode():
    policy = loads_spec(
        "scoring: decayed\nbudget: {per_head: 100, split: {proximity: 0.2, context: 0.7, residual: 0.1}}\n"
        "merge: residual\nschedule: {decode: online}\n")
    assert policy.budget.split == Split(proximity=0.2, context=0.7, residual=0.1)
    assert policy.merges and policy.schedule.decode == Online()


def test_shipped_name_path_and_pathlib_agree():
    by_name = load_spec("snapkv")
    assert load_spec(Path(by_name.source)) == by_name == load_spec(str(by_name.source))
    assert Path(by_name.source).name == "snapkv.yaml"


def test_internals_yaml_example_loads():
    """docs/INTERNALS.md's YAML example is the contract: it must load."""
    text = (ROOT / "docs" / "INTERNALS.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    policy = loads_spec(block)
    assert policy.name == "snapkv" and policy.scoring.pooling == Pooling(kind="avg", kernel=7)


# ---------------------------------------------------------------------------------------
# Overrides

def test_per_head_override_replaces_ratio(tmp_path):
    path = write(tmp_path, S + "budget: {ratio: 0.1, heads: pooled}\n")
    budget = load_spec(path, per_head=32).budget
    assert (budget.per_head, budget.ratio, budget.heads.name) == (32, None, "pooled")


def test_ratio_override_replaces_per_head():
    budget = load_spec("snapkv", ratio=0.3).budget
    assert (budget.per_head, budget.ratio) == (None, 0.3)


def test_same_part_merges_fields_other_part_replaces():
    merged = load_spec("snapkv", scoring={"window_attention": {"pooling": {"kernel": 3}}}).scoring
    assert merged == WindowAttention(window=32, pooling=Pooling(kind="avg", kernel=3))
    replaced = load_spec("snapkv", scoring={"lava": {"window": 16}}).scoring
    assert replaced == PARTS["scoring"]["lava"](window=16)  # lava's own defaults, not snapkv's
    assert load_spec("snapkv", scoring="recency").scoring.name == "recency"


def test_budget_and_schedule_deep_merge():
    policy = load_spec("adakv", budget={"heads": {"pooled": {"floor": 0.5}}, "layers": "pyramid"},
                       schedule={"decode": {"every": {"n": 4}}}, name="adakv_every")
    assert policy.budget.heads == PooledHeads(floor=0.5) and policy.budget.per_head == 128
    assert policy.budget.layers.name == "pyramid"
    assert policy.schedule.decode == Every(n=4) and policy.name == "adakv_every"
    cascade = load_spec("lava", schedule={"decode": "every"}).schedule
    assert cascade.cascade is True and cascade.decode == Every()
    assert load_spec("lava", schedule="prefill").schedule == load_spec("snapkv").schedule  # a name replaces
    assert load_spec("zsmerge", schedule={"decode": None}).schedule.decode is None


def test_spec_error_pickles():
    import pickle

    err = SpecError("f.yaml", 3, "budget.per_head", "0 is not a budget", "an integer > 0")
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and (again.file, again.line, again.field) == ("f.yaml", 3, "budget.per_head")


def test_override_none_removes_a_budget_key():
    policy = load_spec("dbudgetkv", budget={"threshold": None}, per_head=16)
    assert policy.budget.threshold is None and policy.budget.per_head == 16


def test_override_errors_say_override():
    with pytest.raises(SpecError) as info:
        load_spec("snapkv", per_head=0)
    assert_names(info.value, "override", None, "budget.per_head", "0 is not a budget")
    with pytest.raises(SpecError) as info:
        load_spec("snapkv", per_head=16)  # the file's window 32 no longer fits: the override's fault
    assert_names(info.value, "override", None, "ranking.by_score.window", "larger than the budget")
    with pytest.raises(SpecError) as info:
        load_spec("snapkv", windw=8)
    assert_names(info.value, "override", None, "windw", "unknown override 'windw'", "per_head")
    with pytest.raises(SpecError) as info:
        load_spec("snapkv", per_head=8, ratio=0.5)
    assert_names(info.value, "override", None, "budget", "both per_head= and ratio=")
    with pytest.raises(SpecError) as info:
        load_spec("dbudgetkv", per_head=64)
    assert_names(info.value, "override", None, "budget.threshold", "decides the budget itself")


def test_overrides_apply_nothing_on_error_and_never_mutate():
    mapping = {"scoring": {"lava": {"window": 8}}, "budget": {"per_head": 64}}
    snapshot = yaml.safe_dump(mapping)
    with pytest.raises(SpecError):
        load_spec(mapping, scoring={"lava": {"window": 0}})
    load_spec(mapping, scoring={"lava": {"gqa": "mean"}}, per_head=32)
    assert yaml.safe_dump(mapping) == snapshot
    assert load_spec(mapping).scoring == PARTS["scoring"]["lava"](window=8)


def test_numpy_scalars_and_integral_floats_are_numbers():
    """per_head=np.int64(64) and per_head=64.0 are the integer 64 (a plain int, so the policy
    round-trips); numpy floats fill float fields; fractions and booleans stay refused."""
    np = pytest.importorskip("numpy")
    for value in (np.int64(64), np.int32(64), np.uint16(64), 64.0, np.float64(64.0)):
        budget = load_spec("lava", per_head=value).budget
        assert budget.per_head == 64 and type(budget.per_head) is int, value
    for value in (np.float32(0.5), np.float64(0.5), np.int64(1)):
        ratio = load_spec("lava", ratio=value).budget.ratio
        assert ratio == float(value) and type(ratio) is float, value
    scoring = load_spec("lava", scoring={"lava": {"window": np.int64(16)}}).scoring
    assert scoring.window == 16 and type(scoring.window) is int
    assert loads_spec(S + "budget: {per_head: 64.0}\n").budget.per_head == 64
    for value, shown in ((64.5, "64.5"), (True, "True (a boolean)"), (np.True_, "np.True_ (a boolean)"),
                         (np.float64(64.5), "np.float64(64.5) (a number)"), (float("inf"), "inf"), ("64", "'64'")):
        with pytest.raises(SpecError) as info:
            load_spec("lava", per_head=value)
        assert_names(info.value, "override", None, "budget.per_head", f"expected an integer, got {shown}",
                     "an integer > 0")
    with pytest.raises(SpecError) as info:
        load_spec("lava", ratio=np.True_)
    assert_names(info.value, "override", None, "budget.ratio", "expected a finite number", "(a boolean)")


def test_policy_in_policy_out():
    policy = load_spec("zsmerge")
    assert load_spec(policy) is policy
    smaller = load_spec(policy, per_head=64)
    assert smaller.budget.per_head == 64 and smaller.budget.split == policy.budget.split
    assert smaller.description == policy.description and smaller.source == policy.source


# ---------------------------------------------------------------------------------------
# Round trip: random valid policies through YAML text and back

FLOATS = dict(allow_nan=False, allow_infinity=False, allow_subnormal=False)


def part_fields(family: str, name: str, draw) -> dict:
    """Random valid values for the fields this test knows; other fields keep defaults."""
    known = {
        ("scoring", "window"): st.integers(1, 64),
        ("scoring", "gqa"): st.sampled_from(["mean", "max"]),
        ("scoring", "pooling"): st.fixed_dictionaries(
            {"kind": st.sampled_from(["avg", "max", "none"]), "kernel": st.sampled_from([1, 3, 5, 7])}),
        ("scoring", "decay"): st.floats(0.01, 1.0, **FLOATS),
        ("layers", "beta"): st.floats(1.0, 50.0, **FLOATS),
        ("heads", "floor"): st.floats(0.0, 1.0, **FLOATS),
        ("threshold", "t"): st.floats(0.0, 0.99, **FLOATS),
        ("threshold", "keep_layers"): st.integers(0, 4),
        ("merge", "alpha"): st.floats(0.0, 1.0, **FLOATS),
        ("decode", "n"): st.integers(1, 64),
    }
    fields = {}
    for f in dataclasses.fields(PARTS[family][name]):
        if (family, f.name) in known and draw(st.booleans()):
            fields[f.name] = draw(known[(family, f.name)])
    return fields


def written(name: str, fields: dict, draw):
    """A part in one of its YAML forms."""
    if not fields:
        return draw(st.sampled_from([name, {name: None}, {name: {}}]))
    return {name: fields}


@st.composite
def valid_specs(draw) -> dict:
    def pick(family, names=None):
        name = draw(st.sampled_from(sorted(names or PARTS[family])))
        return written(name, part_fields(family, name, draw), draw)

    mode = draw(st.sampled_from(["per_head", "ratio", "threshold"]))
    split = None
    if mode != "threshold" and draw(st.booleans()):
        proximity = draw(st.floats(0.0, 1.0, **FLOATS))
        residual = draw(st.sampled_from([0.0, draw(st.floats(0.01, 1.0 - proximity, **FLOATS))])) \
            if proximity <= 0.99 else 0.0
        split = {"proximity": proximity, "context": max(0.0, 1.0 - proximity - residual),
                 "residual": residual}
    sinks = draw(st.integers(0, 8))
    window = 0 if split else draw(st.integers(0, 32))
    budget = {}
    if mode == "per_head":
        budget["per_head"] = draw(st.integers(sinks + window, 512).filter(lambda n: n > 0))
    elif mode == "ratio":
        budget["ratio"] = draw(st.floats(0.001, 1.0, **FLOATS))
    else:
        budget["threshold"] = pick("threshold")
    if mode != "threshold":
        budget["layers"], budget["heads"] = pick("layers"), pick("heads")
        if "global" in budget["layers"]:  # one ranking of every layer and head: pooled heads (floor 0), no split
            budget["heads"] = "pooled"
            if split:
                budget["layers"] = "uniform"
    if split:
        budget["split"] = split
    merges = split is not None and split["residual"] > 0
    layers = budget.get("layers", "uniform")
    layers = layers if isinstance(layers, str) else next(iter(layers))
    # entropy layers and thresholds read the scores as attention mass: only scorers whose scores are >= 0
    mass = mode == "threshold" or PARTS["layers"][layers].needs_scores
    scoring = pick("scoring", [n for n, cls in PARTS["scoring"].items() if cls.nonnegative] if mass else None)
    name, fields = (scoring, {}) if isinstance(scoring, str) else next(iter(scoring.items()))
    rows = PARTS["scoring"][name](**(fields or {})).query_rows(2 ** 30)
    # decode: every needs the scorer's window queries cached (ranking window >= them) and no split
    every = split is None and (name in ("accumulated", "decayed") or window >= rows)
    # a score of the whole prompt (mean_attention) has no decode schedule
    whole = PARTS["scoring"][name].whole_prompt
    decodes = [None] + ([] if whole else (["every"] if every else []) + (["online"] if split else []))
    decode = draw(st.sampled_from(decodes))
    return {
        "name": draw(st.text(string.ascii_letters + "_", min_size=1, max_size=12)),
        "scoring": scoring,
        "ranking": {draw(st.sampled_from(sorted(PARTS["ranking"]))): {"sinks": sinks, "window": window}},
        "budget": budget,
        "merge": pick("merge", ["residual"]) if merges else "drop",
        "schedule": {"cascade": draw(st.booleans()),
                     "decode": None if decode is None else pick("decode", [decode])},
    }


DESCRIPTION = st.text(string.ascii_letters + string.digits + " .,:;()#'\"-\n", max_size=60)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_specs(), DESCRIPTION)
def test_round_trip_random_policies(mapping, description):
    policy = dataclasses.replace(load_spec(mapping), description=description)
    text = policy_to_yaml(policy)
    again = loads_spec(text)
    assert again == policy
    assert again.description == "\n".join(line.rstrip() for line in description.splitlines()).strip("\n")
    assert load_spec(yaml.safe_load(text)) == policy  # the parsed mapping, too
    assert policy_to_yaml(again) == text  # the full form is a fixed point
    assert text == policy.to_yaml()


def test_every_needs_cached_window_queries_and_no_split():
    with pytest.raises(SpecError, match="ranking window >= 32") as err:
        load_spec("snapkv", ranking={"by_score": {"window": 8}}, schedule={"decode": {"every": 4}})
    assert err.value.field == "ranking.by_score.window"
    with pytest.raises(SpecError, match="decode: online with a split"):
        load_spec("zsmerge", schedule={"decode": {"every": 4}})
    assert load_spec("h2o", ranking={"by_score": {"window": 0}}, schedule={"decode": {"every": 4}})


# ---------------------------------------------------------------------------------------
# Hostile YAML: characters YAML refuses, alias bombs, recursion, deep nesting, bad bytes

@pytest.mark.parametrize("char", ["\0", "\a", "\x1b", "\ufffe"])
def test_unprintable_character_names_file_line_and_column(tmp_path, char):
    text = GOOD.replace("merge: drop", f"merge: dr{char}op")
    path = write(tmp_path, text)
    line = text.splitlines().index(f"merge: dr{char}op") + 1
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert_names(info.value, str(path), line, None, "column 10", f"U+{ord(char):04X}", "cannot appear in YAML")
    with pytest.raises(SpecError) as info:
        loads_spec(text)
    assert_names(info.value, "<string>", line, None, "column 10")


def test_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(GOOD.encode() + "name: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert_names(info.value, str(path), GOOD.count("\n") + 1, None, "column 10", "0xE9", "not UTF-8")


def alias_bomb(levels: int, mapping: bool) -> str:
    """"Billion laughs": each level is ten aliases of the level below (10**levels leaves)."""
    if mapping:
        lines = ["a0: &a0 {" + ", ".join(f"k{j}: lol" for j in range(10)) + "}"]
        lines += [f"a{i}: &a{i} {{" + ", ".join(f"k{j}: *a{i - 1}" for j in range(10)) + "}"
                  for i in range(1, levels + 1)]
    else:
        lines = ["a0: &a0 [" + ", ".join(["lol"] * 10) + "]"]
        lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + f"\nscoring: *a{levels}\nbudget: {{per_head: 64}}\n"


@pytest.mark.parametrize("mapping", [False, True], ids=["lists", "mappings"])
def test_alias_bomb_is_refused_fast(mapping):
    import time

    started = time.perf_counter()
    with pytest.raises(SpecError) as info:
        loads_spec(alias_bomb(10, mapping))
    elapsed = time.perf_counter() - started
    # The first level past 10,000 nodes is a3 (line 4): named as the place that blows up.
    assert_names(info.value, "<string>", 4, None, "more than 10000 nodes through aliases")
    assert elapsed < 1.0, elapsed  # exponential before: 6 levels took seconds, 10 would take days


def test_small_aliases_still_work():
    text = "scoring: &s {window_attention: {window: 8}}\nbudget: {per_head: 64}\n" \
        "ranking: {by_score: {window: 8, sinks: 0}}\n"
    assert loads_spec(text).scoring == WindowAttention(window=8)
    one_part = {"budget": {"per_head": 64, "layers": "uniform", "heads": "uniform"}, "scoring": "recency"}
    aliased = "budget: {per_head: 64, layers: &u uniform, heads: *u}\nscoring: recency\n"
    assert loads_spec(aliased) == load_spec(one_part, name="policy")


def test_recursive_alias_and_deep_nesting():
    with pytest.raises(SpecError) as info:
        loads_spec("scoring: &a [x, *a]\n" + B)
    assert_names(info.value, "<string>", 1, None, "recursive alias")
    with pytest.raises(SpecError) as info:
        loads_spec("scoring: " + "[" * 5000 + "]" * 5000 + "\n" + B)
    assert_names(info.value, "<string>", None, None, "nested too deeply")


def test_yaml_1_1_base_60_and_octal_numbers_are_text_refused_by_number_fields(tmp_path):
    """`1:00` (YAML 1.1: 60) and `010` (YAML 1.1: 8) never become another number: a number field refuses
    them as text, naming file, line and field; decimal, hexadecimal and `1e-3` still read as numbers."""
    for text, field in (("budget: {per_head: 1:00}", "budget.per_head"), ("budget: {ratio: 0:30.5}", "budget.ratio"),
                        ("budget: {per_head: 010}", "budget.per_head")):
        path = tmp_path / "t.yaml"
        path.write_text(f"name: t\nscoring: key_norm\n{text}\n")
        with pytest.raises(SpecError, match="YAML 1.1 would read") as err:
            load_spec(str(path))
        assert (err.value.file, err.value.line, err.value.field) == (str(path), 3, field)
        assert "(a string)" in str(err.value)
    assert loads_spec("name: t\nscoring: key_norm\nbudget: {per_head: 0x40}\n").budget.per_head == 64
    assert loads_spec("name: t\nscoring: key_norm\nbudget: {per_head: 1_024}\n").budget.per_head == 1024
    assert loads_spec("name: t\nscoring: key_norm\nbudget: {ratio: 1e-3}\n").budget.ratio == 1e-3


def test_ratio_below_one_token_in_a_million_is_refused_with_its_range():
    for ratio in ("1e-300", "1e-7", "5.0e-324"):
        with pytest.raises(SpecError, match=r"allowed: a number in \[1e-06, 1\]") as err:
            loads_spec(f"name: t\nscoring: key_norm\nbudget:\n  ratio: {ratio}\n")
        assert (err.value.line, err.value.field) == (4, "budget.ratio")
    assert loads_spec("name: t\nscoring: key_norm\nbudget: {ratio: 1e-6}\n").budget.ratio == 1e-6


def test_kvzip_overlap_is_at_most_its_chunk():
    spec = "name: t\nscoring:\n  kvzip:\n    chunk: 50\n    overlap: {overlap}\nbudget: {{per_head: 8}}\n"
    with pytest.raises(SpecError, match=r"overlap 51 is larger than chunk 50.*allowed: an integer in \[0, chunk\]") \
            as err:
        loads_spec(spec.format(overlap=51))
    assert (err.value.line, err.value.field) == (5, "scoring.kvzip.overlap")
    assert loads_spec(spec.format(overlap=50)).scoring.overlap == 50  # the whole previous chunk quoted
    with pytest.raises(SpecError, match="scoring.kvzip.overlap"):
        load_spec("kvzip", scoring={"kvzip": {"chunk": 16, "overlap": 17}})


def test_layers_kinds_default_to_full_attention_and_load_back():
    """Every layers part names the kinds of layer its policy compresses (default full_attention only); the
    explicit full form writes them and loads back equal; a constructor gets the same checks."""
    from kvcompile.policies.budgets import PyramidLayers, UniformLayers

    assert load_spec("snapkv").budget.layers.kinds == ("full_attention",)
    policy = load_spec({"scoring": "recency", "budget": {"per_head": 64, "layers": {"pyramid": {
        "beta": 10, "kinds": ["full_attention"]}}}})
    assert policy.budget.layers == PyramidLayers(beta=10.0) and "kinds: [full_attention]" in policy.to_yaml()
    assert loads_spec(policy.to_yaml()) == policy
    assert load_spec({**MINI, "budget": {"per_head": 64, "layers": {"pyramid": 30}}}).budget.layers.beta == 30
    with pytest.raises(ValueError, match="kinds: 'local' is not one of"):
        UniformLayers(kinds=("local",))
