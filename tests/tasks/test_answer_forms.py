"""The answers users' tasks have besides a final number: an option letter, a short word, a number inside the
reply's closing sentence; and the custom task's verifiers that read them (hand-written replies, each with the
extraction a reader would make, and replies that must NOT match)."""

from __future__ import annotations

import json
import time

import pytest

from grpo_engine.tasks import make_task
from grpo_engine.tasks.parsing import (
    EXTRACTORS,
    choice_equal,
    choice_letter,
    extract_answer,
    extract_choice,
    extract_final_word,
    extract_sentence_number,
    word_equal,
)


@pytest.mark.parametrize("reply, letter", [
    ("B", "B"),
    ("B.", "B"),
    ("(B)", "B"),
    ("B)", "B"),
    ("[C]", "C"),
    ("**B**", "B"),
    ("**(D)**", "D"),
    ("The answer is B.", "B"),
    ("The correct answer is (C) 87.", "C"),
    ("Answer: (A)", "A"),
    ("answer:B", "B"),
    ("The correct option is **D**", "D"),
    ("B. 78", "B"),
    ("A) stool\n\nThe correct answer is D) mouse.", "D"),  # stated beats marked
    ("A) 12\nB) 45\nThe answer is C", "C"),
    ("A) 12 is small, but the largest is C) 87.", "C"),  # the last marked one
    ("  - B\n", "B"),
    ("B) 69\n\nB) 69 is the only odd number.", "B"),  # one option, named twice
    ("A) 83\n\nThe even one is D) 32.", "D"),  # the last picked in a sentence, after a listed one
])
def test_choice_letter_found(reply, letter):
    assert extract_choice(reply) == letter


@pytest.mark.parametrize("reply", [
    "Apple",                      # 'A' inside a word
    "BAD",
    "CD) player",                 # 'D)' glued to a letter
    "A dog is an animal.",        # the article
    "I think so.",                # the pronoun
    "Option A is 12, option B is 45",  # naming options is not choosing one
    "Plan A failed",
    "f(A) = 3",                   # a function argument
    "The answers are many",
    "The answer is 78.",          # a number, not a letter
    "(E1) and (K)",               # not A-J alone / out of range
    "b) lowercase markers are words too often",
    "",
    "A) 83\nD) 37",              # options listed, none stated: taking the last line would reward listing them
    "A) 98 is the largest.\n\nB) 68 is the smallest among the given numbers.",
    "- A) 12\n- B) 45\n- C) 87",
])
def test_choice_letter_not_found(reply):
    assert extract_choice(reply) is None


def test_choice_letter_of_an_extracted_answer():
    """What the cascade's answer_is / answer_line steps hand the verifier: one letter in any case, or a phrase."""
    assert [choice_letter(a) for a in ["B", "b", "(c)", "**D.**", "(B) 78", "that A is wrong", None]] == \
        ["B", "B", "C", "D", "B", None, None]
    # the letter opening an answer that goes on to say why ('The answer is C, which is the odd one out.')
    assert [choice_letter(a) for a in ["C, which is the odd one out", "(D); 32 is even", "A, B or C", "A,B",
                                       "A good one, I think", "CD, the player"]] == ["C", "D", None, None, None, None]
    assert choice_equal("B", "(B) 78") and choice_equal("b", "B")
    assert not choice_equal("B", "C") and not choice_equal("B", "78") and not choice_equal(None, "B")


@pytest.mark.parametrize("reply, word", [
    ("Paris", "Paris"),
    ("paris!", "paris"),
    ("**tac**.", "tac"),
    ('The word backwards is "tac".', "tac"),
    ("Spelled backwards it is **tac**", "tac"),
    ("Let me think.\n\nOrange", "Orange"),
    ("don't", "don't"),
    ("New-York.", "New-York"),
    ('The word that does not belong with the others is "bunny."', "bunny"),  # the period inside the quotes
    ('The word "blue" is a color.', "blue"),  # the one word the line quotes
    ('The opposite of "late" is "early".', "early"),  # two quoted: the one closing the line
    ('It is "Dog", and "dog" it stays.', "dog"),  # one word quoted twice: the last
])
def test_final_word_found(reply, word):
    assert extract_final_word(reply) == word


@pytest.mark.parametrize("reply", [
    "The word backwards is tac",  # a sentence, not a word: a reply cut off mid-sentence ends like this
    "It is New York",
    "tac and cat",
    'The word "flee" is a verb, and "veil" is a noun.',  # two words quoted: no pick
    'The word "blue" is a color and the word',  # cut off: a quoted word inside an unfinished sentence
    "It's not what they don't say",  # apostrophes are no quotes
    "",
    "\n\n  \n",
])
def test_final_word_not_found(reply):
    assert extract_final_word(reply) is None


def test_word_equal_ignores_case_and_punctuation_only():
    assert word_equal("Paris", "**paris.**") and word_equal("New York", "new-york") and word_equal("don't", "dont")
    assert not word_equal("New York", "newyork") and not word_equal("cat", "cats") and not word_equal("", "")
    assert not word_equal("cat", None)


