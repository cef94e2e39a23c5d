"""Needle-in-a-haystack prompts on natural English filler, entirely offline.

The filler is data/haystack.txt, written at set-up by scripts/prepare_data.py from the
shortened English Wikipedia dump and the Lee news corpus that the gensim wheel ships as
test data.  A needle (one sentence holding a fact) is inserted at a depth fraction of the
filler, a question about it follows, and the whole is wrapped in the model's chat
template.  The test follows Kamradt's "needle in a haystack" and the LAVa / PyramidKV
papers' use of it: the answer is correct when the generated text contains it.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

from kvcompile.tools.models import home

SETUP_COMMAND = "bash scripts/setup.sh demo"
INSTRUCTION = ("Read the text below. Somewhere in it is one sentence with a secret fact; "
               "answer the question at the end with that fact.")


def haystack_path() -> Path:
    return home() / "data" / "haystack.txt"


def load_haystack(path: str | Path | None = None) -> str:
    """The filler text; a clear error naming the set-up command when it is missing."""
    path = Path(path) if path is not None else haystack_path()
    if not path.is_file():
        raise FileNotFoundError(
            f"no haystack text at {path}: run `{SETUP_COMMAND}` (it builds it once from the "
            "gensim wheel's test data) or pass a text file of your own"
        )
    return path.read_text(encoding="utf-8")


def split_sentences(text: str) -> list[str]:
    """Sentences of plain prose: split after . ! ? followed by white space."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


@dataclass(frozen=True)
class Needle:
    sentence: str
    question: str
    answer: str


# A year ("The {thing} was built in {n}") is a bad needle: Wikipedia filler is full of years and
# SmolLM2 answers with one of them even with the full cache.
NEEDLE_TEMPLATES = (
    ("The secret number of the {thing} is {n}.", "What is the secret number of the {thing}?"),
    ("The password for the {thing} is {n}.", "What is the password for the {thing}?"),
)
THINGS = ("red lighthouse", "old library", "blue bridge", "silver tower", "green castle",
          "stone mill", "glass museum", "north harbour", "white observatory")


def make_needle(seed: int) -> Needle:
    """A fact that no filler text contains: a template, a place and a 4-digit number drawn from `seed`."""
    rng = random.Random(seed)
    sentence, question = rng.choice(NEEDLE_TEMPLATES)
    thing, n = rng.choice(THINGS), str(rng.randint(1000, 9999))
    return Needle(sentence.format(thing=thing, n=n), question.format(thing=thing), n)


@dataclass
class NeedlePrompt:
    text: str  # the prompt, chat template applied
    input_ids: list[int]
    needle: Needle
    depth: float  # requested depth fraction of the filler (0 = start, 1 = end)
    needle_span: tuple[int, int]  # token positions [start, end) of the needle in input_ids
    context: str  # the filler with the needle, before the chat template
    target: int = 0  # the length asked for (the prompt is at most this long)

    @property
    def length(self) -> int:
        return len(self.input_ids)

    @property
    def answer(self) -> str:
        return self.needle.answer


def chat_prompt(tokenizer, context: str, question: str) -> str:
    """The user turn (instruction, text, question) in the model's chat template, ready to
    generate the assistant's answer."""
    return user_turn(tokenizer, f"{INSTRUCTION}\n\n{context}\n\nQuestion: {question} Reply with the number only.")


def user_turn(tokenizer, content: str) -> str:
    """`content` as the user's message in the model's chat template, ready for the
    assistant's reply; plain text with "Answer:" for a model without a template."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                             tokenize=False, add_generation_prompt=True)
    return content + "\nAnswer:"


def _count(tokenizer, sentences: list[str]) -> list[int]:
    """Tokens each sentence takes after a joining space."""
    spaced = [" " + s for s in sentences]
    return [len(ids) for ids in tokenizer(spaced, add_special_tokens=False)["input_ids"]]


def needle_prompt(tokenizer, filler: str, length: int, depth: float, needle: Needle,
                  start: int = 0) -> NeedlePrompt:
    """A prompt of about `length` tokens: filler sentences from sentence `start` on (wrapping
    around), `needle` inserted between sentences at fraction `depth` of the filler tokens,
    then the question.  The needle goes at the sentence boundary nearest to the requested
    depth, so the real depth differs by at most half a sentence."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    sentences = split_sentences(filler)
    if not sentences:
        raise ValueError("the filler text has no sentences")
    overhead = len(tokenizer(chat_prompt(tokenizer, needle.sentence, needle.question),
                             add_special_tokens=False)["input_ids"])
    room = length - overhead
    if room <= 0:
        raise ValueError(f"length {length} is too short: instruction, needle and question "
                         f"alone take {overhead} tokens")
    chosen, used, i = [], 0, start
    while used < room:
        batch = [sentences[(i + j) % len(sentences)] for j in range(64)]
        for sentence, n in zip(batch, _count(tokenizer, batch)):
            if used + n > room and chosen:
                used = room  # stop: one more sentence would overshoot
                break
            chosen.append(sentence)
            used += n
        i += 64
    cumulative = [0]
    for n in _count(tokenizer, chosen):
        cumulative.append(cumulative[-1] + n)
    target = depth * cumulative[-1]
    cut = min(range(len(cumulative)), key=lambda k: abs(cumulative[k] - target))
    context = " ".join(chosen[:cut] + [needle.sentence] + chosen[cut:])
    text = chat_prompt(tokenizer, context, needle.question)
    char_start = text.index(context) + (len(" ".join(chosen[:cut])) + 1 if cut else 0)
    char_end = char_start + len(needle.sentence)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    covered = [t for t, (a, b) in enumerate(offsets) if a < char_end and b > char_start]
    return NeedlePrompt(text, ids, needle, depth, (covered[0], covered[-1] + 1), context, length)


def answer_found(generated: str, answer: str) -> bool:
    """The needle test's score: the expected answer appears in the generated text, as a whole
    number when it is one (a made-up "1234567890" does not contain the needle "2345")."""
    if answer.isdigit():
        return re.search(rf"(?<!\d){answer}(?!\d)", generated) is not None
    return answer.lower() in generated.lower()


def needle_suite(tokenizer, filler: str, lengths, depths, seed: int = 0) -> list[NeedlePrompt]:
    """One prompt per (length, depth): a different needle and filler start for each."""
    n_sentences = max(len(split_sentences(filler)), 1)
    rng = random.Random(seed)
    prompts = []
    for length in lengths:
        for depth in depths:
            needle = make_needle(rng.randrange(1 << 30))
            prompts.append(needle_prompt(tokenizer, filler, length, depth, needle,
                                         start=rng.randrange(n_sentences)))
    return prompts
