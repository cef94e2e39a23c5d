"""The repository's docs stand alone (issue 23): no tracked text file sends a reader outside it.

Every tracked .py, .md, .sh, .yaml and .toml file (`git ls-files`) is scanned for
- the team's private design notes or their folder, which are not part of the repository: the notes'
  file name and any path under the sibling folder they live in (the names are assembled below, so
  this file does not match itself);
- a Markdown link `[text](target)` (in .md files) whose target is not a tracked file or folder,
  relative to the linking file, or whose `#anchor` names no heading of the Markdown file it points at;
- a repository path written in code or prose (docs/<name>.md, benchmarks/<name>.md,
  specs/<name>.yaml, kvcompile/<path>.py, tests/<name>.py, scripts/<name>.py|.sh) that names no
  tracked file.
This file writes its own bad examples in pieces, so that it passes its own scan.
Each failure names the file, the line and what it points at.
"""
from __future__ import annotations

import re
import subprocess
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = (".py", ".md", ".sh", ".yaml", ".toml")

_NOTES = "DES" + "IGN.md"
_FOLDER = "sha" + "red"
# the notes by name; the folder as "../<folder>" or as a path starting with it (not "kvcompile/<folder>/x", not
# "<folder>_x")
PRIVATE = re.compile(re.escape(_NOTES) + r"|(?:\.\./)+" + _FOLDER + r"\b|(?<![\w./-])" + _FOLDER + "/")
# [text](target): target without spaces; images too
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
# repository paths named in text; the look-behind keeps "/work/x/docs/A.md" or "a.docs/..." out
PATH = re.compile(r"(?<![\w./-])((?:docs|benchmarks)/[\w./-]*?\.md|specs/[\w.-]+\.yaml|"
                  r"(?:kvcompile|tests|benchmarks)/[\w/.-]*?\.py|scripts/[\w.-]+\.(?:py|sh))\b")


@lru_cache(maxsize=1)
def tracked() -> tuple[str, ...]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30)
    return tuple(p for p in out.stdout.decode().split("\0") if p)


def folders(files) -> set[str]:
    return {str(parent) for f in files for parent in Path(f).parents if str(parent) != "."}


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*|\*|_(?=\W)|(?<=\W)_", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def problems(files=None, read=None) -> list[str]:
    """Every bad reference in `files` (tracked paths; default: all tracked text files), as
    "path:line: what"; `read(path) -> str` gives a file's text (default: the file on disk)."""
    every = tracked()
    known = set(every) | folders(every)
    files = [f for f in every if f.endswith(TEXT)] if files is None else files
    read = read or (lambda f: (ROOT / f).read_text(encoding="utf-8"))
    out = []
    for name in files:
        text = read(name)
        for number, line in enumerate(text.splitlines(), 1):
            where = f"{name}:{number}"
            for m in PRIVATE.finditer(line):
                out.append(f"{where}: names {m.group(0)!r}, which is not in the repository")
            for m in PATH.finditer(line):
                if m.group(1) not in known:
                    out.append(f"{where}: names {m.group(1)!r}, which is not a tracked file")
            if not name.endswith(".md"):
                continue
            for m in LINK.finditer(line):
                target = m.group(1).strip("<>")
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                    continue
                file_part, _, anchor = target.partition("#")
                linked = (Path(name).parent / file_part) if file_part else Path(name)
                resolved = Path(*_normalise(linked.parts)) if _normalise(linked.parts) else None
                if resolved is None or str(resolved) not in known:
                    out.append(f"{where}: links to {target!r}, which is not a tracked file or folder")
                elif anchor and str(resolved).endswith(".md") and anchor not in anchors(ROOT / resolved):
                    out.append(f"{where}: links to {target!r}: {resolved} has no heading with that anchor")
    return out


def _normalise(parts) -> list[str] | None:
    """Resolve '.' and '..' inside the repository; None for a path that leaves it."""
    stack = []
    for part in parts:
        if part in ("", "."):
            continue
        if part == "..":
            if not stack:
                return None
            stack.pop()
        else:
            stack.append(part)
    return stack


def test_every_reference_stays_inside_the_repository():
    found = problems()
    assert not found, "references that leave the repository or name a missing file:\n" + "\n".join(found)


def test_the_scan_finds_each_kind_of_bad_reference():
    """The checks can fail: a made-up file with one bad reference of each kind, and one with good ones."""
    bad_file, good_file = "docs/" + "BAD.md", "docs/" + "GOOD.md"  # untracked names, never written
    missing = ["docs/" + "MISSING.md", "benchmarks/" + "GONE.md", "specs/" + "unknown_policy.yaml",
               "kvcompile/" + "no_such_module.py"]
    bad = "\n".join([
        "See " + _NOTES + " §2.",
        "Read ../" + _FOLDER + "/notes.md first.",
        "It lives in " + _FOLDER + "/papers/x.pdf.",
        "[spec](../docs/NOPE.md) and [a section](SPECS.md#no-such-heading) and [up](../../outside.md)",
        ", ".join(missing),
    ])
    good = "\n".join([
        "[specs](SPECS.md#1-grammar), [results](../benchmarks/RESULTS.md), [home](../README.md),",
        "[web](https://x.org/a.md)",
        "docs/SPECS.md, benchmarks/RESULTS.md, specs/lava.yaml, kvcompile/plan.py, kvcompile/kvcompile_" + _FOLDER +
        "/x, " + _FOLDER + "_x and /work/docs" + "/x.md are fine",
    ])
    texts = {bad_file: bad, good_file: good}
    found = problems(list(texts), read=texts.__getitem__)
    assert [p for p in found if not p.startswith(bad_file)] == []
    expected = ["BAD.md:1: names '" + _NOTES, "BAD.md:2: names '../" + _FOLDER, "BAD.md:3: names '" + _FOLDER + "/'",
                "'../docs/NOPE.md'", "'SPECS.md#no-such-heading'", "'../../outside.md'",
                *(f"BAD.md:5: names {path!r}" for path in missing)]
    for each in expected:
        assert any(each in p for p in found), (each, found)
    assert len(found) == len(expected), found
