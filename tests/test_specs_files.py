"""The shipped specs/: every file loads, cites its source, round-trips; every registered
part and field is documented in docs/SPECS.md."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from kvcompile.policies import PARTS
from kvcompile.spec import available_specs, load_spec, loads_spec, specs_dir

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "SPECS.md").read_text()
PAPERS = ["snapkv", "pyramidkv", "adakv", "lava", "dbudgetkv", "zsmerge", "streamingllm", "tova", "h2o"]
HYBRIDS = ["lava_residual", "dbudget_lava", "pyramid_pooled"]
SPEC_FILES = sorted(Path(specs_dir()).glob("*.yaml"))


def test_every_expected_spec_is_shipped():
    assert set(PAPERS + HYBRIDS) <= set(available_specs())
    assert [p.stem for p in SPEC_FILES] == available_specs()


def test_the_readme_lists_every_shipped_spec():
    """README's "Specs" table names every spec `kvcompile specs` ships (a newcomer finds kvzip there)."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("\n## Specs\n", 1)[1].strip().split("\n\n", 1)[0]
    listed = set(re.findall(r"`(\w+)`", "\n".join(line.split("|")[1] for line in table.splitlines()[2:])))
    assert set(available_specs()) - listed == set()


@pytest.mark.parametrize("path", SPEC_FILES, ids=[p.stem for p in SPEC_FILES])
def test_spec_file_loads_cites_and_round_trips(path):
    policy = load_spec(path)
    assert policy.name == path.stem and policy.source == str(path)
    first = policy.description.splitlines()[0]
    assert "arXiv:" in first, f"{path.name}: the first comment line must cite its source"
    assert load_spec(path.stem) == policy
    text = policy.to_yaml()
    again = loads_spec(text)
    assert again == policy and again.description == policy.description
    assert load_spec(yaml.safe_load(text)) == policy
    if policy.budget.threshold is None and not (policy.budget.ratio == 1.0 and policy.storage.quantizes):
        assert policy.budget.per_head == 128  # a quantizing spec that evicts nothing (KIVI) keeps ratio 1.0


def test_specs_say_what_their_papers_say():
    lava, zsmerge, dbudget = load_spec("lava"), load_spec("zsmerge"), load_spec("dbudgetkv")
    assert lava.layer_dynamic and lava.budget.heads.name == "pooled" and lava.scoring.name == "lava"
    assert zsmerge.merges and zsmerge.schedule.decode.name == "online" and zsmerge.scoring.decay == 0.98
    assert zsmerge.merge.alpha == 0.6
    assert dbudget.budget.threshold.t == 0.01 and dbudget.budget.threshold.keep_layers == 2
    assert (dbudget.ranking.name, dbudget.ranking.sinks, dbudget.scoring.name) == ("by_position", 4, "last_token")
    assert load_spec("adakv").budget.heads.floor == 0.2
    assert load_spec("pyramidkv").budget.layers.beta == 20
    h2o = load_spec("h2o")
    assert h2o.scoring.name == "accumulated" and h2o.ranking.window == h2o.budget.per_head // 2
    streaming = load_spec("streamingllm")
    assert (streaming.scoring.name, streaming.ranking.name, streaming.ranking.sinks) == ("recency", "by_position", 4)
    tova = load_spec("tova")  # TOVA's own code and kvpress's TOVAPress: the mean over every head, one set for all
    assert (tova.scoring.name, tova.scoring.gqa, tova.scoring.heads) == ("last_token", "mean", "all")


def test_hybrids_mix_parts_of_different_papers():
    residual, dbudget_lava, pooled = (load_spec(name) for name in HYBRIDS)
    assert residual.scoring.name == "lava" and residual.merges
    assert dbudget_lava.scoring.name == "lava" and dbudget_lava.budget.threshold is not None
    assert pooled.budget.layers.name == "pyramid" and pooled.budget.heads.name == "pooled"


def section(heading: str) -> str:
    """The text under a markdown heading, up to the next heading of level <= 3."""
    match = re.search(rf"^#{{3,4}} {re.escape(heading)}\n(.*?)(?=^#{{1,3}} |\Z)", DOC, re.S | re.M)
    assert match, f"docs/SPECS.md has no heading {heading!r}"
    return match.group(1)


@pytest.mark.parametrize("family, name", [(f, n) for f in PARTS for n in sorted(PARTS[f])])
def test_every_registered_part_and_field_is_documented(family, name):
    text = section(f"`{family}: {name}`")
    prose = text.strip().split("\n|")[0]
    assert len(prose) > 20, f"{family}: {name} needs a description of what it computes"
    fields = dataclasses.fields(PARTS[family][name])
    for field in fields:  # one table row per field: name, default, allowed, meaning
        assert re.search(rf"^\| `{field.name}` \|.+\|.+\|.+\|$", text, re.M), \
            f"{family}: {name} field {field.name} has no row in docs/SPECS.md"
    if not fields:
        assert "No fields" in text


@pytest.mark.parametrize("heading, cls_path", [("`Pooling` (field of `window_attention` and `lava`)",
                                                "kvcompile.policies.scoring.Pooling"),
                                               ("`budget.split`", "kvcompile.policies.budgets.Split")])
def test_nested_fields_are_documented(heading, cls_path):
    module, cls = cls_path.rsplit(".", 1)
    text = section(heading)
    for field in dataclasses.fields(getattr(__import__(module, fromlist=[cls]), cls)):
        assert re.search(rf"^\| `{field.name}` \|.+\|.+\|.+\|$", text, re.M), field.name


def test_worked_example_in_the_docs_loads(tmp_path):
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", DOC, re.S) if "h2o_dbudget" in b)
    path = tmp_path / "h2o_dbudget.yaml"
    path.write_text(block)
    policy = load_spec(path)
    assert policy.budget.threshold.t == 0.02 and policy.ranking.sinks == 4
