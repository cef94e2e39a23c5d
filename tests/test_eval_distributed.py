"""A sharded `kvcompile eval` (docs/DISTRIBUTED.md, issue 13 item 4): `torchrun --nproc-per-node 2 -m kvcompile
eval ...` shares the prompts round-robin over 2 gloo ranks and rank 0 writes the result file of the
one-process run: the same records in the same order. The fields that measure the process that ran a
record (cli.MEASURED: seconds, tok/s, resident memory) are present in both with the same kinds of
values; everything else is equal. Small: 3 short prompts on the embedded SmolLM2, one thread per process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcompile.tools import cli
from kvcompile.tools.data import SETUP_COMMAND, haystack_path
from kvcompile.tools.models import is_converted

ROOT = Path(__file__).resolve().parent.parent
# 3 prompts (one length, three depths) over 2 ranks: rank 0 runs prompts 0 and 2, rank 1 prompt 1
ARGS = ["eval", "--specs", "snapkv,adakv", "--budgets", "32", "--lengths", "160", "--depths", "0.1,0.5,0.9",
        "--max-new-tokens", "3", "--continuation", "3", "--threads", "1", "--quiet", "--out", "eval.json"]
TIMEOUT = 1800  # seconds for each of the two runs: only stops a run that hangs, whatever the load


def env() -> dict:
    out = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT")}
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    out["OMP_NUM_THREADS"] = "1"
    return out


def run(command: list[str], cwd: Path) -> dict:
    try:
        done = subprocess.run(command, cwd=cwd, env=env(), capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:  # subprocess.run kills the launcher; torchrun's workers die with it
        pytest.fail(f"{' '.join(command[:6])} ... took more than {TIMEOUT} s")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads((cwd / "eval.json").read_text()), done.stdout


def without_measurements(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in cli.MEASURED} for r in records]


@pytest.mark.slow
def test_two_ranks_write_the_file_of_one_process(tmp_path):
    if not is_converted() or not haystack_path().is_file():
        pytest.skip(f"SmolLM2 or the haystack not prepared: run `{SETUP_COMMAND}`")
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one, _ = run([sys.executable, "-m", "kvcompile", *ARGS], tmp_path / "one")
    two, out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "-m", "kvcompile", *ARGS], tmp_path / "two")
    assert "ranks    2 processes, prompts round-robin; needle runs per rank 6, 3" in out  # prompts 0, 2 | 1
    assert len(one["needle"]) == 3 * 3 and len(one["continuation"]) == 1 * 3  # (full, snapkv, adakv) per prompt
    assert {r["spec"] for r in one["needle"]} == {"full", "snapkv", "adakv"}
    assert one.keys() == two.keys()
    for part in ("needle", "continuation"):
        assert [r.keys() for r in two[part]] == [r.keys() for r in one[part]]
        assert without_measurements(two[part]) == without_measurements(one[part]), part
        for a, b in zip(one[part], two[part]):  # a measurement is a number in both, or absent (None) in both
            assert all((a[k] is None) == (b[k] is None) for k in cli.MEASURED if k in a)
    assert {k: v for k, v in two.items() if k not in ("needle", "continuation")} == \
        {k: v for k, v in one.items() if k not in ("needle", "continuation")}  # model, date, args


# --- the environment of a sharded run, checked before the model loads ------------------------------

@pytest.mark.parametrize("variables, message", [
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    ({"WORLD_SIZE": "2"}, "RANK must be between 0 and WORLD_SIZE - 1 = 1, got None"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK must be between 0 and WORLD_SIZE - 1 = 1, got '2'"),
    ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE and RANK must be integers"),
    ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE must be at least 1"),
    ({"WORLD_SIZE": "4", "RANK": "1"}, "4 ranks for 3 prompts (1 lengths x 3 depths): launch at most 3"),
    ({"WORLD_SIZE": "2", "RANK": "1"}, "MASTER_ADDR and MASTER_PORT not set"),
])
def test_a_sharded_environment_that_cannot_run_is_refused(variables, message, monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(cli, "haystack", lambda: "filler")  # no data needed: refused before anything loads
    monkeypatch.setattr(cli, "load", lambda args: pytest.fail("the model must not load"))
    with pytest.raises(SystemExit) as exc:
        cli.main(["eval", "--specs", "snapkv", "--lengths", "200", "--depths", "0.1,0.5,0.9"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_one_rank_is_a_one_process_run(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert cli.eval_ranks() is None
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    assert cli.eval_ranks() is None
    ranks = cli.Ranks(1, 3)
    assert [i for i in range(8) if ranks.mine(i)] == [1, 4, 7]


class Refused(Exception):
    pass


class SentRanks(cli.Ranks):
    """Ranks whose gather keeps what this rank sent and answers as rank `rank` would."""

    def gather(self, parts, error):
        self.sent = (parts, error)
        return None if self.rank else ({k: [r for _, r in v] for k, v in parts.items()}, [len(parts["a"])])


def raising(exc: Exception):
    def work():
        raise exc
    return work


def test_a_run_fails_the_same_way_alone_and_sharded(capsys):
    """`gathered_run`: alone, a refusal exits with its message and any other error raises; sharded, the rank
    sends the refusal's message (or the traceback) instead of records and fails naming itself."""
    refusals = ((Refused, lambda exc: f"refused: {exc}"),)
    assert cli.gathered_run(None, lambda: {"a": [1]}, refusals) == ({"a": [1]}, None)
    with pytest.raises(SystemExit):
        cli.gathered_run(None, raising(Refused("no")), refusals)
    assert "kvcompile: error: refused: no" in capsys.readouterr().err
    with pytest.raises(KeyError):
        cli.gathered_run(None, raising(KeyError("k")), refusals)
    assert cli.gathered_run(SentRanks(0, 2), lambda: {"a": [(0, "x")]}, refusals) == ({"a": ["x"]}, [1])
    assert cli.gathered_run(SentRanks(1, 2), lambda: {"a": [(1, "y")]}, refusals) is None
    for exc, said in ((Refused("no"), "refused: no"), (KeyError("k"), "KeyError: 'k'")):
        ranks = SentRanks(1, 2)
        with pytest.raises(SystemExit):
            cli.gathered_run(ranks, raising(exc), refusals)
        assert ranks.sent[0] == {} and said in ranks.sent[1]
        assert "eval rank 1 of 2 failed:\n" in capsys.readouterr().err
