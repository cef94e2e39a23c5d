"""kvcompile.tools.tune: the search space is the part library, refused candidates are never evaluated, successive
halving finds a planted best candidate and is a function of its seed, an interrupted search resumes from its
records, and the written spec reproduces the score it was chosen for."""
import hashlib
import json
from pathlib import Path

import pytest
import torch

import kvcompile
from kvcompile.kvzip import RepeatPrompt
from kvcompile.tools import tune
from kvcompile.policies import PARTS
from kvcompile.policy import policy_to_mapping
from tiny import prompt, tiny_model

TUNE_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "tune"


def test_the_default_space_is_the_part_library():
    space = tune.default_space(bytes_budget=True)
    for family in ("scoring", "layers", "heads", "storage"):
        assert set(space.parts[family]) == set(PARTS[family]), family
    assert tune.default_space(bytes_budget=False).parts["storage"] == ("model_dtype",)
    found, refused = tune.candidates(space)
    keys = [c.key for c in found]
    assert len(keys) == len(set(keys)) and found
    # every candidate is a spec the validator accepts
    for c in found[:20]:
        kvcompile.load_spec(c.mapping)
    # no two candidates compute the same policy; the points a candidate stands for are that policy
    acting = [kvcompile.load_spec(c.mapping).acting() for c in found]
    assert len(set(acting)) == len(found)
    assert sum(len(c.same) for c in found) > 0
    # kvzip replays (its reconstruction scores computed once per sample): in the space, nothing refused as unreplayable
    assert any(c.mapping["scoring"] == "kvzip" or "kvzip" in c.mapping["scoring"] for c in found)
    assert not any("not replayable" in why for why in refused), refused


HEADS_REFUSAL = "ranks every head's entries together"


@pytest.mark.parametrize("bytes_budget", [False, True])
def test_the_default_space_pairs_a_global_ranking_with_the_heads_it_admits(bytes_budget):
    """layers: global (one ranking over every layer, head and token: KVzip's allocation) is tried with the one heads
    value it admits (pooled, no floor), once per choice of the other families, and never refused for its heads."""
    space = tune.default_space(bytes_budget)
    found, refused = tune.candidates(space)
    assert not any(HEADS_REFUSAL in why for why in refused), refused
    ranked = [c for c in found if "global" in c.mapping["budget"]["layers"]]
    assert all(c.mapping["budget"]["heads"] == "pooled" for c in ranked)
    # one per (scoring, storage), every scorer, kvzip's included: a global ranking cascades whatever the schedule,
    # so `schedule: cascade` beside it is the same policy as `prefill`, searched once and named in `same`
    per_choice = len(space.parts["scoring"]) * len(space.parts["storage"])
    assert len(ranked) == per_choice and len({c.key for c in ranked}) == per_choice
    for c in ranked:
        assert c.mapping["schedule"] == "prefill"
        assert c.same == (c.key.replace("schedule=prefill", "schedule=cascade"),)
    shipped = policy_to_mapping(kvcompile.load_spec("kvzip"))
    kvzip = [c for c in ranked if "kvzip" in c.mapping["scoring"]]
    assert len(kvzip) == len(space.parts["storage"])
    for c in kvzip:  # the shipped kvzip's allocation
        policy = kvcompile.load_spec(c.mapping)
        assert policy.budget.layers == kvcompile.load_spec(shipped).budget.layers
        assert policy.budget.heads == kvcompile.load_spec(shipped).budget.heads


def test_a_global_ranking_follows_the_space_heads():
    """Where the space's heads leave out the part a global ranking admits, its candidates are refused for their
    heads (counted, never run), not given a heads part the space did not ask for."""
    space = tune.load_space({"scoring": ["key_norm"], "layers": ["global", "uniform"], "heads": ["uniform"],
                             "schedule": ["prefill"]}, bytes_budget=False)
    found, refused = tune.candidates(space)
    assert [c.mapping["budget"]["layers"] for c in found] == [{"uniform": {"kinds": ["full_attention"]}}]
    assert sum(n for why, n in refused.items() if HEADS_REFUSAL in why) == 1, refused


def test_the_heads_beside_a_ranking_of_every_entry_are_the_layers_parts_declaration():
    """The heads value a ranks_entries layers part admits is its own `sole_heads`, which the search and the spec
    validator both read: a registered part that admits uniform heads is paired with uniform heads only."""
    from kvcompile.policies.budgets import GlobalLayers
    from kvcompile.policies.registry import part
    from kvcompile.spec import SpecError

    part("layers", "ranked_uniform")(type("RankedUniform", (GlobalLayers,), {"sole_heads": "uniform"}))
    try:
        space = tune.load_space({"scoring": ["key_norm"], "layers": ["ranked_uniform", "global"],
                                 "heads": ["uniform", "pooled"], "schedule": ["prefill"]}, bytes_budget=False)
        found, refused = tune.candidates(space)
        assert not refused
        budgets = [kvcompile.load_spec(c.mapping).budget for c in found]
        assert sorted((b.layers.name, b.heads) for b in budgets) == [("global", PARTS["heads"]["pooled"]()),
                                                                    ("ranked_uniform", PARTS["heads"]["uniform"]())]
        with pytest.raises(SpecError, match=r"heads is pooled \(allowed: heads: uniform"):
            kvcompile.load_spec("kvzip", budget={"layers": "ranked_uniform"})
    finally:
        PARTS["layers"].pop("ranked_uniform")


