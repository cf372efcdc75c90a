"""benchmarks/own_tasks/: the five example tasks a user's own-task run is measured on. Each generator is seeded and
deterministic, writes 2,000 train and 200 disjoint test rows the custom task reads, and every answer is right:
recomputed here from the prompt's own text (letter counts, unit factors, the options), or from hand-made cases."""

from __future__ import annotations

import collections
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from grpo_engine.tasks import make_task

OWN_TASKS = Path(__file__).resolve().parents[2] / "benchmarks" / "own_tasks"
VERIFIERS = {"word_problems": "numeric", "conversions": "numeric", "choice": "choice", "words": "word",
             "strings": "word"}


def script(name: str):
    """benchmarks/own_tasks/make_<name>.py (or <name>.py) as a module (its `common` import resolved from its
    folder)."""
    if str(OWN_TASKS) not in sys.path:
        sys.path.insert(0, str(OWN_TASKS))
    path = OWN_TASKS / f"make_{name}.py"
    path = path if path.exists() else OWN_TASKS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while they are made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Each task generated at seed 0: {name: (train rows, test rows, train path, test path)}."""
    out = tmp_path_factory.mktemp("own")
    files = {}
    for name in VERIFIERS:
        module = script(name)
        module.main(module.NAME, module.draw, module.__doc__, ["--out", str(out)])
        train, test = out / f"{name}_train.jsonl", out / f"{name}_test.jsonl"
        rows = [[json.loads(line) for line in p.read_text().splitlines()] for p in (train, test)]
        files[name] = (*rows, train, test)
    return files


@pytest.mark.parametrize("name", list(VERIFIERS))
def test_sizes_fields_and_disjoint_splits(written, name):
    train, test, train_path, test_path = written[name]
    assert (len(train), len(test)) == (2000, 200)
    prompts = [r["prompt"] for r in train + test]
    assert len(set(prompts)) == 2200, "train and test share no prompt, and no prompt repeats"
    assert len({r["id"] for r in train + test}) == 2200
    assert all(isinstance(r["answer"], str) and r["answer"] for r in train + test)
    task = make_task("custom", data_path=str(train_path), test_path=str(test_path), verifier=VERIFIERS[name])
    assert len(task.examples("train")) == 2000 and len(task.examples("test")) == 200
    assert task.examples("test")[0].question == test[0]["prompt"]


@pytest.mark.parametrize("name", list(VERIFIERS))
def test_seeded_and_deterministic(tmp_path, name):
    module = script(name)
    from common import generate  # the generators' shared module, on sys.path once a script is loaded

    paths = [generate(module.NAME, module.draw, tmp_path / d, seed, 50, 10) for d, seed in (("a", 0), ("b", 0),
                                                                                            ("c", 1))]
    read = [p[0].read_bytes() + p[1].read_bytes() for p in paths]
    assert read[0] == read[1] and read[0] != read[2]
    assert len(paths[0][0].read_text().splitlines()) == 50 and len(paths[0][1].read_text().splitlines()) == 10


def test_kinds_are_mixed_and_the_test_split_looks_like_train(written):
    for name, (train, test, _, _) in written.items():
        kinds_train, kinds_test = (collections.Counter(r["kind"] for r in rows) for rows in (train, test))
        assert len(kinds_train) >= 4 and set(kinds_test) <= set(kinds_train), name
        for kind, count in kinds_train.items():  # same mix: each kind's share within 8 points
            assert abs(count / 2000 - kinds_test[kind] / 200) < 0.08, (name, kind)


# --------------------------------------------------------------------------------------------- word problems
@pytest.mark.parametrize("kind, numbers, answer", [
    ("gain_then_loss", {"a": 34, "b": 14, "c": 7}, 41),
    ("loss_then_gain", {"a": 10, "b": 4, "c": 3}, 11),
    ("boxes_give", {"a": 3, "b": 4, "c": 5}, 7),
    ("more_than_total", {"a": 5, "b": 3}, 13),
    ("twice_then_loss", {"a": 6, "b": 5}, 7),
    ("share_then_gain", {"a": 12, "b": 3, "c": 2}, 6),
    ("packs_then_loss", {"a": 5, "b": 2, "c": 3, "d": 4}, 7),
    ("pages_left", {"a": 10, "b": 15, "c": 50}, 25),
    ("money_left", {"a": 20, "b": 3, "c": 4}, 8),
    ("rows_then_gain", {"a": 3, "b": 4, "c": 2}, 14),
])
def test_word_problem_templates_by_hand(kind, numbers, answer):
    wp = script("word_problems")
    row = wp.render(kind, ("Gina", "She"), "Tom", "marbles", "pens", "buys {b} more", "loses {c}", numbers)
    assert row.answer == str(answer) and row.kind == kind
    assert row.prompt.endswith("? Reply with just the number.")
    for value in numbers.values():
        assert re.search(rf"\b{value}\b", row.prompt), (value, row.prompt)


def test_gina_reads_as_written():
    wp = script("word_problems")
    row = wp.render("gain_then_loss", ("Gina", "She"), "Tom", "marbles", "pens", "buys {b} more", "loses {c}",
                    {"a": 34, "b": 14, "c": 7})
    assert row.prompt == ("Gina has 34 marbles. She buys 14 more and then loses 7. How many marbles does Gina have "
                          "now? Reply with just the number.")


def test_word_problem_answers_are_small_whole_numbers(written):
    train, test, _, _ = written["word_problems"]
    answers = [int(r["answer"]) for r in train + test]  # int() fails on anything but a whole number
    assert min(answers) >= 0 and max(answers) <= 200


# ----------------------------------------------------------------------------------------------- conversions
# one large unit in small ones: written here from general knowledge, not copied from the generator
FACTS = {("kilometers", "meters"): 1000, ("meters", "centimeters"): 100, ("centimeters", "millimeters"): 10,
         ("kilograms", "grams"): 1000, ("liters", "milliliters"): 1000, ("hours", "minutes"): 60,
         ("minutes", "seconds"): 60, ("days", "hours"): 24, ("weeks", "days"): 7, ("years", "months"): 12,
         ("dollars", "cents"): 100, ("dozens", "eggs"): 12}
UNIT_QUESTIONS = [r"How many (\w+) are in (\d+) (\w+)\?", r"What is (\d+) (\w+) in (\w+)\?",
                  r"Convert (\d+) (\w+) to (\w+)\."]


def expected_conversion(prompt: str) -> int | None:
    for i, pattern in enumerate(UNIT_QUESTIONS):
        m = re.match(pattern, prompt)
        if m:
            target, amount, unit = (m.group(1), m.group(2), m.group(3)) if i == 0 else (m.group(3), m.group(1),
                                                                                         m.group(2))
            if (unit, target) in FACTS:
                return int(amount) * FACTS[(unit, target)]
            assert int(amount) % FACTS[(target, unit)] == 0, prompt
            return int(amount) // FACTS[(target, unit)]
    return None


def expected_count(prompt: str) -> int | None:
    word = re.search(r'the word "(\w+)"', prompt)
    if word is None:
        return None
    w = word.group(1)
    if prompt.startswith("How many letters"):
        return len(w)
    if prompt.startswith("How many vowels"):
        return sum(w.count(v) for v in "aeiou")
    letter = re.match(r'How many times does the letter "(\w)" appear', prompt).group(1)
    return w.count(letter)


def test_conversion_and_count_answers_recomputed_from_the_prompt(written):
    train, test, _, _ = written["conversions"]
    for row in train + test:
        expected = expected_conversion(row["prompt"])
        expected = expected_count(row["prompt"]) if expected is None else expected
        assert expected is not None and row["answer"] == str(expected), row


# ---------------------------------------------------------------------------------------------------- choice
def options(prompt: str) -> dict[str, str]:
    return dict(re.findall(r"^([A-D])\) (.+)$", prompt, re.MULTILINE))


def test_choice_rows_have_one_right_option(written):
    cm = script("choice")
    train, test, _, _ = written["choice"]
    for row in train + test:
        opts, stem, right = options(row["prompt"]), row["prompt"].split("\n")[0], row["answer"]
        assert sorted(opts) == list("ABCD") and len(set(opts.values())) == 4, row
        values = list(opts.values())
        if row["kind"] in ("largest", "smallest"):
            pick = max if row["kind"] == "largest" else min
            assert opts[right] == str(pick(int(v) for v in values)), row
        elif row["kind"] in ("even", "odd"):
            wanted = 0 if row["kind"] == "even" else 1
            assert [int(v) % 2 == wanted for v in values].count(True) == 1 and int(opts[right]) % 2 == wanted, row
        elif row["kind"] == "category":
            members = cm.CATEGORIES[stem.removeprefix("Which of these is ").removesuffix("?")]
            assert [v in members for v in values].count(True) == 1 and opts[right] in members, row
        else:
            word = re.search(r'opposite of "(\w+)"', stem).group(1)
            pairs = {frozenset(p) for p in cm.OPPOSITES}
            assert [frozenset((word, v)) in pairs for v in values].count(True) == 1, row
            assert frozenset((word, opts[right])) in pairs, row


def test_choice_letters_are_balanced(written):
    train, _, _, _ = written["choice"]
    counts = collections.Counter(r["answer"] for r in train)
    assert set(counts) == set("ABCD") and all(400 <= c <= 600 for c in counts.values()), counts


def test_a_reply_to_a_generated_choice_row_is_scored_by_its_letter(written):
    _, test, train_path, test_path = written["choice"]
    task = make_task("custom", data_path=str(train_path), test_path=str(test_path), verifier="choice")
    example = task.examples("test")[0]
    right = example.answer
    wrong = next(letter for letter in "ABCD" if letter != right)
    value = options(example.question)[right]
    assert task.reward(example, f"The answer is {right}.").correct
    assert task.reward(example, f"{right}) {value}").correct
    assert not task.reward(example, f"{wrong}) {options(example.question)[wrong]}").correct


def test_choice_rewordings_keep_the_options_and_their_letters():
    cw = script("choice_wordings")
    prompt = "Which of these numbers is even?\nA) 17\nB) 69\nC) 32\nD) 33\nReply with just the letter (A, B, C or D)."
    assert cw.reworded(prompt, "Which letter is right?", one_line=False) == (
        "Which of these numbers is even?\nA) 17\nB) 69\nC) 32\nD) 33\nWhich letter is right?")
    assert cw.reworded(prompt, "Answer: the letter.", one_line=True) == (
        "Which of these numbers is even? (A) 17 (B) 69 (C) 32 (D) 33\nAnswer: the letter.")
    assert len(cw.ON_THEIR_LINES) + len(cw.ON_ONE_LINE) == 10


# ------------------------------------------------------------------------------------------------ one word
def shown_words(prompt: str) -> list[str]:
    return re.search(r": ([a-z, ]+)\?", prompt).group(1).split(", ")


def test_word_answers_recomputed_from_the_prompt(written):
    wm = script("words")
    category_of = {w: name for name, ws in wm.GROUPS.items() for w in ws}
    train, test, _, _ = written["words"]
    for row in train + test:
        prompt, answer, kind = row["prompt"], row["answer"], row["kind"]
        assert prompt.endswith(" Reply with just the word."), row
        if kind == "member":
            name = re.search(r"is (an? [a-z ]+):", prompt).group(1)
            assert [category_of[w] == name for w in shown_words(prompt)].count(True) == 1, row
            assert category_of[answer] == name, row
        elif kind == "odd_one_out":
            groups = collections.Counter(category_of[w] for w in shown_words(prompt))
            assert sorted(groups.values()) == [1, 3] and groups[category_of[answer]] == 1, row
        elif kind in ("opposite", "plural"):
            word = re.search(r'of "(\w+)"', prompt).group(1)
            assert (word, answer) in (wm.OPPOSITES if kind == "opposite" else wm.PLURALS), row
        else:
            unit, way, name = re.search(r"Which (day|month) comes (after|before) (\w+)\?", prompt).groups()
            names = wm.SEQUENCES[unit]
            assert names[(names.index(name) + (1 if way == "after" else -1)) % len(names)] == answer, row
    assert "orange" not in category_of  # a fruit and a color: never a question's only right word


def test_a_reply_to_a_generated_word_row_is_scored_by_its_word(written):
    _, test, train_path, test_path = written["words"]
    task = make_task("custom", data_path=str(train_path), test_path=str(test_path), verifier="word")
    example = task.examples("test")[0]
    assert task.reward(example, f'The word "{example.answer}" is the answer.').correct
    assert task.reward(example, f"**{example.answer.capitalize()}.**").correct
    assert not task.reward(example, f'"{example.answer}" and "other" both fit.').correct


# ------------------------------------------------------------------------------------------ letters and words
def test_string_answers_recomputed_from_the_prompt(written):
    nouns = script("strings").NOUNS
    assert len(set(nouns)) == len(nouns) and all(w.isascii() and w.isalpha() and w.islower() for w in nouns)
    train, test, _, _ = written["strings"]
    for row in train + test:
        prompt, answer, kind = row["prompt"], row["answer"], row["kind"]
        if kind in ("first_letter", "last_letter"):
            assert prompt.endswith(" Reply with just the letter."), row
            word = re.search(r'of the word "([a-z]+)"\?', prompt).group(1)
            assert answer == (word[0] if kind == "first_letter" else word[-1]), row
            continue
        assert prompt.endswith(" Reply with just the word."), row
        shown = shown_words(prompt)
        assert len(set(shown)) == len(shown) and answer in shown, row
        if kind in ("first_word", "last_word"):
            assert 3 <= len(shown) <= 6 and answer == shown[0 if kind == "first_word" else -1], row
        elif kind == "alphabetical":
            assert len(shown) == 3 and all(answer < w for w in shown if w != answer), row
        else:
            assert kind == "longest" and len(shown) == 4, row
            assert all(len(answer) > len(w) for w in shown if w != answer), row


@pytest.mark.parametrize("prompt, answer", [
    ("What is the last word in this list: lamp, river, cloud? Reply with just the word.", "cloud"),
    ("What is the first word in this list: owl, kite, moon, ship? Reply with just the word.", "owl"),
    ('What is the last letter of the word "garden"? Reply with just the letter.', "n"),
    ("Which of these words comes first in alphabetical order: pig, hat, owl? Reply with just the word.", "hat"),
    ("Which of these words is the longest: cup, library, lamp, pen? Reply with just the word.", "library"),
])
def test_string_replies_scored_by_hand(tmp_path, prompt, answer):
    """Hand-made rows of each kind, scored by the word verifier in the forms the starting model replies in."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
    task = make_task("custom", data_path=str(path), verifier="word")
    example = task.examples("train")[0]
    assert task.reward(example, f'The answer is "{answer.upper()}".').correct
    assert task.reward(example, f'The one asked for is "{answer}."').correct
    assert task.reward(example, f"{answer}").correct
    assert not task.reward(example, "The answer is: zebra.").correct


