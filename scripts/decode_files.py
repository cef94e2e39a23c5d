"""The kvcompile files a decode token runs Python code in (docs/INTERNALS.md "Layers"): one decode step of a
compiled tiny random Llama (tests/tiny.py), eager, on this CPU, traced with sys.setprofile.

    python3 scripts/decode_files.py [spec ...]      (default: snapkv zsmerge kivi)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import kvcompile  # noqa: E402
from tiny import tiny_model  # noqa: E402


def files_of_one_step(spec: str) -> dict[str, set[str]]:
    """{file under kvcompile/: the functions called in it} for one decode step after a 64-token prompt."""
    model = tiny_model("llama")
    kvcompile.compile(model, spec, **({"per_head": 48} if spec != "kivi" else {}))
    ids = torch.randint(3, 90, (1, 64), generator=torch.Generator().manual_seed(0))
    out = model.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True)
    seen: dict[str, set[str]] = {}

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and "/kvcompile/" in name:
            seen.setdefault(name.split("/kvcompile/", 1)[1], set()).add(frame.f_code.co_name)

    with torch.no_grad():
        sys.setprofile(profile)
        try:
            model(out.sequences[:, -1:], past_key_values=out.past_key_values, use_cache=True)
        finally:
            sys.setprofile(None)
    return seen


def main(specs: list[str]) -> None:
    for spec in specs:
        seen = files_of_one_step(spec)
        print(f"{spec}: {len(seen)} files")
        for name, functions in sorted(seen.items()):
            print(f"    {name}: {', '.join(sorted(functions))}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["snapkv", "zsmerge", "kivi"])
