"""`kvcompile bench` (issue 39): a measured speed-up above the table's own "ideal" column is marked and
explained, not printed without a word; every long phase (loading, the prompt, the warm-up, each policy's run)
says so on stderr as it starts. The model, the prompt and the runs are replaced here by stand-ins that record
what had been said when they were called: the order of work and messages is checked, not how long anything
takes."""
from types import SimpleNamespace

from kvcompile.tools import cli


def run(tok_s: float, prefill: float = 1.0) -> SimpleNamespace:
    return SimpleNamespace(decode_tokens_per_second=tok_s, prefill_seconds=prefill, peak_bytes=2**30,
                           new_tokens=[1] * 8, report={"bytes_held": 10 * 2**20, "bytes_full": 100 * 2**20})


def test_a_speed_up_above_the_ideal_is_marked_and_explained():
    weights = 100 * 2**20
    full = 100 * 2**20
    rows = [("full", run(10.0), full, full),  # ideal 1.00x
            ("snapkv 64/head", run(15.0), 10 * 2**20, full),  # ideal (100+100)/(100+10) = 1.82x: 1.5x below it
            ("lava 64/head", run(30.0), 10 * 2**20, full)]  # 3.0x: above its ideal
    lines = cli.bench_table(rows, weights)
    table = {line.split()[0]: line for line in lines[1:4]}
    assert table["snapkv"].endswith("1.82x") and table["lava"].endswith("1.82x !") and table["full"].endswith("x")
    note = next(line for line in lines if line.startswith("!:"))
    assert "1 measured speed-up(s) above the ideal" in note and "--repeat" in note
    assert not any(line.startswith("!:") for line in cli.bench_table(rows[:2], weights))


def test_bench_says_what_runs_before_each_long_phase(monkeypatch, capsys):
    said = []  # (what was called, stderr printed before the call)
    err = []

    def record(what):
        err.append(capsys.readouterr().err)
        said.append((what, "".join(err)))

    import kvcompile.tools.models as models

    monkeypatch.setattr(cli, "haystack", lambda: "filler")
    monkeypatch.setattr(cli, "load", lambda args: record("load") or ("model", "tokenizer"))
    monkeypatch.setattr(models, "model_summary", lambda model: {"weight_bytes": 100 * 2**20})
    monkeypatch.setattr(cli, "demo_prompt", lambda *a: record("prompt") or SimpleNamespace(length=4000,
                                                                                          input_ids=list(range(4000))))
    monkeypatch.setattr(models, "generate", lambda model, tok, ids, new: record(f"generate {len(ids)}") or run(10.0))
    monkeypatch.setattr(models, "full_kv_bytes", lambda model, n: 100 * 2**20)
    monkeypatch.setattr(cli, "run_policy",
                        lambda model, tok, ids, policy, new, progress: record(policy.name) or run(12.0))
    cli.main(["bench", "--specs", "snapkv,lava", "--repeat", "2"])
    out = capsys.readouterr().out
    calls = [what for what, _ in said]
    assert calls == ["load", "prompt", "generate 64", "generate 4000", "generate 4000", "snapkv", "snapkv", "lava",
                     "lava"]
    before = dict((what, text) for what, text in reversed(said))  # what was said before each first call
    assert "loading the model" in before["load"] and "building a 4000-token prompt" in before["prompt"]
    assert "warm-up" in before["generate 64"]
    assert before["generate 4000"].rstrip().splitlines()[-1].endswith("[1/3] full, run 1 of 2: prefill 4000 tokens, "
                                                                      "decode 32 ...")
    assert before["lava"].rstrip().splitlines()[-1].startswith("bench    [3/3] lava")
    assert "speed-up" in out and "ideal" in out
