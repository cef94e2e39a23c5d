"""Write data/haystack.txt: natural English filler for needle-in-a-haystack tests, offline.

Source: the gensim wheel on PyPI ships test data under gensim/test/test_data/: a shortened
English Wikipedia dump (about 100 articles) and the Lee news corpus.  At set-up time this
script runs `pip download --no-deps gensim` into a temporary folder, reads those files
straight from the wheel (gensim itself is never installed or imported), strips the wiki
markup and writes plain prose: one paragraph per line, a blank line between documents.
Run by `bash scripts/setup.sh demo`; does nothing if the file exists (--force redoes it).
"""
from __future__ import annotations

import argparse
import bz2
import html
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

from kvcompile.tools.data import haystack_path

TEST_DATA = "gensim/test/test_data/"
WIKI_DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
LEE_FILES = ("lee_background.cor", "lee.cor")
END_SECTIONS = {"references", "external links", "see also", "further reading", "notes",
                "bibliography", "sources", "footnotes", "citations"}
MIN_WORDS = 12  # shorter lines are captions, list items or leftovers, not prose


def download_gensim_wheel(folder: Path) -> Path:
    """`pip download --no-deps gensim` into `folder`; the path of the wheel."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary",
                    ":all:", "gensim", "-d", str(folder)], check=True)
    wheels = sorted(folder.glob("gensim-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download gensim produced no wheel in {folder}")
    return wheels[0]


def drop_balanced(text: str, opener: str, closer: str, keep=lambda inner: None) -> str:
    """Remove every outermost `opener … closer` span (nesting counted); where
    keep(inner) returns a string, that string replaces the span instead."""
    out, depth, start, i = [], 0, 0, 0
    while i < len(text):
        if text.startswith(opener, i):
            if depth == 0:
                out.append(text[start:i])
                inner_start = i + len(opener)
            depth += 1
            i += len(opener)
        elif depth and text.startswith(closer, i):
            depth -= 1
            i += len(closer)
            if depth == 0:
                replacement = keep(text[inner_start:i - len(closer)])
                if replacement:
                    out.append(replacement)
                start = i
        else:
            i += 1
    if depth == 0:
        out.append(text[start:])
    return "".join(out)


def link_text(inner: str) -> str | None:
    """[[target|label]] → label, [[target]] → target; files, categories and
    interlanguage links vanish."""
    target = inner.split("|", 1)[0]
    if ":" in target:
        return None
    return inner.rsplit("|", 1)[-1]


def clean_wikitext(text: str) -> list[str]:
    """Plain-prose paragraphs of one article's wikitext."""
    text = html.unescape(text)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"<ref[^>]*/>", "", text)
    text = re.sub(r"<ref[^>]*>.*?</ref>", "", text, flags=re.S)
    text = re.sub(r"<(math|gallery|timeline|source|syntaxhighlight)[^>]*>.*?</\1>", "", text, flags=re.S)
    text = drop_balanced(text, "{{", "}}")
    text = drop_balanced(text, "{|", "|}")
    text = drop_balanced(text, "[[", "]]", keep=link_text)
    text = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", text)
    text = re.sub(r"\[https?://\S+\]", "", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"'{2,}", "", text)
    paragraphs = []
    for line in text.splitlines():
        line = line.strip()
        heading = re.fullmatch(r"=+\s*(.*?)\s*=+", line)
        if heading:
            if heading.group(1).lower() in END_SECTIONS:
                break
            continue
        line = re.sub(r"^[*#:;]+\s*", "", line)
        line = re.sub(r"\(\s*[,;]?\s*\)", "", line)  # parentheses emptied by the removals
        line = re.sub(r"\s+([,.;:])", r"\1", re.sub(r"\s{2,}", " ", line))
        if len(line.split()) >= MIN_WORDS and line[-1] in ".!?\"'":
            paragraphs.append(line)
    return paragraphs


def wiki_articles(dump: bytes) -> list[list[str]]:
    """Main-namespace, non-redirect articles of a MediaWiki XML dump, cleaned."""
    root = ET.fromstring(bz2.decompress(dump))
    ns = root.tag[: root.tag.index("}") + 1]
    articles = []
    for page in root.iter(f"{ns}page"):
        if page.findtext(f"{ns}ns") != "0" or page.find(f"{ns}redirect") is not None:
            continue
        paragraphs = clean_wikitext(page.findtext(f"{ns}revision/{ns}text") or "")
        if paragraphs:
            articles.append(paragraphs)
    return articles


def lee_documents(corpus: bytes) -> list[list[str]]:
    """The Lee news corpus: one document per line, already plain text."""
    return [[line.strip()] for line in corpus.decode("utf-8", "replace").splitlines()
            if len(line.split()) >= MIN_WORDS]


def build_haystack(wheel: Path) -> list[list[str]]:
    with zipfile.ZipFile(wheel) as z:
        docs = wiki_articles(z.read(TEST_DATA + WIKI_DUMP))
        seen = set()
        for name in LEE_FILES:
            for doc in lee_documents(z.read(TEST_DATA + name)):
                if doc[0] not in seen:
                    seen.add(doc[0])
                    docs.append(doc)
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help=f"output file (default {haystack_path()})")
    parser.add_argument("--wheel", type=Path, default=None, help="use this gensim wheel instead of downloading it")
    parser.add_argument("--force", action="store_true", help="rebuild even if the file exists")
    args = parser.parse_args()
    out = args.out or haystack_path()
    if out.is_file() and not args.force:
        print(f"haystack already prepared: {out}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or download_gensim_wheel(Path(tmp))
        docs = build_haystack(wheel)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join("\n".join(doc) for doc in docs) + "\n"
    out.write_text(text, encoding="utf-8")
    print(f"haystack prepared: {out} ({len(docs)} documents, {len(text.split())} words)")


if __name__ == "__main__":
    main()
