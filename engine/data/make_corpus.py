"""Regenerate ``corpus.txt``: the text the test model's tokenizer is trained on.

The corpus is our own text, produced deterministically from small word lists and sentence
templates (no downloads, no third-party text). It mixes prose, dialogue, numbers, code,
lines of invented words (so a vocabulary of several thousand tokens has enough distinct
words to learn) and some non-ASCII text (accents, CJK, emoji) so that the byte-level BPE
tokenizer learns merges for all of them and multi-byte characters get split across tokens.

Run: ``python engine/data/make_corpus.py`` (writes corpus.txt next to this file).
"""

from __future__ import annotations

import random
from pathlib import Path

TARGET_BYTES = 420_000
LEXICON_SIZE = 6000
SEED = 20240611

NAMES = [
    "Ada",
    "Bram",
    "Chen",
    "Dalia",
    "Emeka",
    "Freya",
    "Goran",
    "Hana",
    "Ivo",
    "Júlia",
    "Kenji",
    "Léa",
    "Mateo",
    "Nadia",
    "Oskar",
    "Priya",
    "Quinn",
    "Rosa",
    "Søren",
    "Tomás",
]
PLACES = [
    "the harbour",
    "the old mill",
    "the library",
    "a quiet valley",
    "the market square",
    "the north tower",
    "the river bank",
    "a small café",
    "the train station",
    "the orchard",
    "the observatory",
    "the workshop",
    "the lighthouse",
    "a crowded street",
    "the garden",
]
NOUNS = [
    "lamp",
    "letter",
    "engine",
    "map",
    "garden",
    "clock",
    "window",
    "river",
    "bridge",
    "notebook",
    "kettle",
    "compass",
    "ladder",
    "violin",
    "bicycle",
    "server",
    "cache",
    "request",
    "token",
    "signal",
    "storm",
    "harvest",
    "mountain",
    "question",
    "answer",
]
ADJS = [
    "quiet",
    "bright",
    "broken",
    "ancient",
    "careful",
    "narrow",
    "golden",
    "patient",
    "sudden",
    "heavy",
    "gentle",
    "curious",
    "distant",
    "hollow",
    "steady",
    "warm",
    "cold",
]
VERBS = [
    "carried",
    "repaired",
    "found",
    "opened",
    "watched",
    "painted",
    "measured",
    "sent",
    "counted",
    "followed",
    "forgot",
    "remembered",
    "built",
    "traded",
    "described",
    "moved",
]
ADVS = [
    "slowly",
    "carefully",
    "at once",
    "without a word",
    "again",
    "before dawn",
    "after supper",
    "in silence",
    "with great care",
    "for the first time",
]
CONNECT = [
    "Then",
    "Later",
    "Meanwhile",
    "After a while",
    "Still",
    "Because of that",
    "In the morning",
    "By evening",
    "Nevertheless",
    "Soon",
]
FOREIGN = [
    "café au lait",
    "naïve façade",
    "crème brûlée",
    "Straße und Brücke",
    "mañana",
    "smörgåsbord",
    "Ωμέγα και άλφα",
    "Добрый вечер",
    "東京の朝",
    "北京欢迎你",
    "안녕하세요",
    "こんにちは世界",
    "🙂 good",
    "🚀 launch",
    "☕ break",
    "ñandú",
    "Łódź",
    "€ 12,50",
    "½ cup",
    "naïveté",
]
CODE = [
    "def {f}(x, y):\n    return x {op} y\n",
    "for i in range({n}):\n    total += values[i] * {m}\n",
    'if {a} > {b}:\n    print("{w}")\nelse:\n    print({n})\n',
    "class {F}:\n    def __init__(self):\n        self.{w} = {n}\n",
    '{{"name": "{w}", "count": {n}, "ok": true}}\n',
    "SELECT {w}, COUNT(*) FROM {w}s WHERE id > {n} GROUP BY {w};\n",
]


