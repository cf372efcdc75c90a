"""Four-option multiple choice with a letter answer, for trying GRPO on a task of your own.

    python benchmarks/own_tasks/make_choice.py --out data/own [--seed N]

writes data/own/choice_train.jsonl (2,000 rows) and data/own/choice_test.jsonl (200 held-out rows), one
{"id", "prompt", "answer", "kind"} per line:

    Which of these numbers is the largest?
    A) 34
    B) 78
    C) 12
    D) 56
    Reply with just the letter (A, B, C or D).        -> "B"

Question kinds, drawn evenly: the largest or smallest of four numbers, the one even (or odd) number among
four, the member of a category (an animal, a fruit, a color, a vehicle, an instrument, a piece of furniture)
among three that are not, and the opposite of a word. The right option's place is shuffled, so each letter is
the answer about a quarter of the time. Score with the custom task's `verifier: choice` (it reads 'B', '(B)',
'B)', '**B**', 'The answer is B.').

Why this task: a letter answer, not a number, where a verifier must find the option the reply picks and not a
number in it. Chance is 25%, and SmolLM2-135M-Instruct knows the facts but not always how to pick an option,
so it starts above zero and below 80%, with room for GRPO to move it.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Row, main, words  # noqa: E402

NAME = "choice"
INSTRUCTION = "Reply with just the letter (A, B, C or D)."
LETTERS = "ABCD"
CATEGORIES = {
    "an animal": words("dog cat horse rabbit tiger elephant monkey lion sheep goat mouse bear"),
    "a fruit": words("apple banana orange grape cherry pear peach lemon mango plum melon strawberry"),
    "a color": words("red blue green yellow purple orange pink brown black white gray"),
    "a vehicle": words("car bus train truck bicycle airplane boat motorcycle tractor taxi"),
    "a musical instrument": words("piano guitar violin drum flute trumpet harp cello saxophone"),
    "a piece of furniture": words("chair table sofa bed desk shelf cupboard stool wardrobe bench"),
}
OPPOSITES = [("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"),
             ("open", "closed"), ("full", "empty"), ("early", "late"), ("hard", "soft"), ("wet", "dry"),
             ("loud", "quiet"), ("rich", "poor"), ("tall", "short"), ("thick", "thin"), ("strong", "weak"),
             ("clean", "dirty"), ("old", "young"), ("sweet", "sour"), ("push", "pull"), ("up", "down"),
             ("inside", "outside"), ("day", "night"), ("win", "lose"), ("buy", "sell"), ("first", "last")]


def question(stem: str, right: str, wrong: list[str], r: random.Random, kind: str) -> Row:
    """The stem, the four options in a shuffled order, the instruction; the answer is the right one's letter."""
    options = [right, *wrong]
    r.shuffle(options)
    lines = [stem, *(f"{letter}) {option}" for letter, option in zip(LETTERS, options)), INSTRUCTION]
    return Row("\n".join(lines), LETTERS[options.index(right)], kind)


def extreme(r: random.Random) -> Row:
    numbers = r.sample(range(10, 100), 4)
    largest = r.random() < 0.5
    right = max(numbers) if largest else min(numbers)
    stem = f"Which of these numbers is the {'largest' if largest else 'smallest'}?"
    return question(stem, str(right), [str(n) for n in numbers if n != right], r, "largest" if largest else "smallest")


def parity(r: random.Random) -> Row:
    even = r.random() < 0.5  # the one even number among three odd ones, or the reverse
    pool_right = range(10 + (0 if even else 1), 100, 2)
    pool_wrong = range(10 + (1 if even else 0), 100, 2)
    right, wrong = r.choice(pool_right), r.sample(pool_wrong, 3)
    stem = f"Which of these numbers is {'even' if even else 'odd'}?"
    return question(stem, str(right), [str(n) for n in wrong], r, "even" if even else "odd")


def category(r: random.Random) -> Row:
    name = r.choice(sorted(CATEGORIES))
    members = set(CATEGORIES[name])
    others = sorted({w for other, words in CATEGORIES.items() if other != name for w in words} - members)
    return question(f"Which of these is {name}?", r.choice(CATEGORIES[name]), r.sample(others, 3), r, "category")


def opposite(r: random.Random) -> Row:
    pair = r.choice(OPPOSITES)
    word, right = pair if r.random() < 0.5 else pair[::-1]
    unrelated = sorted({w for p in OPPOSITES if p != pair for w in p} - {word, right})
    return question(f'Which word is the opposite of "{word}"?', right, r.sample(unrelated, 3), r, "opposite")


def draw(r: random.Random) -> Row:
    return r.choice([extreme, parity, category, opposite])(r)


if __name__ == "__main__":
    main(NAME, draw, __doc__)