def test_the_kvzip_reconstruct_space_is_the_default_space_with_both_reconstructions(monkeypatch, capsys):
    """benchmarks/tune/space_kvzip_reconstruct.yaml: every default candidate (same keys, so the committed records of
    a default-space search are reused), and each kvzip candidate once more with reconstruct: prompt; `kvcompile tune
    --space` takes it."""
    from kvcompile.tools import cli

    path = TUNE_DIR / "space_kvzip_reconstruct.yaml"
    space = tune.load_space(path, bytes_budget=False)
    default = tune.default_space(bytes_budget=False)
    assert space.parts == default.parts and space.fields == {"scoring.kvzip.reconstruct": ("prompt", "context")}
    found, refused = tune.candidates(space)
    base, base_refused = tune.candidates(default)
    assert refused == base_refused
    kvzip = [c for c in base if "kvzip" in c.mapping["scoring"]]
    assert all(c.mapping["scoring"]["kvzip"]["reconstruct"] == "context" for c in kvzip)  # the shipped kvzip's
    assert {c.key for c in base} < {c.key for c in found} and len(found) == len(base) + len(kvzip)
    added = [c for c in found if c.key not in {b.key for b in base}]
    assert all(c.mapping["scoring"]["kvzip"]["reconstruct"] == "prompt" for c in added)
    records = TUNE_DIR / "agnostic25_seed0_v2.jsonl"
    keys = {json.loads(line)["candidate"] for line in records.read_text().splitlines()}
    # a resumed search re-evaluates none of them (a record under a point a candidate stands for is the candidate's)
    assert keys <= {key for c in found for key in (c.key,) + c.same}

    class Stop(Exception):
        pass

    def stop():  # the first step after the space is read: stop before any data or model is loaded
        raise Stop

    monkeypatch.setattr(cli, "haystack", stop)
    with pytest.raises(Stop):
        cli.main(["tune", "--kv-fraction", "0.25", "--no-plot", "--space", str(path)])
    same = sum(len(c.same) for c in found)
    assert (f"tune     {len(found)} candidates ({same} more points of the space are the same policy as one of them), "
            f"{sum(refused.values())} refused") in capsys.readouterr().out


def test_a_space_narrows_widens_and_is_checked_against_the_declared_ranges():
    space = tune.load_space({"scoring": ["window_attention"], "layers": "uniform", "heads": ["uniform"],
                             "schedule": ["prefill"], "fields": {"scoring.window_attention.window": [8, 16]}},
                            bytes_budget=False)
    found, _ = tune.candidates(space)
    assert sorted(c.mapping["scoring"]["window_attention"]["window"] for c in found) == [8, 16]
    with pytest.raises(tune.SpaceError, match=r"scoring\.decayed\.decay: decay must be a number in \(0, 1\]"):
        tune.load_space({"fields": {"scoring.decayed.decay": [1.5]}}, bytes_budget=False)
    with pytest.raises(tune.SpaceError, match="unknown part 'snap'; registered: .*window_attention"):
        tune.load_space({"scoring": ["snap"]}, bytes_budget=False)
    with pytest.raises(tune.SpaceError, match="unknown family 'rank'"):
        tune.load_space({"rank": ["by_score"]}, bytes_budget=False)
    with pytest.raises(tune.SpaceError, match="window_attention has no field 'width'"):
        tune.load_space({"fields": {"scoring.window_attention.width": [3]}}, bytes_budget=False)


def test_a_space_widened_to_a_merge_rule_gives_it_the_shipped_split_and_runs_it():
    """merge: [drop, residual]: a residual candidate takes the split of the first shipped spec with that rule
    (ZSMerge's parts) and a ranking window of 0 (the split's proximity part is the recent window; the validator
    refuses both), global allocation refuses the slots (counted, never run), and a merge candidate is
    replayed and scored on a model like any other."""
    space = tune.load_space({"scoring": ["key_norm"], "layers": ["uniform", "global"], "heads": ["uniform", "pooled"],
                             "merge": ["drop", "residual"], "schedule": ["prefill"]}, bytes_budget=False)
    found, refused = tune.candidates(space)
    merged = [c for c in found if c.mapping["merge"] != "drop"]
    assert len(merged) == 2 and len(found) == 5  # residual × (uniform, pooled); drop × (uniform, pooled, global)
    split = kvcompile.load_spec("expected_zsmerge").budget.split
    for c in merged:
        policy = kvcompile.load_spec(c.mapping)
        assert policy.budget.split == split and policy.ranking.window == 0 and policy.merge.alpha == 0.6
        assert "merge=residual(alpha=0.6)" in c.key and "window=0" in c.key
    assert all(c.mapping["ranking"]["by_score"]["window"] == 32 for c in found if c.mapping["merge"] == "drop")
    assert refused == {"budget.layers: layers: global ranks prompt tokens only, without merge slots or a split": 1}
    model = tiny_model(layers=2)
    samples = [tune.Sample(0, prompt(96, seed=10)[0].tolist(), prompt(4, seed=20)[0].tolist(),
                           prompt(3, seed=30)[0].tolist())]
    ev = tune.Evaluator(model, samples, tune.Budget(kv_fraction=0.25), max_new_tokens=3)
    values = [ev.proxy(c, 0) for c in merged]
    assert all(v < 0 for v in values)  # replayed with its slots: a KL above 0 from the full cache


class Planted:
    """A stand-in evaluator: the proxy of a candidate is a fixed function of its key (the planted key best)
    plus a per-sample wobble; calls are counted."""

    def __init__(self, planted: str, samples: int = 9):
        self.planted, self.calls, self.confirms = planted, [], []
        self.samples = [tune.Sample(i, [], [], []) for i in range(samples)]
        self.budget = tune.Budget(kv_fraction=0.25)
        self.model = tiny_model(layers=1)

    def _h(self, key: str, i: int) -> float:
        return int(hashlib.sha256(f"{key}/{i}".encode()).hexdigest()[:8], 16) / 16**8

    def proxy(self, candidate, i):
        self.calls.append((candidate.key, i))
        return (1.0 if candidate.key == self.planted else 0.0) + 0.5 * self._h(candidate.key, i)

    def confirm(self, candidate, i):
        self.confirms.append((candidate.key, i))
        return 100.0 if candidate.key == self.planted else 50.0 * self._h(candidate.key, i)


