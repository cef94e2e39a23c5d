"""scripts/kvpress_compare.py's RULER steps, the parts that need no kvpress: reading the samples,
kvpress's two query modes and context groups, resuming, the options, and the token-id check."""
import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kvpress_compare.py"
spec = importlib.util.spec_from_file_location("kvpress_compare", SCRIPT)
kc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kc)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def row(**kw):
    base = {"context": "Some text. The key is 42.", "question": " What is the key?", "answer_prefix": "The key is",
            "answers": ["42"], "max_new_tokens": 8, "task": "niah_single_1"}
    return {**base, **kw}


def test_read_samples_columns_and_defaults(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [row(index=7), "", {"context": "c", "question": "q", "answer": "a"}])
    first, second = kc.read_samples(path)
    assert first == {"index": 7, "task": "niah_single_1", "context": row()["context"], "question": " What is the key?",
                     "answer_prefix": "The key is", "answers": ["42"], "max_new_tokens": 8}
    # defaults as kvcompile's loader: index = row number, one answer string -> list, 128 tokens, task "dataset"
    assert second == {"index": 1, "task": "dataset", "context": "c", "question": "q", "answer_prefix": "",
                      "answers": ["a"], "max_new_tokens": 128}


@pytest.mark.parametrize("rows, message", [
    ([row(), {"question": "q", "answers": ["a"]}], "line 2: column 'context' missing"),
    ([row(), row(question=3)], "line 2: column 'question' missing or not text"),
    ([{"context": "c", "question": "q"}], "line 1: column 'answers' (or 'answer') missing"),
    ([row(index=1), row(index=1)], "line 2: 'index' must be a distinct integer"),
    ([row(max_new_tokens=-1)], "'max_new_tokens' must be a positive integer"),
    (["{not json"], "line 1: not JSON"),
    (["[1, 2]"], "line 1: expected a JSON object"),
    ([], "no samples"),
])
def test_read_samples_errors_name_file_and_line(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(kc.SamplesError) as exc:
        kc.read_samples(path)
    assert str(path) in str(exc.value) and message in str(exc.value)
    with pytest.raises(kc.SamplesError, match="no such file"):
        kc.read_samples(tmp_path / "missing.jsonl")


def test_modes_as_kvpress_evaluation():
    s = row()
    assert kc.mode_inputs(s, "agnostic") == (s["context"], s["question"])
    # evaluate.py's query_aware: the question joins the context, the question asked is empty
    assert kc.mode_inputs(s, "aware") == (s["context"] + s["question"], "")
    with pytest.raises(ValueError, match="aware"):
        kc.mode_inputs(s, "both")


def test_context_groups_share_a_context_only_when_agnostic():
    a = {**row(), "index": 0}
    b = {**row(question=" Which key?"), "index": 1}
    c = {**row(answer_prefix="Key:"), "index": 2}
    d = {**row(context="Other text."), "index": 3}
    agnostic = kc.context_groups([a, b, c, d], "agnostic")
    assert [[s["index"] for s in g] for g in agnostic] == [[0, 1], [2], [3]]
    aware = kc.context_groups([a, b, c, d], "aware")
    assert [[s["index"] for s in g] for g in aware] == [[0], [1], [2], [3]]


def test_resume_keys(tmp_path):
    out = tmp_path / "p.jsonl"
    assert kc.done_runs(out) == set()
    write_jsonl(out, [{"index": 3, "mode": "aware", "method": "kvpress:snapkv", "fraction": 0.25, "prediction": "x"},
                      {"index": 3, "mode": "aware", "method": "kvpress:full", "fraction": None, "prediction": "y"}])
    done = kc.done_runs(out)
    assert kc.run_key(3, "aware", "kvpress:snapkv", 0.25) in done
    assert kc.run_key(3, "aware", "kvpress:full", None) in done
    assert kc.run_key(3, "agnostic", "kvpress:snapkv", 0.25) not in done
    assert kc.run_key(3, "aware", "kvpress:snapkv", 0.1) not in done
    assert kc.side_path(out, "meta") == tmp_path / "p.meta.json"


def test_first_difference():
    assert kc.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert kc.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert kc.first_difference([1, 2], [1, 2, 3]) == 2
    assert kc.first_difference([], []) is None


@pytest.mark.parametrize("argv", [
    ["ruler", "--samples", "s", "--out", "o", "--presses", "snapkv,nope"],
    ["ruler", "--samples", "s", "--out", "o", "--fractions", "0.25,1"],
    ["ruler", "--samples", "s", "--out", "o", "--fractions", "0"],
    ["ruler", "--samples", "s", "--out", "o", "--modes", "both"],
    ["ruler", "--samples", "s", "--out", "o", "--unknown"],
])
def test_bad_options_fail_before_anything_runs(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        kc.main(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_presses_are_kvpress_registry_names():
    assert kc.RULER_PRESSES == ("snapkv", "pyramidkv", "adakv_snapkv", "streaming_llm", "tova",
                                "observed_attention", "knorm", "expected_attention", "kvzip")
    assert kc.method_name("snapkv") == "kvpress:snapkv"


def test_tokens_step_reports_a_mismatch(tmp_path, capsys):
    """The kvcompile-side check: ids equal to kvcompile's prompt pass; one changed id is reported."""
    ruler = pytest.importorskip("kvcompile.tools.ruler")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<|im_end|>", *"abcdefghijklmnopqrstuvwxyz .?:#0123456789TWK"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    tokenizer.save_pretrained(tmp_path / "tok")
    samples = write_jsonl(tmp_path / "s.jsonl", [row(index=0), row(index=1, context="Other text.")])
    loaded = ruler.load_dataset(samples)
    groups = []
    for mode in ("agnostic", "aware"):
        for s in loaded:
            ids, question = ruler.mode_prompt(tokenizer, s, mode)
            groups.append({"mode": mode, "indices": [s["index"]], "context_ids": ids, "questions_ids": [question]})
    fed = tmp_path / "t.tokens.json"
    fed.write_text(json.dumps({"model": str(tmp_path / "tok"), "groups": groups}))
    kc.main(["tokens", "--samples", str(samples), "--tokens", str(fed)])
    assert "4 sample prompts compared, 0 mismatching" in capsys.readouterr().out
    groups[1]["questions_ids"][0][2] += 1
    fed.write_text(json.dumps({"model": str(tmp_path / "tok"), "groups": groups}))
    with pytest.raises(SystemExit) as exc:
        kc.main(["tokens", "--samples", str(samples), "--tokens", str(fed)])
    assert exc.value.code == 1
    out = capsys.readouterr().out
    assert "sample 1 (agnostic) question" in out and "first difference at 2" in out and "1 mismatching" in out


def test_ruler_table_runs_kvcompile_on_the_answered_samples_only(tmp_path):
    samples = write_jsonl(tmp_path / "s.jsonl", [row(), row(context="B"), row(context="C")])
    preds = write_jsonl(tmp_path / "p.jsonl", [
        {"index": i, "mode": m, "method": "kvpress:full", "fraction": None, "prediction": "x"}
        for i in (0, 2) for m in ("aware", "agnostic")])
    path, count = kc.samples_subset(samples, preds)
    assert count == 2 and path == tmp_path / "p.samples.jsonl"
    assert [(r["index"], r["context"]) for r in kc.read_samples(path)] == [(0, row()["context"]), (2, "C")]
    write_jsonl(preds, [{"index": i, "mode": "aware", "method": "kvpress:full", "fraction": None, "prediction": "x"}
                        for i in range(3)])
    assert kc.samples_subset(samples, preds) is None


# --- the kept comparison (issue 35): the parts that run without kvpress -------------------------------

KEPT = Path(__file__).resolve().parents[1] / "scripts" / "kvpress_kept.py"
kept_spec = importlib.util.spec_from_file_location("kvpress_kept", KEPT)
kk = importlib.util.module_from_spec(kept_spec)
kept_spec.loader.exec_module(kk)


def test_agreement_is_the_share_of_kvpress_kept_positions_kvcompile_keeps():
    np = pytest.importorskip("numpy")
    theirs = np.zeros((2, 2, 8), dtype=bool)
    ours = np.zeros((2, 2, 8), dtype=bool)
    theirs[0, 0, [0, 1, 2, 3]] = True
    ours[0, 0, [0, 1, 2, 5, 6]] = True        # 3 of kvpress's 4, one more of its own: 0.75
    theirs[0, 1, [4, 5]] = True
    ours[0, 1, [4, 5]] = True                 # the same set: 1.0
    theirs[1, 0, [7]] = True                  # kvcompile keeps none of it: 0.0
    ours[1, 0, [0, 1, 2, 3, 4, 5, 6]] = True  # (keeping more elsewhere does not count)
    ours[1, 1, [3]] = True                    # kvpress keeps nothing in this head: 1.0 by definition
    got = kk.agreement(theirs, ours)
    assert got.shape == (2, 2)
    assert got.tolist() == [[0.75, 1.0], [0.0, 1.0]]
    # a superset of kvpress's set agrees fully, a subset by its share
    assert kk.agreement(theirs[:1, :1], np.ones((1, 1, 8), dtype=bool)).tolist() == [[1.0]]
    half = theirs[:1, :1].copy()
    half[0, 0, [2, 3]] = False
    assert kk.agreement(theirs[:1, :1], half).tolist() == [[0.5]]
    with pytest.raises(ValueError, match="different shapes"):
        kk.agreement(theirs, ours[:, :, :7])


def test_kept_sets_pack_and_unpack_bit_for_bit():
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    grid = rng.random((3, 2, 13)) < 0.4  # 78 bits: not a whole number of bytes
    text = kk.pack(grid)
    assert (kk.unpack(text, grid.shape) == grid).all()
    with pytest.raises(ValueError, match="expected"):
        kk.unpack(text, (3, 2, 40))


def test_summary_mean_min_and_where():
    np = pytest.importorskip("numpy")
    rows = [{"index": 4, "press": "snapkv", "label": "snapkv", "mode": "aware", "fraction": 0.25, "ratio": 1.0,
             "agreement": np.array([[1.0, 1.0], [1.0, 0.5]])},
            {"index": 9, "press": "snapkv", "label": "snapkv", "mode": "aware", "fraction": 0.25, "ratio": 1.5,
             "agreement": np.array([[1.0, 0.25], [1.0, 1.0]])},
            {"index": 4, "press": "snapkv", "label": "snapkv", "mode": "agnostic", "fraction": 0.25, "ratio": 1.0,
             "agreement": np.ones((2, 2))}]
    aware, agnostic = kk.summarize(rows)
    assert aware["samples"] == 2 and aware["mean"] == pytest.approx(6.75 / 8) and aware["min"] == 0.25
    assert aware["min_at"] == {"index": 9, "layer": 0, "head": 1}
    assert aware["exact_heads"] == pytest.approx(6 / 8) and aware["size_ratio"] == pytest.approx(1.25)
    assert agnostic["mean"] == 1.0 and agnostic["min"] == 1.0
    (line,) = kk.overall([aware, agnostic])
    assert line["samples"] == 3 and line["mean"] == pytest.approx((6.75 / 8 * 2 + 1.0) / 3) and line["min"] == 0.25
    table = kk.markdown([aware, agnostic])
    assert "| snapkv | snapkv | 0.8958 | 0.250 | 0.844 | 1.000 |" in table


def test_round_robin_covers_every_task_first():
    samples = [{"task": t, "index": i} for i, t in enumerate(["a", "a", "b", "b", "c"])]
    assert [s["index"] for s in kk.round_robin(samples)] == [0, 2, 4, 1, 3]


def test_read_kvpress_keeps_finished_prompts_and_the_last_of_a_rerun(tmp_path):
    path = write_jsonl(tmp_path / "k.jsonl", [
        {"kind": "kept", "index": 0, "mode": "aware", "press": "snapkv", "fraction": 0.1, "kept": "old"},
        {"kind": "kept", "index": 0, "mode": "aware", "press": "snapkv", "fraction": 0.1, "kept": "new"},
        {"kind": "kept", "index": 0, "mode": "aware", "press": "knorm", "fraction": 0.1, "kept": "k"},
        {"kind": "prompt", "index": 0, "mode": "aware", "ids": [1, 2]},
        {"kind": "kept", "index": 1, "mode": "aware", "press": "snapkv", "fraction": 0.1, "kept": "cut short"}])
    prompts, kept = kk.read_kvpress(path)
    assert list(prompts) == [(0, "aware")] and list(kept) == [(0, "aware")]
    assert sorted((r["press"], r["kept"]) for r in kept[(0, "aware")]) == [("knorm", "k"), ("snapkv", "new")]
    other = write_jsonl(tmp_path / "k2.jsonl", [
        {"kind": "kept", "index": 0, "mode": "aware", "press": "kvzip", "fraction": 0.1, "kept": "z"},
        {"kind": "prompt", "index": 0, "mode": "aware", "ids": [1, 2]}])
    prompts, kept = kk.read_kvpress([path, other])  # two runs over the same prompt: their presses together
    assert sorted(r["press"] for r in kept[(0, "aware")]) == ["knorm", "kvzip", "snapkv"]
    write_jsonl(other, [{"kind": "prompt", "index": 0, "mode": "aware", "ids": [1, 3]}])
    with pytest.raises(ValueError, match="other ids"):
        kk.read_kvpress([path, other])


def test_kvcompile_kept_sets_are_the_caches_entries():
    """kvcompile's side: the kept positions read from the cache the RULER eval decodes from, with each scorer's
    scores computed once (replay_scored), are sweep.replay's and the reference's; StreamingLLM's are the sinks
    and the most recent tokens; KVzip's (its reconstruction run once) are a compiled prefill's."""
    import torch
    from tiny import prompt, tiny_model

    from kvcompile import reference
    from kvcompile.tools import ruler
    from kvcompile.kvzip import RepeatPrompt
    from kvcompile.tools.sweep import capture, prefilled, replay

    model = tiny_model(layers=3, heads=4, kv_heads=2)
    ids = prompt(60)[0].tolist()
    n = len(ids)
    repeat = RepeatPrompt(first=(5, 6, 7, 8), later=(9, 10), suffix=(11, 12))
    here = kk.Prompt(model, ids, repeat_prompt=repeat)
    policy = kk.spec_policy("streamingllm", {}, n, 0.25)  # per_head = floor(0.25 * 60) = 15: 4 sinks + last 11
    assert policy.budget.per_head == 15
    kept = here.kept(policy)
    assert kept.shape == (3, 2, n) and kept.dtype == torch.bool
    expected = torch.zeros(n, dtype=torch.bool)
    expected[:4] = expected[n - 11:] = True
    assert (kept == expected).all()
    states, _ = capture(model, torch.tensor([ids]))
    for spec, overrides in (("snapkv", kk._window(8)), ("adakv", kk._snap(8, "max", 7)),
                            ("h2o", {"ranking": {"by_score": {"window": 0}}}), ("pyramidkv", {})):
        for fraction in (0.25, 0.5):
            policy = kk.spec_policy(spec, overrides, n, fraction)
            kept = here.kept(policy)
            assert (kept == kk.kvcompile_kept(replay(policy, model.config, states))).all(), (spec, fraction)
            ref = torch.stack([k[0] for k in reference.compress(policy, states).kept])
            assert (kept == ref).all(), (spec, fraction)
    assert kk.spec_policy("snapkv", kk._window(8), n, 0.5).scoring.window == 8
    for spec in ("knorm", "tova", "expected_adakv"):  # the budget the RULER eval gives the spec
        ((_, shipped),) = ruler.policies_for(spec, n, [0.1], None)
        assert kk.spec_policy(spec, {}, n, 0.1) == shipped
    for spec in ("kvzip", "kvzip_adakv"):
        policy = kk.spec_policy(spec, {}, n, 0.25)
        cache, _ = prefilled(model, policy, torch.tensor([ids]), repeat_prompt=repeat)
        assert (here.kept(policy) == kk.kvcompile_kept(cache)).all(), spec
    assert len(here.kvzip) == 1  # one reconstruction for both specs (the same scorer)


def test_agreement_rows_resume(tmp_path):
    np = pytest.importorskip("numpy")
    path = tmp_path / "rows.jsonl"
    assert kk.read_rows(path) == []
    row = {"index": 3, "mode": "aware", "press": "snapkv", "label": "snapkv window 64", "fraction": 0.1,
           "ratio": 1.0, "agreement": [[1.0, 0.5], [0.25, 1.0]]}
    write_jsonl(path, [row])
    (back,) = kk.read_rows(path)
    assert back["agreement"].shape == (2, 2) and back["agreement"][1, 0] == 0.25
    assert kk.row_key(back) == (3, "aware", "snapkv", "snapkv window 64", 0.1)
    assert kk.row_key({**row, "fraction": 0.1000000001}) == kk.row_key(back)


def test_prompts_todo_skips_the_done_and_stops_after_the_batch():
    """kept-kvpress --resume --max-prompts N: the missing prompts in round-robin order, both modes of a sample
    together, at most N (scripts/kvpress_env.sh kept alternates the two sides one batch at a time)."""
    samples = [{"task": t, "index": i} for i, t in enumerate(["a", "a", "b"])]
    todo = kk.prompts_todo(samples, ["aware", "agnostic"], {(0, "aware")})
    assert [(s["index"], m) for s, m in todo] == [(0, "agnostic"), (2, "aware"), (2, "agnostic"), (1, "aware"),
                                                   (1, "agnostic")]
    assert [(s["index"], m) for s, m in kk.prompts_todo(samples, ["agnostic"], {(0, "agnostic")}, 1)] == [(2, "agnostic")]
    assert kk.prompts_todo(samples, ["aware"], {(0, "aware"), (1, "aware"), (2, "aware")}, 1) == []


def test_results_table_pools_the_modes_per_fraction_and_replaces_its_block():
    def line(mode, fraction, samples, mean, low):
        return {"press": "snapkv", "spec": "snapkv window 64", "mode": mode, "fraction": fraction,
                "samples": samples, "mean": mean, "min": low}
    lines = [line("aware", 0.1, 3, 1.0, 1.0), line("agnostic", 0.1, 1, 0.6, 0.2), line("aware", 0.5, 3, 0.9, 0.5)]
    table = kk.results_table(lines)
    head, rule, row = table.splitlines()
    assert head.startswith("| kvpress press") and head.endswith("| 10% | 50% | why not 1.0 |")
    # prompts: the most at one fraction (4 at 10 %); mean over all 7: (3 + 0.6 + 2.7) / 7; 10 %: (3 + 0.6) / 4
    assert row.startswith("| snapkv | snapkv window 64 | 4 | 0.9000 | 0.200 | 0.900 | 0.900 | exact up to float")
    text = f"intro\n{kk.TABLE_START}\nold table\n{kk.TABLE_END}\nafter\n"
    assert kk.replace_table(text, "new") == f"intro\n{kk.TABLE_START}\nnew\n{kk.TABLE_END}\nafter\n"
    with pytest.raises(ValueError, match="must hold one"):
        kk.replace_table("no markers", "new")


def test_merge_lines_pools_two_runs_and_base_lines_skips_presses(tmp_path):
    def line(press, samples, mean, low, at):
        return {"press": press, "spec": press, "mode": "aware", "fraction": 0.1, "samples": samples, "mean": mean,
                "min": low, "exact_heads": mean, "size_ratio": 1.0, "min_at": {"index": at, "layer": 0, "head": 0}}
    (a, b) = kk.merge_lines([line("snapkv", 3, 0.9, 0.5, 1), line("kvzip", 1, 0.8, 0.3, 1)],
                            [line("snapkv", 1, 0.5, 0.2, 7)])
    assert a["samples"] == 4 and a["mean"] == pytest.approx((2.7 + 0.5) / 4) and a["min"] == 0.2
    assert a["min_at"]["index"] == 7 and a["exact_heads"] == pytest.approx(a["mean"])
    assert b == line("kvzip", 1, 0.8, 0.3, 1)
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"lines": [line("snapkv", 3, 0.9, 0.5, 1), line("kvzip", 1, 0.8, 0.3, 1)],
                                "prompts": [[0, "aware"], [2, "agnostic"]]}))
    lines, prompts = kk.base_lines(path, ["kvzip"])
    assert [x["press"] for x in lines] == ["snapkv"] and prompts == [(0, "aware"), (2, "agnostic")]
    rows = [{"index": 0, "mode": "aware", "press": "snapkv"}, {"index": 0, "mode": "aware", "press": "kvzip"},
            {"index": 4, "mode": "aware", "press": "snapkv"}]
    assert kk.rows_beside(rows, prompts, ["kvzip"]) == rows[1:]  # snapkv on prompt 0: counted by the base already


