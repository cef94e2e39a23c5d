"""The `kvcompile` command: help, argument errors, tables and plots; one real run when the
embedded model has been prepared (skipped, naming the set-up command, otherwise)."""
import re
import subprocess
import sys

import pytest

from kvcompile import cli
from kvcompile.data import SETUP_COMMAND, haystack_path
from kvcompile.models import is_converted

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
    (["plot", "needle"], "--results"),
    (["plot", "heatmap"], "invalid choice"),
])
def test_argument_errors(argv, message, capsys):
    code, text = exit_code(argv, capsys)
    assert code == 2
    assert message in text


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
    out = capsys.readouterr().out
    assert re.search(r"^answer\s+\S", out, re.M)
    held, full = (float(x) for x in re.search(r"KV held ([\d.]+) MiB of ([\d.]+) MiB", out).groups())
    assert held < full / 4
    cells = re.findall(r"L(\d+)\s+\[([\d ]+)\]", out)
    assert [int(layer) for layer, _ in cells] == list(range(30))
    assert all(row.split() == ["32", "32", "32"] for _, row in cells)


def test_needle_number_must_stand_alone():
    """A hallucinated digit run that merely contains the needle's number is not an answer."""
    from kvcompile.data import answer_found

    assert answer_found("The secret number of the old library is 8298.", "8298")
    assert answer_found("8298", "8298")
    assert not answer_found("The secret number is 1234567890.", "2345")
    assert not answer_found("It is 82981.", "8298")
    assert answer_found("The password is BLUE.", "blue")
