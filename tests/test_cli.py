"""The `kvcompile` command: help, argument errors, tables and plots; one real run when the
embedded model has been prepared (skipped, naming the set-up command, otherwise)."""
import re
import subprocess
import sys

import pytest

from kvcompile.tools import cli
from kvcompile.tools.data import SETUP_COMMAND, haystack_path
from kvcompile.tools.models import is_converted

COMMANDS = ("run", "eval", "bench", "plot", "specs")


def exit_code(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    out = capsys.readouterr()
    return exc.value.code, out.out + out.err


def test_python_m_kvcompile_help():
    done = subprocess.run([sys.executable, "-m", "kvcompile", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for command in COMMANDS:
        assert re.search(rf"^\s+{command}\s+\S", done.stdout, re.M), command


@pytest.mark.parametrize("command, words", [
    ("run", ["--spec", "--prompt-file", "--model", "--max-new-tokens", "--per-head", "embedded SmolLM2"]),
    ("eval", ["--specs", "--budgets", "--lengths", "--depths", "--plot-dir", "--continuation"]),
    ("bench", ["--specs", "--per-head", "--length", "--new-tokens", "ideal"]),
    ("plot", ["budget-map", "needle", "quality", "--results", "--out"]),
    ("serve", ["--spec", "--per-head", "--kv-tokens", "--max-batch-tokens", "--host", "--port", "max_tokens", "1024"]),
])
def test_subcommand_help(command, words, capsys):
    code, text = exit_code([command, "--help"], capsys)
    assert code == 0
    for word in words:
        assert word in text


@pytest.mark.parametrize("argv, message", [
    ([], "required"),
    (["run", "--per-head", "0"], "positive"),
    (["run", "--depth", "2"], "--depth"),
    (["run", "--spec", "no_such_policy"], "snapkv"),
    (["eval", "--depths", "0.5,1.5"], "between 0 and 1"),
    (["eval", "--budgets", "64,lots"], "integers"),
    (["eval", "--specs", "snapkv,no_such_policy"], "no_such_policy"),
    (["eval", "--suite", "ruler", "--specs", "full", "--no-full"], "nothing to run"),
    (["plot", "needle"], "--results"),
    (["plot", "heatmap"], "invalid choice"),
    # a threshold spec decides its own budget: --per-head is refused as load_spec(per_head=) refuses it
    (["run", "--spec", "dbudgetkv", "--per-head", "64"], "a threshold decides the budget itself"),
    (["plot", "budget-map", "--spec", "dbudgetkv", "--per-head", "64"], "--per-head 64 with spec dbudgetkv"),
    (["run", "--spec", "full", "--per-head", "64"], "does not apply to --spec full"),
    (["serve", "--seed", "1"], "unrecognized arguments: --seed"),  # the demos' needle seed: no meaning to a server
])
def test_argument_errors(argv, message, capsys):
    code, text = exit_code(argv, capsys)
    assert code == 2
    assert message in text


def test_per_head_error_is_the_python_apis(capsys):
    import kvcompile

    with pytest.raises(kvcompile.SpecError) as info:
        kvcompile.load_spec("dbudgetkv", per_head=64)
    code, text = exit_code(["run", "--spec", "dbudgetkv", "--per-head", "64"], capsys)
    assert code == 2 and str(info.value) in text and "Traceback" not in text


def imported_modules(*argv):
    """Top-level modules a fresh `python -m kvcompile ARGV` imports (from -X importtime)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "kvcompile", *argv],
                          capture_output=True, text=True, timeout=120)
    names = {line.rsplit("|", 1)[1].strip().split(".")[0]
             for line in done.stderr.splitlines() if line.startswith("import time:") and "|" in line}
    return done, names


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["run", "--per-head", "0"], []])
def test_help_and_argument_errors_import_no_torch(argv):
    """`kvcompile --help` and argument errors are fast: torch and transformers (seconds to
    import) load inside the commands, not before the arguments are parsed."""
    done, names = imported_modules(*argv)
    assert done.returncode == (0 if "--help" in argv else 2), done.stderr[-2000:]
    assert "kvcompile" in names
    assert not names & {"torch", "transformers", "numpy", "yaml"}, sorted(names & {"torch", "transformers"})


def test_package_names_load_lazily_and_compile_is_the_function():
    """`import kvcompile` stays light; its public names load on first use, and
    `kvcompile.compile` is the function even after the submodule of that name is imported."""
    code = ("import sys, kvcompile\n"
            "assert 'torch' not in sys.modules\n"
            "import kvcompile.integrations.generate, kvcompile.tools.models\n"
            "from kvcompile import compile as f, load_spec, SpecError, KVCompileCache, Policy\n"
            "assert callable(kvcompile.compile) and kvcompile.compile is f and f.__module__ == 'kvcompile.integrations.generate'\n"
            "assert kvcompile.load_spec('lava').budget.per_head == 128\n"
            "assert set(kvcompile.__all__) <= set(dir(kvcompile))\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_specs_into_a_closed_pipe_prints_no_traceback():
    """`kvcompile specs | head -1`: the reader leaves early; no BrokenPipeError traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "kvcompile", "specs"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # before the command writes anything (it first loads every spec)
    err = proc.stderr.read().decode()
    proc.wait(timeout=300)
    assert proc.returncode == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.parametrize("command", ["run", "eval", "bench", "plot"])
def test_quiet_on_every_command_that_loads_a_model(command, capsys):
    code, text = exit_code([command, "--help"], capsys)
    assert code == 0 and "--quiet" in text


def test_quiet_silences_transformers():
    from transformers.utils import logging

    before = (logging.is_progress_bar_enabled(), logging.get_verbosity())
    try:
        cli.quiet_libraries()
        assert not logging.is_progress_bar_enabled()
        assert logging.get_verbosity() == logging.ERROR
    finally:
        (logging.enable_progress_bar if before[0] else logging.disable_progress_bar)()
        logging.set_verbosity(before[1])


def test_missing_haystack_names_setup(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVCOMPILE_HOME", str(tmp_path))
    code, text = exit_code(["run"], capsys)
    assert code == 2 and SETUP_COMMAND in text


def test_specs_lists_the_papers(capsys):
    cli.main(["specs"])
    text = capsys.readouterr().out
    for name in ("snapkv", "pyramidkv", "adakv", "lava", "dbudgetkv", "zsmerge", "streamingllm"):
        assert re.search(rf"^{name}\s", text, re.M), name
    assert re.search(r"^dbudgetkv\s+threshold", text, re.M)
    assert re.search(r"^full\s+all\s+The uncompressed cache", text, re.M)  # the README's `--spec full`


def first_lines():
    import kvcompile
    from kvcompile.spec import available_specs

    return {name: kvcompile.load_spec(name).description.splitlines()[0] for name in available_specs()}


def test_specs_wraps_descriptions_at_word_boundaries(capsys, monkeypatch):
    """Each description's first line is printed whole, wrapped between words (no word cut)."""
    monkeypatch.setenv("COLUMNS", "72")
    cli.main(["specs"])
    lines = capsys.readouterr().out.splitlines()
    col = lines[0].index("The uncompressed")  # the description column (after the longest name and the budget)
    for name, first in first_lines().items():
        start = next(i for i, line in enumerate(lines) if line.split()[:1] == [name])
        assert lines[start][col - 1] == " ", name  # the name and budget columns end before the description
        block = [lines[start][col:]]
        for line in lines[start + 1:]:  # continuation lines, indented under the description column
            if not line.startswith(" " * col) or not line.strip():
                break
            block.append(line[col:])
        assert all(len(line) <= 72 for line in lines[start:start + len(block)])
        assert " ".join(block) == " ".join(first.split()), name


def test_specs_short_cuts_between_words(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "90")
    cli.main(["specs", "--short"])
    out = capsys.readouterr().out
    col = out.index("The uncompressed")  # the description column of the first row (`full`)
    for name, first in first_lines().items():
        line = re.search(rf"^{name}\s.*$", out, re.M).group(0)
        assert len(line) <= 90
        shown = line[col:]
        words = " ".join(first.split())
        if shown.endswith(" ..."):
            kept = shown[:-4]
            assert words.startswith(kept) and words[len(kept)] == " ", (name, shown)  # a whole word ends there
        else:
            assert shown == words, name


def records():
    """Eval-shaped rows over two specs, two budgets, two lengths and depths, plus the full cache."""
    rows = []
    for spec, budgets in (("full", [None]), ("snapkv", [32, 64]), ("lava", [32, 64])):
        for b in budgets:
            for length in (500, 1000):
                for depth in (0.0, 1.0):
                    correct = spec == "full" or (b == 64 and depth == 1.0) or spec == "lava" and length == 500
                    rows.append({"spec": spec, "per_head": b, "length": length, "depth": depth,
                                 "correct": correct})
    return rows


def test_accuracy_table_counts(capsys):
    cli.print_accuracy_table(records())
    lines = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert lines["full"] == ["-", "-", "4/4"]
    assert lines["snapkv"] == ["0/4", "2/4", "-"]
    assert lines["lava"] == ["2/4", "3/4", "-"]


@pytest.mark.parametrize("draw", [cli.plot_needle, cli.plot_quality])
def test_plots_write_png(draw, tmp_path):
    pytest.importorskip("matplotlib", reason=f"plots need matplotlib: run `{SETUP_COMMAND}`")
    path = tmp_path / "out.png"
    draw(records(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_budget_map_png(tmp_path):
    pytest.importorskip("matplotlib", reason=f"plots need matplotlib: run `{SETUP_COMMAND}`")
    import torch

    path = tmp_path / "map.png"
    cli.plot_budget_map(torch.arange(30 * 3).reshape(30, 3), "test", path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_demo_on_the_real_model(capsys):
    """`kvcompile run` end to end: snapkv at 32 tokens per head keeps 32 prompt tokens in
    every layer and head, and holds far less than the full cache."""
    if not is_converted() or not haystack_path().is_file():
        pytest.skip(f"SmolLM2 or the haystack not prepared: run `{SETUP_COMMAND}`")
    cli.main(["run", "--spec", "snapkv", "--per-head", "32", "--length", "500", "--max-new-tokens", "4",
              "--quiet", "--threads", "1"])
    captured = capsys.readouterr()
    out = captured.out
    assert re.search(r"^answer\s+\S", out, re.M)
    assert "Loading weights" not in captured.err and "%|" not in captured.err  # --quiet: no progress bars
    # the full cache beside the policy on the same prompt: answers, KV bytes, decode speed
    assert re.search(r"^answer\s+full cache:\s+\S", out, re.M)
    assert re.search(r"^\s+snapkv 32/head:\s+\S", out, re.M)
    kv_full, kv_held = (float(x) for x in re.search(r"^KV bytes held\s+([\d.]+) MiB\s+([\d.]+) MiB", out, re.M).groups())
    assert kv_held < kv_full / 4
    assert re.search(r"^decode\s+[\d.]+ tok/s\s+[\d.]+ tok/s", out, re.M)
    held, full = (float(x) for x in re.search(r"KV held ([\d.]+) MiB of ([\d.]+) MiB", out).groups())
    assert held < full / 4
    cells = re.findall(r"L(\d+)\s+\[([\d ]+)\]", out)
    assert [int(layer) for layer, _ in cells] == list(range(30))
    assert all(row.split() == ["32", "32", "32"] for _, row in cells)


def test_needle_number_must_stand_alone():
    """A hallucinated digit run that merely contains the needle's number is not an answer."""
    from kvcompile.tools.data import answer_found

    assert answer_found("The secret number of the old library is 8298.", "8298")
    assert answer_found("8298", "8298")
    assert not answer_found("The secret number is 1234567890.", "2345")
    assert not answer_found("It is 82981.", "8298")
    assert answer_found("The password is BLUE.", "blue")


def refused_checkpoint(folder):
    """A tiny Phi (Phi-2) checkpoint, an architecture compile() refuses, with a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PhiConfig, PhiForCausalLM, PreTrainedTokenizerFast

    words = "the old mill kept one number for years".split()
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(folder)
    PhiForCausalLM(PhiConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, max_position_embeddings=2048)).save_pretrained(folder)
    return " ".join(words * 4)


@pytest.mark.parametrize("command", ["run", "eval", "eval-ruler"])
def test_a_model_compile_refuses_is_an_error_not_a_traceback(command, tmp_path, capsys):
    """run and eval (needle, RULER) on a checkpoint whose architecture compile() refuses exit with
    code 2 and compile()'s reason, not a traceback."""
    text = refused_checkpoint(tmp_path / "phi")
    (tmp_path / "prompt.txt").write_text(text)
    model = ["--model", str(tmp_path / "phi"), "--quiet"]
    if command == "run":
        argv = ["run", *model, "--prompt-file", str(tmp_path / "prompt.txt"), "--raw", "--spec", "streamingllm",
                "--no-compare", "--max-new-tokens", "2"]
    else:
        if not haystack_path().is_file():
            pytest.skip(f"no haystack: run `{SETUP_COMMAND}`")
        argv = ["eval", *model, "--specs", "streamingllm", "--lengths", "600", "--max-new-tokens", "2"]
        argv += ["--depths", "0.5"] if command == "eval" else ["--suite", "ruler", "--tasks", "niah_single_1",
                                                               "--samples", "1", "--query", "agnostic", "--no-full",
                                                               "--kv-fraction", "0.5"]
    code, out = exit_code(argv, capsys)
    assert code == 2 and "unsupported model type 'phi'" in out and "Traceback" not in out, out
