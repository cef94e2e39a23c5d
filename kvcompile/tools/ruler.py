"""RULER's synthetic tasks, generated offline, and their evaluation in both query modes.

RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?", NVIDIA/RULER) hides facts in long synthetic contexts and scores the answer by string
match.  This module generates its tasks niah_single_1/2/3, niah_multikey_1/2/3, niah_multivalue,
niah_multiquery, vt, cwe and fwe locally and deterministically from a seed (the task settings,
templates, answer prefixes and tokens to generate are RULER's; docs/EVAL.md says where the
generation differs), builds the prompt exactly as kvpress's pipeline does, and runs the full
cache and every policy in two modes:

- agnostic: the context alone is compressed, then each question (+ end of the user turn +
  answer prefix) goes through its own copy of the compressed cache, then greedy decoding;
- aware: context + question are compressed (kvpress's `query_aware`), then the end of the
  user turn and the answer prefix go through the compressed cache.

A sample is a dict in kvpress's evaluation columns: `index`, `task`, `length`, `context`,
`question`, `answer_prefix`, `answers` (list of gold strings), `max_new_tokens`.
"""
from __future__ import annotations

import copy
import itertools
import json
import math
import numbers
import random
import re
import string
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction
from functools import lru_cache
from pathlib import Path

# --- the tasks: RULER's scripts/synthetic.yaml and scripts/data/synthetic/constants.py ---------

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER: np.round(np.linspace(0, 100, 40))


@dataclass(frozen=True)
class Task:
    """One RULER task: its generator (`kind`) and that generator's settings."""

    name: str
    kind: str  # niah | vt | cwe | fwe
    max_new_tokens: int
    haystack: str = "essay"  # niah, vt: noise | essay | needle
    type_k: str = "words"  # niah keys: words | numbers | uuids
    type_v: str = "numbers"  # niah values
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1
    extra: dict = field(default_factory=dict)


TASKS = {t.name: t for t in [
    Task("niah_single_1", "niah", 128, haystack="noise"),
    Task("niah_single_2", "niah", 128, haystack="essay"),
    Task("niah_single_3", "niah", 128, haystack="essay", type_v="uuids"),
    Task("niah_multikey_1", "niah", 128, haystack="essay", num_k=4),
    Task("niah_multikey_2", "niah", 128, haystack="needle"),
    Task("niah_multikey_3", "niah", 128, haystack="needle", type_k="uuids", type_v="uuids"),
    Task("niah_multivalue", "niah", 128, haystack="essay", num_v=4),
    Task("niah_multiquery", "niah", 128, haystack="essay", num_q=4),
    Task("vt", "vt", 30, haystack="noise", extra={"num_chains": 1, "num_hops": 4}),
    Task("cwe", "cwe", 120, extra={"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
    Task("fwe", "fwe", 50, extra={"alpha": 2.0, "coded_wordlen": 6}),
]}
QA_TASKS = ("qa_1", "qa_2")  # SQuAD / HotpotQA: from a user's file only (--dataset)


@dataclass(frozen=True)
class Text:
    """A generated task text in kvpress's split: what precedes the question, the question, the
    start of the answer, and the gold strings."""

    context: str
    question: str
    answer_prefix: str
    answers: list


# --- word lists ---------------------------------------------------------------------------

@lru_cache(maxsize=None)
def wordlists() -> dict[str, list[str]]:
    """wonderwords' noun, adjective and verb lists (RULER's word source), sorted and deduplicated."""
    try:
        from wonderwords import RandomWord
    except ImportError:
        raise ImportError("RULER's word tasks need the wonderwords package: pip install wonderwords") from None
    rw = RandomWord()
    return {c: sorted(set(rw.filter(include_categories=[c]))) for c in ("nouns", "adjectives", "verbs")}


def haystack_words(text: str) -> list[str]:
    return re.sub(r"\s+", " ", text).strip().split(" ")


def random_value(rng: random.Random, kind: str) -> str:
    """RULER's needle keys and values: a 7-digit number, an adjective-noun pair, a version-4 UUID."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        lists = wordlists()
        return f"{rng.choice(lists['adjectives'])}-{rng.choice(lists['nouns'])}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


# --- the generators: one text for a haystack size -------------------------------------------

def niah_text(task: Task, rng: random.Random, size: int, essay: list[str]) -> Text:
    """RULER's niah.py: needles "One of the special magic {values} for {key} is: {value}." in a
    haystack of `size` noise sentences, essay words or distractor needles."""
    num_k = max(task.num_k, task.num_q)
    keys, values, needles = [], [], []
    for _ in range(num_k):
        keys.append(random_value(rng, task.type_k))
        values.append([random_value(rng, task.type_v) for _ in range(task.num_v)])
        needles += [NEEDLE.format(type_v=task.type_v, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    if task.haystack == "essay":
        from kvcompile.tools.data import split_sentences

        words = (essay * (size // max(len(essay), 1) + 1))[:size]
        sentences = split_sentences(" ".join(words))
        cuts = sorted(int(len(sentences) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
        bounds = [0] + cuts + [len(sentences)]
        parts = []
        for i in range(1, len(bounds)):
            parts.append(" ".join(sentences[bounds[i - 1]:bounds[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        haystack = " ".join(parts)
    else:
        if task.haystack == "noise":
            lines = [NOISE] * size
        else:  # needle: every line a needle with its own random key and value
            lines = [NEEDLE.format(type_v=task.type_v, key=random_value(rng, task.type_k),
                                   value=random_value(rng, task.type_v)) for _ in range(size)]
        for index, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
            lines.insert(index, needle)
        haystack = "\n".join(lines)
    chosen = rng.sample(range(num_k), task.num_q)
    queries = [keys[i] for i in chosen]
    answers = [v for i in chosen for v in values[i]]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    head = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {type_v} afterwards.\n")
    question = "What are all the special magic {type_v} for {query} mentioned in the provided text?"
    prefix = "The special magic {type_v} for {query} mentioned in the provided text are"
    type_v = task.type_v
    if task.num_q * task.num_v == 1:  # RULER's singular wording for one answer
        def singular(t):
            return t.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")
        head, question, prefix, type_v = singular(head), singular(question), singular(prefix), type_v[:-1]
    return Text(head.format(type_v=type_v) + haystack + "\n", question.format(type_v=type_v, query=query),
                prefix.format(type_v=type_v, query=query), answers)


VT_HEAD = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
VT_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {n} variables "
             "are assigned the value {value}, they are: ")


def vt_chain(rng: random.Random, hops: int, letters: int) -> tuple[list[str], list[str], str]:
    """RULER's variable_tracking.py: hops + 1 distinct names of `letters` capitals, the chain
    `VAR A = 12345`, `VAR B = VAR A `, ... and its value."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(hops)]
    return names, chain, value


def vt_body(rng: random.Random, size: int, hops: int, letters: int) -> tuple[str, list[str], str]:
    """`size` noise sentences with the chain's lines inserted in order at random places."""
    names, chain, value = vt_chain(rng, hops, letters)
    size = max(size, len(chain))
    lines = [NOISE] * size
    for j, at in enumerate(sorted(rng.sample(range(size), len(chain)))):
        lines.insert(at + j, chain[j])
    return "\n".join(lines).replace(". \n", ".\n"), names, value


def vt_example(rng: random.Random, size: int, hops: int) -> str:
    """RULER's solved example: the task text, its answer prefix and its answer."""
    body, names, value = vt_body(rng, size, hops, 3)
    return (VT_HEAD + body + "\n" + VT_QUESTION.format(value=value) + " "
            + VT_PREFIX.format(n=hops + 1, value=value) + " " + " ".join(names) + "\n")


def vt_text(task: Task, rng: random.Random, size: int, example_size: int) -> Text:
    """The chain in `size` noise sentences, after one solved example (RULER's in-context
    example: 3-letter names, at most 500 tokens)."""
    hops = task.extra["num_hops"]
    example = vt_example(rng, example_size, hops)
    body, names, value = vt_body(rng, size, hops, 5)
    return Text(example + "\n" + VT_HEAD + body + "\n", VT_QUESTION.format(value=value),
                VT_PREFIX.format(n=hops + 1, value=value), names)


CWE_HEAD = ("Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n")
CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"


def cwe_words(essay: list[str]) -> tuple[list[str], list[str]]:
    """wonderwords' nouns, adjectives and verbs (RULER's list), and the haystack's other words
    (lower case; used only when a list needs more distinct words than wonderwords holds)."""
    lists = wordlists()
    base = sorted(set(lists["nouns"] + lists["adjectives"] + lists["verbs"]))
    known = set(base)
    extra = sorted({w for w in (re.sub(r"[^a-z]", "", w.lower()) for w in essay) if w and w not in known})
    return base, extra


def cwe_list(rng: random.Random, words: tuple[list[str], list[str]], num_words: int, freq: int, ufreq: int,
             num_cw: int):
    base, extra = words
    pool = base if num_words <= len(base) else base + extra
    if num_words > len(pool):
        raise ValueError(f"cwe needs {num_words} distinct words, the word lists hold {len(pool)}")
    chosen = rng.sample(pool, num_words)
    common, rare = chosen[:num_cw], chosen[num_cw:]
    listed = common * freq + rare * ufreq
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), common


def cwe_text(task: Task, rng: random.Random, size: int, length: int, words: tuple[list[str], list[str]]) -> Text:
    """RULER's common_words_extraction.py: `size` distinct words, the 10 common ones repeated
    30 times and the others 3 (6 and 1 below 4096 tokens), after one solved example."""
    x = task.extra
    long = length >= 4096
    example, answer = cwe_list(rng, words, 40 if long else 20, 10 if long else 3, 3 if long else 1, x["num_cw"])
    shot = (CWE_HEAD + example + "\n" + CWE_QUESTION + " " + CWE_PREFIX + " "
            + " ".join(f"{i + 1}. {w}" for i, w in enumerate(answer)))
    listed, common = cwe_list(rng, words, size, x["freq_cw"] if long else 6, x["freq_ucw"] if long else 1,
                              x["num_cw"])
    return Text(shot + "\n" + CWE_HEAD + listed + "\n", CWE_QUESTION, CWE_PREFIX, common)


FWE_HEAD = ("Read the following coded text and track the frequency of each coded word. "
            "Find the three most frequently appeared coded words. ")
FWE_QUESTION = ("Question: Do not provide any explanation. Please ignore the dots '....'. "
                "What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"


def zeta(alpha: float, terms: int = 10000) -> float:
    """Riemann zeta(alpha), alpha > 1: the partial sum plus its Euler-Maclaurin tail."""
    head = sum(k ** -alpha for k in range(1, terms))
    return head + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms ** -alpha


def fwe_text(task: Task, rng: random.Random, size: int, length: int) -> Text:
    """RULER's freq_words_extraction.py: `size` words drawn from a Zipf law (zeta, alpha) over
    (length - tokens to generate) // 50 random 6-letter words; the top one is '...' (noise),
    the answer is the next three."""
    alpha, wordlen = task.extra["alpha"], task.extra["coded_wordlen"]
    vocab_size = max((length - task.max_new_tokens) // 50, 5)
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=wordlen)))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    vocab[0] = "..."
    norm = zeta(alpha)
    words = [w for k, w in enumerate(vocab, start=1) for _ in range(int(size * k ** -alpha / norm))]
    rng.shuffle(words)
    return Text(FWE_HEAD + " ".join(words) + "\n", FWE_QUESTION, FWE_PREFIX, vocab[1:4])


