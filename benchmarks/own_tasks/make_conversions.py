"""Unit conversions and letter counts with an exact whole-number answer, for trying GRPO on a task of your own.

    python benchmarks/own_tasks/make_conversions.py --out data/own [--seed N]

writes data/own/conversions_train.jsonl (2,000 rows) and data/own/conversions_test.jsonl (200 held-out rows),
one {"id", "prompt", "answer", "kind"} per line. Two kinds of question (about two thirds conversions: there
are fewer distinct counting questions):
- a unit conversion, either way: "How many meters are in 7 kilometers?" -> "7000", "Convert 42 days to
  weeks." -> "6" (twelve everyday units: length, mass, volume, time, money, dozens);
- a count over a word: "How many letters are in the word "garden"?" -> "6", "How many vowels ...", "How
  many times does the letter "r" appear in "strawberry"?" -> "3".
Each ends "Reply with just the number."; score with the custom task's `verifier: numeric`.

Why this task: a different skill from the word problems (a fact to recall and apply, or a count over
characters a subword tokenizer hides), with exact answers and no arithmetic chain. SmolLM2-135M-Instruct knows
some of the factors and miscounts letters, so it starts part of the way, with room to improve.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Row, main, words  # noqa: E402

NAME = "conversions"
INSTRUCTION = "Reply with just the number."
# (large unit, small unit, how many small units make one large one)
UNITS = [("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("centimeters", "millimeters", 10),
         ("kilograms", "grams", 1000), ("liters", "milliliters", 1000), ("hours", "minutes", 60),
         ("minutes", "seconds", 60), ("days", "hours", 24), ("weeks", "days", 7), ("years", "months", 12),
         ("dollars", "cents", 100), ("dozens", "eggs", 12)]
WORDS = words("""apple banana garden window pencil rabbit orange yellow purple guitar monkey planet river mountain
bottle candle kitten jacket butter coffee doctor engine forest hammer island ladder magnet needle pepper rocket
silver summer tomato turtle violin wallet winter zipper anchor basket carrot dinner feather garlic helmet insect
jungle kettle lemon mirror napkin oyster parrot pillow puzzle salad saddle spider tunnel velvet wizard bridge
castle cherry circle cookie dragon flower ginger hollow lizard market meadow muffin nickel number ocean office
pocket police rubber school shadow spring strawberry street table teacher thunder ticket tiger travel valley
water whisper airplane blanket breakfast butterfly calendar chocolate dinosaur elephant envelope festival
giraffe hospital kangaroo mushroom notebook painting pineapple raincoat sandwich scissors sunflower telephone
umbrella vacation volcano weekend bicycle cabbage cupboard football goldfish hedgehog keyboard lighthouse
marathon necklace octopus pancake pyramid skeleton snowman squirrel stomach tractor triangle backpack balloon
pumpkin letter happy puppy little bubble tomorrow""")
VOWELS = "aeiou"


def conversion(large: str, small: str, factor: int, n: int, to_small: bool, phrasing: int) -> Row:
    """n large units in small ones (to_small) or n * factor small units in large ones; three phrasings."""
    amount, unit, target = (n, large, small) if to_small else (n * factor, small, large)
    questions = [f"How many {target} are in {amount} {unit}?", f"What is {amount} {unit} in {target}?",
                 f"Convert {amount} {unit} to {target}."]
    answer = n * factor if to_small else n
    return Row(f"{questions[phrasing]} {INSTRUCTION}", str(answer), "convert_down" if to_small else "convert_up")


def letter_count(word: str, question: str, letter: str = "") -> Row:
    """How many letters / vowels / times `letter` appears in `word`."""
    if question == "letters":
        return Row(f'How many letters are in the word "{word}"? {INSTRUCTION}', str(len(word)), "count_letters")
    if question == "vowels":
        vowels = sum(ch in VOWELS for ch in word)
        return Row(f'How many vowels (a, e, i, o, u) are in the word "{word}"? {INSTRUCTION}', str(vowels),
                   "count_vowels")
    return Row(f'How many times does the letter "{letter}" appear in the word "{word}"? {INSTRUCTION}',
               str(word.count(letter)), "count_letter")


def draw(r: random.Random) -> Row:
    if r.random() < 0.5:
        large, small, factor = r.choice(UNITS)
        return conversion(large, small, factor, r.randint(2, 40), r.random() < 0.5, r.randrange(3))
    word = r.choice(WORDS)
    question = r.choice(["letters", "vowels", "letter"])
    return letter_count(word, question, r.choice(sorted(set(word))))


if __name__ == "__main__":
    main(NAME, draw, __doc__)