# ------------------------------------------------------------------------------------------------ the recipe
def test_the_own_task_recipe_reads_each_example_task(written):
    """configs/own_task.yaml with only the data paths and the verifier changed: the task builds, reads replies with
    its verifier's cascade, and the settings the real demos found to work are in place."""
    from grpo_engine.config import load_config
    from grpo_engine.tasks import build_task

    recipe = Path(__file__).resolve().parents[2] / "configs" / "own_task.yaml"
    for name, verifier in VERIFIERS.items():
        _, _, train_path, test_path = written[name]
        cfg = load_config(recipe, [f"task.options.data_path={train_path}", f"task.options.test_path={test_path}",
                                   f"task.options.verifier={verifier}"])
        task = build_task(cfg.task.name, dict(cfg.task.options), cfg.task.data_path)
        assert len(task.examples("train")) == 2000 and len(task.examples("test")) == 200
        assert task.options.extractors[-1] == {"numeric": "sentence_number", "choice": "choice",
                                                "word": "final_word"}[verifier]
        example = task.examples("test")[0]
        assert task.reward(example, f"The answer is {example.answer}.").correct
    assert cfg.algorithm.group_filter.enabled and cfg.lora.enabled and cfg.algorithm.policy_loss.beta == 0.0
    assert cfg.rollout.max_new_tokens >= 64 and cfg.eval.max_new_tokens == cfg.rollout.max_new_tokens
    assert cfg.task.options["format_weight"] == 0.0
