"""Answer extraction, format rewards, number parsing and the safe evaluator: tables of hand-checked cases,
adversarial inputs, and hypothesis properties (never raise, stay under 50 ms per call)."""

from __future__ import annotations

import re
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_engine.tasks import make_task
from grpo_engine.tasks.expressions import MAX_EXPR_CHARS, MAX_PAREN_DEPTH, evaluate_arithmetic
from grpo_engine.tasks.parsing import (
    bare_number_format,
    extract_answer,
    extract_answer_is,
    extract_answer_tag,
    extract_boxed,
    extract_final_number,
    extract_last_number,
    numeric_equal,
    parse_number,
    partial_format,
    strict_format,
)

# Per-call bound on adversarial strings: a linear-time parser takes a few ms on them, catastrophic regex
# backtracking takes seconds to hours. The bound is generous so that a loaded or slow CPU does not fail it.
BUDGET_S = 0.5


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    elapsed = time.perf_counter() - start
    assert elapsed < BUDGET_S, f"{fn.__name__} took {elapsed * 1000:.1f} ms on input of length {len(args[0])}"
    return out


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>42</answer>", "42"),
        ("<think>x</think><answer> 7 </answer>", "7"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),  # several tags: the last complete one
        ("<answer>1</answer><answer>2", "1"),  # unclosed final tag: last COMPLETE block
        ("<answer></answer>", None),  # empty
        ("no tags 5", None),
        ("</answer><answer>", None),  # closing before opening
        ("<answer>" + "9" * 2000 + "</answer>", None),  # longer than MAX_ANSWER_CHARS
    ],
)
def test_extract_answer_tag(text, expected):
    assert extract_answer_tag(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces balanced
        (r"\boxed{1} and finally \boxed{2}", "2"),  # the last one
        (r"\boxed 5$", "5"),  # short form
        (r"\boxed{12", None),  # unbalanced
        (r"\boxed", None),
        ("nothing", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("So the answer is 42.", "42"),
        ("THE FINAL ANSWER IS: $3/4$.\nmore", "3/4"),
        ("the answer is **18**", "18"),
        ("the answer is 1. Wait, the answer is 2.", "2"),
        ("answer: 5", None),
    ],
)
def test_extract_answer_is(text, expected):
    assert extract_answer_is(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("we get 3 then 1,234.5", "1,234.5"),
        ("ratio 3/4", "3/4"),
        ("minus -7", "-7"),
        ("a total of 1{,}000", "1,000"),  # LaTeX's thousands separator
        (r"so \underline{42}", "42"),  # a styling wrapper, unlike the exponent of 2^{42}
        ("٣ and ٤", None),  # unicode digits are not digits here (documented in parsing.py)
        ("none", None),
    ],
)
def test_extract_last_number(text, expected):
    assert extract_last_number(text) == expected


@pytest.mark.parametrize(
    "text, answer, method",
    [
        (r"<answer>7</answer> \boxed{8} the answer is 9. 10", "7", "answer_tag"),
        (r"\boxed{8} the answer is 9. 10", "8", "boxed"),
        ("the answer is 9. 10", "9", "answer_is"),
        ("blah 10 blah", "10", "last_number"),
        ("no answer at all", None, None),
    ],
)
def test_cascade_order(text, answer, method):
    found = extract_answer(text, ("answer_tag", "boxed", "answer_is", "last_number"))
    assert (found.answer, found.method) == (answer, method)


def test_cascade_can_be_restricted():
    assert extract_answer("the answer is 9", ("answer_tag",)).answer is None


@pytest.mark.parametrize(
    "text, strict, partial",
    [
        ("<think>a</think>\n<answer>1</answer>", 1.0, 1.0),
        ("Let me solve this step by step.\n<think>a</think> <answer>1</answer>\n", 1.0, 1.0),  # prefill
        ("<think>a</think>junk<answer>1</answer>", 0.0, 1.0),  # text between blocks
        ("<think>a</think><answer>1</answer>junk", 0.0, 1.0),  # text after answer
        ("<think>a</think><answer> </answer>", 0.0, 1.0),  # empty answer
        ("<answer>1</answer><think>a</think>", 0.0, 1.0),  # wrong order
        ("<think>a</think><answer>1</answer><answer>2</answer>", 0.0, 0.5),  # several answer tags
        ("<think>a</think>", 0.0, 0.5),  # missing answer tags
        ("<answer>1</answer>", 0.0, 0.5),  # missing think tags
        ("plain text", 0.0, 0.0),
    ],
)
def test_format_rewards(text, strict, partial):
    assert strict_format(text) == strict
    assert partial_format(text) == partial