SMALL = {"scoring": ["window_attention", "key_norm", "last_token", "lava"], "layers": ["uniform", "pyramid"],
         "heads": ["uniform", "pooled"], "schedule": ["prefill"]}


def test_successive_halving_finds_a_planted_best_and_is_a_function_of_its_seed():
    space = tune.load_space(SMALL, bytes_budget=False)
    found, _ = tune.candidates(space)
    planted = found[len(found) // 2].key
    runs = []
    for _ in range(2):
        ev = Planted(planted)
        result = tune.tune(ev, space, seed=7, progress=False)
        runs.append(([t.candidate.key for t in result.trials], result.rungs, ev.calls))
        assert result.best.candidate.key == planted
        assert result.rungs[0] == (len(found), 3) and result.rungs[-1][1] == len(ev.samples)
        assert len(ev.calls) < len(found) * len(ev.samples)  # not every candidate on every sample
        # what the progress bar counts: the proxies, and the finalists' confirmations on every sample
        proxies, finalists = tune._planned(len(found), len(ev.samples), 3, 3, 3)
        assert len(ev.calls) == proxies and len(ev.confirms) == finalists * len(ev.samples)
        assert finalists >= 3 and len({key for key, _ in ev.confirms}) == finalists
    assert runs[0] == runs[1]
    other = tune.tune(Planted(planted), space, seed=8, progress=False)
    assert other.best.candidate.key == planted


def test_an_entered_press_is_searched_beside_the_space_and_can_be_the_answer(tmp_path):
    """Candidates entered beside the space (kvpress's presses): one that is best is found and written as the
    answer, saying so; one that acts as a candidate of the space is that candidate (named in its `same`), never
    searched twice; the CLI enters the reproduced presses at the evaluator's budget."""
    space = tune.load_space(SMALL, bytes_budget=False)
    found, _ = tune.candidates(space)
    press = tune.Candidate("kvpress knorm", policy_to_mapping(kvcompile.load_spec("knorm")))
    twin = tune.Candidate("kvpress twin", dict(found[2].mapping, name="twin"))
    ev = Planted("kvpress knorm")
    result = tune.tune(ev, space, seed=7, progress=False, entered=[press, twin])
    assert len(result.trials) == len(found) + 1 and result.best.candidate.key == "kvpress knorm"
    (held,) = [t for t in result.trials if t.candidate.key == found[2].key]
    assert "kvpress twin" in held.candidate.same and "kvpress twin" not in {k for k, _ in ev.calls}
    text = tune.write_spec(result, tmp_path / "t.yaml", "planted").read_text()
    assert "# the best is an entered candidate, kvpress knorm: no candidate of the space beat it" in text
    assert "# entered beside the space: kvpress knorm, kvpress twin" in text
    assert kvcompile.load_spec(tmp_path / "t.yaml").scoring == kvcompile.load_spec("knorm").scoring
    model = tiny_model(layers=2)
    samples = [tune.Sample(0, prompt(200, seed=10)[0].tolist(), [], [1])]
    presses = tune.press_candidates(tune.Evaluator(model, samples, tune.Budget(kv_fraction=0.25)))
    keys = {c.key for c in presses}
    assert "kvpress snapkv" in keys and "kvzip = kvpress kvzip" in keys and "tova = kvpress tova" in keys


def test_workers_in_other_processes_find_what_one_process_finds(tmp_path):
    """Workers(2): each sample's candidates evaluated by two forked processes give the values, the order and
    the choice that one process gives, and the records resume either way."""
    space = tune.load_space(SMALL, bytes_budget=False)
    found, _ = tune.candidates(space)
    one = tune.tune(Planted(found[3].key), space, seed=5, progress=False)
    two = tune.tune(Planted(found[3].key), space, seed=5, progress=False, workers=2, records=tmp_path / "r.jsonl")
    assert [(t.candidate.key, t.proxy, t.confirmed) for t in two.trials] == \
        [(t.candidate.key, t.proxy, t.confirmed) for t in one.trials]
    assert two.best.candidate.key == found[3].key and two.rungs == one.rungs
    again = Planted(found[3].key)
    resumed = tune.tune(again, space, seed=5, progress=False, workers=2, records=tmp_path / "r.jsonl")
    assert not again.calls and resumed.best.candidate.key == found[3].key


def test_successive_halving_finds_a_planted_best_that_needs_a_global_ranking():
    space = tune.load_space(dict(SMALL, layers=["uniform", "global", "pyramid"]), bytes_budget=False)
    found, refused = tune.candidates(space)
    assert not any(HEADS_REFUSAL in why for why in refused), refused
    ranked = [c.key for c in found if "global" in c.mapping["budget"]["layers"]]
    assert len(ranked) == len(SMALL["scoring"])  # one heads value each: pooled without a floor
    planted = ranked[-1]
    ev = Planted(planted)
    result = tune.tune(ev, space, seed=7, progress=False)
    assert result.best.candidate.key == planted
    assert kvcompile.load_spec(result.best.candidate.mapping).budget.layers.name == "global"


def test_refused_candidates_are_counted_and_never_evaluated():
    # entropy layers read scores as attention mass: key_norm's are not, so the spec validator refuses the pair
    space = tune.load_space({"scoring": ["key_norm", "window_attention"], "layers": ["entropy", "uniform"],
                             "heads": ["uniform"], "schedule": ["prefill", "cascade"]}, bytes_budget=False)
    found, refused = tune.candidates(space)
    assert sum(refused.values()) >= 1
    ev = Planted(found[0].key)
    result = tune.tune(ev, space, progress=False)
    evaluated = {key for key, _ in ev.calls}
    assert evaluated <= {c.key for c in found}
    assert not any("scoring=key_norm" in key and "layers=entropy" in key for key in evaluated)
    assert all(result.refused[why] >= n for why, n in refused.items())


def test_an_interrupted_search_resumes_from_its_records(tmp_path):
    space = tune.load_space(SMALL, bytes_budget=False)
    found, _ = tune.candidates(space)
    path = tmp_path / "tune.jsonl"
    first = tune.tune(Planted(found[1].key), space, seed=3, records=path, progress=False)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:10])  # the last record cut mid-line
    again = Planted(found[1].key)
    second = tune.tune(again, space, seed=3, records=path, progress=False)
    assert len(again.calls) + len(again.confirms) == 1  # only the cut record is evaluated again
    assert [t.candidate.key for t in second.trials] == [t.candidate.key for t in first.trials]
    assert second.best.candidate.key == first.best.candidate.key


