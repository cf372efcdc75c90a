"""Grade-school word problems with a whole-number answer, for trying GRPO on a task of your own.

    python benchmarks/own_tasks/make_word_problems.py --out data/own [--seed N]

writes data/own/word_problems_train.jsonl (2,000 rows) and data/own/word_problems_test.jsonl (200 held-out
rows), one {"id", "prompt", "answer", "kind"} per line: "Gina has 14 marbles. She buys 6 more and then loses
3. How many marbles does Gina have now? Reply with just the number." -> "17". Score with the custom task's
`verifier: numeric`.

Why this task: two or three operations (+, -, x, equal shares) on small numbers, in ten templates with varied
names, objects and verbs, so no single surface form can be memorised. The numbers are small enough that
SmolLM2-135M-Instruct gets a few right before training, which a 2-digit sum written out as a story does not
guarantee, and hard enough that it gets most wrong: a task GRPO can move, measured on held-out prompts.
Answers are never negative and every division is exact.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Row, main  # noqa: E402

NAME = "word_problems"
INSTRUCTION = "Reply with just the number."
PEOPLE = [("Gina", "She"), ("Tom", "He"), ("Maya", "She"), ("Leo", "He"), ("Aisha", "She"), ("Ben", "He"),
          ("Sofia", "She"), ("Omar", "He"), ("Lena", "She"), ("Jack", "He"), ("Priya", "She"), ("Sam", "He"),
          ("Nora", "She"), ("Ivan", "He"), ("Rosa", "She"), ("Kofi", "He"), ("Emma", "She"), ("Luis", "He")]
OBJECTS = ["marbles", "stickers", "apples", "pencils", "cookies", "books", "coins", "shells", "cards", "balloons",
           "stamps", "crayons", "oranges", "buttons", "beads", "toy cars"]
ITEMS = ["pens", "notebooks", "sandwiches", "tickets", "plants", "comics", "cups", "kites"]  # bought for dollars
GAINS = ["buys {b} more", "finds {b} more", "gets {b} more from a friend", "picks up {b} more", "wins {b} more"]
LOSSES = ["gives away {c}", "loses {c}", "sells {c}", "gives {c} to {other}", "trades away {c}"]


@dataclass(frozen=True)
class Template:
    text: str  # fields: name, pron, other, obj, item, gain, loss and the numbers
    answer: Callable[[dict], int]  # the answer from the numbers
    draw: Callable[[random.Random], dict]  # numbers for which every step and the answer are whole and >= 0


def _gain_loss(r: random.Random) -> dict:
    a, b = r.randint(5, 30), r.randint(2, 15)
    return {"a": a, "b": b, "c": r.randint(1, a + b - 1)}


def _boxes(r: random.Random) -> dict:
    a, b = r.randint(2, 6), r.randint(2, 10)
    return {"a": a, "b": b, "c": r.randint(1, a * b - 1)}


def _packs(r: random.Random) -> dict:
    a, b, c = r.randint(1, 15), r.randint(2, 4), r.randint(2, 6)
    return {"a": a, "b": b, "c": c, "d": r.randint(1, a + b * c - 1)}


def _twice(r: random.Random) -> dict:
    a = r.randint(3, 20)
    return {"a": a, "b": r.randint(1, 2 * a - 1)}


def _share(r: random.Random) -> dict:
    b, k = r.randint(2, 6), r.randint(2, 10)
    return {"a": b * k, "b": b, "c": r.randint(1, 9)}


def _pages(r: random.Random) -> dict:
    a, b = r.randint(3, 25), r.randint(3, 25)
    return {"a": a, "b": b, "c": a + b + r.randint(1, 40)}


def _spend(r: random.Random) -> dict:
    b, c = r.randint(2, 5), r.randint(2, 9)
    return {"a": b * c + r.randint(0, 30), "b": b, "c": c}


TEMPLATES: dict[str, Template] = {
    "gain_then_loss": Template(
        "{name} has {a} {obj}. {pron} {gain} and then {loss}. How many {obj} does {name} have now?",
        lambda n: n["a"] + n["b"] - n["c"], _gain_loss),
    "loss_then_gain": Template(
        "{name} has {a} {obj}. First {pron_lower} {loss}, then {pron_lower} {gain}. How many {obj} does {name} have "
        "now?", lambda n: n["a"] - n["c"] + n["b"], lambda r: _gain_loss(r) | {"c": r.randint(1, 4)}),
    "boxes_give": Template(
        "{name} buys {a} boxes of {obj}. Each box holds {b} {obj}. {pron} gives {c} of them to {other}. How many "
        "{obj} does {name} have left?", lambda n: n["a"] * n["b"] - n["c"], _boxes),
    "more_than_total": Template(
        "{name} has {a} {obj}. {other} has {b} more {obj} than {name}. How many {obj} do they have altogether?",
        lambda n: 2 * n["a"] + n["b"], lambda r: {"a": r.randint(3, 20), "b": r.randint(1, 10)}),
    "twice_then_loss": Template(
        "{name} has {a} {obj}. {other} has twice as many {obj} as {name}, then {other} gives away {b}. How many "
        "{obj} does {other} have now?",
        lambda n: 2 * n["a"] - n["b"], _twice),
    "share_then_gain": Template(
        "{name} has {a} {obj} and shares them equally among {b} friends. Then each friend finds {c} more. How "
        "many {obj} does each friend have?", lambda n: n["a"] // n["b"] + n["c"], _share),
    "packs_then_loss": Template(
        "{name} has {a} {obj}. {pron} buys {b} packs with {c} {obj} in each pack and then {loss_d}. How many {obj} "
        "does {name} have now?", lambda n: n["a"] + n["b"] * n["c"] - n["d"], _packs),
    "pages_left": Template(
        "A book has {c} pages. {name} reads {a} pages on Monday and {b} pages on Tuesday. How many pages are left "
        "to read?", lambda n: n["c"] - n["a"] - n["b"], _pages),
    "money_left": Template(
        "{name} has {a} dollars. {pron} buys {b} {item} that cost {c} dollars each. How many dollars does {name} "
        "have left?", lambda n: n["a"] - n["b"] * n["c"], _spend),
    "rows_then_gain": Template(
        "{name} puts {obj} in {a} rows with {b} {obj} in each row. Then {pron_lower} adds {c} more. How many {obj} "
        "are there in all?", lambda n: n["a"] * n["b"] + n["c"],
        lambda r: {"a": r.randint(2, 9), "b": r.randint(2, 9), "c": r.randint(1, 12)}),
}


def render(kind: str, person: tuple[str, str], other: str, obj: str, item: str, gain: str, loss: str,
           numbers: dict) -> Row:
    """One problem of template `kind` with the given words and numbers (the tests' hand-made cases use this)."""
    name, pron = person
    fields = {"name": name, "pron": pron, "pron_lower": pron.lower(), "other": other, "obj": obj, "item": item,
              "b": 0, "c": 0, "d": 0, **numbers}  # the verb phrases a template does not use may name no number
    fields["gain"] = gain.format(**fields)
    fields["loss"] = loss.format(**fields)
    fields["loss_d"] = loss.format(**(fields | {"c": fields["d"]}))
    template = TEMPLATES[kind]
    prompt = template.text.format(**fields)
    return Row(f"{prompt} {INSTRUCTION}", str(template.answer(numbers)), kind)


def draw(r: random.Random) -> Row:
    kind = r.choice(sorted(TEMPLATES))
    person = r.choice(PEOPLE)
    other = r.choice([name for name, _ in PEOPLE if name != person[0]])
    words = r.choice(OBJECTS), r.choice(ITEMS), r.choice(GAINS), r.choice(LOSSES)
    return render(kind, person, other, *words, TEMPLATES[kind].draw(r))


if __name__ == "__main__":
    main(NAME, draw, __doc__)