@pytest.mark.parametrize(
    "text, value",
    [
        ("42", Fraction(42)),
        ("1,234", Fraction(1234)),
        ("$1,234.00", Fraction(1234)),
        ("18 dollars", Fraction(18)),
        ("18.0", Fraction(18)),
        ("50%", Fraction(50)),
        ("-3", Fraction(-3)),
        ("3/4", Fraction(3, 4)),
        (r"\frac{3}{4}", Fraction(3, 4)),
        (r"-\dfrac{1}{2}", Fraction(-1, 2)),
        ("x = 5 apples", Fraction(5)),
        ("1/0", None),
        (r"\frac{1}{0}", None),
        ("٤٢", None),  # Arabic-Indic digits: not a number here (no crash)
        ("9" * 5000, None),  # huge literal: refused, not int() with 5000 digits
        ("", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "text, value",
    [
        # forms whose digits alone read as another number: each scored a wrong answer as right
        (".5", Fraction(1, 2)),  # was 5
        ("$.75", Fraction(3, 4)),
        ("−5", Fraction(-5)),  # Unicode minus, was 5
        (r"\dfrac12", Fraction(1, 2)),  # brace-less \frac, was 12
        (r"\frac1{4}", Fraction(1, 4)),
        (r"−\frac{3}{4}", Fraction(-3, 4)),
        ("1{,}000", Fraction(1000)),  # LaTeX thousands separator, was 0
        ("2^{10}", None),  # an exponent, was 10
        ("10^6", None),
        ("1e3", None),  # was 3
        ("1.5e-3", None),  # was -3
        ("12-7", None),  # a difference, was -7
        ("10,00", None),  # malformed separator, was 0
        ("(1,2)", None),  # a pair, was 2
        ("1.2.3", None),
        (r"2\frac{1}{2}", None),  # a mixed number, was 1/2
        (r"\sqrt{2}", None),  # was 2
        ("x2", None),
        # still read as before
        ("x = -3", Fraction(-3)),
        (r"\text{5}", Fraction(5)),
        ("5 - 3", Fraction(3)),
        ("1, 2, 3", Fraction(3)),
    ],
)
def test_parse_number_refuses_the_tail_of_another_token(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "text, expected",
    [("so it is 2^{10}", None), ("that is 1e3.", None), (r"half: \frac12", None), (r"= \frac{1}{2}", None),
     (r"= \sqrt{2}", None), ("it costs .5", ".5"), ("so −5.", "−5"), ("2 + 3 = 5.", "5"), (r"\text{7}", "7")],
)
def test_final_number_is_not_the_tail_of_another_token(text, expected):
    assert extract_final_number(text) == expected


@pytest.mark.parametrize(
    "a, b, equal",
    [
        ("1,000", "1000", True),
        ("72.0", "72", True),
        ("0.5", "1/2", True),
        ("3", "4", False),
        ("x", "x", False),
        ("0.333333", "1/3", True),  # a rounded decimal is within the tolerance
        ("2,000,001", "2000000", False),  # distinct integers never are (1e-6 relative is 2 at two million)
        ("2000000.5", "2000000", False),  # nor is a half next to an integer
        ("1999999.9999", "2000000", True),  # but a rounded decimal next to one is
    ],
)
def test_numeric_equal(a, b, equal):
    assert numeric_equal(a, b) is equal


@pytest.mark.parametrize(
    "expr, value, numbers",
    [
        ("1 + 2 * 3", Fraction(7), (1, 2, 3)),
        ("(1 + 2) * 3", Fraction(9), (1, 2, 3)),
        ("7 - 2 - 1", Fraction(4), (7, 2, 1)),  # left associative
        ("8 / 4 / 2", Fraction(1), (8, 4, 2)),
        ("1 / 3", Fraction(1, 3), (1, 3)),
        ("6 × 7 ÷ 2 − 1", Fraction(20), (6, 7, 2, 1)),  # unicode operators normalised
    ],
)
def test_evaluate_valid(expr, value, numbers):
    ev = evaluate_arithmetic(expr)
    assert (ev.value, ev.numbers, ev.error) == (value, numbers, None)


@pytest.mark.parametrize(
    "expr, error_part",
    [
        ("1 / 0", "division by zero"),
        ("4 / (2 - 2)", "division by zero"),
        ("2 ** 3", "exponentiation"),
        ("2 ^ 3", "not allowed"),
        ("-3 + 4", "expected a number"),  # no unary minus
        ("1.5 + 2", "not allowed"),
        ("__import__('os')", "not allowed"),
        ("٣ + 4", "not allowed"),  # unicode digit
        ("(1 + 2", "unbalanced"),
        ("1 + 2)", "unbalanced"),
        ("()", "expected a number"),
        ("1 2", "unexpected"),
        ("", "empty"),
        ("1" * 10 + " + 1", "longer than"),  # huge literal
        ("999999999 * 999999999 * 999999999", "too large"),  # magnitude cap
        ("(" * 40 + "1" + ")" * 40, "deeper"),
        ("(" * 10_000 + "1" + ")" * 10_000, "longer than"),
        ("1+" * 200 + "1", "longer than"),
    ],
)
def test_evaluate_invalid(expr, error_part):
    ev = evaluate_arithmetic(expr)
    assert ev.value is None and error_part in ev.error


def test_named_values_only_where_given():
    named = {"a": 287, "b": 232, "big": 10**18, "flag": True}
    ev = evaluate_arithmetic("a * (b + 1) - a_1", {**named, "a_1": 7})
    assert (ev.value, ev.numbers) == (Fraction(287 * 233 - 7), (287, 232, 1, 7))
    assert "unknown name 'c' (known names: a, b, big, flag)" in evaluate_arithmetic("c + 1", named).error
    assert "not an integer" in evaluate_arithmetic("flag", named).error  # a bool is not a number here
    assert "too large" in evaluate_arithmetic("big * big", named).error  # names pass through the magnitude cap
    assert "not allowed" in evaluate_arithmetic("a * b").error  # without variables letters are refused
    assert "no names are defined" in evaluate_arithmetic("a", {}).error


def test_depth_limit_is_exact():
    ok = "(" * MAX_PAREN_DEPTH + "1" + ")" * MAX_PAREN_DEPTH
    too_deep = "(" + ok + ")"
    assert evaluate_arithmetic(ok).value == 1
    assert "deeper" in evaluate_arithmetic(too_deep).error
    assert len(too_deep) < MAX_EXPR_CHARS


ADVERSARIAL = [
    "<answer>" * 100_000,  # many unclosed tags (a lazy regex would go quadratic)
    "<answer>" * 50_000 + "</answer>" * 50_000,
    "\\boxed{" * 100_000,
    "{" * 200_000 + "\\boxed{" + "{" * 200_000,
    "the answer is " * 50_000,
    "the     " * 100_000,
    "1," * 300_000,
    "9" * 1_000_000,  # a 1 MB number
    "(" * 10_000 + "1" + ")" * 10_000,
    "x" * 1_000_000 + "<answer>5</answer>",  # 1 MB completion
    "٣" * 200_000,
    "-" * 500_000 + "1",
    "\\frac{1}{" * 100_000,
]


@pytest.mark.parametrize("text", ADVERSARIAL, ids=lambda t: f"{t[:12]!r}x{len(t)}")
def test_adversarial_strings_are_fast(text):
    extract_answer("warm up")
    for fn in (extract_answer, strict_format, partial_format, parse_number, evaluate_arithmetic):
        timed(fn, text)


def test_one_megabyte_completion_still_finds_final_answer():
    assert extract_answer("x" * 1_000_000 + "<answer>5</answer>").answer == "5"


ALPHABET = "<>/answerthink\\boxed{}()[]0123456789+-*/=., ٣×÷$\n^thefinalis"
untrusted = st.one_of(st.text(max_size=3000), st.text(alphabet=ALPHABET, max_size=3000))


@settings(max_examples=150, deadline=None)
@given(untrusted)
def test_parsers_never_raise_and_are_fast(text):
    for fn in (extract_answer, strict_format, partial_format, parse_number, evaluate_arithmetic):
        timed(fn, text)


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet="0123456789+-*/() ×÷−", max_size=300))
def test_evaluator_agrees_with_reference_or_rejects(expr):
    """Whenever the evaluator accepts, its value equals a reference computed with Python's own parser on
    the same (trusted, test-generated) string over Fractions."""
    ev = timed(evaluate_arithmetic, expr)
    if ev.error is not None:
        return
    import ast

    normalised = expr.replace("×", "*").replace("÷", "/").replace("−", "-").strip()
    normalised = re.sub(r"\b0+([0-9])", r"\1", normalised)  # Python rejects leading zeros; we read 07 as 7
    assert ev.value == _reference(ast.parse(normalised, mode="eval").body)


def _reference(node):
    import ast

    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}
    ops[ast.Div] = lambda a, b: a / b
    return ops[type(node.op)](_reference(node.left), _reference(node.right))


@pytest.mark.parametrize(
    "text, expected",
    [("47", 1.0), (" 47\n", 1.0), ("-3.5", 1.0), ("1,234", 1.0), ("47 apples", 0.0), ("<answer>47</answer>", 0.0),
     ("", 0.0), ("4 7", 0.0), ("9" * 65, 0.0), ("٣", 0.0)],
)
def test_bare_number_format(text, expected):
    assert bare_number_format(text) == expected


def test_arithmetic_bare_number_reference_scores_full_reward():
    task = make_task("arithmetic", format="bare_number", extractors=("last_number",))
    ex = task.examples("train")[0]
    assert task.reference_completion(ex) == ex.answer
    assert task.reward(ex, ex.answer).components == {"format": 1.0, "answer": 1.0}
    assert task.reward(ex, "<answer>" + ex.answer + "</answer>").components == {"format": 0.0, "answer": 1.0}