def test_a_search_reports_what_its_evaluations_cost_across_a_resume(tmp_path):
    space = tune.load_space(SMALL, bytes_budget=False)
    found, _ = tune.candidates(space)
    path = tmp_path / "tune.jsonl"
    first = tune.tune(Planted(found[1].key), space, seed=3, confirm=2, records=path, progress=False)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(r["seconds"] >= 0 and r["cpu"] >= 0 for r in rows)
    proxy, confirm = first.cost["proxy"], first.cost["confirm"]
    assert proxy.evaluations == sum(r["kind"] == "proxy" for r in rows) == proxy.timed
    assert confirm.evaluations == sum(r["kind"] == "confirm" for r in rows) == confirm.timed
    assert proxy.wall == pytest.approx(sum(r["seconds"] for r in rows if r["kind"] == "proxy"), abs=1e-3 * len(rows))
    # a resumed search reads the recorded times; a record written before times were kept counts as untimed
    rows[0].pop("seconds"), rows[0].pop("cpu")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    again = Planted(found[1].key)
    second = tune.tune(again, space, seed=3, confirm=2, records=path, progress=False)
    assert not again.calls and not again.confirms
    assert second.cost["proxy"].evaluations == proxy.evaluations
    assert second.cost["proxy"].timed == proxy.evaluations - (rows[0]["kind"] == "proxy")
    assert "recorded without a time" in second.cost[rows[0]["kind"]].describe()
    text = tune.write_spec(second, tmp_path / "tuned.yaml", "planted").read_text()
    assert f"# cost of the proxy: {proxy.evaluations} evaluations" in text


def test_tune_on_a_model_writes_a_spec_that_reproduces_its_score(tmp_path):
    model = tiny_model(layers=2)
    samples = [tune.Sample(i, prompt(96, seed=10 + i)[0].tolist(), prompt(4, seed=20 + i)[0].tolist(),
                           prompt(3, seed=30 + i)[0].tolist()) for i in range(3)]
    ev = tune.Evaluator(model, samples, tune.Budget(kv_fraction=0.25), max_new_tokens=3)
    space = tune.load_space({"scoring": ["window_attention", "key_norm"], "layers": ["uniform"],
                             "heads": ["uniform", "pooled"], "schedule": ["prefill"],
                             "ranking": {"by_score": {"sinks": 0, "window": 8}}}, bytes_budget=False)
    result = tune.tune(ev, space, seed=0, confirm=2, progress=False, answered_only=False)  # random weights
    assert all(t.error is None for t in result.trials)
    path = tune.write_spec(result, tmp_path / "tuned.yaml", "3 random prompts")
    text = path.read_text()
    assert "# Found by `kvcompile tune`" in text and "seed 0" in text and result.best.candidate.key in text
    policy = kvcompile.load_spec(path)
    assert policy.budget.ratio == 0.25 and policy.name == "tuned"
    again = tune.Candidate("written", policy_to_mapping(policy))
    scores = [ev.proxy(again, i) for i in range(len(samples))]
    assert sum(scores) / len(scores) == pytest.approx(result.best.mean(), abs=0, rel=1e-6)
    # GoldLikelihood: the mean log-likelihood of the gold tokens: a full cache gives the plain model's; the
    # default proxy, FullCacheKL: minus the KL from the plain model's distributions along the gold, 0 for a full
    # cache and below 0 for the search's best
    with torch.no_grad():
        s = samples[0]
        ids = torch.tensor([s.context + s.question + s.gold])
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        n = len(s.context) + len(s.question)
        along = logp[n - 1:n - 1 + len(s.gold)]
        plain = float(along.gather(-1, torch.tensor(s.gold)[:, None]).mean())
    keep_all = tune.Candidate("all", {"name": "all", "scoring": "key_norm", "ranking": {"by_score": {"window": 0}},
                                      "budget": {"per_head": 64}})
    for proxy, expected in ((tune.GoldLikelihood(), plain), (tune.FullCacheKL(), 0.0)):
        full = tune.Evaluator(model, samples, tune.Budget(kv_fraction=0.5), max_new_tokens=3, proxy=proxy)
        full.budget.kv_fraction = 1.0  # a budget a search never takes (validated to (0, 1)): every entry kept
        assert full.proxy(keep_all, 0) == pytest.approx(expected, abs=1e-4)
    torch.testing.assert_close(ev.reference(0), along, atol=1e-4, rtol=1e-4)
    compressed = torch.log_softmax(torch.zeros_like(along), -1)  # the measure itself, by its definition
    kl = float((along.exp() * (along - compressed)).sum(-1).mean())
    assert tune.FullCacheKL()(compressed, torch.tensor(s.gold), along) == pytest.approx(-kl)
    assert isinstance(ev.measure, tune.FullCacheKL) and result.best.mean() < 0
    assert "# the proxy: minus the mean KL" in text
    from kvcompile.tools import cli

    assert set(cli.TUNE_PROXIES) == set(tune.PROXIES)  # what --proxy offers


