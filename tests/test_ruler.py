"""RULER-style eval (kvcompile/tools/ruler.py, `kvcompile eval --suite ruler`): the generators on a tiny
character tokenizer, RULER's scorers, the dataset and predictions files, kvpress's prompt, the
query-agnostic path against the plain model's generate(), and one end-to-end eval in both modes."""
from __future__ import annotations

import json
import re
import string

import pytest
import torch

import kvcompile
from kvcompile.tools import cli
from kvcompile.tools import ruler
from kvcompile.tools.sweep import capture, feed, greedy, replay
from tests.tiny import tiny_model

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FILLER = ("Rivers carry water to the sea. Mountains rise slowly over ages. A quiet town sat by the lake! "
          "Did the old bridge survive the flood? Farmers planted wheat in early spring. ") * 40
LENGTH = 2400  # characters = tokens: a prompt and its tokens to generate fit in this (vt: a 500-token example)


def char_tokenizer(template: str | None = TEMPLATE):
    """One token per printable ASCII character (no download); <|im_end|> is id 1 (tiny_model's eos)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    specials = ["<pad>", "<|im_end|>", "<|im_start|>", "<unk>"]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + chars)}, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                   bos_token="<|im_start|>", unk_token="<unk>", chat_template=template)


TOK = char_tokenizer()


def tiny_for(tokenizer, seed: int = 0):
    model = tiny_model(seed=seed)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id, cfg.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    return model.eval()


def sample(task: str, index: int = 0, seed: int = 0, length: int = LENGTH) -> dict:
    return ruler.generate_sample(TOK, task, length, seed, index, FILLER)


# --- the generators ---------------------------------------------------------------------------

@pytest.mark.parametrize("task", list(ruler.TASKS))
def test_task_deterministic_answers_in_context_and_length(task):
    s = sample(task)
    assert s == sample(task), "the same seed gives the same sample"
    assert sample(task, seed=1) != s and sample(task, index=1) != s
    assert set(s) >= set(ruler.COLUMNS)
    assert s["max_new_tokens"] == ruler.TASKS[task].max_new_tokens
    # the prompt as the model receives it, plus the tokens to generate, fits, and is near the target
    for mode in ("aware", "agnostic"):
        ids, question = ruler.mode_prompt(TOK, s, mode)
        total = len(ids) + len(question) + s["max_new_tokens"]
        assert LENGTH - 120 <= total <= LENGTH, (mode, total)
    kind = ruler.TASKS[task].kind
    if kind == "niah":
        for value in s["answers"]:
            assert f"is: {value}." in s["context"]
        assert "special magic" in s["question"] and "special magic" in s["answer_prefix"]
        t = ruler.TASKS[task]
        assert len(s["answers"]) == t.num_v * t.num_q
        # the question names the key(s) of the needle(s) holding the answers
        for value in s["answers"]:
            key = s["context"].split(f" is: {value}.")[0].rsplit("special magic ", 1)[1].split(" for ", 1)[1]
            assert key in s["question"]
    elif kind == "vt":
        value = s["question"].split("the value ")[1].split(" ")[0]
        main = s["context"].split(ruler.VT_HEAD)[-1]
        assert f"VAR {s['answers'][0]} = {value}" in main
        for a, b in zip(s["answers"], s["answers"][1:]):
            assert f"VAR {b} = VAR {a}" in main
        assert ruler.VT_HEAD in s["context"].split(main)[0], "one solved example comes first"
    elif kind == "cwe":
        listed = s["context"].split(ruler.CWE_HEAD)[-1].split()[1::2]  # "1. w 2. w ..."
        counts = {w: listed.count(w) for w in set(listed)}
        assert len(s["answers"]) == 10
        assert min(counts[w] for w in s["answers"]) > max(c for w, c in counts.items() if w not in s["answers"])
    else:  # fwe
        words = s["context"][len(ruler.FWE_HEAD):].split()
        counts = sorted(((words.count(w), w) for w in set(words) if w != "..."), reverse=True)
        assert [w for _, w in counts[:3]] == s["answers"]


def test_generated_context_question_split_is_kvpress_ruler():
    s = sample("niah_multiquery")
    assert s["context"].startswith("Some special magic numbers are hidden")
    assert s["context"].endswith("\n") and s["question"].startswith("What are all the special magic numbers for ")
    assert s["answer_prefix"].startswith("The special magic numbers for ") and len(s["answers"]) == 4
    single = sample("niah_single_2")
    assert single["context"].startswith("A special magic number is hidden")
    assert single["question"].startswith("What is the special magic number for ")
    assert ruler.ruler_samples(TOK, ["vt", "fwe"], [LENGTH], 2, 0, FILLER) == [
        {**sample(t, i), "index": k, "sample": i} for k, (t, i) in enumerate([("vt", 0), ("vt", 1), ("fwe", 0), ("fwe", 1)])]


def test_unknown_task_and_too_short():
    with pytest.raises(ValueError, match="qa_1 and qa_2 need SQuAD"):
        ruler.generate_sample(TOK, "qa_1", LENGTH, 0, 0, FILLER)
    with pytest.raises(ValueError, match="too short"):
        ruler.generate_sample(TOK, "niah_single_1", 200, 0, 0, FILLER)


# --- scoring ------------------------------------------------------------------------------------

def test_scorers_on_hand_made_cases():
    assert ruler.string_match_all("The numbers are 123 and 456.", ["123", "456"]) == 1.0
    assert ruler.string_match_all("only 123", ["123", "456", "789", "000"]) == 0.25
    assert ruler.string_match_all("APPLE pie", ["apple"]) == 1.0  # case-insensitive
    assert ruler.string_match_all("nothing", ["x1"]) == 0.0
    assert ruler.string_match_part("it was Paris", ["London", "paris"]) == 1.0
    assert ruler.string_match_part("it was Rome", ["London", "Paris"]) == 0.0
    assert ruler.score("qa_2", "Paris", ["Paris", "London"]) == 1.0  # part
    assert ruler.score("niah_multivalue", "Paris", ["Paris", "London"]) == 0.5  # all
    assert ruler.clean("\n\t 12\x0334 \n") == "1234"  # kvpress strips control characters


# --- the prompt, as kvpress's pipeline builds it ------------------------------------------------

def test_prompt_split_as_kvpress():
    before, suffix = ruler.split_chat(TOK, "CTX")
    assert before == "<|im_start|>user\nCTX" and suffix == "<|im_end|>\n<|im_start|>assistant\n"
    ids, (q,) = ruler.prompt_ids(TOK, "CTX", ["Q?"], "A:")
    assert TOK.decode(ids) == before and TOK.decode(q) == "Q?" + suffix + "A:"
    plain = char_tokenizer(template=None)
    assert ruler.split_chat(plain, "CTX") == ("<|im_start|>CTX", "\n")
    s = {"context": "C.\n", "question": "Q?", "answer_prefix": "A"}
    aware_ids, aware_q = ruler.mode_prompt(TOK, s, "aware")
    assert TOK.decode(aware_ids).endswith("C.\nQ?") and TOK.decode(aware_q) == suffix + "A"


# --- files ----------------------------------------------------------------------------------------

def test_dump_and_load_roundtrip(tmp_path):
    samples = ruler.ruler_samples(TOK, ["niah_single_1", "vt"], [LENGTH], 1, 0, FILLER)
    path = tmp_path / "ds.jsonl"
    ruler.dump_dataset(samples, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [list(r) for r in rows] == [list(ruler.COLUMNS)] * 2
    assert ruler.load_dataset(path) == samples


def test_a_dataset_row_may_name_its_sample_once_per_task(tmp_path):
    row = {"context": "c", "question": "q", "answers": ["a"], "task": "t", "length": 100}
    got = ruler.load_dataset(write(tmp_path / "a.jsonl", [{**row, "sample": 3}, {**row, "sample": 4},
                                                           {**row, "task": "u", "sample": 3}, row]))
    assert [s.get("sample") for s in got] == [3, 4, 3, None]
    assert [ruler.sample_id(s) for s in got] == [3, 4, 3, 3]  # without it: its index (the row number)
    with pytest.raises(ruler.DatasetError, match=r"row 2.*'sample' 3 is already a sample of task 't'"):
        ruler.load_dataset(write(tmp_path / "b.jsonl", [{**row, "sample": 3}, {**row, "sample": 3}]))
    with pytest.raises(ruler.DatasetError, match=r"'sample' must be a non-negative integer, got -1"):
        ruler.load_dataset(write(tmp_path / "c.jsonl", [{**row, "sample": -1}]))


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_dataset_errors(tmp_path):
    with pytest.raises(ruler.DatasetError, match=r"missing column 'question'.*|.*row 1: missing column 'question'"):
        ruler.load_dataset(write(tmp_path / "a.jsonl", [{"context": "c", "answers": ["x"]}]))
    with pytest.raises(ruler.DatasetError, match=r"a\.jsonl, row 2: missing column 'answers' \(or 'answer'\)"):
        ruler.load_dataset(write(tmp_path / "a.jsonl", [{"context": "c", "question": "q", "answer": "x"},
                                                        {"context": "c", "question": "q"}]))
    (tmp_path / "bad.jsonl").write_text('{"context": "c"\n')
    with pytest.raises(ruler.DatasetError, match=r"bad\.jsonl, line 1: not JSON"):
        ruler.load_dataset(tmp_path / "bad.jsonl")
    with pytest.raises(ruler.DatasetError, match="no such file"):
        ruler.load_dataset(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ruler.DatasetError, match="no rows"):
        ruler.load_dataset(tmp_path / "empty.jsonl")
    loaded = ruler.load_dataset(write(tmp_path / "ok.jsonl", [{"context": "c", "question": "q", "answer": "x"}]))
    assert loaded == [{"index": 0, "task": "dataset", "length": None, "context": "c", "question": "q",
                       "answer_prefix": "", "answers": ["x"], "max_new_tokens": 128}]
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        try:
            import pandas  # noqa: F401
        except ImportError:
            (tmp_path / "d.parquet").write_bytes(b"PAR1")
            with pytest.raises(ruler.DatasetError, match="Parquet needs pyarrow"):
                ruler.load_dataset(tmp_path / "d.parquet")


def test_dataset_values_and_encodings_are_refused_naming_file_row_and_field(tmp_path):
    row = {"context": "c", "question": "q", "answers": ["x"]}
    for answers in (5, {"a": 1}, [["x"]], [None], True):
        with pytest.raises(ruler.DatasetError, match=r"a\.jsonl, row 2: 'answers' must be a string or a list of "
                                                     r"strings"):
            ruler.load_dataset(write(tmp_path / "a.jsonl", [row, {**row, "answers": answers}]))
    for new in (-3, 0, "4", 4.5, True):
        with pytest.raises(ruler.DatasetError, match=r"a\.jsonl, row 1: 'max_new_tokens' must be an integer >= 1, "
                                                     rf"got {re.escape(repr(new))}"):
            ruler.load_dataset(write(tmp_path / "a.jsonl", [{**row, "max_new_tokens": new}]))
    with pytest.raises(ruler.DatasetError, match=r"row 1: 'max_new_tokens' must be an integer in \[1, 1024\] \(the "
                                                 r"model's context\), got 1000000000000"):
        ruler.load_dataset(write(tmp_path / "a.jsonl", [{**row, "max_new_tokens": 10**12}]), limit=1024)
    assert ruler.load_dataset(write(tmp_path / "a.jsonl", [{**row, "max_new_tokens": 4.0}]))[0]["max_new_tokens"] == 4
    # the command line's --max-new-tokens overrides the file's (then not read)
    assert ruler.load_dataset(write(tmp_path / "a.jsonl", [{**row, "max_new_tokens": 0}]), 7)[0]["max_new_tokens"] == 7
    text = json.dumps(row) + "\n" + json.dumps({**row, "context": "café"}, ensure_ascii=False) + "\n"
    for encoding, match in (("utf-16", r"u16\.jsonl: the file is UTF-16 \(it starts with a UTF-16 byte-order mark\)"),
                            ("utf-32", r"u16\.jsonl: the file is UTF-32"),
                            ("utf-16-le", r"u16\.jsonl, line 1: NUL bytes \(UTF-16 or UTF-32 without a byte-order"),
                            ("latin-1", r"u16\.jsonl, line 2: not UTF-8 \(byte 0xe9 at byte 17 of the line\)")):
        (tmp_path / "u16.jsonl").write_bytes(text.encode(encoding))
        with pytest.raises(ruler.DatasetError, match=match):
            ruler.load_dataset(tmp_path / "u16.jsonl")
    (tmp_path / "bom.jsonl").write_bytes(text.encode("utf-8-sig"))
    assert [s["context"] for s in ruler.load_dataset(tmp_path / "bom.jsonl")] == ["c", "café"]
    (tmp_path / "gaps.jsonl").write_text(json.dumps(row) + "\n\n" + json.dumps({**row, "answers": 5}) + "\n")
    with pytest.raises(ruler.DatasetError, match=r"gaps\.jsonl, row 2 \(line 3\): 'answers'"):
        ruler.load_dataset(tmp_path / "gaps.jsonl")
    (tmp_path / "p.jsonl").write_bytes(b'{"index": 0}\n\xff\n')
    with pytest.raises(ruler.DatasetError, match=r"p\.jsonl, line 2: not UTF-8"):  # a predictions file too
        ruler.load_predictions(tmp_path / "p.jsonl", [], set())


def short_rows(tmp_path, lengths):
    """A dataset whose rows have contexts of `lengths` characters (one token each), and its samples."""
    rows = [{"index": i, "context": FILLER[:n], "question": " What?", "answers": ["x"], "max_new_tokens": 2}
            for i, n in enumerate(lengths)]
    path = write(tmp_path / "short.jsonl", rows)
    return path, ruler.load_dataset(path)


def test_a_row_too_short_for_a_spec_at_a_fraction_is_refused_up_front_naming_it(tmp_path):
    """snapkv keeps its last 32 tokens: at fraction 0.25 a prompt under 128 tokens cannot hold them (at 0.5, one
    under 64). The run
    is refused before any model work, naming the shortest row and how many are as short (none is skipped:
    every method is scored on the same rows)."""
    path, samples = short_rows(tmp_path, [600, 80, 700, 100])
    ruler.check_budgets(TOK, samples, ["snapkv"], ("aware", "agnostic"), fractions=[0.5], source=str(path))
    with pytest.raises(ruler.DatasetError) as err:
        ruler.check_budgets(TOK, samples, ["snapkv"], ("agnostic",), fractions=[0.5, 0.25], source=str(path))
    message = str(err.value)
    n = len(ruler.prompt_ids(TOK, FILLER[:80], [], "")[0])
    assert message.startswith(f"{path}: the row of index 1 (task dataset) has a agnostic prompt of {n} tokens, "
                              "too short for snapkv at fraction 0.25")
    assert "sinks 0 + window 32 > per_head" in message and "2 of 4 agnostic prompts are that short" in message
    ruler.check_budgets(TOK, samples, ["snapkv"], ("agnostic",), budgets=[40])  # tokens per head: no length
    ruler.check_budgets(TOK, samples, ["dbudgetkv"], ("agnostic",), fractions=[0.01])  # a threshold: its own


def test_eval_refuses_a_short_row_before_any_model_work(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "tiny"
    tiny_for(TOK).save_pretrained(folder)
    TOK.save_pretrained(folder)
    path, _ = short_rows(tmp_path, [600, 40])
    monkeypatch.setattr(ruler, "run_group", lambda *a, **k: pytest.fail("a model ran"))
    out = tmp_path / "ruler.json"
    with pytest.raises(SystemExit):
        cli.main(["eval", "--suite", "ruler", "--model", str(folder), "--dataset", str(path), "--specs", "snapkv",
                  "--kv-fraction", "0.25", "--out", str(out), "--quiet"])
    assert "the row of index 1 (task dataset)" in capsys.readouterr().err and not out.exists()
    with pytest.raises(SystemExit):
        cli.main(["eval", "--suite", "ruler", "--model", str(folder), "--dataset", str(path), "--specs", "snapkv",
                  "--kv-fraction", "0.25", "--max-new-tokens", str(10**12), "--quiet"])
    assert "at most the model's context (1024 tokens)" in capsys.readouterr().err


def test_predictions_file(tmp_path):
    samples = [{"index": 3, "task": "niah_single_1", "length": 100, "context": "c", "question": "q",
                "answer_prefix": "", "answers": ["42", "7"], "max_new_tokens": 8}]
    good = {"index": 3, "mode": "agnostic", "method": "kvpress:snapkv", "fraction": 0.25, "prediction": "42"}
    (rec,) = ruler.load_predictions(write(tmp_path / "p.jsonl", [good]), samples, {"full", "snapkv"})
    assert (rec["spec"], rec["mode"], rec["fraction"], rec["score"], rec["source"]) == \
        ("kvpress:snapkv", "agnostic", 0.25, 0.5, "predictions")
    for change, message in (({"index": 4}, "index 4 is not a sample"), ({"mode": "both"}, "mode must be"),
                            ({"method": "snapkv"}, "also a kvcompile run"), ({"fraction": 2}, "fraction must be")):
        with pytest.raises(ruler.DatasetError, match=rf"p\.jsonl, line 1: .*{message}"):
            ruler.load_predictions(write(tmp_path / "p.jsonl", [{**good, **change}]), samples, {"full", "snapkv"})
    with pytest.raises(ruler.DatasetError, match=r"line 2: missing field\(s\) prediction"):
        ruler.load_predictions(write(tmp_path / "p.jsonl", [good, {k: v for k, v in good.items() if k != "prediction"}]),
                               samples, set())


# --- the query-agnostic path is exact -----------------------------------------------------------

def test_agnostic_path_equals_generate_with_a_budget_covering_everything():
    """Compress the context with a budget that keeps every token, feed the question through the
    cache, decode greedily: the tokens of the plain model's generate() on context + question."""
    model = tiny_for(TOK)
    s = sample("niah_single_1", length=700)
    ids, (question,) = ruler.prompt_ids(TOK, s["context"], [s["question"]], s["answer_prefix"])
    new = 12
    expected = model.generate(torch.tensor([ids + question]), max_new_tokens=new, do_sample=False,
                              pad_token_id=0)[0, len(ids) + len(question):].tolist()
    states, _ = capture(model, torch.tensor([ids]))
    for spec in ("snapkv", "lava"):
        cache = replay(kvcompile.load_spec(spec, per_head=len(ids)), model.config, states, headroom=len(question) + new)
        logits = feed(model, cache, torch.tensor([question]))
        assert greedy(model, cache, logits, new, ruler.eos_ids(model))[0].tolist() == expected, spec
    assert ruler.plain_answers(model, ids, [question], new) == [expected]
    # the run's own path: the record's prediction is the decoded generate() answer, in both modes, for
    # question-aware and query-agnostic scorers alike
    for mode in ("agnostic", "aware"):
        ids_m, q_m = ruler.mode_prompt(TOK, {**s, "max_new_tokens": new}, mode)
        want = model.generate(torch.tensor([ids_m + q_m]), max_new_tokens=new, do_sample=False,
                              pad_token_id=0)[0, len(ids_m) + len(q_m):]
        # snapkv, expected_attention and kvzip (its reconstruction over the captured context) replay it, and
        # a chunked prefill the compiled model's own chunked forward (a replay would be one pass)
        chunked = kvcompile.load_spec("expected_attention", name="ea_chunked", schedule={"prefill": {"chunk": 256}})
        specs = ["snapkv", "expected_attention", "kvzip", chunked]
        records = ruler.run_group(model, TOK, [{**s, "max_new_tokens": new}], mode, specs, fractions=[1.0])
        assert [r["spec"] for r in records] == ["full", "snapkv", "expected_attention", "kvzip", "ea_chunked"]
        for r in records:
            assert r["prediction"] == TOK.decode(want, skip_special_tokens=True), (mode, r["spec"])