# --- the prompt, as kvpress's pipeline builds it -----------------------------------------------

def split_chat(tokenizer, context: str) -> tuple[str, str]:
    """kvpress's KVPressTextGenerationPipeline.preprocess: (context text, question suffix).

    With a chat template, the user message is context + a separator of '#' (len(context) + 10
    of them), the template is applied with the generation prompt, and the text is split at the
    separator: before it the context text (system prompt, user header, context), after it the
    suffix (end of the user turn, assistant header). Without a template: BOS + context, and "\\n"."""
    if getattr(tokenizer, "chat_template", None) is None:
        return (getattr(tokenizer, "bos_token", None) or "") + context, "\n"
    separator = "#" * (len(context) + 10)
    text = tokenizer.apply_chat_template([{"role": "user", "content": context + separator}],
                                         add_generation_prompt=True, tokenize=False)
    before, suffix = text.split(separator)
    return before, suffix


def prompt_ids(tokenizer, context: str, questions: list[str], answer_prefix: str) -> tuple[list[int], list[list[int]]]:
    """The context's token ids and each question's (question + suffix + answer prefix), each
    tokenized on its own without special tokens, as kvpress does; a context longer than the
    tokenizer's model_max_length is cut to it."""
    before, suffix = split_chat(tokenizer, context)
    ids = tokenizer.encode(before, add_special_tokens=False)
    limit = min(int(getattr(tokenizer, "model_max_length", 0) or 0) or 10**10, 10**10)
    return ids[:limit], [tokenizer.encode(q + suffix + answer_prefix, add_special_tokens=False) for q in questions]


def mode_prompt(tokenizer, sample: dict, mode: str) -> tuple[list[int], list[int]]:
    """(compressed ids, ids fed after compression) of one sample: agnostic compresses the
    context; aware the context + question (kvpress's query_aware: the question joins the
    context and an empty question follows)."""
    if mode == "agnostic":
        ids, (question,) = prompt_ids(tokenizer, sample["context"], [sample["question"]], sample["answer_prefix"])
    elif mode == "aware":
        ids, (question,) = prompt_ids(tokenizer, sample["context"] + sample["question"], [""],
                                      sample["answer_prefix"])
    else:
        raise ValueError(f"mode is 'aware' or 'agnostic', got {mode!r}")
    return ids, question


def prompt_tokens(tokenizer, text: Text) -> int:
    """The longer of the two modes' prompts (they tokenize the question's boundary apart)."""
    sample = {"context": text.context, "question": text.question, "answer_prefix": text.answer_prefix}
    return max(len(a) + len(b) for a, b in (mode_prompt(tokenizer, sample, m) for m in ("agnostic", "aware")))


# --- sizing and the samples ---------------------------------------------------------------

def sample_rng(seed: int, task: str, length: int, index: int) -> random.Random:
    """A sample's own generator: the same sample whatever else is generated."""
    return random.Random(f"ruler:{seed}:{task}:{length}:{index}")