def test_kept_summarize_only_writes_the_summary_of_the_rows_without_a_model(tmp_path, monkeypatch):
    import argparse

    import kvcompile.tools.models

    monkeypatch.setattr(kvcompile.tools.models, "load_model", lambda *a, **k: pytest.fail("no model for a summary"))
    samples = write_jsonl(tmp_path / "s.jsonl", [])
    kvp = write_jsonl(tmp_path / "k.jsonl", [{"kind": "prompt", "index": 4, "mode": "aware", "ids": [1, 2]}])
    rows = write_jsonl(tmp_path / "r.jsonl", [
        {"index": 4, "task": "t", "mode": "aware", "press": "tova", "label": "tova", "fraction": 0.1,
         "agreement": [[1.0, 0.5]], "ratio": 1.0}])
    out = tmp_path / "sum.json"
    args = argparse.Namespace(threads=1, kvpress=[str(kvp)], samples=str(samples), rows=str(rows), out=str(out),
                              model="unused", presses=None, specs=None, base=None, base_skip=None,
                              summarize_only=True)
    kk.cmd_kept(args)
    data = json.loads(out.read_text())
    assert data["prompts"] == [[4, "aware"]] and data["lines"][0]["mean"] == 0.75


# kvpress press (kvpress_kept's name) -> the kept table's row that reproduces it entry for entry, by fraction
EXACT_ROWS = {"snapkv": "snapkv window 64", "adakv_snapkv": "adakv window 64 avg 5", "streaming_llm": "streamingllm",
              "tova": "tova", "knorm": "knorm", "observed_attention": "observed_attention",
              "expected_attention_uniform": "expected_attention", "expected_attention": "expected_adakv",
              "kvzip_global": "kvzip", "kvzip": "kvzip_adakv floor 0"}