def test_each_phase_of_a_sample_is_announced_as_it_starts(capsys):
    """A RULER sample takes minutes on a real model: the progress says which phase runs (the full cache, then each
    spec at each budget, then their answers' decoding) as it starts, before any of its forwards; `eval --suite ruler` shows it on its bar."""
    model = tiny_for(TOK, seed=1)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    s = {**sample("niah_single_1", length=600), "max_new_tokens": 4}
    notes = []
    ruler.run_group(model, TOK, [s], "aware", ["snapkv", "lava"], fractions=[0.5],
                    note=lambda text: notes.append((text, len(forwards))))
    n = int(notes[0][0].split(", ")[1].split("-token")[0])  # the context's tokens
    assert [text.split(": ", 1)[1] for text, _ in notes] == ["full cache", f"snapkv {n // 2}/head",
                                                             f"lava {n // 2}/head", "2 answers decoding together"]
    assert notes[0][0].startswith("aware, ") and "1 question(s)" in notes[0][0]
    counts = [count for _, count in notes] + [len(forwards)]
    assert counts[0] == 0 and all(a < b for a, b in zip(counts, counts[1:]))  # each note before its phase's work
    ruler.run_ruler(model, TOK, [s], ["snapkv"], modes=("agnostic",), fractions=[0.5])
    err = capsys.readouterr().err
    assert "ruler samples" in err and "agnostic" in err and "full cache" in err and "snapkv" in err