def largest_fitting(fits, start: int) -> int:
    """The largest size n >= 1 with fits(n) (fits is monotone), by doubling then bisection, as
    RULER's binary search over the haystack size; 0 when even size 1 does not fit."""
    if not fits(1):
        return 0
    low, high = 1, max(start, 2)
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def generate_sample(tokenizer, task: str, length: int, seed: int, index: int, filler: str) -> dict:
    """One sample of `task`: the largest haystack whose prompt (as the model receives it) plus the
    task's tokens to generate fit in `length` tokens."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}: one of {', '.join(TASKS)}"
                         + ("; qa_1 and qa_2 need SQuAD / HotpotQA: pass them with --dataset" if task in QA_TASKS else ""))
    t = TASKS[task]
    essay = haystack_words(filler)
    extra = {}
    if t.kind == "vt":  # RULER's solved example: the largest noise haystack within 500 tokens
        def example_fits(n):
            text = vt_example(sample_rng(seed, task + ":example", length, index), n, t.extra["num_hops"])
            return len(tokenizer.encode(text, add_special_tokens=False)) <= 500
        extra["example_size"] = max(largest_fitting(example_fits, 16), t.extra["num_hops"] + 1)
    if t.kind == "cwe":
        extra["words"] = cwe_words(essay)

    def make(n: int) -> Text:
        rng = sample_rng(seed, task, length, index)
        if t.kind == "niah":
            return niah_text(t, rng, n, essay)
        if t.kind == "vt":
            return vt_text(t, rng, max(n, t.extra["num_hops"] + 1), extra["example_size"])
        if t.kind == "cwe":
            return cwe_text(t, rng, max(n, t.extra["num_cw"]), length, extra["words"])
        return fwe_text(t, rng, n, length)

    minimum = {"niah": 1, "vt": t.extra.get("num_hops", 0) + 1, "cwe": t.extra.get("num_cw", 0), "fwe": 1}[t.kind]

    def fits(n: int) -> bool:
        if t.kind == "cwe" and n > sum(map(len, extra["words"])):
            return False
        return prompt_tokens(tokenizer, make(max(n, minimum))) + t.max_new_tokens <= length

    size = largest_fitting(fits, 64)
    if size == 0:
        raise ValueError(f"length {length} is too short for {task}: its smallest prompt and "
                         f"{t.max_new_tokens} tokens to generate do not fit")
    text = make(max(size, minimum))
    return {"index": index, "sample": index, "task": task, "length": length, "context": text.context,
            "question": text.question,
            "answer_prefix": text.answer_prefix, "answers": list(text.answers), "max_new_tokens": t.max_new_tokens}


def ruler_samples(tokenizer, tasks, lengths, samples: int, seed: int, filler: str, progress: bool = False) -> list[dict]:
    """`samples` samples of each task at each length; `index` numbers them 0, 1, ... in the
    order length, task, sample (a row number, kvpress's column), `sample` numbers them within their task and
    length: (task, length, seed, sample) is what a sample is, whatever else a run generates (`sample_id`)."""
    from tqdm.auto import tqdm

    plan = [(length, task, i) for length in lengths for task in tasks for i in range(samples)]
    out = []
    for length, task, i in tqdm(plan, desc="generating samples", unit="sample", disable=not progress):
        out.append(generate_sample(tokenizer, task, length, seed, i, filler))
        out[-1]["index"] = len(out) - 1
        out[-1]["sample"] = i
    return out


def sample_id(s: dict) -> int:
    """A sample's identity within its task, length and seed: `sample` for a generated one (the same content
    under any --samples or --tasks), its `index` for a row of a dataset file (the file's own numbering)."""
    return s.get("sample", s["index"])


# --- scoring: RULER's scripts/eval/synthetic/constants.py, as kvpress's calculate_metrics -------

CONTROL = re.compile(r"[\x00-\x1f]")


def clean(prediction: str) -> str:
    """kvpress's normalisation of a prediction: control characters out, white space stripped."""
    return CONTROL.sub("", prediction.strip()).strip()


def string_match_all(prediction: str, answers: list[str]) -> float:
    """The share of gold strings found in the prediction, case-insensitive."""
    p = clean(prediction).lower()
    return sum(a.lower() in p for a in answers) / len(answers)


def string_match_part(prediction: str, answers: list[str]) -> float:
    """1 when any gold string is found in the prediction, case-insensitive."""
    p = clean(prediction).lower()
    return float(any(a.lower() in p for a in answers))


def score(task: str, prediction: str, answers: list[str]) -> float:
    """RULER's metric of `task`: string_match_part for qa tasks, string_match_all otherwise."""
    return (string_match_part if task.split("_")[0] == "qa" else string_match_all)(prediction, answers)


# --- files: the dataset and other tools' predictions ---------------------------------------

COLUMNS = ("index", "sample", "task", "length", "context", "question", "answer_prefix", "answers", "max_new_tokens")


class DatasetError(ValueError):
    """A dataset or predictions file that cannot be read as documented (docs/EVAL.md)."""


def dump_dataset(samples: list[dict], path) -> None:
    """The samples as JSONL in kvpress's columns (loadable by load_dataset)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps({c: s[c] for c in COLUMNS if c in s}, ensure_ascii=False) + "\n")


_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
         (b"\xfe\xff", "UTF-16"))


def _jsonl_rows(path: Path, what: str = "a dataset is UTF-8 JSONL (one object a line) or Parquet") \
        -> list[tuple[int, dict]]:
    """(line, object) of every non-blank line of a UTF-8 JSONL file (a UTF-8 byte-order mark is allowed);
    DatasetError naming the file and line for another encoding, bytes that are not UTF-8, or a line that is
    not a JSON object (`what`: what the file must be, for the message)."""
    rows = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if line_no == 1:
                for bom, encoding in _BOMS:
                    if raw.startswith(bom):
                        raise DatasetError(f"{path}: the file is {encoding} (it starts with a {encoding} byte-order "
                                           f"mark); {what}: convert it (iconv -f {encoding} -t UTF-8)")
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            if b"\x00" in raw:
                raise DatasetError(f"{path}, line {line_no}: NUL bytes (UTF-16 or UTF-32 without a byte-order "
                                   f"mark?); {what}")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{path}, line {line_no}: not UTF-8 (byte 0x{raw[exc.start]:02x} at byte "
                                   f"{exc.start + 1} of the line); {what}") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise DatasetError(f"{path}, line {line_no}: not JSON ({exc}); {what}") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{path}, line {line_no}: expected a JSON object, got {type(row).__name__}")
            rows.append((line_no, row))
    return rows


def _read_rows(path: Path) -> list[tuple[int | None, dict]]:
    """(line, row) of every row: the JSONL line, None in a Parquet file."""
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    if path.suffix.lower() in (".parquet", ".pq"):
        try:
            import pyarrow.parquet as pq

            return [(None, row) for row in pq.read_table(path).to_pylist()]
        except ImportError:
            pass
        try:
            import pandas

            return [(None, row) for row in pandas.read_parquet(path).to_dict("records")]
        except ImportError:
            raise DatasetError(f"{path}: reading Parquet needs pyarrow (or pandas): pip install pyarrow") from None
        except Exception as exc:
            raise DatasetError(f"{path}: not a readable Parquet file: {exc}") from None
    return _jsonl_rows(path)


def _answers(gold, where: str) -> list[str]:
    """The gold strings: one string, or a list of strings (numbers are written as text)."""
    if isinstance(gold, str):
        return [gold]
    if isinstance(gold, (dict, bytes)) or not hasattr(gold, "__iter__"):
        raise DatasetError(f"{where}: 'answers' must be a string or a list of strings, got {gold!r} "
                           f"({type(gold).__name__})")
    gold = list(gold)
    for a in gold:
        if not isinstance(a, (str, numbers.Integral)) or isinstance(a, bool):
            raise DatasetError(f"{where}: 'answers' must be a string or a list of strings, and holds {a!r} "
                               f"({type(a).__name__})")
    if not gold:
        raise DatasetError(f"{where}: 'answers' is empty")
    return [str(a) for a in gold]


def _max_new_tokens(value, where: str, limit: int | None) -> int:
    """A row's max_new_tokens: an integer in [1, limit] (limit: the model's context, where known)."""
    allowed = f"an integer in [1, {limit}] (the model's context)" if limit else "an integer >= 1"
    number = value if isinstance(value, numbers.Integral) and not isinstance(value, bool) else None
    if isinstance(value, float) and value.is_integer():
        number = int(value)
    if number is None or number < 1 or (limit and number > limit):
        raise DatasetError(f"{where}: 'max_new_tokens' must be {allowed}, got {value!r}")
    return int(number)


def load_dataset(path, max_new_tokens: int | None = None, limit: int | None = None) -> list[dict]:
    """Samples from a JSONL or Parquet file in kvpress's columns: context, question, answers (or
    answer), optional answer_prefix, max_new_tokens, task, index, length. `max_new_tokens`, when
    given, overrides the file's (else the file's, else 128); a file's must be an integer in [1, `limit`]
    (the model's context, where given). Errors name the file and the row (and its line where it is not
    the row's number: blank lines in a JSONL file)."""
    path = Path(path)
    rows = _read_rows(path)
    if not rows:
        raise DatasetError(f"{path}: no rows")
    samples, seen, seen_samples = [], set(), set()
    for i, (line, row) in enumerate(rows):
        where = f"{path}, row {i + 1}" + (f" (line {line})" if line is not None and line != i + 1 else "")
        for column in ("context", "question"):
            if column not in row:
                raise DatasetError(f"{where}: missing column '{column}' (a dataset needs context, question "
                                   "and answers or answer)")
            if not isinstance(row[column], str):
                raise DatasetError(f"{where}: column '{column}' must be text, got {type(row[column]).__name__}")
        gold = row.get("answers", row.get("answer"))
        if gold is None:
            raise DatasetError(f"{where}: missing column 'answers' (or 'answer'): the gold strings")
        gold = _answers(gold, where)
        index = row.get("index", i)
        if not isinstance(index, numbers.Integral) or isinstance(index, bool) or int(index) in seen:
            raise DatasetError(f"{where}: 'index' must be a distinct integer, got {index!r}")
        index = int(index)
        seen.add(index)
        length = row.get("length")
        if length is not None and not isinstance(length, numbers.Integral):
            raise DatasetError(f"{where}: 'length' must be an integer, got {length!r}")
        if max_new_tokens is not None:
            new = max_new_tokens
        elif row.get("max_new_tokens") is None:
            new = 128
        else:
            new = _max_new_tokens(row["max_new_tokens"], where, limit)
        sample = row.get("sample")
        if sample is not None and (not isinstance(sample, numbers.Integral) or isinstance(sample, bool) or sample < 0):
            raise DatasetError(f"{where}: 'sample' must be a non-negative integer, got {sample!r}")
        if sample is not None:
            named = (str(row.get("task") or "dataset"), length, int(sample))
            if named in seen_samples:
                raise DatasetError(f"{where}: 'sample' {sample} is already a sample of task {named[0]!r} at length "
                                   f"{length!r}: a sample's number is distinct within its task and length")
            seen_samples.add(named)
        samples.append({"index": index, **({} if sample is None else {"sample": int(sample)}),
                        "task": str(row.get("task") or "dataset"),
                        "length": None if length is None else int(length), "context": row["context"], "question": row["question"],
                        "answer_prefix": str(row.get("answer_prefix") or ""), "answers": gold,
                        "max_new_tokens": int(new)})
    return samples


PREDICTION_FIELDS = ("index", "mode", "method", "fraction", "prediction")
# optional, with byte_fraction (an equal-bytes run): what the other tool's compressed cache held
BYTES_FIELDS = ("kv_bytes_target", "kv_bytes_entries", "kv_bytes_pages", "kv_entries", "kv_entry_bytes", "kept_share",
                "storage")


def load_predictions(path, samples: list[dict], reserved: set[str]) -> list[dict]:
    """Records scored from another tool's predictions (JSONL: index, mode, method, fraction,
    prediction); `reserved`: method names kvcompile uses in this run (refused)."""
    path = Path(path)
    by_index = {s["index"]: s for s in samples}
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    records = []
    for line_no, row in _jsonl_rows(path, "a predictions file is UTF-8 JSONL (one object a line)"):
        where = f"{path}, line {line_no}"
        missing = [k for k in PREDICTION_FIELDS if not isinstance(row, dict) or k not in row]
        if missing:
            raise DatasetError(f"{where}: missing field(s) {', '.join(missing)} "
                               f"(a prediction is {{{', '.join(PREDICTION_FIELDS)}}})")
        if row["index"] not in by_index:
            raise DatasetError(f"{where}: index {row['index']!r} is not a sample of this run")
        if row["mode"] not in ("aware", "agnostic"):
            raise DatasetError(f"{where}: mode must be 'aware' or 'agnostic', got {row['mode']!r}")
        if row["method"] in reserved:
            raise DatasetError(f"{where}: method {row['method']!r} is also a kvcompile run here; "
                               "name it apart (e.g. 'kvpress:...')")
        fraction = row["fraction"]
        if fraction is not None and (not isinstance(fraction, (int, float)) or not 0 < fraction <= 1):
            raise DatasetError(f"{where}: fraction must be in (0, 1] or null, got {fraction!r}")
        if not isinstance(row["prediction"], str):
            raise DatasetError(f"{where}: prediction must be text")
        byte_fraction = row.get("byte_fraction")
        if byte_fraction is not None and (isinstance(byte_fraction, bool) or
                                          not isinstance(byte_fraction, (int, float)) or not 0 < byte_fraction <= 1):
            raise DatasetError(f"{where}: byte_fraction must be in (0, 1] or null, got {byte_fraction!r}")
        s = by_index[row["index"]]
        fraction = None if fraction is None or fraction == 1 else float(fraction)
        held = {k: row[k] for k in BYTES_FIELDS if row.get(k) is not None}
        if byte_fraction is not None:
            held["byte_fraction"] = float(byte_fraction)
        extra = {k: v for k, v in row.items() if k not in PREDICTION_FIELDS and k not in BYTES_FIELDS
                 and k != "byte_fraction"}
        records.append({"index": s["index"], **({"sample": s["sample"]} if "sample" in s else {}),
                        "task": s["task"], "length": s["length"], "mode": row["mode"],
                        "spec": row["method"], "fraction": fraction, "per_head": None, "tokens": None,
                        "question_tokens": None, "prediction": row["prediction"], "answers": s["answers"],
                        "score": score(s["task"], row["prediction"], s["answers"]), "kv_bytes": None,
                        "kv_bytes_full": None, "source": "predictions", **held, **({"extra": extra} if extra else {})})
    return records


# --- running: full cache and policies, both modes --------------------------------------------

def eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def plain_answers(model, context_ids: list[int], questions: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """kvpress's pipeline without a press: the plain model prefills the context into a
    DynamicCache; each question continues from its own copy, then greedy decoding."""
    return plain_answers_timed(model, context_ids, questions, max_new_tokens)[0]


def plain_answers_timed(model, context_ids: list[int], questions: list[list[int]], max_new_tokens: int,
                        until=None, prefilled=None):
    """plain_answers, with the Phases of the context's prefill and of each question's decode (its
    forward through the cache and the greedy steps). `until(j, tokens)`: question j's answer is complete
    (its decoding stops there, as at EOS). `prefilled`: the context's DynamicCache, where it is made already
    (sweep.dynamic_cache of a capture), not prefilled again."""
    import torch
    from transformers import DynamicCache

    from kvcompile import cache as cache_arg

    stop = eos_ids(model)
    n = len(context_ids)
    device = model.device
    out, decode = [], []
    prefill = Phases()
    with torch.no_grad():
        base = prefilled
        if base is None:
            with prefill.timing("prefill"):
                base = DynamicCache()
                model.model(input_ids=torch.tensor([context_ids], device=device), **cache_arg.given(base))
        for j, q in enumerate(questions):
            clock = Phases()
            clock.start("decode")
            cache = copy.deepcopy(base)
            positions = torch.arange(n, n + len(q), device=device)[None]
            logits = model(input_ids=torch.tensor([q], device=device), **cache_arg.given(cache),
                           position_ids=positions).logits[0, -1]
            tokens = [int(logits.argmax())]
            position = n + len(q)
            while len(tokens) < max_new_tokens and tokens[-1] not in stop and not (until and until(j, tokens)):
                logits = model(input_ids=torch.tensor([[tokens[-1]]], device=device), **cache_arg.given(cache),
                               position_ids=torch.tensor([[position]], device=device)).logits[0, -1]
                tokens.append(int(logits.argmax()))
                position += 1
            out.append(tokens)
            clock.stop()
            decode.append(clock)
    return out, prefill, decode


def answered(tokenizer, samples: list[dict]):
    """until(j, tokens): sample j's answer so far already scores 1, the most RULER's metric gives
    (string_match_all: every gold string is in it; string_match_part: one is). Both metrics only look for
    the gold strings in the text, and more tokens only add text, so an answer that scores 1 scores 1
    whatever follows: stopping there changes no score, only the time spent (docs/EVAL.md)."""
    def until(j: int, tokens: list[int]) -> bool:
        s = samples[j]
        return score(s["task"], tokenizer.decode(tokens, skip_special_tokens=True), s["answers"]) >= 1.0

    return until


MEASURED = ("seconds", "cpu_seconds")  # the fields of a record that are this run's own measurements


class Phases:
    """Wall-clock and CPU (process) seconds by phase of a RULER record: prefill, compress, decode. On a
    shared machine the CPU seconds are the cost; the wall seconds are what a user waits."""

    NAMES = ("prefill", "compress", "decode")

    def __init__(self):
        self.wall = dict.fromkeys(self.NAMES, 0.0)
        self.cpu = dict.fromkeys(self.NAMES, 0.0)
        self._running = None

    def start(self, phase: str) -> None:
        self._running = (phase, time.perf_counter(), time.process_time())

    def stop(self) -> None:
        phase, wall, cpu = self._running
        self.wall[phase] += time.perf_counter() - wall
        self.cpu[phase] += time.process_time() - cpu
        self._running = None

    @contextmanager
    def timing(self, phase: str):
        self.start(phase)
        try:
            yield
        finally:
            self.stop()

    def add(self, other: "Phases") -> None:
        for name in self.NAMES:
            self.wall[name] += other.wall[name]
            self.cpu[name] += other.cpu[name]

    def moved(self) -> "Phases":
        """A Phases holding these seconds; this one back to 0."""
        out = Phases()
        out.add(self)
        self.__init__()
        return out

    def take(self) -> dict:
        """{"seconds": wall by phase, "cpu_seconds": CPU by phase}, rounded to ms; then all back to 0."""
        out = {"seconds": {k: round(v, 3) for k, v in self.wall.items()},
               "cpu_seconds": {k: round(v, 3) for k, v in self.cpu.items()}}
        self.__init__()
        return out


# --- equal bytes: budgets as a share of the full cache's bytes (issue 24) -----------------------
#
# A byte fraction F of a spec whose storage part keeps an entry's key and value in e bytes (codes,
# scales and zero points: Storage.entry_bytes) holds, on a compressed part of n tokens,
#     per_head = floor(F * n * E / e)   entries per KV head and layer,  E = 2 * head_dim * element size
# (E: one entry of the full cache, in the model's dtype), so that its keys and values take
# per_head * L * H * e <= F * (n * L * H * E) bytes, short of it by less than one entry per head.
# Only keys and values count (with their scales and zero points), as for kvpress's QuantizedCache
# (scripts/kvpress_compare.py): kvcompile's 16 bytes of score, position and count beside each entry
# (pages.ENTRY_METADATA_BYTES), its block tables and the unused slots of each head's last page are not
# in the target; the eval prints the page-rounded bytes beside it.

STORAGE_FORMS = re.compile(r"^(int4|int8)(?:g(\d+))?$")
MIXED_FORM = re.compile(r"^mixed(\d+)(?:int(4|8))?(?:g(\d+))?$")  # mixed25int4g32: 25 % of the kept in full precision
KIVI_FORM = re.compile(r"^kivi(4|8)?$")


# kvpress's presses as kvcompile reproduces them entry for entry (benchmarks/RESULTS.md, "Quality: kvpress's
# presses reproduced entry for entry"): press -> (shipped spec, the overrides that set kvpress's settings). An eval
# spec `kvpress:PRESS` runs one (eval_spec), named `kvpress PRESS` in tables and records.
# PyramidKVPress falls back to uniform layers where its smallest layer budget is under its window (below about
# 32 % kept of a 4k prompt); its reproduction follows it (reproduction()). KVzipPress reconstructs the context after
# the chat template's prefix (reconstruct: context, the default): with its default layerwise=False one ranking of
# every layer and head (`kvzip` as shipped), with layerwise=True (kvzip_layerwise) a count per layer without AdaKV's
# floor. ObservedAttentionPress is `observed_attention` (the mean attention a key receives; H2O's own rule is `h2o`).
_SNAP64 = {"scoring": {"window_attention": {"window": 64, "pooling": {"kind": "avg", "kernel": 5}}},
           "ranking": {"by_score": {"window": 64}}}
KVPRESS_REPRODUCTIONS = {
    "snapkv": ("snapkv", {"scoring": {"window_attention": {"window": 64}}, "ranking": {"by_score": {"window": 64}}}),
    "pyramidkv": ("pyramidkv", _SNAP64),
    "adakv_snapkv": ("adakv", _SNAP64),
    "streaming_llm": ("streamingllm", {}),
    "tova": ("tova", {}),
    "knorm": ("knorm", {}),
    "observed_attention": ("observed_attention", {}),
    "expected_attention_uniform": ("expected_attention", {}),
    "expected_attention": ("expected_adakv", {}),
    "kvzip": ("kvzip", {}),
    "kvzip_layerwise": ("kvzip_adakv", {"budget": {"heads": {"pooled": {"floor": 0.0}}}}),
}


def reproduction(press: str, kept_share: float, n: int) -> dict:
    """The spec mapping that reproduces kvpress's `press` keeping `kept_share` of an n-token context's entries."""
    from kvcompile.spec import load_spec, policy_to_mapping

    spec, overrides = KVPRESS_REPRODUCTIONS[press]
    mapping = policy_to_mapping(load_spec(load_spec(spec, **overrides), name=f"kvpress {press}"))
    if press == "pyramidkv" and n is not None and kept_share * n / 20 < 64:  # kvpress: min budget B/beta (beta
        # 20) under its window; another policy, so another name (one name, one definition: RULER records)
        mapping["budget"] = dict(mapping["budget"], layers="uniform")
        mapping["name"] = f"kvpress {press} (uniform layers)"
    return mapping


class BytesError(ValueError):
    """A byte fraction a spec cannot hold (the message says why and what would)."""


KVPRESS = "kvpress:"  # the eval spec of a kvpress press as kvcompile reproduces it: kvpress:snapkv


def eval_spec(text: str, kept_share: float = 1.0, n: int | None = None):
    """The policy of an eval spec: a shipped name or YAML file, or `kvpress:PRESS` (a kvpress press as kvcompile
    reproduces it entry for entry, KVPRESS_REPRODUCTIONS; `kept_share` of an n-token context decides where
    PyramidKVPress falls back to uniform layers), optionally with `@STORAGE` to store its kept entries in another
    precision: `@int8`, `@int4`, `@int4g32` (32 channels per scale and zero point; without `gG` one per entry's
    head dim). Named as written (`snapkv@int4g32`; `kvpress snapkv`)."""
    import kvcompile

    if not isinstance(text, str):  # a Policy, a mapping or a Path: as load_spec takes it
        return kvcompile.load_spec(text)
    base, sep, form = text.partition("@")
    if base.startswith(KVPRESS):
        press = base[len(KVPRESS):]
        if press not in KVPRESS_REPRODUCTIONS:
            raise kvcompile.SpecError("override", None, "spec", f"{text!r}: kvpress has no press {press!r} that "
                                      "kvcompile reproduces", ", ".join(KVPRESS + p for p in KVPRESS_REPRODUCTIONS))
        policy = kvcompile.load_spec(reproduction(press, kept_share, n))
    else:
        policy = kvcompile.load_spec(base)
    if not sep:
        return policy
    match, mixed, kivi = STORAGE_FORMS.match(form), MIXED_FORM.match(form), KIVI_FORM.match(form)
    if match is not None:
        kind, group = match.groups()
        storage = {kind: {"group": int(group)}} if group else kind
    elif mixed is not None:  # MiKV: the highest-scored P % of each head's kept entries in the model's dtype
        percent, bits, group = mixed.groups()
        storage = {"mixed": {"full": int(percent) / 100, "bits": int(bits or 4), "group": int(group or 0)}}
    elif kivi is not None:
        storage = {"kivi": {"bits": int(kivi.group(1) or 4)}}
    else:
        raise kvcompile.SpecError("override", None, "storage",
                                  f"{text!r}: unknown storage {form!r} after '@'",
                                  "int8, int4 (gG for G channels per scale: int4g32), mixedP[int4|int8][gG] "
                                  "(P % of the kept entries in full precision: mixed25int4), kivi, kivi8")
    return kvcompile.load_spec(policy, storage=storage, name=f"{policy.name}@{form}")


def parse_byte_fraction(text: str) -> Fraction:
    """A byte fraction written `1/16` or `0.0625`, in (0, 1]."""
    try:
        value = Fraction(text.strip())
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"a byte fraction is written 1/16 or 0.0625, got {text!r}") from None
    if not 0 < value <= 1:
        raise ValueError(f"a byte fraction is in (0, 1], got {text!r}")
    return value


def byte_label(value) -> str:
    """1/16 for 0.0625; the decimal where no small denominator writes it."""
    f = Fraction(value).limit_denominator(4096)
    return f"{f.numerator}/{f.denominator}" if abs(float(f) - float(value)) < 1e-12 else f"{float(value):.4g}"


def full_entry_bytes(head_dim: int, element_size: int) -> int:
    """Key + value bytes of one entry of the full cache (the model's dtype)."""
    return 2 * head_dim * element_size


def mean_entry_bytes(storage, head_dim: int, element_size: int) -> float:
    """A storage part's key + value bytes per kept entry on average (a tiered part's mix of its tiers)."""
    return storage.mean_entry_bytes(head_dim, element_size)


def head_bytes(storage, k: int, head_dim: int, element_size: int) -> float:
    """Key + value bytes of one head holding k entries under `storage` (Storage.head_bytes: for `mixed`
    round(full * k) of them in the model's dtype and the rest as codes; for `kivi` its last k - L(k) in
    the model's dtype and L(k) as codes, keys' scales per channel shared by `tokens` entries)."""
    return storage.head_bytes(k, head_dim, element_size)


def kept_share_for_bytes(policy, byte_fraction, head_dim: int, element_size: int) -> Fraction:
    """The share of the entries `policy` keeps so that its keys and values take `byte_fraction` of
    the full cache's bytes: F * E / e (e: its storage's mean bytes per entry). Refused (BytesError)
    where it cannot: above 1 (even every entry in its storage takes less) or for a spec whose
    threshold decides its own budget."""
    name = policy.name
    if policy.budget.threshold is not None:
        raise BytesError(f"{name}: its threshold decides how many entries it keeps, so no byte fraction can be "
                         "set; leave it out of an equal-bytes run")
    full = full_entry_bytes(head_dim, element_size)
    e = Fraction(mean_entry_bytes(policy.storage, head_dim, element_size)).limit_denominator(1 << 20)
    share = Fraction(byte_fraction) * full / e
    if share > 1:
        raise BytesError(f"{name} cannot hold {byte_label(byte_fraction)} of the full cache's bytes: it stores an "
                         f"entry's key and value in {float(e):g} bytes against {full} in the model's dtype, so keeping "
                         f"every entry holds only {float(e) / full:.2%} of them; give a byte fraction of at most "
                         f"{byte_label(e / full)}")
    return share


def per_head_for_bytes(policy, n: int, byte_fraction, head_dim: int, element_size: int) -> int:
    """The most entries per KV head and layer whose bytes (head_bytes) stay within `byte_fraction` of the
    bytes of a full cache of n tokens: floor(F * n * E / e) for a one-format storage (BytesError where
    none, or more than n, would)."""
    kept_share_for_bytes(policy, byte_fraction, head_dim, element_size)
    storage = policy.storage
    budget = Fraction(byte_fraction) * n * full_entry_bytes(head_dim, element_size)
    if head_bytes(storage, n, head_dim, element_size) < budget:
        raise BytesError(f"{policy.name} cannot hold {byte_label(byte_fraction)} of the bytes of {n} tokens: keeping "
                         f"all {n} takes less")
    low, high = 0, n  # the largest k with head_bytes(k) <= budget (head_bytes grows with k)
    while low < high:
        mid = (low + high + 1) // 2
        if head_bytes(storage, mid, head_dim, element_size) <= budget:
            low = mid
        else:
            high = mid - 1
    if low < 1:
        raise BytesError(f"{policy.name} at {byte_label(byte_fraction)} of the bytes of {n} tokens keeps no entry "
                         f"per head; give a larger byte fraction or a longer prompt")
    return low


def target_bytes(n: int, byte_fraction, layers: int, kv_heads: int, head_dim: int, element_size: int) -> float:
    """F * (the full cache's key and value bytes for n tokens)."""
    return float(Fraction(byte_fraction) * n * layers * kv_heads * full_entry_bytes(head_dim, element_size))


def policies_for(spec: str, n: int, fractions, budgets, kv_bytes=None,
                 geometry: tuple[int, int] | None = None) -> list[tuple[float | None, "object"]]:
    """(fraction, policy) for each budget of `spec` on a compressed part of n tokens: per_head
    = floor(fraction * n) (at least 1) for each fraction, else each of `budgets` tokens per
    head; a spec whose threshold decides its budget runs once at its own (fraction None).
    `kv_bytes` (byte fractions, with `geometry` = (head_dim, element size)): (byte fraction, policy)
    with per_head_for_bytes (BytesError where the spec cannot hold it)."""
    import kvcompile

    base = eval_spec(spec, 1.0, n)
    if kv_bytes:
        out = []
        for f in kv_bytes:
            per_head = per_head_for_bytes(base, n, f, *geometry)
            try:
                out.append((f, kvcompile.load_spec(eval_spec(spec, per_head / n, n), per_head=per_head)))
            except kvcompile.SpecError as exc:
                raise BytesError(f"{base.name} at {byte_label(f)} of the bytes keeps {per_head} entries per head of "
                                 f"{n}, which it refuses: {exc}") from None
        return out
    if base.budget.threshold is not None:
        return [(None, base)]
    if fractions:
        return [(f, kvcompile.load_spec(eval_spec(spec, f, n), per_head=max(1, math.floor(f * n + 1e-9))))
                for f in fractions]
    return [(None, kvcompile.load_spec(base, per_head=b)) for b in budgets]


def context_groups(samples: list[dict]) -> list[list[dict]]:
    """Samples sharing a context (and answer prefix and max_new_tokens), in first-seen order."""
    groups: dict = {}
    for s in samples:
        groups.setdefault((s["context"], s["answer_prefix"], s["max_new_tokens"]), []).append(s)
    return list(groups.values())


def budget_kinds(fractions=None, budgets=None, kv_bytes=None) -> list[tuple]:
    """The (fractions, budgets, kv_bytes) arguments of policies_for, one kind of budget each, that a run gives every
    spec: shares of the KV kept (or tokens per head), then shares of the full cache's bytes. One run with both kinds
    captures and scores each context once for all of them."""
    kinds = [(fractions, budgets, None)] if fractions or budgets else []
    return kinds + ([(None, None, kv_bytes)] if kv_bytes else [])


def check_budgets(tokenizer, samples: list[dict], specs, modes, fractions=None, budgets=None, kv_bytes=None,
                  geometry=None, source: str = "the samples") -> None:
    """Size every budget the run will compress before any model work: DatasetError naming the shortest row
    (and how many rows are as short) where a spec refuses a budget at a row's prompt length (a fraction of a
    short prompt below the spec's window and sinks, a byte fraction it cannot hold). A RULER or kvpress
    comparison scores every method on the same rows, so a row is never skipped for one spec: the run is
    refused up front instead of failing hours later, and the message says what to change."""
    import kvcompile

    if not specs:
        return
    choices = [(f"{byte_label(b)} of the bytes", (None, None, [b])) for b in kv_bytes or ()]
    if fractions:
        choices += [(f"fraction {f}", ([f], None, None)) for f in fractions]
    else:
        choices += [(f"{b} tokens per head", (None, [b], None)) for b in budgets or ()]
    for mode in modes:
        lengths = []  # (prompt tokens, sample) of every prompt this mode compresses
        for group in context_groups(samples):
            if mode == "agnostic":
                lengths.append((len(prompt_ids(tokenizer, group[0]["context"], [], group[0]["answer_prefix"])[0]),
                                group[0]))
            else:
                lengths += [(len(mode_prompt(tokenizer, s, "aware")[0]), s) for s in group]
        lengths.sort(key=lambda x: x[0])
        ns = sorted({n for n, _ in lengths})
        for spec in specs:
            for label, (f, b, k) in choices:
                def refusal(n):
                    try:
                        policies_for(spec, n, f, b, k, geometry)
                    except (kvcompile.SpecError, BytesError) as exc:
                        return exc
                    return None

                first = refusal(ns[0])
                if first is None:
                    continue
                low, high = 0, len(ns)  # a longer prompt keeps more: the first length that passes
                while low < high:
                    mid = (low + high) // 2
                    low, high = (low, mid) if refusal(ns[mid]) is None else (mid + 1, high)
                short = [s for n, s in lengths if high == len(ns) or n < ns[high]]
                n, shortest = lengths[0]
                raise DatasetError(
                    f"{source}: the row of index {shortest['index']} (task {shortest['task']}) has a {mode} prompt of "
                    f"{n} tokens, too short for {spec} at {label}: {first}. {len(short)} of {len(lengths)} {mode} "
                    f"prompts are that short" + (f" (under {ns[high]} tokens)" if high < len(ns) else "") +
                    ". Every method is scored on the same rows, so none is skipped: drop those rows, give a larger "
                    "fraction or budget, or a spec with a smaller window and sinks")


def record_key(r: dict) -> tuple:
    """A record's key in a records file (kvcompile.tools.ruler_records): (task, sample_id, seed, length, spec, budget,
    mode), budget = budget_key(r)."""
    return (r["task"], sample_id(r), r.get("seed"), r["length"], r["spec"], budget_key(r), r["mode"])


def variant_key(sample: dict, seed, spec: str, budget: tuple, mode: str) -> tuple:
    """The key a record of `sample` under `spec` at `budget` (a budget_key) in `mode` will have."""
    return (sample["task"], sample_id(sample), seed, sample["length"], spec, budget, mode)


def variant_budget(fraction, policy, fractions, budgets, kv_bytes) -> tuple:
    """The budget key (budget_key) of the records `policies_for`'s (fraction, policy) will give."""
    if kv_bytes:
        return ("bytes", float(fraction))
    if policy.budget.threshold is not None:
        return ("own", None)
    if fractions:
        return ("fraction", fraction)
    return ("per_head", policy.budget.per_head)


def run_group(model, tokenizer, group: list[dict], mode: str, specs, fractions=None, budgets=None,
              full: bool = True, kv_bytes=None, seed=None, done=None, emit=None,
              answer_stop: bool = False, note=None) -> list[dict]:
    """Records of one context group in one mode: the full cache, then each spec and budget.
    agnostic: the context is captured once and compressed once per policy; every question
    continues from its own copy. aware: each sample's context + question is captured once and
    compressed once per policy. `kv_bytes`: byte fractions, beside or instead of fractions / budgets (each of
    their records has the target and the bytes the compressed cache holds, before the question).
    `seed`: the samples' seed (None for a dataset file), in each record. `done(key)`: True for the
    records (variant_key) already made, which are skipped (a variant none of
    whose records is wanted runs nothing, not even the capture); `emit(record)`: called with each
    record as soon as it is scored. Each record's `seconds` (wall) and `cpu_seconds` (this process's CPU
    time, all threads): {prefill, compress, decode}, what this record added to the run (the context's
    prefill or capture on the first record that needs it, a policy's compression on its first record, its
    own question and greedy decode), so that their sums are the run's time. `answer_stop`: a greedy answer
    also stops once it scores 1 (`answered`: no score changes); each record's `stop` says why it ended
    ("eos", "answered", or "length": max_new_tokens). `note`: called with a line saying what
    runs next (the full cache, then each spec at each budget) as each phase starts."""
    import torch

    from kvcompile.tools.models import full_kv_bytes, model_summary
    from kvcompile.tools.sweep import capture, dynamic_cache, feed, greedy_together, not_replayable, prefilled, \
        replay

    wanted = (lambda s, spec, budget: True) if done is None else \
        (lambda s, spec, budget: not done(variant_key(s, seed, spec, budget, mode)))
    stop = eos_ids(model)
    max_new = group[0]["max_new_tokens"]
    if mode == "agnostic":
        units = [(prompt_ids(tokenizer, group[0]["context"], [s["question"] for s in group],
                             group[0]["answer_prefix"]), group)]
    else:
        units = [((ids, [q]), [s]) for s in group for ids, q in [mode_prompt(tokenizer, s, "aware")]]
    records = []
    shape = model_summary(model)
    geometry = (shape["head_dim"], next(model.parameters()).element_size())
    kinds = budget_kinds(fractions, budgets, kv_bytes)

    owed = Phases()  # the seconds the next record carries

    def record(s, spec, fraction, per_head, n, q, tokens, kv, kv_full, held=None, decode=None, definition=None):
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if decode is not None:
            owed.add(decode)
        value = score(s["task"], text, s["answers"])
        ended = "eos" if tokens and tokens[-1] in stop else \
            "answered" if answer_stop and value >= 1 and len(tokens) < max_new else "length"
        out = {"index": s["index"], **({"sample": s["sample"]} if "sample" in s else {}),
               "task": s["task"], "length": s["length"], "seed": seed, "mode": mode,
               "spec": spec, "fraction": fraction, "per_head": per_head, "tokens": n, "question_tokens": len(q),
               "prediction": text, "answers": s["answers"], "score": value,
               "kv_bytes": kv, "kv_bytes_full": kv_full, "source": "kvcompile", "new_tokens": len(tokens), "stop": ended,
               **({"definition": definition} if definition is not None else {}), **owed.take(), **(held or {})}
        if emit is not None:
            emit(out)
        return out

    for (ids, questions), members in units:
        n = len(ids)
        say = (lambda what: note(f"{mode}, {n}-token context, {len(questions)} question(s): {what}")) if note \
            else (lambda what: None)
        context = torch.tensor([ids], device=model.device)
        headroom = max(map(len, questions)) + max_new
        states = None
        pending = []  # (sample, question, policy, fraction, per_head, held, cache, logits, Phases) to decode
        if full:
            todo = [j for j, s in enumerate(members) if wanted(s, "full", ("own", None))]
            if todo:
                say("full cache")
                prompt = None
                if specs:  # the specs' capture is the plain model's prefill, keys and values bit for bit: one forward
                    with owed.timing("prefill"):
                        states, _ = capture(model, context)
                    prompt = dynamic_cache(states)  # (None for a hybrid model: its own prefill)
                answers, prefill, decode = plain_answers_timed(
                    model, ids, [questions[j] for j in todo], max_new,
                    answered(tokenizer, [members[j] for j in todo]) if answer_stop else None, prefilled=prompt)
                owed.add(prefill)
                for j, tokens, seconds in zip(todo, answers, decode):
                    held = full_kv_bytes(model, n + len(questions[j]) + len(tokens) - 1)
                    records.append(record(members[j], "full", None, None, n, questions[j], tokens, held, held,
                                          decode=seconds))
        if not specs:
            continue

        def compressed(policy):
            nonlocal states
            if not_replayable(policy):  # chunked prefill: the model's own forward
                with owed.timing("compress"):
                    return prefilled(model, policy, context, headroom, tokenizer=tokenizer)[0]
            if states is None:
                with owed.timing("prefill"):
                    states, _ = capture(model, context)
            with owed.timing("compress"):  # (kvzip: its reconstruction, once per context and scorer)
                return replay(policy, model.config, states, headroom=headroom, model=model, tokenizer=tokenizer)

        for spec, (fractions_, budgets_, kv_bytes_) in itertools.product(specs, kinds):
            for fraction, policy in policies_for(spec, n, fractions_, budgets_, kv_bytes_, geometry):
                per_head = policy.budget.per_head if policy.budget.threshold is None else None
                budget = variant_budget(fraction, policy, fractions_, budgets_, kv_bytes_)
                todo = [j for j, s in enumerate(members) if wanted(s, policy.name, budget)]
                if not todo:
                    continue
                say(f"{policy.name} " + (f"{per_head}/head" if per_head is not None else "(its threshold)"))
                base = compressed(policy)
                held = None
                if kv_bytes_:  # the compressed context's bytes, before any question or answer is appended
                    report = base.memory_report()
                    kept = int(report["kept"].sum())
                    held = {"byte_fraction": float(fraction), "storage": policy.storage.name,
                            "kv_bytes_target": target_bytes(n, fraction, shape["layers"], len(report["kv_heads"]),
                                                            *geometry),
                            "kv_entries": kept, "kv_bytes_entries": report["bytes_entries"],
                            "kv_bytes_pages": report["bytes_held"], "kv_entry_bytes": report["bytes_entries"] // kept,
                            "kept_share": kept / (n * shape["layers"] * len(report["kv_heads"]))}
                    fraction = None
                spent = owed.moved()  # this variant's capture and compression: its first record's
                for j in todo:  # each question from its own copy of the compressed context
                    decode, spent = spent, Phases()
                    with decode.timing("decode"):
                        cache = base if j == todo[-1] else copy.deepcopy(base)
                        logits = feed(model, cache, torch.tensor([questions[j]], device=model.device),
                                      tokenizer=tokenizer)
                    pending.append((members[j], questions[j], policy, fraction, per_head, held, cache, logits,
                                    decode))
        states = None  # this context's captured states go before the next context is captured
        if pending:  # every answer of the context decodes together (sweep.greedy_together: as each alone)
            say(f"{len(pending)} answers decoding together")
            until = None
            if answer_stop:
                until = (lambda i, tokens: answered(tokenizer, [pending[i][0]])(0, tokens))
            answers, seconds = greedy_together(model, [p[6] for p in pending], [p[7] for p in pending], max_new,
                                               stop, until=until, tokenizer=tokenizer)
            for (s, q, policy, fraction, per_head, held, cache, _, decode), tokens, (wall, cpu) \
                    in zip(pending, answers, seconds):
                decode.wall["decode"] += wall
                decode.cpu["decode"] += cpu
                report = cache.memory_report()
                records.append(record(s, policy.name, fraction, per_head, n, q, tokens, report["bytes_held"],
                                      report["bytes_full"], held, decode=decode, definition=policy.definition()))
            pending = []
    return records


def run_ruler(model, tokenizer, samples: list[dict], specs, modes=("aware", "agnostic"), fractions=None,
              budgets=None, full: bool = True, quiet: bool = False, ranks=None, kv_bytes=None, seed=None,
              done=None, emit=None, answer_stop: bool = False):
    """Every record of `samples` in each mode; with `ranks` (a sharded eval) only the context
    groups `ranks.mine(g)` gives this process, as (key, record) pairs ordered as one process
    orders them (Ranks.gather sorts by key). `seed`, `done`, `emit`, `answer_stop`: run_group's."""
    from tqdm.auto import tqdm

    if not fractions and not budgets and not kv_bytes and specs:
        raise ValueError("give fractions (KV kept), byte fractions or budgets (tokens per head) for the specs")
    groups = context_groups(samples)
    mine = [g for g in range(len(groups)) if ranks is None or ranks.mine(g)]
    out = []
    bar = tqdm(total=sum(len(groups[g]) for g in mine) * len(modes), desc="ruler samples", unit="sample",
               disable=quiet)
    for g in mine:
        for m, mode in enumerate(modes):
            for r, rec in enumerate(run_group(model, tokenizer, groups[g], mode, specs, fractions, budgets, full, kv_bytes,
                                              seed, done, emit, answer_stop,
                                              note=bar.set_postfix_str)):
                out.append(((g, m, r), rec))
            bar.update(len(groups[g]))
    bar.close()
    return [rec for _, rec in out] if ranks is None else out


# --- summaries ------------------------------------------------------------------------------

def budget_key(r: dict):
    """The budget column of a record: its byte fraction, its fraction, else its tokens per head
    (None: own / full)."""
    if r.get("byte_fraction") is not None:
        return ("bytes", r["byte_fraction"])
    if r["fraction"] is not None:
        return ("fraction", r["fraction"])
    if r["spec"] != "full" and r["source"] == "kvcompile" and r["per_head"] is not None:
        return ("per_head", r["per_head"])
    return ("own", None)


def budget_text(key) -> str:
    kind, value = key
    if kind == "bytes":
        return f"{byte_label(value)} B"
    return f"{value:.0%} KV" if kind == "fraction" else f"{value}/head" if kind == "per_head" else "-"


def summary(records: list[dict]) -> dict:
    """{mode: {(method, budget key): {task: mean score in percent, "average": mean of the tasks}}}."""
    out: dict = {}
    for r in records:
        out.setdefault(r["mode"], {}).setdefault((r["spec"], budget_key(r)), {}).setdefault(r["task"], []).append(r["score"])
    for mode, rows in out.items():
        for key, tasks in rows.items():
            means = {t: 100 * sum(v) / len(v) for t, v in tasks.items()}
            means["average"] = sum(means.values()) / len(means)
            rows[key] = means
    return out


def format_summary(records: list[dict]) -> str:
    """The summary table, one block per mode: rows method x budget, columns tasks and average."""
    lines = []
    table = summary(records)
    held = held_bytes(records)
    width = max([22] + [len(r["spec"]) + 2 for r in records])  # the method column fits the longest name
    tasks = list(dict.fromkeys(r["task"] for r in records))
    short = {t: t.replace("niah_", "").replace("multi", "m").replace("single_", "s") for t in tasks}
    for mode in ("aware", "agnostic"):
        if mode not in table:
            continue
        rows = table[mode]
        lines.append(f"\nRULER score (%), query-{mode}:")
        lines.append(f"{'method':<{width}}{'budget':>9}" + "".join(f"{short[t]:>9}" for t in tasks) + f"{'average':>9}")
        if held:  # equal bytes: rows grouped by byte fraction (largest first), then method
            order = sorted(rows, key=lambda k: (k[1][0] != "own", -(k[1][1] or 0), k[0]))
        else:
            order = sorted(rows, key=lambda k: (k[0] != "full", k[0], k[1][0], k[1][1] or 0))
        if held:
            lines[-1] += f"{'kept':>7}{'target KiB':>12}{'held KiB':>10}{'held/tgt':>9}{'pages KiB':>11}"
        for spec, key in order:
            cells = [f"{rows[(spec, key)][t]:>9.1f}" if t in rows[(spec, key)] else f"{'-':>9}" for t in tasks]
            line = f"{spec:<{width}}{budget_text(key):>9}" + "".join(cells) + f"{rows[(spec, key)]['average']:>9.1f}"
            if held and (mode, spec, key) in held:
                h = held[(mode, spec, key)]
                pages = f"{h['pages'] / 1024:>11.1f}" if h["pages"] is not None else f"{'-':>11}"
                line += (f"{h['share']:>7.1%}{h['target'] / 1024:>12.1f}{h['entries'] / 1024:>10.1f}"
                         f"{h['entries'] / h['target']:>9.4f}" + pages)
            lines.append(line)
    shortened = [f"{short[t]} = {t}" for t in tasks if short[t] != t]
    if shortened:  # the columns are RULER's task names, cut to fit
        lines.append("\ncolumns: " + ", ".join(shortened) + " (RULER's tasks: s = niah_single, the needle-in-a-haystack "
                     "tasks with one needle; mkey, mvalue, mquery = niah_multikey, _multivalue, _multiquery)")
    if held:
        lines.append("\nkept: share of the compressed part's entries kept; target: the byte fraction of the full "
                     "cache's key and value bytes (model dtype); held: the keys and values (codes, scales, zero "
                     "points) the compressed cache holds before the question, mean per sample; pages: the bytes its "
                     "tensors take (kvcompile: whole pages, each head's last page counted whole; kvpress: every "
                     "entry stored, masked ones included); kvcompile's 16 bytes of score, position and count per "
                     "entry are in neither (docs/EVAL.md, Equal bytes)")
    return "\n".join(lines)


def held_bytes(records: list[dict]) -> dict:
    """{(mode, method, budget key): mean target, held (entries) and page bytes and kept share} of the
    records that carry an equal-bytes measurement."""
    sums: dict = {}
    for r in records:
        if r.get("kv_bytes_target") is None or r.get("kv_bytes_entries") is None:
            continue
        acc = sums.setdefault((r["mode"], r["spec"], budget_key(r)), {"target": 0.0, "entries": 0.0, "pages": 0.0,
                                                                      "share": 0.0, "n": 0, "paged": True})
        acc["target"] += r["kv_bytes_target"]
        acc["entries"] += r["kv_bytes_entries"]
        acc["share"] += r.get("kept_share") or 0.0
        if r.get("kv_bytes_pages") is None:
            acc["paged"] = False
        else:
            acc["pages"] += r["kv_bytes_pages"]
        acc["n"] += 1
    return {k: {"target": v["target"] / v["n"], "entries": v["entries"] / v["n"], "share": v["share"] / v["n"],
                "pages": v["pages"] / v["n"] if v["paged"] else None} for k, v in sums.items()}


def plot_ruler(records: list[dict], plot_dir, heatmap_fraction: float = 0.25) -> list[Path]:
    """ruler_vs_kv.png (score against KV kept, one line per method, one panel per mode, full
    cache dashed) and ruler_heatmap.png (task x method at one budget, one panel per mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = summary(records)
    modes = [m for m in ("aware", "agnostic") if m in table]
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.2), squeeze=False)
    uses_fraction = any(r["fraction"] is not None for r in records)
    uses_bytes = any(r.get("byte_fraction") is not None for r in records)
    for ax, mode in zip(axes[0], modes):
        rows = table[mode]
        for spec in dict.fromkeys(k[0] for k in rows):
            points = sorted((k[1][1], v["average"]) for k, v in rows.items() if k[0] == spec and k[1][0] != "own")
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=spec)
            else:
                ax.axhline(rows[(spec, ("own", None))]["average"], linestyle="--",
                           color="grey" if spec == "full" else None,
                           label="full cache" if spec == "full" else f"{spec} (own budget)")
        ax.set_xlabel("share of the full cache's KV bytes held" if uses_bytes else
                      "KV fraction kept" if uses_fraction else "budget (tokens per KV head)")
        if uses_bytes or not uses_fraction:
            ax.set_xscale("log", base=2)
        ax.set_ylabel("RULER score (%, mean over tasks)")
        ax.set_ylim(-3, 103)
        ax.set_title(f"query-{mode}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    curve = out / "ruler_vs_kv.png"
    fig.savefig(curve, dpi=120)
    plt.close(fig)

    keys = sorted({budget_key(r) for r in records if budget_key(r)[0] != "own"}, key=lambda k: k[1])
    target = min(keys, key=lambda k: abs(k[1] - heatmap_fraction)) if uses_fraction and keys else \
        (keys[len(keys) // 2] if keys else ("own", None))
    tasks = list(dict.fromkeys(r["task"] for r in records))
    fig, axes = plt.subplots(1, len(modes), figsize=(1.2 + 0.9 * len(tasks) * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        rows = table[mode]
        methods = [k for k in rows if k[1] == target or k[1][0] == "own"]
        grid = np.array([[rows[k].get(t, np.nan) for t in tasks] for k in methods])
        ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(tasks)), tasks, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(methods)), [k[0] for k in methods], fontsize=7)
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=6)
        ax.set_title(f"query-{mode}, {budget_text(target)}", fontsize=9)
    fig.tight_layout()
    heat = out / "ruler_heatmap.png"
    fig.savefig(heat, dpi=120)
    plt.close(fig)
    return [curve, heat]
