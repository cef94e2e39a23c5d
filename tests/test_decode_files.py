"""A decode token's path through kvcompile's files (docs/INTERNALS.md "Layers": the decode-token path), traced by
scripts/decode_files.py: one decode step of the generate path runs Python code in the 4 files INTERNALS lists (the
entry, the cache, the op's decode step, the store that runs its fused step), and nothing on it only passes the
call along (the plan's fields are read, not asked for through a method; entering decoding and pruning,
engine/decode.py, are not on a step's path)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "decode_files.py"
PATH = {"integrations/generate.py", "cache.py", "engine/op.py", "store/pages.py"}
PATHS = {"snapkv": PATH, "zsmerge": PATH}


def files_of_one_step(spec: str) -> set[str]:
    loaded = importlib.util.spec_from_file_location("decode_files", SCRIPT)
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return set(module.files_of_one_step(spec))


@pytest.mark.parametrize("spec", list(PATHS))
def test_a_decode_token_runs_in_the_files_internals_lists(spec):
    assert files_of_one_step(spec) == PATHS[spec]


# KIVI's step is one C++ call too (kernels.tiered_step: the append, a full group's flush into the codes, both tiers'
# attention); the two-tier store hands it its tiers' tensors (store/tiers.py, the float tier's store/pages.py, the
# codes' store/codes.py) and counts the step on both. The step traced here is also the one where the codes' tier
# takes the pages of its next flushes (make_room, the named host read: plan.py names it, the cache counts it).
KIVI = PATH | {"store/tiers.py", "store/codes.py", "kernels/tiered_step.py"}


def test_kivis_decode_token_runs_the_fused_two_tier_step():
    files = files_of_one_step("kivi")
    assert files - {"plan.py"} == KIVI and not files & {"policy.py", "engine/state.py", "engine/online.py"}, \
        sorted(files)