ONSETS = [
    "b",
    "br",
    "c",
    "ch",
    "d",
    "dr",
    "f",
    "fl",
    "g",
    "gr",
    "h",
    "j",
    "k",
    "l",
    "m",
    "n",
    "p",
    "pl",
    "qu",
    "r",
    "s",
    "sh",
    "st",
    "t",
    "th",
    "tr",
    "v",
    "w",
    "z",
    "",
]
VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y", "ie"]
CODAS = ["", "", "n", "r", "s", "l", "m", "nd", "st", "x", "ck"]


def _lexicon(rng: random.Random) -> list[str]:
    """Invented words (2-3 syllables), so the tokenizer has many distinct words to merge."""
    words: dict[str, None] = {}
    while len(words) < LEXICON_SIZE:
        n = rng.choice((2, 2, 3))
        words[
            "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(n))
        ] = None
    return list(words)


def _lexicon_line(rng: random.Random, lexicon: list[str]) -> str:
    """A line of invented words drawn with a Zipf-like skew (frequent and rare words)."""
    n = len(lexicon)
    words = [lexicon[min(int(n * rng.random() ** 2.2), n - 1)] for _ in range(rng.randint(6, 16))]
    if rng.random() < 0.5:
        words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice([".", ",", "!", "?", ";"]) + "\n"


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(7)
    n, a, p = rng.choice(NAMES), rng.choice(ADJS), rng.choice(PLACES)
    if kind == 0:
        return f"{n} {rng.choice(VERBS)} the {a} {rng.choice(NOUNS)} {rng.choice(ADVS)}."
    if kind == 1:
        verb, noun = rng.choice(VERBS), rng.choice(NOUNS)
        return f"{rng.choice(CONNECT)}, {n} went to {p} and {verb} a {a} {noun}."
    if kind == 2:
        return (
            f'"Where is the {rng.choice(NOUNS)}?" asked {n}. "Near {p}," said {rng.choice(NAMES)}.'
        )
    if kind == 3:
        count, noun, share = rng.randint(2, 9999), rng.choice(NOUNS), rng.randint(1, 99)
        return f"There were {count} {noun}s at {p}, and {share}% of them were {a}."
    if kind == 4:
        return f"{n} wrote: {rng.choice(FOREIGN)}, {rng.choice(FOREIGN)}."
    if kind == 5:
        noun, adj, verb, adv = (
            rng.choice(NOUNS),
            rng.choice(ADJS),
            rng.choice(VERBS),
            rng.choice(ADVS),
        )
        return f"The {a} {noun} was {adj}, yet {n} {verb} it {adv}."
    num, noun, verb = rng.randint(1, 500), rng.choice(NOUNS), rng.choice(VERBS)
    return f"Question {num}: why is the {noun} {a}? Answer: because {n} {verb} it."


def _code(rng: random.Random) -> str:
    w = rng.choice(NOUNS)
    return rng.choice(CODE).format(
        f=f"{w}_{rng.choice(VERBS)}",
        F=w.capitalize(),
        w=w,
        op=rng.choice("+-*/%"),
        n=rng.randint(0, 4096),
        m=rng.randint(2, 64),
        a=rng.choice("xyzabc"),
        b=rng.choice("xyzabc"),
    )


def generate() -> str:
    rng = random.Random(SEED)
    lexicon = _lexicon(rng)
    parts: list[str] = []
    size = 0
    while size < TARGET_BYTES:
        r = rng.random()
        if r < 0.12:
            block = _code(rng)
        elif r < 0.45:
            block = _lexicon_line(rng, lexicon)
        else:
            block = " ".join(_sentence(rng) for _ in range(rng.randint(2, 7))) + "\n"
        if rng.random() < 0.3:
            block += "\n"
        parts.append(block)
        size += len(block.encode("utf-8"))
    return "".join(parts)


if __name__ == "__main__":
    out = Path(__file__).with_name("corpus.txt")
    out.write_text(generate(), encoding="utf-8")
    print(f"wrote {out} ({out.stat().st_size} bytes)")
