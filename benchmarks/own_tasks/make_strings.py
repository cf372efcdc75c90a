"""Questions about the prompt's own letters and words, for trying GRPO on a task of your own.

    python benchmarks/own_tasks/make_strings.py --out data/own [--seed N]

writes data/own/strings_train.jsonl (2,000 rows) and data/own/strings_test.jsonl (200 held-out rows), one
{"id", "prompt", "answer", "kind"} per line:

    What is the last word in this list: pillow, rocket, garden, mirror? Reply with just the word.   -> "mirror"

Question kinds, drawn evenly: the first or the last word of a list of three to six words, the first or the last
letter of a word, the word of three that comes first in alphabetical order, and the longest word of four. The two
letter kinds have one question per word and letter end (a few hundred), so they run out early in the draw and most
rows are of the four list kinds. Score with the custom task's `verifier: word` (case, quotes, markdown and a
closing period ignored: '"R".' = 'r').

Why this task: the answer is read off the question itself, not recalled (the one-word task) or computed (the
conversions), and a subword tokenizer hides the letters it asks about. SmolLM2-135M-Instruct finds the first
letter of a word most of the time and the last one seldom, and often names a word of the list other than the one
asked for, so it starts above zero and below 80%, with room for GRPO to move it.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Row, main, words  # noqa: E402

NAME = "strings"
# everyday nouns of 3 to 8 letters, lowercase ASCII, each once
NOUNS = words(
    "lamp river cloud stone garden window pencil bottle mirror candle forest ladder basket jacket pillow rocket "
    "button carpet tunnel violin apple bridge castle dragon engine feather guitar hammer island jungle kettle "
    "lemon magnet needle orange parrot rabbit saddle tomato umbrella valley wagon yogurt zebra anchor blanket "
    "cactus desert eagle finger glove helmet insect jigsaw kitten lizard monkey napkin ocean pepper quilt "
    "ribbon spoon tiger velvet walnut barrel cabin dolphin elbow fountain goblet harbor iceberg jewel kayak "
    "lantern meadow nutmeg oyster pebble puzzle raven shovel thimble tulip vessel whistle acorn beetle cherry "
    "donkey falcon ginger hedge igloo jelly koala locket marble noodle orchid pirate rooster sailor teapot "
    "trumpet vase wallet bean cup map hat owl pig sun box fan key pen rug web ant bell cake door fish frog "
    "kite moon ring ship star tree wolf chair table piano clock brush plate train truck horse sheep mouse "
    "library calendar notebook sandwich elephant necklace hospital computer treasure dinosaur")


def ask(question: str, answer: str, kind: str, what: str = "word") -> Row:
    return Row(f"{question} Reply with just the {what}.", answer, kind)


def first_or_last_word(r: random.Random) -> Row:
    shown = r.sample(NOUNS, r.randint(3, 6))
    first = r.random() < 0.5
    which = "first" if first else "last"
    return ask(f"What is the {which} word in this list: {', '.join(shown)}?", shown[0 if first else -1],
               f"{which}_word")


def first_or_last_letter(r: random.Random) -> Row:
    word = r.choice(NOUNS)
    first = r.random() < 0.5
    which = "first" if first else "last"
    return ask(f'What is the {which} letter of the word "{word}"?', word[0 if first else -1], f"{which}_letter",
               "letter")


def alphabetical(r: random.Random) -> Row:
    shown = r.sample(NOUNS, 3)
    return ask(f"Which of these words comes first in alphabetical order: {', '.join(shown)}?", min(shown),
               "alphabetical")


def longest(r: random.Random) -> Row:
    """Four words of which exactly one is longer than the other three (so there is one right answer)."""
    while True:
        shown = r.sample(NOUNS, 4)
        lengths = sorted(len(w) for w in shown)
        if lengths[-1] > lengths[-2]:
            return ask(f"Which of these words is the longest: {', '.join(shown)}?", max(shown, key=len), "longest")


def draw(r: random.Random) -> Row:
    return r.choice([first_or_last_word, first_or_last_word, first_or_last_letter, first_or_last_letter,
                     alphabetical, longest])(r)


if __name__ == "__main__":
    main(NAME, draw, __doc__)