def test_one_context_serves_each_question_from_its_own_copy():
    """Several questions on one context (agnostic): each answer equals the answer of that question alone."""
    model = tiny_for(TOK, seed=1)
    s = sample("niah_multikey_1", length=950)
    group = [{**s, "index": i, "question": q, "max_new_tokens": 6}
             for i, q in enumerate([s["question"], "What is the special magic number for nobody?"])]
    together = ruler.run_group(model, TOK, group, "agnostic", ["snapkv"], fractions=[0.5], full=False)
    for member in group:
        alone = ruler.run_group(model, TOK, [member], "agnostic", ["snapkv"], fractions=[0.5], full=False)
        assert [r["prediction"] for r in together if r["index"] == member["index"]] == \
            [r["prediction"] for r in alone]
    assert len(ruler.context_groups(group)) == 1


# --- end to end: the CLI on a tiny model, both modes ---------------------------------------------

def test_eval_ruler_end_to_end(tmp_path, capsys):
    folder = tmp_path / "tiny"
    model = tiny_for(TOK)
    model.save_pretrained(folder)
    TOK.save_pretrained(folder)
    samples = ruler.ruler_samples(TOK, ["niah_single_1", "fwe"], [700], 1, 0, FILLER)
    data = tmp_path / "ds.jsonl"
    ruler.dump_dataset(samples, data)
    preds = write(tmp_path / "preds.jsonl", [
        {"index": s["index"], "mode": m, "method": "kvpress:snapkv", "fraction": 0.5, "prediction": s["answers"][0]}
        for s in samples for m in ("aware", "agnostic")])
    out = tmp_path / "ruler.json"
    cli.main(["eval", "--suite", "ruler", "--model", str(folder), "--dataset", str(data), "--specs", "snapkv,adakv",
              "--kv-fraction", "0.25,0.5", "--max-new-tokens", "3", "--predictions", str(preds),
              "--out", str(out), "--plot-dir", str(tmp_path / "plots"), "--quiet"])
    assert (tmp_path / "plots" / "ruler_vs_kv.png").stat().st_size > 0
    assert (tmp_path / "plots" / "ruler_heatmap.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "query-aware" in printed and "query-agnostic" in printed and "kvpress:snapkv" in printed
    result = json.loads(out.read_text())
    assert result["suite"] == "ruler" and result["samples"] == 2 and {"model", "date", "args"} <= set(result)
    records = result["ruler"]
    ours = [r for r in records if r["source"] == "kvcompile"]
    # 2 samples x 2 modes x (full + 2 specs x 2 fractions)
    assert len(ours) == 2 * 2 * 5
    fields = {"index", "task", "length", "mode", "spec", "fraction", "per_head", "tokens", "question_tokens",
              "prediction", "answers", "score", "kv_bytes", "kv_bytes_full", "source"}
    assert all(fields <= set(r) for r in records)
    for r in ours:
        if r["spec"] != "full":
            assert r["per_head"] == int(r["fraction"] * r["tokens"])
            assert r["kv_bytes"] < r["kv_bytes_full"]
        assert r["score"] == ruler.score(r["task"], r["prediction"], r["answers"])
    aware = {r["index"]: r["tokens"] for r in ours if r["mode"] == "aware"}
    agnostic = {r["index"]: r["tokens"] for r in ours if r["mode"] == "agnostic"}
    assert all(aware[i] > agnostic[i] for i in aware), "aware mode compresses the question too"
    theirs = [r for r in records if r["source"] == "predictions"]
    assert len(theirs) == 4 and all(r["score"] > 0 for r in theirs)


def test_sharded_run_gathers_the_one_process_records():
    """torchrun's sharding: contexts round-robin over the ranks; the records sorted by key are the
    records of one process, in its order."""
    model = tiny_for(TOK)
    samples = [{**s, "max_new_tokens": 2} for s in ruler.ruler_samples(TOK, ["niah_single_1"], [700], 3, 0, FILLER)]
    one = ruler.run_ruler(model, TOK, samples, [], quiet=True)
    parts = [ruler.run_ruler(model, TOK, samples, [], quiet=True, ranks=cli.Ranks(r, 2)) for r in range(2)]
    assert [len(p) for p in parts] == [2 * 2, 1 * 2]  # contexts 0, 2 and 1; both modes
    gathered = [rec for _, rec in sorted(parts[0] + parts[1], key=lambda pair: pair[0])]

    def unmeasured(records):  # each run's own seconds (ruler.MEASURED) differ; the phases they hold do not
        assert all({k: set(r[k]) for k in ruler.MEASURED} == {k: set(ruler.Phases.NAMES) for k in ruler.MEASURED}
                   for r in records)
        return [{k: v for k, v in r.items() if k not in ruler.MEASURED} for r in records]

    assert unmeasured(gathered) == unmeasured(one)


def test_eval_ruler_argument_errors(capsys):
    for argv, message in ((["--kv-fraction", "0.5", "--budgets", "8"], "not both"),
                          (["--tasks", "qa_1"], "needs SQuAD"),
                          (["--tasks", "nope"], "unknown RULER task"),
                          (["--kv-fraction", "0"], "in \\(0, 1\\]")):
        with pytest.raises(SystemExit):
            cli.main(["eval", "--suite", "ruler", *argv])
        assert re.search(message, capsys.readouterr().err), argv
    with pytest.raises(SystemExit):
        cli.main(["eval", "--tasks", "vt"])
    assert "apply to --suite ruler" in capsys.readouterr().err


def test_the_summary_says_what_its_short_column_names_are():
    """The table's columns are RULER's task names cut to fit (`s1`): a line under it names each one."""
    records = [{"index": i, "task": task, "length": 950, "mode": "agnostic", "spec": "full", "fraction": None,
                "per_head": None, "tokens": 900, "question_tokens": 20, "prediction": "x", "answers": ["1"],
                "score": 1.0, "kv_bytes": 1, "kv_bytes_full": 1, "source": "kvcompile"}
               for i, task in enumerate(["niah_single_1", "niah_multikey_2", "vt"])]
    text = ruler.format_summary(records)
    header = next(line for line in text.splitlines() if line.startswith("method"))
    assert header.split()[2:5] == ["s1", "mkey_2", "vt"]
    assert "columns: s1 = niah_single_1, mkey_2 = niah_multikey_2 (" in text and "vt =" not in text


def test_the_full_cache_answers_from_the_specs_capture_as_from_its_own_prefill():
    """With specs to run, the context is prefilled once: the full cache's answer decodes from the capture's keys and
    values (the model's own forward), and is the answer of the plain model's own prefill."""
    model = tiny_for(TOK, seed=1)
    s = {**sample("niah_single_1", length=700), "max_new_tokens": 8}
    prompts = []
    model.model.register_forward_hook(lambda module, args, kwargs, out: prompts.append(1)
                                      if kwargs.get("input_ids", args[0] if args else None) is not None and
                                      kwargs.get("input_ids", args[0] if args else None).shape[1] > 100 else None,
                                      with_kwargs=True)
    alone = ruler.run_group(model, TOK, [s], "aware", [], full=True)
    assert len(prompts) == 1  # the plain model's prefill
    both = ruler.run_group(model, TOK, [s], "aware", ["snapkv"], fractions=[0.5])
    assert len(prompts) == 2  # one forward over the context more: the capture, for the full cache and snapkv
    full = [r for r in both if r["spec"] == "full"]
    assert [r["prediction"] for r in full] == [r["prediction"] for r in alone] and alone[0]["new_tokens"] == 8
    assert full[0]["kv_bytes"] == alone[0]["kv_bytes"]


def test_every_answer_of_a_context_decodes_together_as_each_alone():
    """run_group decodes every (spec, budget) answer of a context as one batch (sweep.greedy_together): each
    answer is the one its cache gives decoded alone (sweep.greedy), and holds the same bytes after."""
    model = tiny_for(TOK, seed=1)
    s = {**sample("niah_multikey_1", length=800), "max_new_tokens": 10}
    specs = ["snapkv", "tova", "expected_zsmerge", "h2o", "kivi"]
    records = ruler.run_group(model, TOK, [s], "agnostic", specs, fractions=[0.25, 0.5], full=False)
    ids, (q,) = ruler.prompt_ids(TOK, s["context"], [s["question"]], s["answer_prefix"])
    states, _ = capture(model, torch.tensor([ids]))
    assert len(records) == 10
    for r in records:
        policy = dict(ruler.policies_for(r["spec"], len(ids), [r["fraction"]], None))[r["fraction"]]
        cache = replay(policy, model.config, states, headroom=len(q) + 10, model=model, tokenizer=TOK)
        logits = feed(model, cache, torch.tensor([q]), tokenizer=TOK)
        tokens = greedy(model, cache, logits, 10,
                        ruler.eos_ids(model), tokenizer=TOK)[0].tolist()
        assert r["prediction"] == TOK.decode(tokens, skip_special_tokens=True), r["spec"]
        assert r["kv_bytes"] == cache.memory_report()["bytes_held"], r["spec"]