EVAL_NAME = {"kvzip_global": "kvzip", "kvzip": "kvzip_layerwise"}  # the eval follows KVzipPress()'s default


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5])
def test_an_eval_spec_kvpress_press_runs_the_kept_tables_exact_row(fraction):
    """`kvcompile eval --specs kvpress:PRESS` runs the spec and overrides whose kept positions the kept table
    measured equal to kvpress's (RESULTS), at the eval's budget, named after the press; PyramidKVPress's fallback
    to uniform layers below kvpress's window follows the fraction; an unknown press is refused with the list."""
    import kvcompile
    from kvcompile.tools import ruler

    n = 3923
    exact = dict(EXACT_ROWS, pyramidkv="pyramidkv window 64 avg 5" + (" layers uniform" if fraction < 0.32 else ""))
    assert set(exact) == set(kk.KEPT_PRESSES) | {kk.KVZIP_GLOBAL}
    assert {EVAL_NAME.get(p, p) for p in exact} == set(ruler.KVPRESS_REPRODUCTIONS)
    for press, label in exact.items():
        spec, overrides = next((s, o) for lab, s, o in kk.KEPT_SPECS[press] if lab == label)
        want = kk.spec_policy(spec, overrides, n, fraction)
        name = EVAL_NAME.get(press, press)
        ((f, got),) = ruler.policies_for(f"kvpress:{name}", n, [fraction], None)
        fallback = " (uniform layers)" if press == "pyramidkv" and fraction < 0.32 else ""  # another policy
        assert f == fraction and got.name == f"kvpress {name}{fallback}", press
        assert got.definition() == want.definition() and got.budget.per_head == want.budget.per_head, press
    assert ruler.eval_spec("kvpress:snapkv@int4").storage.bits == 4
    with pytest.raises(kvcompile.SpecError, match=r"kvpress has no press 'snap'.*kvpress:snapkv"):
        ruler.eval_spec("kvpress:snap")


def test_commands_without_a_share_of_the_context_refuse_a_kvpress_press(capsys):
    """A command whose budget is tokens per head (needle eval, bench, serve) refuses `kvpress:PRESS` and names the
    spec that reproduces it (PyramidKVPress's layers depend on the share of each context kept)."""
    from kvcompile.tools.cli import policy_for

    with pytest.raises(SystemExit) as exit_:
        policy_for("kvpress:snapkv", 128)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "kvcompile eval --suite ruler" in err and "snapkv with {'scoring': {'window_attention': {'window': 64}}" in err