def test_at_a_byte_budget_a_lower_precision_keeps_more_entries_in_the_same_bytes():
    model = tiny_model(layers=1, head_dim=16)
    budget = tune.Budget(kv_bytes=1 / 8)
    base = {"name": "c", "scoring": "key_norm", "ranking": {"by_score": {"window": 0}}, "budget": {"per_head": 8}}
    full = budget.policy(dict(base, storage="model_dtype"), 512, model)
    int4 = budget.policy(dict(base, storage="int4"), 512, model)
    assert full.budget.per_head == 64  # 1/8 of 512 entries in fp32
    # an int4 entry of head dim 16: 2 x 8 bytes of codes + a scale and a zero point per vector (fp32 here)
    entry = int4.storage.entry_bytes(16, 4)
    assert int4.budget.per_head == (512 * 2 * 16 * 4 // 8) // entry > 3 * full.budget.per_head
    with pytest.raises(ValueError, match="exactly one of kv_fraction and kv_bytes"):
        tune.Budget(kv_fraction=0.25, kv_bytes=0.1)
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        tune.Budget(kv_fraction=1.5)


def test_the_pareto_front_of_a_planted_set_of_points():
    from kvcompile.tools.tune_plot import Point, pareto_front

    pts = [Point("a", 0.10, -3.0), Point("b", 0.10, -2.0), Point("c", 0.25, -2.5), Point("d", 0.25, -1.0),
           Point("e", 0.50, -1.0), Point("f", 0.50, -0.5, "shipped"), Point("g", 0.05, -4.0, "kvpress"),
           Point("h", 0.05, 5.0, complete=False), Point("i", 0.25, -1.0)]
    # a: b has the same bytes and more; c: b has fewer bytes and more; e: d has fewer bytes and the same;
    # h scored on fewer samples: never on the front; d and i are equal: both kept
    assert [p.label for p in pareto_front(pts)] == ["g", "b", "d", "i", "f"]
    assert pareto_front([Point("z", 0.2, 1.0, complete=False)]) == []
    with pytest.raises(ValueError, match="kind must be one of"):
        Point("x", 0.1, 0.0, "other")


def test_plot_labels_at_equal_bytes_stack_instead_of_overlapping():
    from kvcompile.tools.tune_plot import Point, labels

    pts = [Point("snapkv", 0.25, -2.0, "shipped"), Point("kvpress snapkv", 0.25, -2.0, "kvpress"),
           Point("knorm", 0.25, -2.01, "shipped"), Point("tova", 0.25, -2.02, "kvpress"),
           Point("lava", 0.50, -2.0, "shipped"), Point("cand", 0.25, -2.0), Point("few", 0.25, -2.0, "shipped",
                                                                                complete=False)]
    got = labels(pts, x_span=0.25, y_span=1.0)
    assert [t for t, *_ in got] == ["tova", "knorm", "snapkv = kvpress snapkv", "lava"]  # candidates: unlabelled
    ups = {t: up for t, _, _, up in got}
    assert sorted(ups[t] for t in ("tova", "knorm", "snapkv = kvpress snapkv")) == [3.0, 11.0, 19.0]  # stacked
    assert ups["lava"] == 3.0  # far from the others: not moved


def test_tune_writes_its_plot_with_the_references(tmp_path):
    model = tiny_model(layers=2)
    samples = [tune.Sample(i, prompt(160, seed=10 + i)[0].tolist(), prompt(4, seed=20 + i)[0].tolist(),
                           prompt(3, seed=30 + i)[0].tolist()) for i in range(2)]
    ev = tune.Evaluator(model, samples, tune.Budget(kv_fraction=0.25), max_new_tokens=3)
    space = tune.load_space({"scoring": ["window_attention", "key_norm"], "layers": ["uniform"],
                             "heads": ["uniform"], "schedule": ["prefill"],
                             "ranking": {"by_score": {"sinks": 0, "window": 8}}}, bytes_budget=False)
    result = tune.tune(ev, space, seed=0, confirm=1, progress=False, answered_only=False)  # random weights
    refs, skipped = tune.reference_candidates(ev)
    names = {c.key for _, c in refs}
    assert {"snapkv", "kivi", "kvpress snapkv", "tova = kvpress tova"} <= names  # tova reproduces TOVAPress as is
    assert {"expected_attention = kvpress expected_attention_uniform", "knorm = kvpress knorm",
            "observed_attention = kvpress observed_attention"} <= names
    assert len(refs) == len({json.dumps({k: v for k, v in c.mapping.items() if k not in ("name", "description")},
                                        sort_keys=True) for _, c in refs})  # each policy scored once
    # KVzip replays from the capture (sweep.reconstruction_scores): the shipped specs and KVzipPress's reproductions;
    # the shipped kvzip reproduces KVzipPress's default (layerwise=False) as it is
    assert {"kvzip = kvpress kvzip", "kvzip_adakv", "kvzip_uniform", "kvpress kvzip_layerwise"} <= names and not skipped
    scored = tune.score_references(ev, [r for r in refs if r[1].key in ("knorm = kvpress knorm", "snapkv_int4", "tova = kvpress tova", "kvpress snapkv")],
                                   progress=False)
    errors = {t.candidate.key: t.error for _, t in scored}
    assert errors["kvpress snapkv"].startswith("ranking.by_score.window: window or sinks larger than the budget")
    points = tune.plot_points(result, ev, scored)
    assert "kvpress snapkv" not in {p.label for p in points}  # refused at this budget: not drawn
    by = {p.label: p for p in points}
    assert by["snapkv_int4"].kind == "shipped" and by["tova = kvpress tova"].kind == "kvpress"
    assert by["knorm = kvpress knorm"].kv_bytes == pytest.approx(40 / 160)  # floor(0.25 * 160) of 160 entries in fp32
    assert by["snapkv_int4"].kv_bytes < 0.4 * by["knorm = kvpress knorm"].kv_bytes  # the same entries in int4 codes
    assert by["knorm = kvpress knorm"].score == pytest.approx(sum(ev.proxy(tune.Candidate("s", refs_mapping(refs, "knorm = kvpress knorm")), i)
                                                   for i in range(2)) / 2, rel=1e-6)
    path = tune.write_plot(result, ev, tmp_path / "tuned.png", scored)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def refs_mapping(refs, name):
    return next(c.mapping for _, c in refs if c.key == name)


def test_tune_refuses_to_start_without_matplotlib_unless_told_not_to_plot(monkeypatch, capsys):
    """The plot comes after the search: a missing matplotlib is an error before the search, not after it."""
    import importlib.util

    from kvcompile.tools import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as exc:
        cli.main(["tune", "--kv-fraction", "0.25"])
    assert exc.value.code == 2
    assert "pip install 'kvcompile[tune]' (or give --no-plot)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # with --no-plot it goes on (to the next check: a bad --space file)
        cli.main(["tune", "--kv-fraction", "0.25", "--no-plot", "--space", "/nonexistent/space.yaml"])
    assert "matplotlib" not in capsys.readouterr().err


REPEAT = RepeatPrompt(first=(5, 6, 7, 8), later=(9, 10), suffix=(11, 12))  # token ids of the tiny vocabulary


def test_tune_searches_kvzip_with_one_reconstruction_per_sample(tmp_path, monkeypatch):
    """KVzip's candidates are run, not refused: each sample's reconstruction scores are computed once (for the one
    scorer configuration of the space) and every allocation is replayed over them, through the proxy, the
    confirmation and the references; the written spec reproduces the score it was chosen for."""
    from kvcompile import kvzip

    model = tiny_model(layers=2)
    samples = [tune.Sample(i, prompt(80, seed=10 + i)[0].tolist(), prompt(4, seed=20 + i)[0].tolist(),
                           prompt(3, seed=30 + i)[0].tolist()) for i in range(3)]
    ev = tune.Evaluator(model, samples, tune.Budget(kv_fraction=0.25), max_new_tokens=3, repeat_prompt=REPEAT)
    space = tune.load_space({"scoring": ["kvzip"], "layers": ["uniform", "global", "pyramid"],
                             "heads": ["uniform", "pooled"], "schedule": ["prefill", "cascade"],
                             "fields": {"scoring.kvzip.chunk": [32]},
                             "ranking": {"by_score": {"sinks": 0, "window": 4}}}, bytes_budget=False)
    found, refused = tune.candidates(space)
    assert len(found) >= 6 and not any("not replayable" in why for why in refused), refused
    forwards = []
    real = kvzip._reconstruct
    monkeypatch.setattr(kvzip, "_reconstruct", lambda *a, **k: (forwards.append(len(a[4])), real(*a, **k))[1])
    result = tune.tune(ev, space, seed=0, confirm=2, progress=False, answered_only=False)  # random weights
    assert len(result.trials) == len(found) and all(t.error is None for t in result.trials)
    assert result.refused == refused  # the spec validator's refusals only (layers: global needs pooled heads)
    assert len(result.trials[0].proxy) == len(samples) and len(result.trials[0].confirmed) == len(samples)
    assert forwards == [3] * len(samples)  # one reconstruction of each sample's 3 chunks, for every candidate
    path = tune.write_spec(result, tmp_path / "tuned.yaml", "3 random prompts")
    policy = kvcompile.load_spec(path)
    assert policy.scoring.name == "kvzip" and policy.scoring.chunk == 32 and policy.budget.ratio == 0.25
    again = tune.Candidate("written", policy_to_mapping(policy))
    scores = [ev.proxy(again, i) for i in range(len(samples))]
    assert sum(scores) / len(scores) == pytest.approx(result.best.mean(), abs=0, rel=1e-6)
    assert forwards == [3] * len(samples)  # the written spec scored over the kept scores


def test_workers_on_a_model_score_as_one_process_and_send_their_scores_back():
    """On a model: two worker processes give one process's proxies and confirmations (one torch thread each,
    as one process with one thread), and the prompt scores they compute come back to the parent, kept for the
    sample's later candidates (with kvzip's reconstruction scores, which the parent computes before the fork:
    the next test)."""
    model = tiny_model(layers=2)
    samples = [tune.Sample(i, prompt(80, seed=50 + i)[0].tolist(), prompt(4, seed=60 + i)[0].tolist(),
                           prompt(3, seed=70 + i)[0].tolist()) for i in range(3)]
    space = tune.load_space({"scoring": ["kvzip", "window_attention", "key_norm"], "layers": ["uniform", "global"],
                             "heads": ["uniform", "pooled"], "schedule": ["prefill"],
                             "fields": {"scoring.kvzip.chunk": [32]},
                             "ranking": {"by_score": {"sinks": 0, "window": 4}}}, bytes_budget=False)
    runs = {}
    threads = torch.get_num_threads()
    try:
        for workers in (1, 2):
            torch.set_num_threads(1)
            ev = tune.Evaluator(model, samples, tune.Budget(kv_fraction=0.25), max_new_tokens=3,
                                repeat_prompt=REPEAT)
            runs[workers] = ev, tune.tune(ev, space, seed=0, confirm=2, progress=False, workers=workers,
                                          answered_only=False)
    finally:
        torch.set_num_threads(threads)
    (ev1, one), (ev2, two) = runs[1], runs[2]
    assert [t.candidate.key for t in two.trials] == [t.candidate.key for t in one.trials]
    for a, b in zip(one.trials, two.trials):
        assert a.proxy.keys() == b.proxy.keys() and a.confirmed == b.confirmed
        torch.testing.assert_close(torch.tensor(list(b.proxy.values())), torch.tensor(list(a.proxy.values())))
    assert two.best.candidate.key == one.best.candidate.key
    for i in range(len(samples)):  # every scorer's scores, computed in a child, kept by the parent
        assert len(ev2._scores[i]) == len(ev1._scores[i])
        for key, value in ev1._scores[i].items():
            torch.testing.assert_close(ev2._scores[i][key], value)
    assert max(len(kept) for kept in ev2._scores.values()) == 3  # the first sample: every scorer's


def test_workers_compute_a_samples_reconstruction_once_in_the_parent(tmp_path, monkeypatch):
    """Workers(2): kvzip's reconstruction scores (a second forward over the context) are computed once per sample,
    by the parent before its children start (Evaluator.prescore, with every thread), never by a child; the
    values are one process's."""
    import os

    from kvcompile import kvzip

    model = tiny_model(layers=2)
    samples = [tune.Sample(i, prompt(80, seed=150 + i)[0].tolist(), prompt(4, seed=160 + i)[0].tolist(),
                           prompt(3, seed=170 + i)[0].tolist()) for i in range(3)]
    space = tune.load_space({"scoring": ["kvzip", "key_norm"], "layers": ["uniform", "global"],
                             "heads": ["uniform", "pooled"], "schedule": ["prefill"],
                             "fields": {"scoring.kvzip.chunk": [32]},
                             "ranking": {"by_score": {"sinks": 0, "window": 4}}}, bytes_budget=False)
    log = tmp_path / "reconstructions"
    original = kvzip.scores_of

    def counted(*args, **kwargs):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return original(*args, **kwargs)

    monkeypatch.setattr(kvzip, "scores_of", counted)
    threads = torch.get_num_threads()
    runs = {}
    try:
        for workers in (1, 2):
            torch.set_num_threads(1)
            log.write_text("")
            ev = tune.Evaluator(model, samples, tune.Budget(kv_fraction=0.25), max_new_tokens=3,
                                repeat_prompt=REPEAT)
            runs[workers] = tune.tune(ev, space, seed=0, confirm=2, progress=False, workers=workers,
                                      answered_only=False)
            pids = log.read_text().split()
            assert pids == [str(os.getpid())] * len(samples), workers  # once a sample, in this process
    finally:
        torch.set_num_threads(threads)
    one, two = runs[1], runs[2]
    assert [(t.candidate.key, t.confirmed) for t in two.trials] == [(t.candidate.key, t.confirmed) for t in one.trials]
    for a, b in zip(one.trials, two.trials):
        torch.testing.assert_close(torch.tensor(list(b.proxy.values())), torch.tensor(list(a.proxy.values())))


def test_a_samples_confirmations_are_batched_per_scorer_and_queued_first():
    """_together: a scorer's confirmations batched (at most TOGETHER a batch), the batches before the proxies, the
    largest first; each trial confirmed once."""
    model = tiny_model(layers=2)
    ev = tune.Evaluator(model, [], tune.Budget(kv_fraction=0.25))
    a = [tune.Trial(tune.Candidate(f"a{k}", {"scoring": {"key_norm": {}}})) for k in range(5)]
    b = [tune.Trial(tune.Candidate(f"b{k}", {"scoring": {"recency": {}}})) for k in range(2)]
    jobs = [(t, "proxy", None) for t in a[:2]] + [(t, "confirm", None) for t in b + a]
    out = tune._together(ev, 0, jobs)
    assert [job[0].trials for job in out[:2]] == [a, b] and [job[0] for job in out[2:]] == a[:2]
    assert all(job[1] == "confirm" for job in out[:2]) and all(job[1] == "proxy" for job in out[2:])
    many = [(tune.Trial(tune.Candidate(f"c{k}", {"scoring": {"key_norm": {}}})), "confirm", None) for k in range(70)]
    assert [len(job[0].trials) for job in tune._together(ev, 0, many)] == [32, 32, 6]


def test_a_search_calibrates_on_the_samples_the_full_cache_answers(tmp_path):
    """answered_only (the default): a sample whose gold answer the full cache does not give is left out of every
    rung (no candidate evaluated on it) and the rungs count the others; the full cache's answers are recorded."""
    model = tiny_model(layers=2)
    samples = []
    for i in range(6):
        context, question = prompt(64, seed=80 + i)[0].tolist(), prompt(3, seed=90 + i)[0].tolist()
        with torch.no_grad():
            ids = torch.tensor([context + question])
            greedy = model.generate(ids, max_new_tokens=2, do_sample=False)[0, ids.shape[1]:].tolist()
        gold = greedy if i % 2 == 0 else [(t + 1) % model.config.vocab_size for t in greedy]  # odd: not answered
        samples.append(tune.Sample(i, context, question, gold))
    ev = tune.Evaluator(model, samples, tune.Budget(kv_fraction=0.25), max_new_tokens=2)
    assert [ev.full_score(i) for i in range(6)] == [100.0, 0.0] * 3
    space = tune.load_space({"scoring": ["window_attention", "key_norm"], "layers": ["uniform"],
                             "heads": ["uniform", "pooled"], "schedule": ["prefill"],
                             "ranking": {"by_score": {"sinks": 0, "window": 4}}}, bytes_budget=False)
    path = tmp_path / "r.jsonl"
    result = tune.tune(ev, space, seed=0, confirm=2, progress=False, records=path)
    assert result.calibration == (3, 6) and result.rungs[-1][1] == 3
    for t in result.trials:
        assert set(t.proxy) <= {0, 2, 4} and set(t.confirmed) <= {0, 2, 4}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(r["sample"] for r in rows if r["candidate"] == tune.FULL_CACHE) == list(range(6))
    text = tune.write_spec(result, tmp_path / "tuned.yaml", "6 prompts").read_text()
    assert "# calibration samples: 3 of 6 (those the full cache answers)" in text
    every = tune.tune(ev, space, seed=0, confirm=2, progress=False, answered_only=False)
    assert every.calibration == (6, 6)


def test_records_of_another_proxy_are_not_read_as_this_ones(tmp_path):
    """A records file resumed under another --proxy: its proxy lines (of the other measure, or without a name:
    the log-likelihood's) are evaluated again, never mixed in; confirmations are the same under both and kept."""
    space = tune.load_space(SMALL, bytes_budget=False)
    found, _ = tune.candidates(space)
    path = tmp_path / "tune.jsonl"
    tune.tune(Planted(found[2].key), space, seed=3, records=path, progress=False)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r.get("proxy") for r in rows if r["kind"] == "proxy"} == {"logp"}
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "proxy"}) + "\n" for r in rows))

    class KL(Planted):
        measure = tune.FullCacheKL()

    again = KL(found[2].key)
    tune.tune(again, space, seed=3, records=path, progress=False)
    assert len(again.calls) == sum(r["kind"] == "proxy" for r in rows) and not again.confirms
    added = [json.loads(line) for line in path.read_text().splitlines()][len(rows):]
    assert added and all(r["proxy"] == "kl" for r in added)
    once_more = KL(found[2].key)
    tune.tune(once_more, space, seed=3, records=path, progress=False)
    assert not once_more.calls


