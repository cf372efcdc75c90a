"""MATH / MATH-500 with math-verify: equivalence table, loaders, bounded inputs, missing-extra message."""

from __future__ import annotations

import json
import sys

import pytest

from grpo_engine.tasks import DataError, Example, make_task, safe_reward
from grpo_engine.tasks.math import nesting_depth

pytest.importorskip("math_verify")


@pytest.fixture(scope="module")
def task():
    return make_task("math", verify_timeout_s=2)


def done(answer: str) -> str:
    return f" work </think>\n<answer>{answer}</answer>"


@pytest.mark.parametrize(
    "gold, completion, correct",
    [
        (r"\frac{1}{2}", done("0.5"), 1.0),
        (r"\frac{1}{2}", done(r"\boxed{1/2}"), 1.0),
        (r"\frac{1}{2}", r" so the result is \boxed{\dfrac12}", 1.0),  # no tags: boxed
        (r"\frac{1}{2}", done("1/3"), 0.0),
        ("(1,2)", done("(1, 2)"), 1.0),
        ("x^2+1", done("1+x^2"), 1.0),
        (r"\sqrt{2}/2", done(r"\frac{\sqrt2}{2}"), 1.0),
        ("3", done("4"), 0.0),
        ("3", done("3") + "<answer>4</answer>", 0.0),  # several tags: the last
        ("3", " the final answer is 3", 1.0),
        ("3", " no answer 3", 0.0),  # MATH's cascade does not use the bare last number
        ("3", done("(" * 10_000 + "3" + ")" * 10_000), 0.0),  # too long for an answer
        ("3", done("(" * 40 + "3" + ")" * 40), 0.0),  # nested past max_nesting: refused before parsing
        ("3", "x" * 1_000_000 + done("3"), 1.0),  # 1 MB completion
        ("3", done("٣"), 0.0),  # unicode digit: no crash
    ],
    ids=lambda v: repr(v)[:30] if isinstance(v, str) else None,
)
def test_reward_table(task, gold, completion, correct):
    result = task.reward(Example("m", "q", gold), completion)
    assert result.components["answer"] == correct


def test_timeout_bounds_pathological_answers(task):
    """10^(10^10) makes sympy compute for a long time: the reward is cut by the timeout and scores 0."""
    result = safe_reward(task, Example("m", "q", "9"), done("10^{10^{10}}"), timeout_s=0.5)
    assert result.total == 0.0 and result.info["error"] == "timeout"


def test_each_math_verify_call_has_its_own_bound_inside_the_rewards():
    """Under safe_reward's alarm, math-verify's own timeouts cannot run (they would cancel it): the answer's
    parse / verify get verify_timeout_s of their own, so a pathological answer scores as wrong after that
    bound, with the format still scored, instead of using up the whole reward timeout."""
    quick = make_task("math", verify_timeout_s=0.3)
    result = safe_reward(quick, Example("m", "q", "9"), r" so it is \boxed{10^{10^{10}}}", timeout_s=20)
    assert "error" not in result.info, result.info
    assert result.components["answer"] == 0.0 and result.components["format"] == 1.0
    with pytest.raises(ValueError, match="verify_timeout_s"):
        make_task("math", verify_timeout_s=0)


def test_equivalent(task):
    assert task.equivalent(r"\frac{1}{2}", "0.5") and not task.equivalent("2", "3")
    assert not task.equivalent("", "")


def test_escaped_dollar_answers_are_parsed(task):
    r"""'\$18.90' (a MATH gold answer) held a '$' and was passed to math-verify without delimiters: it parsed to
    nothing and no answer could match it."""
    assert task.reward(Example("m", "q", r"\$18.90"), r" so \boxed{18.90}").components["answer"] == 1.0
    assert task.reward(Example("m", "q", "18.90"), r" so \boxed{\$18.90}").components["answer"] == 1.0
    assert task.reward(Example("m", "q", r"\$18.90"), r" so \boxed{18.80}").components["answer"] == 0.0


def test_nesting_depth():
    assert nesting_depth("a(b[c{d}])") == 3 and nesting_depth(")))(") == 1


def test_loader_math500_and_math_layouts(tmp_path):
    rows = [
        {"problem": "p1", "answer": r"\frac{1}{2}", "unique_id": "u1"},  # MATH-500 layout
        {"problem": "p2", "solution": r"so it is $\boxed{\frac{3}{4}}$."},  # MATH layout
    ]
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = make_task("math", data_path=str(path)).examples("test")
    assert [(e.id, e.question, e.answer) for e in examples][0] == ("u1", "p1", r"\frac{1}{2}")
    assert examples[1].answer == r"\frac{3}{4}"


def test_loader_missing_fields(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"problem": "p"}) + "\n")
    with pytest.raises(DataError, match=r"m.jsonl: line 1 field 'answer' must be present"):
        make_task("math", data_path=str(path)).examples("test")
    path.write_text(json.dumps({"problem": "p", "answer": "1"}) + "\n" + json.dumps({"answer": "1"}) + "\n")
    with pytest.raises(DataError, match=r"m.jsonl: line 2 has no field 'problem'"):
        make_task("math", data_path=str(path)).examples("test")


def test_missing_math_verify_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"pip install 'grpo-engine\[math\]'"):
        make_task("math")