@pytest.mark.parametrize("reply, number", [
    ('The letter "n" appears 1 time in the word "lemon".', "1"),
    ("2 kilograms is equal to 2000 grams.", "2000"),
    ("First 3 + 4 = 7. So she has 9 marbles!", "9"),
    ("It is 3.5 km.", "3.5"),
    ("He has 7 apples. **Total: 9 apples**.", "9"),
    ("1 hour has\n60 minutes.", "60"),
])
def test_sentence_number_found(reply, number):
    assert extract_sentence_number(reply) == number


@pytest.mark.parametrize("reply", [
    "So she has 12 apples. Then she buys",  # cut off: the last sentence is unfinished
    "There are no numbers here.",
    "x = 2^{10}.",                           # the tail of an exponent is not the number 10
    "The result is 5 and",
])
def test_sentence_number_not_found(reply):
    assert extract_sentence_number(reply) is None


def test_new_extractors_are_fast_on_adversarial_replies():
    """Linear by construction: each under half a second on 100k-character inputs built to make regexes backtrack."""
    inputs = ["(" * 100_000, "A)" * 50_000, "answer is " * 10_000, "a" * 100_000, '"' + "a-" * 50_000,
              "**" * 50_000, "1. " * 33_000 + ".", "\n" * 100_000, "answer" + " " * 100_000]
    for name in ("choice", "final_word", "sentence_number"):
        for text in inputs:
            start = time.perf_counter()
            EXTRACTORS[name](text)
            assert time.perf_counter() - start < 0.5, (name, text[:20])


# ------------------------------------------------------------------------------------------ the custom task
def task_with(tmp_path, answer: str, **options):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "q", "answer": answer}) + "\n")
    task = make_task("custom", data_path=str(path), **options)
    return task, task.examples("train")[0]


@pytest.mark.parametrize("verifier, answer, reply, correct", [
    ("choice", "D", "A) stool\n\nThe correct answer is D) mouse.", True),
    ("choice", "B", "**B**", True),
    ("choice", "B", "The answer is (B) 78.", True),
    ("choice", "B", "B) 78", True),                 # numeric cascade would have read 78
    ("choice", "A", "Apples are red.", False),      # 'A' of a word
    ("choice", "A", "A) 17", True),
    ("choice", "C", "A) 17", False),
    ("choice", "C", "The answer is C, which is the odd one out.", True),  # answer_is takes the whole clause
    ("word", "tac", "Backwards, it reads **Tac**.", True),
    ("word", "tac", "The answer is tac.", True),
    ("word", "tac", "The word backwards is cat", False),
    ("numeric", "2000", "2 kilograms is equal to 2000 grams.", True),
    ("numeric", "2000", "2 kilograms is equal to 2000 grams and", False),  # unfinished: no answer
    ("numeric", "41", "34 + 14 = 48, 48 - 7 = 41.\n#### 41\nThe answer is: 41", True),
    ("exact", "Paris", "Answer: Paris", True),
])
def test_custom_verifiers_read_their_answer_forms(tmp_path, verifier, answer, reply, correct):
    task, example = task_with(tmp_path, answer, verifier=verifier)
    assert task.reward(example, reply).correct is correct


def test_each_verifier_brings_its_cascade_and_explicit_extractors_win(tmp_path):
    task, example = task_with(tmp_path, "B", verifier="choice")
    assert task.options.extractors == ("answer_tag", "boxed", "answer_line", "answer_is", "choice")
    numeric, _ = task_with(tmp_path, "B", verifier="numeric")
    assert numeric.options.extractors[-2:] == ("final_number", "sentence_number")
    exact, _ = task_with(tmp_path, "B", verifier="exact")
    assert exact.options.extractors[-1] == "final_number"
    pinned, example = task_with(tmp_path, "B", verifier="choice", extractors=["final_word"])
    assert pinned.options.extractors == ("final_word",)
    assert pinned.reward(example, "**B**").correct and not pinned.reward(example, "The answer is (B) 78").correct


def test_custom_bad_verifier_or_extractor_is_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"verifier='letter' is not one of \['exact', 'numeric', 'math', 'choice'"):
        task_with(tmp_path, "B", verifier="letter")
    with pytest.raises(ValueError, match="unknown answer extractor"):
        task_with(tmp_path, "B", verifier="choice", extractors=["letter"])


def test_choice_answers_vote_together(tmp_path):
    """maj@k groups answers by the task's equivalence: '(B) 78' and 'B' are one vote."""
    from grpo_engine.eval.metrics import majority_answer

    task, _ = task_with(tmp_path, "B", verifier="choice")
    assert majority_answer(["(B) 78", "C", "B"], task.equivalent) in ("(B) 78", "B")
    assert extract_answer("The answer is (B) 78.", task.options.extractors).answer == "(B) 78"