def test_a_candidate_that_scores_as_a_better_one_on_every_sample_goes_no_further():
    """Candidates whose proxies equal a better one's on every sample (the same entries kept) are not carried to
    the next rung, so the finalists are distinct policies in effect."""
    space = tune.load_space(SMALL, bytes_budget=False)
    found, _ = tune.candidates(space)

    class ByScorer(Planted):  # every candidate with one scorer scores alike: one policy in effect per scorer
        def proxy(self, candidate, i):
            self.calls.append((candidate.key, i))
            return self._h(candidate.key.split(" | ")[0], i)

    ev = ByScorer(found[0].key)
    result = tune.tune(ev, space, seed=1, confirm=3, progress=False)
    finalists = [t for t in result.trials if t.confirmed]
    scorers = [t.candidate.key.split(" | ")[0] for t in finalists]
    assert len(finalists) == 3 and len(set(scorers)) == 3


def test_the_first_rungs_see_one_sample_of_each_task_in_turn():
    """calibration_order: each task's samples shuffled, the tasks shuffled, then one of each task in turn, a
    function of the seed; so a first rung of 3 samples covers 3 tasks."""
    tasks = ["a"] * 4 + ["b"] * 2 + ["c"] * 3
    samples = [tune.Sample(i, [], [], [], task) for i, task in enumerate(tasks)]
    order = tune.calibration_order(samples, seed=4)
    assert sorted(order) == list(range(9)) and order == tune.calibration_order(samples, seed=4)
    assert len({tasks[i] for i in order[:3]}) == 3 and len({tasks[i] for i in order[3:6]}) == 3
    assert tasks[order[-1]] == "a"  # the largest task's last sample comes last
    assert any(tune.calibration_order(samples, seed) != order for seed in range(5, 10))


