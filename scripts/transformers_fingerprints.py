"""The fingerprints of the installed transformers under every row of kvcompile's transformers table
(kvcompile/integrations/transformers_patches.py): one JSON object, target -> fingerprint (or the error that
resolving it raised). To add a release: run this under it, run the suite under it, and add the fingerprints
that differ to the table with the release.

    PYTHONPATH=. python3 scripts/transformers_fingerprints.py
"""
from __future__ import annotations

import json

import transformers

from kvcompile.integrations.transformers_patches import PATCHES, fingerprint, resolve


def fingerprints() -> dict:
    out = {}
    for patch in PATCHES:
        for target in (patch.target, *(t for t, _ in patch.relies_on)):
            try:
                out[target] = fingerprint(resolve(target))
            except (ImportError, AttributeError, OSError, TypeError) as exc:
                out[target] = f"{type(exc).__name__}: {exc}"
    return out


if __name__ == "__main__":
    print(json.dumps({"transformers": transformers.__version__, "fingerprints": fingerprints()}, indent=1))
