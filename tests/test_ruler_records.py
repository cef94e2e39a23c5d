"""A RULER table that accumulates: `--resume FILE` appends one line per record and skips the keys already
there (a cut-off last line is dropped and made again); `kvcompile report` computes the tables with a paired
bootstrap (deterministic for a seed, its interval around the point, differences paired on the same draws)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompile.tools import cli
from kvcompile.tools import ruler
from kvcompile.tools.ruler_records import RecordsError, RecordsFile, read_records, record_key
from kvcompile.tools import ruler_report
from kvcompile.tools.ruler_report import estimate, paired, report, table
from tests.test_ruler import FILLER, TOK, tiny_for


@pytest.fixture(scope="module")
def setup():
    model = tiny_for(TOK)
    samples = [{**s, "max_new_tokens": 3} for s in ruler.ruler_samples(TOK, ["niah_single_1", "fwe"], [700], 2, 0, FILLER)]
    return model, samples


def run(setup, path, **kw):
    model, samples = setup
    store = RecordsFile(path)
    made = ruler.run_ruler(model, TOK, samples, ["snapkv"], ("agnostic",), fractions=[0.5], quiet=True, seed=0,
                           done=store.has, emit=store.append, **kw)
    return store, made


def test_resume_skips_exactly_the_recorded_keys(setup, tmp_path):
    path = tmp_path / "r.jsonl"
    store, made = run(setup, path)
    keys = [record_key(r) for r in made]
    assert len(made) == 4 * 2 and len(set(keys)) == len(keys)  # 4 samples x (full, snapkv 50 %)
    assert [record_key(r) for r in read_records([path])] == keys  # every record on disk, in order
    assert all(r["seed"] == 0 and set(r["seconds"]) == set(r["cpu_seconds"]) == {"prefill", "compress", "decode"}
               for r in made)
    # each record carries what it added: the sample's capture, on the full cache's record (the one forward over the
    # context serves the full cache's answer and snapkv's replay), snapkv's replay, each its own answer
    assert all(r["seconds"]["prefill"] > 0 for r in made if r["spec"] == "full")
    assert all(r["seconds"]["prefill"] == 0 for r in made if r["spec"] == "snapkv")
    assert all(r["seconds"]["decode"] > 0 for r in made)
    assert all(r["seconds"]["compress"] > 0 for r in made if r["spec"] == "snapkv")
    lines = path.read_text().splitlines()
    kept = [lines[i] for i in (0, 3, 4, 7)]
    path.write_text("\n".join(kept) + "\n")
    _, again = run(setup, path)
    missing = [k for k in keys if json.dumps(k) not in {json.dumps(record_key(json.loads(x))) for x in kept}]
    assert [record_key(r) for r in again] == missing  # exactly the keys that were not there
    by_key = {json.dumps(record_key(r)): r["prediction"] for r in made}
    assert all(by_key[json.dumps(record_key(r))] == r["prediction"] for r in again)  # the same answers
    _, nothing = run(setup, path)
    assert nothing == []
    assert sorted(map(json.dumps, map(record_key, read_records([path])))) == sorted(map(json.dumps, keys))


def test_a_record_names_its_sample_within_its_task_whatever_the_run_generates(setup, tmp_path):
    """`--samples 1` then `--samples 2` into one file: the second run makes only each task's second sample.
    (A sample's row number depends on --samples: fwe's first sample is row 1 of the first run, row 2 of the
    second; keyed by it, the same sample was recorded twice and counted twice by the report.)"""
    model, _ = setup
    path = tmp_path / "r.jsonl"

    def grown(n):
        samples = [{**s, "max_new_tokens": 3} for s in ruler.ruler_samples(TOK, ["niah_single_1", "fwe"], [700], n, 0,
                                                                             FILLER)]
        store = RecordsFile(path)
        return ruler.run_ruler(model, TOK, samples, [], ("agnostic",), fractions=[0.5], quiet=True, seed=0,
                               done=store.has, emit=store.append)
    first = grown(1)
    assert sorted((r["task"], r["index"], r["sample"]) for r in first) == [("fwe", 1, 0), ("niah_single_1", 0, 0)]
    second = grown(2)
    assert sorted((r["task"], r["index"], r["sample"]) for r in second) == [("fwe", 3, 1), ("niah_single_1", 1, 1)]
    assert sorted(ruler_report.sample_id(r) for r in read_records([path]) if r["task"] == "fwe") == [
        (700, 0, 0), (700, 0, 1)]


def test_a_record_without_its_sample_number_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "old.jsonl"
    old = {"task": "vt", "index": 3, "seed": 0, "length": 700, "spec": "full", "mode": "aware", "fraction": None,
           "per_head": None, "score": 1.0, "prediction": "x", "source": "kvcompile"}
    path.write_text(json.dumps(old) + "\n")
    for read in (lambda: RecordsFile(path), lambda: read_records([path])):
        with pytest.raises(RecordsError, match=r"line 1: a record of a generated sample without its `sample`.*"
                                               r"scripts/ruler_records_sample.py"):
            read()
    path.write_text(json.dumps({**old, "seed": None}) + "\n")  # a dataset file's row: its index is its identity
    assert RecordsFile(path).records[0]["index"] == 3


def test_old_records_are_numbered_by_their_answers_and_duplicates_dropped():
    numbering = load_script("ruler_records_sample")
    answers = {("vt", 700, 0): [["a"], ["b"], ["c"]], ("fwe", 700, 0): [["x"], ["y"], ["x"]]}

    def generate(task, length, seed, i):
        return answers[(task, length, seed)][i]
    base = {"length": 700, "seed": 0, "spec": "full", "mode": "agnostic", "fraction": None, "per_head": None}
    rows = [{**base, "task": "vt", "index": 2, "answers": ["b"]}, {**base, "task": "vt", "index": 5, "answers": ["b"]},
            {**base, "task": "vt", "index": 6, "answers": ["c"]}, {**base, "task": "vt", "index": 9, "seed": None,
                                                                    "answers": ["zz"]}]
    out, dropped = numbering.number(rows, generate, 3)
    assert [(r["index"], r.get("sample")) for r in out] == [(2, 1), (6, 2), (9, None)] and dropped == 1
    with pytest.raises(SystemExit, match="match no sample"):
        numbering.number([{**base, "task": "vt", "index": 0, "answers": ["q"]}], generate, 3)
    with pytest.raises(SystemExit, match=r"match samples \[0, 2\]"):
        numbering.number([{**base, "task": "fwe", "index": 0, "answers": ["x"]}], generate, 3)


def load_script(name):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_run_killed_mid_line_resumes(setup, tmp_path):
    path = tmp_path / "r.jsonl"
    _, made = run(setup, path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-25])  # the last record cut off mid-line, as a kill leaves it
    assert len(read_records([path])) == len(made) - 1  # readers skip the cut-off line
    store = RecordsFile(path)
    assert store.repaired and len(store.records) == len(made) - 1
    assert path.read_bytes() == raw[:raw.rstrip(b"\n").rfind(b"\n") + 1]  # the partial line is gone
    _, again = run(setup, path)
    assert [record_key(r) for r in again] == [record_key(made[-1])]
    assert [json.loads(x) for x in path.read_text().splitlines()][-1]["prediction"] == made[-1]["prediction"]


def test_a_bad_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "r.jsonl"
    good = {"task": "vt", "index": 0, "sample": 0, "seed": 0, "length": 700, "spec": "full", "mode": "aware", "fraction": None,
            "per_head": None, "score": 1.0, "prediction": "x", "source": "kvcompile"}
    path.write_text(json.dumps(good) + "\n{not json\n" + json.dumps(good) + "\n")
    with pytest.raises(RecordsError, match="line 2"):
        RecordsFile(path)
    with pytest.raises(RecordsError, match="line 2"):
        read_records([path])
    path.write_text(json.dumps({**good, "model": "other"}) + "\n")
    with pytest.raises(RecordsError, match="model 'other'"):
        RecordsFile(path, model="mine")


def test_records_of_an_embedded_model_resume_in_any_checkout_and_two_models_are_not_pooled(tmp_path):
    """A record names its model by the checkpoint folder it was made with; an embedded model's converted folder
    (`models/<name>`) is that model in any checkout, so a file made in one checkout resumes in another; records of
    two models are refused by the report (naming a line of each), which would pool them into one table."""
    good = {"task": "vt", "index": 0, "sample": 0, "seed": 0, "length": 700, "spec": "full", "mode": "agnostic",
            "fraction": None, "per_head": None, "score": 1.0, "prediction": "x", "source": "kvcompile"}
    gemma = tmp_path / "gemma.jsonl"
    gemma.write_text(json.dumps({**good, "model": "/work/wt/a/models/gemma3-270m"}) + "\n")
    assert len(RecordsFile(gemma, model="/work/main/models/gemma3-270m").records) == 1
    with pytest.raises(RecordsError, match="model '/work/wt/a/models/gemma3-270m'"):
        RecordsFile(gemma, model="/work/main/models/smollm2-135m")
    mine = tmp_path / "mine.jsonl"  # any other folder is itself: the same name elsewhere is another model
    mine.write_text(json.dumps({**good, "model": "/a/models/checkpoint"}) + "\n")
    with pytest.raises(RecordsError, match="model '/a/models/checkpoint'"):
        RecordsFile(mine, model="/b/models/checkpoint")
    smol = tmp_path / "smol.jsonl"
    smol.write_text(json.dumps({**good, "sample": 1, "model": "/work/main/models/smollm2-135m"}) + "\n")
    old = tmp_path / "old.jsonl"  # written before records named their model: pooled with either
    old.write_text(json.dumps({**good, "sample": 2}) + "\n")
    with pytest.raises(RecordsError, match=f"'gemma3-270m' \\({re.escape(str(gemma))}, line 1\\) and "
                                           f"'smollm2-135m' \\({re.escape(str(smol))}, line 1\\)"):
        read_records([gemma, old, smol])
    again = tmp_path / "again.jsonl"
    again.write_text(json.dumps({**good, "sample": 3, "model": "/work/main/models/gemma3-270m"}) + "\n")
    assert len(read_records([gemma, old, again])) == 3


def rec(method, task, index, score, budget=None, mode="agnostic"):
    return {"task": task, "index": index, "sample": index, "seed": 0, "length": 4096, "mode": mode, "spec": method,
            "fraction": budget, "per_head": None, "score": score, "source": "kvcompile" if method != "p" else "x"}


def test_hand_example():
    """Task a: full [1, 0], x [1, 1]; task b: full [1, 1, 1], x [1, 0, 1]. Full: a 50, b 100, average 75;
    a's replicates are means of two draws from {0, 1}: 0, 50 or 100 (each end with chance 1/4), so its
    interval is [0, 100]; b's is [100, 100]; the average's [50, 100]. x − full: a {0, +1} → +50 [0, 100],
    b {0, −1, 0} → −33.3 (its replicates −100, −66.7, −33.3 or 0)."""
    records = [rec("full", "a", 0, 1), rec("full", "a", 1, 0), rec("x", "a", 0, 1), rec("x", "a", 1, 1)]
    records += [rec("full", "b", i, 1) for i in (2, 3, 4)]
    records += [rec("x", "b", 2, 1), rec("x", "b", 3, 0), rec("x", "b", 4, 1)]
    rows = table(records)["agnostic"]
    full, x = rows[("full", ("own", None))], rows[("x", ("own", None))]
    est = estimate(full)
    assert (est["a"].point, est["a"].low, est["a"].high, est["a"].n) == (50.0, 0.0, 100.0, 2)
    assert (est["b"].point, est["b"].low, est["b"].high, est["b"].n) == (100.0, 100.0, 100.0, 3)
    assert (est["average"].point, est["average"].low, est["average"].high) == (75.0, 50.0, 100.0)
    diff = estimate(paired(x, full))
    assert (diff["a"].point, diff["a"].low, diff["a"].high) == (50.0, 0.0, 100.0)
    assert diff["b"].point == pytest.approx(-100 / 3) and diff["b"].low == -100.0 and diff["b"].high == 0.0
    assert diff["average"].point == pytest.approx((50 - 100 / 3) / 2)


scores = st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from(["vt", "cwe", "fwe", "niah_single_1"]), scores, min_size=1),
       st.integers(0, 2 ** 31))
def test_bootstrap_is_deterministic_and_its_interval_holds_the_point(tasks, seed):
    values = {t: dict(enumerate(v)) for t, v in tasks.items()}
    first, second = estimate(values, seed=seed), estimate(values, seed=seed)
    assert first == second
    for e in first.values():
        assert e.low <= e.point <= e.high
    assert first["average"].point == pytest.approx(np.mean([100 * np.mean(v) for v in tasks.values()]))


def test_rows_with_the_same_samples_are_resampled_with_the_same_draws():
    """A row that equals another on every sample differs by exactly 0 in every replicate; one that is the
    other plus a constant, by that constant: the draws are paired."""
    a = {"vt": {i: float(i % 2) for i in range(25)}, "cwe": {i: (i % 3) / 2 for i in range(25)}}
    same = estimate(paired(a, {t: dict(v) for t, v in a.items()}))
    assert all((e.point, e.low, e.high) == (0.0, 0.0, 0.0) for e in same.values())
    shifted = {t: {i: x - 0.1 for i, x in v.items()} for t, v in a.items()}
    diff = estimate(paired(a, shifted))
    assert all(e.low == pytest.approx(10) and e.high == pytest.approx(10) for e in diff.values())
    assert estimate(a, seed=1) != estimate(a, seed=2)


def test_the_verdict_layout_holds_the_reports_averages_and_differences(tmp_path, capsys):
    """`report --verdict`: a row per method, a column per (mode, budget), each cell the average the per-task
    report gives and the paired difference against the baseline at the same budget; the entries' and the bytes'
    budgets in tables of their own; --methods keeps the named rows (and the full cache's and the baseline's)."""
    records = []
    for mode in ("agnostic", "aware"):
        for i in range(4):
            records.append(rec("full", "t", i, 1, mode=mode))
            for budget in (0.1, 0.25):
                records += [rec("kvzip", "t", i, float(i < 3), budget, mode), rec("x", "t", i, float(i < 1), budget,
                                                                                   mode)]
            records += [{**rec(name, "t", i, float(i < k), mode=mode), "byte_fraction": 0.0625}
                        for name, k in (("kvzip", 1), ("kvzip@int8", 3))]
            records += [rec("other", "t", i, 0.0, 0.25, mode), rec("kvpress snapkv", "t", i, 0.0, 0.25, mode)]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({**r, "model": "m", "definition": r["spec"]}) + "\n" for r in records))
    cli.main(["report", str(path), "--baseline", "kvzip", "--verdict", "--methods", "x,kvzip@int8"])
    out = capsys.readouterr().out
    entries, nbytes = out.split("| method (bytes)")
    rows = {line.split(" | ")[0].strip("| "): line for line in entries.splitlines() if line.startswith("| ")}
    assert "| method (entries) | agnostic 25% KV | agnostic 10% KV | aware 25% KV | aware 10% KV |" in entries
    assert nbytes.startswith(" | agnostic 1/16 B | aware 1/16 B |") and "other" not in out
    assert set(rows) == {"method (entries)", "full cache", "kvzip", "x"}
    assert rows["full cache"].count("| 100.0 [100.0, 100.0] (4)") == 4
    data = table(records)
    for mode in ("agnostic", "aware"):
        for budget in (0.25, 0.1):
            x, kvzip = data[mode][("x", ("fraction", budget))], data[mode][("kvzip", ("fraction", budget))]
            cell = f"{estimate(x)['average'].text()}; {estimate(paired(x, kvzip))['average'].text(True)} vs kvzip"
            assert f"| {cell} " in rows["x"] and "25.0 [" in cell and "-50.0 [" in cell
            assert f"| {estimate(kvzip)['average'].text()} " in rows["kvzip"]
    assert "vs kvzip" not in rows["kvzip"]
    x, kvzip = (data["aware"][(name, ("bytes", 0.0625))] for name in ("kvzip@int8", "kvzip"))
    cell = f"{estimate(x)['average'].text()}; {estimate(paired(x, kvzip))['average'].text(True)} vs kvzip"
    assert f"| kvzip@int8 | {cell} | {cell} |" in nbytes and "+50.0 [" in cell
    cli.main(["report", str(path), "--baseline", "kvpress:snapkv", "--verdict", "--methods", "kvpress:snapkv,x"])
    out = capsys.readouterr().out  # a press named as --specs names it
    assert "| kvpress snapkv | 0.0 [0.0, 0.0] (4) |" in out and "-25.0 [" not in out and "+25.0 [" in out
    with pytest.raises(SystemExit):
        cli.main(["report", str(path), "--verdict"])
    assert "--verdict compares every row with --baseline" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["report", str(path), "--methods", "nope"])
    assert "--methods: no records of nope" in capsys.readouterr().err


def saved(setup, tmp_path, rows=None):
    """The tiny model and tokenizer saved as a checkpoint folder, and the samples (or the first `rows`) as a
    dataset file: what the eval command reads."""
    model, samples = setup
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    TOK.save_pretrained(folder)
    data = tmp_path / "ds.jsonl"
    ruler.dump_dataset(samples[:rows], data)
    return folder, data


def test_report_command(setup, tmp_path, capsys):
    folder, data = saved(setup, tmp_path)
    path = tmp_path / "r.jsonl"
    argv = ["eval", "--suite", "ruler", "--model", str(folder), "--dataset", str(data), "--specs", "snapkv,adakv",
            "--kv-fraction", "0.5", "--query", "agnostic", "--max-new-tokens", "3", "--resume", str(path), "--quiet"]
    cli.main(argv)
    first = read_records([path])
    assert len(first) == 4 * 3 and all(r["model"] == str(folder) for r in first)
    capsys.readouterr()
    cli.main(argv)
    assert "0 records made now, 12 there before" in capsys.readouterr().out
    assert len(read_records([path])) == 12
    cli.main(["report", str(path), "--baseline", "snapkv"])
    out = capsys.readouterr().out
    assert "query-agnostic: difference against the full cache" in out
    assert "difference against snapkv at the same budget" in out and "| adakv | 50% KV |" in out
    assert "where the time went" in out
    with pytest.raises(SystemExit):
        cli.main(["report", str(path), "--baseline", "nope"])
    assert "no such method" in capsys.readouterr().err
    cli.main(["report", str(path), "--tasks", "fwe"])  # one task's table: its rows' averages are fwe's scores
    out = capsys.readouterr().out
    assert "niah_single_1" not in out and "| method | budget | fwe | average |" in out
    with pytest.raises(SystemExit):
        cli.main(["report", str(path), "--tasks", "vt"])
    assert "--tasks: no records of vt" in capsys.readouterr().err
    assert report(first).count("| full |") == 2  # the score table and the time table


def test_answer_stop_ends_at_a_complete_answer_and_changes_no_score(setup):
    """A sample whose gold string is the start of what the model answers: with answer_stop the answer ends as
    soon as it holds it (a prefix of the whole answer, the same score 1), for the full cache and a spec; with a
    gold string the model never writes it runs to the bound, as without."""
    model, samples = setup
    s = {**samples[0], "max_new_tokens": 8}
    whole = ruler.run_group(model, TOK, [s], "agnostic", ["snapkv"], fractions=[1.0])
    assert all(r["stop"] == "length" and r["new_tokens"] == 8 for r in whole)
    text = whole[0]["prediction"]
    gold = text.strip()[:2]
    assert len(gold) == 2 and whole[1]["prediction"] == text  # the spec keeping everything answers the same
    early = ruler.run_group(model, TOK, [{**s, "answers": [gold]}], "agnostic", ["snapkv"], fractions=[1.0],
                            answer_stop=True)
    for r in early:
        assert r["stop"] == "answered" and r["score"] == 1.0 and r["new_tokens"] < 8
        assert text.startswith(r["prediction"]) and r["prediction"].strip().endswith(gold)
    late = ruler.run_group(model, TOK, [{**s, "answers": ["@@@"]}], "agnostic", ["snapkv"], fractions=[1.0],
                           answer_stop=True)
    assert [r["prediction"] for r in late] == [text, text] and all(r["stop"] == "length" for r in late)


def test_a_policy_definition_names_what_it_computes_not_its_name_or_size():
    import kvcompile

    snapkv = kvcompile.load_spec("snapkv")
    assert kvcompile.load_spec(snapkv, per_head=700).definition() == snapkv.definition()
    # a spec whose budget is a ratio (tune writes them so) runs at a count per head: one definition for both
    assert kvcompile.load_spec(snapkv, ratio=0.3).definition() == snapkv.definition()
    assert ruler.eval_spec("snapkv").definition() == snapkv.definition()
    renamed = kvcompile.load_spec({**yaml_of(snapkv), "name": "other"})
    assert renamed.name == "other" and renamed.definition() == snapkv.definition()
    wider = kvcompile.load_spec({**yaml_of(snapkv), "ranking": {"by_score": {"sinks": 0, "window": 64}}})
    assert wider.definition() != snapkv.definition()
    assert ruler.eval_spec("snapkv@int8").definition() != snapkv.definition()
    assert kvcompile.load_spec("kvzip").definition() != kvcompile.load_spec("kvzip_uniform").definition()


def yaml_of(policy) -> dict:
    import yaml

    return yaml.safe_load(policy.to_yaml())


def test_a_spec_whose_definition_changed_is_not_pooled_with_its_old_records(setup, tmp_path, capsys):
    """Records carry their spec's definition; a file with records of a spec name made under another definition
    (or an unrecorded one) is refused before any record is added, and the report refuses to pool them."""
    folder, data = saved(setup, tmp_path, 1)
    spec = tmp_path / "mine.yaml"
    spec.write_text("name: mine\nscoring: {window_attention: {window: 8}}\nranking: {by_score: {window: 8}}\n"
                    "budget: {per_head: 16}\n")
    path = tmp_path / "r.jsonl"
    argv = ["eval", "--suite", "ruler", "--model", str(folder), "--dataset", str(data), "--specs", str(spec),
            "--kv-fraction", "0.5", "--query", "agnostic", "--max-new-tokens", "2", "--resume", str(path), "--quiet"]
    cli.main(argv)
    made = read_records([path])
    mine = [r for r in made if r["spec"] == "mine"]
    assert len(mine) == 1 and mine[0]["definition"] == ruler.eval_spec(str(spec)).definition()
    assert all("definition" not in r for r in made if r["spec"] == "full")
    before = path.read_bytes()
    spec.write_text(spec.read_text().replace("window: 8}}\nranking", "window: 4}}\nranking"))  # same name, changed
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert re.search(r"line 2: a record of spec 'mine' made under another definition of it", capsys.readouterr().err)
    assert path.read_bytes() == before  # nothing added
    # a record written before records carried a definition: refused with the stamping command
    rows = [json.loads(x) for x in before.decode().splitlines()]
    legacy = [{k: v for k, v in r.items() if k != "definition"} for r in rows]
    path.write_text("".join(json.dumps(r) + "\n" for r in legacy))
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert "scripts/ruler_records_definition.py" in capsys.readouterr().err
    stamping = load_script("ruler_records_definition")
    stamping.main([str(path), "--spec", "mine", "--as", str(spec)])  # made under the spec as it is now, says its user
    assert [r.get("definition") for r in read_records([path]) if r["spec"] == "mine"] == \
        [ruler.eval_spec(str(spec)).definition()]
    capsys.readouterr()
    cli.main(argv)
    assert "0 records made now, 2 there before" in capsys.readouterr().out
    # the report never pools two definitions of one name
    other = tmp_path / "old.jsonl"
    other.write_text("".join(json.dumps({**r, "sample": 1}) + "\n" for r in rows))
    with pytest.raises(RecordsError, match=r"records of spec 'mine' were made under 2 definitions"):
        read_records([path, other])
    with pytest.raises(SystemExit):
        cli.main(["report", str(path), str(other)])
    assert "2 definitions" in capsys.readouterr().err
    # the old definition's records renamed: one report reads both
    stamping.main([str(other), "--spec", "mine", "--rename", "mine_before", "--as", str(spec)])
    assert {r["spec"] for r in read_records([other]) if r["spec"] != "full"} == {"mine_before"}
    assert {r["spec"] for r in read_records([path, other])} == {"full", "mine", "mine_before"}


def test_a_shipped_spec_that_is_a_press_as_it_is_is_labelled_with_the_press():
    """A row whose records' definition is a kvpress press's reproduction says so (`tova = kvpress tova`); a row of
    the same name under another definition (the spec changed) or a spec that needs overrides to be the press
    (snapkv: kvpress's window is 64) is not; `kvpress PRESS` rows keep their name."""
    snapkv, tova = ruler.eval_spec("snapkv"), ruler.eval_spec("tova")
    records = [dict(rec("tova", "a", 0, 1), definition=tova.definition()),
               dict(rec("snapkv", "a", 0, 0), definition=snapkv.definition()),
               dict(rec("kvpress snapkv", "a", 0, 0), definition=ruler.eval_spec("kvpress:snapkv").definition()),
               dict(rec("knorm", "a", 0, 0), definition="0123456789ab")]
    assert ruler_report.press_labels(records) == {"tova": "tova = kvpress tova"}
    text = report(records)
    assert "| tova = kvpress tova | - |" in text and "| snapkv | - |" in text and "| kvpress snapkv | - |" in text
    assert "| knorm | - |" in text


def test_an_eval_of_kvpress_presses_records_them_under_their_names(setup, tmp_path, capsys):
    """`--specs kvpress:PRESS` through the command: records named `kvpress PRESS` with the reproduction's
    definition, resumed like any spec, and the report's rows under those names."""
    folder, data = saved(setup, tmp_path, 1)
    path = tmp_path / "r.jsonl"
    argv = ["eval", "--suite", "ruler", "--model", str(folder), "--dataset", str(data), "--specs",
            "kvpress:snapkv,kvpress:tova", "--kv-fraction", "0.5", "--query", "agnostic", "--no-full",
            "--max-new-tokens", "3", "--resume", str(path), "--quiet"]
    cli.main(argv)
    records = read_records([path])
    assert sorted(r["spec"] for r in records) == ["kvpress snapkv", "kvpress tova"]
    for r in records:
        assert r["definition"] == ruler.eval_spec(f"kvpress:{r['spec'].split()[1]}").definition()
    cli.main(argv)
    assert "0 records made now, 2 there before" in capsys.readouterr().out
    cli.main(["report", str(path)])
    out = capsys.readouterr().out
    assert "| kvpress snapkv | 50% KV |" in out and "| kvpress tova | 50% KV |" in out
