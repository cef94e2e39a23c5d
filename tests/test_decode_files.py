"""A decode token's path through kvcompile's files (docs/INTERNALS.md "Layers": the decode-token path), traced by
scripts/decode_files.py: one decode step of the generate path runs Python code in the files INTERNALS lists, and
nothing on it only passes the call along (the plan's fields are read, not asked for through a method; the decode
state is its owner's, engine/decode.py)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "decode_files.py"
ENTRY = {"integrations/generate.py", "cache.py", "engine/op.py", "engine/decode.py"}
PATHS = {"snapkv": ENTRY | {"kernels/append_step.py", "store/pages.py"},
         "zsmerge": ENTRY | {"kernels/online_step.py", "store/pages.py"}}


def files_of_one_step(spec: str) -> set[str]:
    loaded = importlib.util.spec_from_file_location("decode_files", SCRIPT)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return set(module.files_of_one_step(spec))


@pytest.mark.parametrize("spec", list(PATHS))
def test_a_decode_token_runs_in_the_files_internals_lists(spec):
    assert files_of_one_step(spec) == PATHS[spec]


def test_kivis_decode_token_asks_neither_the_policy_nor_the_state_module():
    files = files_of_one_step("kivi")
    assert len(files) <= 13 and not files & {"policy.py", "engine/state.py"}, sorted(files)