def test_confirmations_batched_are_each_candidates_own():
    """Evaluator.confirms decodes the candidates' greedy answers of a sample as one batch (sweep.greedy_together):
    each value is Evaluator.confirm's of that candidate alone, and a candidate its plan refuses gets its reason
    without stopping the others."""
    model = tiny_model(layers=2)
    samples = []
    for i in range(3):  # the gold: the plain model's own first tokens, which some candidates keep and others lose
        context, question = prompt(96, seed=10 + i)[0].tolist(), prompt(4, seed=20 + i)[0].tolist()
        with torch.no_grad():
            plain = model.generate(torch.tensor([context + question]), max_new_tokens=3, do_sample=False)
        samples.append(tune.Sample(i, context, question, plain[0, -3:].tolist()))
    ev = tune.Evaluator(model, samples, tune.Budget(kv_fraction=0.1), max_new_tokens=6)
    values = set()
    space = tune.load_space({"scoring": ["window_attention", "key_norm", "recency"], "layers": ["uniform", "entropy"],
                             "heads": ["uniform", "pooled"], "schedule": ["prefill"],
                             "ranking": {"by_score": {"sinks": 0, "window": 8}}}, bytes_budget=False)
    found, _ = tune.candidates(space)
    for i in range(len(samples)):
        together = ev.confirms(found, i)
        assert len(together) == len(found)
        refused = 0
        for candidate, (value, error, wall, cpu) in zip(found, together):
            try:
                alone = ev.confirm(candidate, i)
            except (ValueError, RuntimeError) as exc:
                assert value is None and error == tune._reason(str(exc)), candidate.key
                refused += 1
                continue
            assert error is None and value == alone and wall >= 0 and cpu >= 0, candidate.key
            values.add(value)
        assert refused < len(found)
    assert values == {0.0, 100.0}  # answers that differ: some candidates keep the answer, others lose it


