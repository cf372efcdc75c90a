"""Questions answered with one word, for trying GRPO on a task of your own.

    python benchmarks/own_tasks/make_words.py --out data/own [--seed N]

writes data/own/words_train.jsonl (2,000 rows) and data/own/words_test.jsonl (200 held-out rows), one
{"id", "prompt", "answer", "kind"} per line:

    Which of these words is an animal: chair, mouse, bus, apple? Reply with just the word.   -> "mouse"

Question kinds, drawn evenly: the member of a category among four words, the word that does not belong among
four, the opposite of a word, the plural of a noun, and the day or month before or after another. The last three
have few distinct questions (a few dozen each), so they run out early in the draw and most rows are of the first
two kinds. Score with the custom task's `verifier: word` (case, quotes, markdown and a closing period ignored:
'**Mouse.**' = 'mouse').

Why this task: a short word, not a number or a letter, where a verifier must find the word that ends the reply.
SmolLM2-135M-Instruct knows most of these facts but often answers in a sentence or lists the options, so it
starts above zero and below 80%, with room for GRPO to move it.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Row, main, words  # noqa: E402
from make_choice import CATEGORIES  # noqa: E402

NAME = "words"
INSTRUCTION = "Reply with just the word."
# a word in two categories ('orange': a fruit and a color) would make a question with two right answers
_SHARED = {w for name, ws in CATEGORIES.items() for w in ws
           if any(w in other for o, other in CATEGORIES.items() if o != name)}
GROUPS = {name: [w for w in ws if w not in _SHARED] for name, ws in CATEGORIES.items()}
# (word, its opposite): only pairs whose opposite is the one word a reader would give ('old' -> 'young' or 'new'
# is left out; 'young' -> 'old' is in)
OPPOSITES = [("hot", "cold"), ("cold", "hot"), ("fast", "slow"), ("slow", "fast"), ("happy", "sad"),
             ("sad", "happy"), ("full", "empty"), ("empty", "full"), ("early", "late"), ("late", "early"),
             ("wet", "dry"), ("dry", "wet"), ("rich", "poor"), ("poor", "rich"), ("strong", "weak"),
             ("weak", "strong"), ("clean", "dirty"), ("dirty", "clean"), ("push", "pull"), ("pull", "push"),
             ("up", "down"), ("down", "up"), ("inside", "outside"), ("outside", "inside"), ("day", "night"),
             ("night", "day"), ("win", "lose"), ("buy", "sell"), ("sell", "buy"), ("first", "last"),
             ("black", "white"), ("white", "black"), ("left", "right"), ("north", "south"), ("south", "north"),
             ("east", "west"), ("west", "east"), ("always", "never"), ("never", "always"), ("true", "false"),
             ("false", "true"), ("yes", "no"), ("boy", "girl"), ("girl", "boy"), ("king", "queen"),
             ("queen", "king"), ("brother", "sister"), ("sister", "brother"), ("father", "mother"),
             ("mother", "father"), ("above", "below"), ("below", "above"), ("young", "old"), ("tall", "short"),
             ("thick", "thin"), ("heavy", "light"), ("asleep", "awake"), ("awake", "asleep")]
PLURALS = [("mouse", "mice"), ("child", "children"), ("foot", "feet"), ("tooth", "teeth"), ("man", "men"),
           ("woman", "women"), ("goose", "geese"), ("person", "people"), ("leaf", "leaves"), ("knife", "knives"),
           ("wife", "wives"), ("wolf", "wolves"), ("half", "halves"), ("city", "cities"), ("baby", "babies"),
           ("box", "boxes"), ("bus", "buses"), ("dish", "dishes"), ("cat", "cats"), ("dog", "dogs"),
           ("book", "books"), ("glass", "glasses"), ("story", "stories"), ("potato", "potatoes"),
           ("tomato", "tomatoes"), ("fox", "foxes"), ("church", "churches"), ("life", "lives"), ("ox", "oxen"),
           ("cactus", "cacti"), ("fish", "fish"), ("sheep", "sheep"), ("deer", "deer"), ("party", "parties")]
SEQUENCES = {"day": words("Monday Tuesday Wednesday Thursday Friday Saturday Sunday"),
             "month": words("January February March April May June July August September October November "
                            "December")}


def ask(question: str, answer: str, kind: str) -> Row:
    return Row(f"{question} {INSTRUCTION}", answer, kind)


def member(r: random.Random) -> Row:
    name = r.choice(sorted(GROUPS))
    others = sorted({w for other, ws in GROUPS.items() if other != name for w in ws})
    right = r.choice(GROUPS[name])
    shown = [right, *r.sample(others, 3)]
    r.shuffle(shown)
    return ask(f"Which of these words is {name}: {', '.join(shown)}?", right, "member")


def odd_one_out(r: random.Random) -> Row:
    name = r.choice(sorted(GROUPS))
    others = sorted({w for other, ws in GROUPS.items() if other != name for w in ws})
    odd = r.choice(others)
    shown = [odd, *r.sample(GROUPS[name], 3)]
    r.shuffle(shown)
    return ask(f"Which word does not belong with the others: {', '.join(shown)}?", odd, "odd_one_out")


def opposite(r: random.Random) -> Row:
    word, right = r.choice(OPPOSITES)
    return ask(f'What is the opposite of "{word}"?', right, "opposite")


def plural(r: random.Random) -> Row:
    word, right = r.choice(PLURALS)
    return ask(f'What is the plural of "{word}"?', right, "plural")


def neighbour(r: random.Random) -> Row:
    unit = r.choice(sorted(SEQUENCES))
    names = SEQUENCES[unit]
    i = r.randrange(len(names))
    after = r.random() < 0.5
    right = names[(i + (1 if after else -1)) % len(names)]
    return ask(f"Which {unit} comes {'after' if after else 'before'} {names[i]}?", right, "neighbour")


def draw(r: random.Random) -> Row:
    return r.choice([member, odd_one_out, opposite, plural, neighbour])(r)


if __name__ == "__main__":
    main(NAME, draw, __doc__)