@pytest.mark.parametrize("name", ["snapkv", "h2o", "zsmerge", "kivi", "streamingllm"])
@pytest.mark.parametrize("question", [True, False])
def test_the_proxys_gold_in_one_forward_is_the_gold_token_by_token(name, question):
    """Evaluator._along_gold feeds the question and the gold answer in one forward (sweep.fed): the op decodes it
    token by token with every decode rule of the policy (running scores, online eviction, a quantized tier's
    flush), so its log-probabilities are teacher_forced's, token by token, up to float summation order."""
    from kvcompile.tools.sweep import capture, feed, replay, teacher_forced

    model = tiny_model(layers=2)
    context, q, gold = prompt(160, seed=3)[0].tolist(), prompt(5, seed=4)[0].tolist(), prompt(6, seed=5)[0].tolist()
    s = tune.Sample(0, context, q if question else [], gold)
    ev = tune.Evaluator(model, [s], tune.Budget(kv_fraction=0.25))
    policy = kvcompile.load_spec(name, per_head=max(40, kvcompile.load_spec(name).ranking.window + 16))
    states, last = capture(model, torch.tensor([context]))
    one = replay(policy, model.config, states, headroom=20)
    got = ev._along_gold(one, last, s, {})
    stepwise = replay(policy, model.config, states, headroom=20)
    logits = feed(model, stepwise, torch.tensor([q])) if question else last
    rows = teacher_forced(model, stepwise, logits, torch.tensor([gold]))[0]
    torch.testing.assert_close(got, torch.log_softmax(rows.float(), -1), rtol=1e-4, atol=1e-4)
    assert got.shape == (len(gold), model.config.vocab_size)
    assert torch.equal(one.kept(), stepwise.kept())  # the same entries evicted and merged along the way
