"""Countdown: reward table, generator guarantees, and the Countdown-Tasks-3to4 loaders (JSONL + parquet)."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from references import R1_COUNTDOWN

from grpo_engine.tasks import DataError, make_task
from grpo_engine.tasks.countdown import (
    CountdownExample,
    CountdownOptions,
    CountdownTask,
    check_equation,
    generate_countdown,
)

# Linear-time parsing takes a few ms on these inputs, catastrophic backtracking seconds or more: a generous
# bound keeps that meaning on a loaded or slow CPU.
BUDGET_S = 0.5

# nums 4 6 8 2, target 24. Hand-checked solutions: (6-2)*4+8 = 16+8 = 24 and 6*8/(4-2) = 48/2 = 24.
EX = CountdownExample("t", "q", "24", nums=(4, 6, 8, 2), target=24)
TASK = CountdownTask(CountdownOptions(n_train=50, n_test=10, **R1_COUNTDOWN))


def done(answer: str) -> str:
    """A well-formatted completion (the default prefill already opened <think>)."""
    return f" reasoning </think>\n<answer>{answer}</answer>"


@pytest.mark.parametrize(
    "completion, total, answer_score, reason_part",
    [
        (done("(6 - 2) * 4 + 8"), 1.1, 1.0, "ok"),
        (done("6 × 8 ÷ (4 − 2)"), 1.1, 1.0, "ok"),  # unicode operators
        (done("6*8/(4-2) = 24"), 1.1, 1.0, "ok"),  # 'lhs = rhs': the lhs is evaluated
        (" </think><answer>1+2</answer> <answer>(6-2)*4+8</answer>", 1.0, 1.0, "ok"),  # several tags: last
        (" </think><answer>(6-2)*4+8</answer> <answer>1</answer>", 0.0, 0.0, "must use"),  # last is wrong
        (" (6-2)*4+8", 0.0, 0.0, "no answer"),  # missing tags
        (" </think>\n<answer>(6-2)*4+8", 0.0, 0.0, "no answer"),  # malformed: unclosed
        (" </think> <answer></answer>", 0.0, 0.0, "no answer"),  # empty answer
        (done("6 * 4 * (8 / 8)"), 0.1, 0.0, "must use"),  # reuses 8, omits 2
        (done("(8 - 4) * 6"), 0.1, 0.0, "must use"),  # = 24 but omits 2
        (done("(6 - 2) * 5 + 4"), 0.1, 0.0, "must use"),  # = 24 but 5 is not given (and 8 omitted)
        (done("24"), 0.1, 0.0, "must use"),  # the target alone
        (done("6 * 8 / (2 - 2) * 4"), 0.1, 0.0, "division by zero"),
        (done("8 * 2 + 6 + 4"), 0.1, 0.0, "equals 26"),  # all numbers once, wrong value
        (done("6 * 8 / 4 - 2"), 0.1, 0.0, "equals 10"),
        (done("4 ** 6"), 0.1, 0.0, "exponentiation"),
        (done("__import__('os').system('x')"), 0.1, 0.0, "not allowed"),
        (done("٤ * 6 + 8 / 2 - 4"), 0.1, 0.0, "not allowed"),  # unicode digit
        (done("99999999999999999999 + 4 + 6 + 8 + 2"), 0.1, 0.0, "longer than"),  # huge literal
        (done("(" * 100 + "(6-2)*4+8" + ")" * 100), 0.1, 0.0, "deeper"),
        (done("(" * 10_000 + "(6-2)*4+8" + ")" * 10_000), 0.1, 0.0, "no answer"),  # too long for an answer
        ("x" * 1_000_000 + done("(6 - 2) * 4 + 8"), 1.1, 1.0, "ok"),  # 1 MB completion
    ],
    ids=lambda v: repr(v)[:40] if isinstance(v, str) else None,
)
def test_reward_table(completion, total, answer_score, reason_part):
    TASK.reward(EX, "warm up")
    start = time.perf_counter()
    result = TASK.reward(EX, completion)
    assert time.perf_counter() - start < BUDGET_S
    assert result.total == pytest.approx(total)
    expected_format = (total - answer_score) / 0.1  # default weights: 0.1 x format + 1 x answer
    assert result.components == {"format": pytest.approx(expected_format), "answer": answer_score}
    assert reason_part in result.info["reason"]


def test_weights_and_partial_format_are_configurable():
    task = make_task("countdown", **{**R1_COUNTDOWN, "format": "partial"}, format_weight=0.5, answer_weight=2.0,
                     n_train=5, n_test=5)
    result = task.reward(EX, " </think> <answer>(6-2)*4+8</answer> <answer>1+1</answer>")
    assert result.components == {"format": 0.5, "answer": 0.0}  # </answer> and <answer> appear twice
    assert result.total == pytest.approx(0.5 * 0.5)
    result = task.reward(EX, done("(6-2)*4+8"))
    assert result.total == pytest.approx(0.5 * 1.0 + 2.0 * 1.0)


def test_equivalent_compares_values():
    assert TASK.equivalent("(6-2)*4+8", "6*8/(4-2)")
    assert not TASK.equivalent("(6-2)*4+8", "6*8/4")
    assert TASK.equivalent("garbage", "garbage") and not TASK.equivalent("1/0", "2/0")


def test_equivalent_needs_the_same_numbers():
    """By value alone every attempt at 24 was one answer: maj@k then took a cluster of one valid and two invalid
    equations as right because the valid one came first."""
    assert not TASK.equivalent("24", "(6-2)*4+8") and not TASK.equivalent("8*3", "(6-2)*4+8")
    assert TASK.equivalent("8*3", "3*8") and TASK.equivalent("(6 - 2) * 4 + 8", "8+4*(6-2)")
    from grpo_engine.eval.metrics import majority_answer

    assert majority_answer(["(6-2)*4+8", "8*3", "3*8"], TASK.equivalent) == "8*3"


@pytest.mark.parametrize(
    "expression, nums, target, correct, reason_part",
    [
        (r"(6 - 2) \times 4 + 8", (4, 6, 8, 2), 24, True, "ok"),  # LaTeX operators, as in \boxed{} answers
        (r"6 \cdot 8 \div \left(4 - 2\right)", (4, 6, 8, 2), 24, True, "ok"),
        ("6*8/(4-2) = 25", (4, 6, 8, 2), 24, False, "states 25, not 24"),  # the stated result is wrong
        ("(6-2)*4+8 = 16 + 9 = 24", (4, 6, 8, 2), 24, False, "states 25"),
        ("(6-2)*4+8 = 16 + 8 = 24", (4, 6, 8, 2), 24, True, "ok"),
        ("(6-2)*4+8 = 24 (done)", (4, 6, 8, 2), 24, True, "ok"),  # a side that is text is not read
        ("2000001 / 2", (2000001, 2), 1000000, False, "equals 2000001/2, not 1000000"),  # tolerance is absolute
    ],
)
def test_check_equation_reads_latex_and_the_stated_result(expression, nums, target, correct, reason_part):
    check = check_equation(expression, nums, target)
    assert check.correct is correct and reason_part in check.reason


def test_prompt_has_system_user_and_prefill():
    prompt = TASK.prompt(EX)
    assert [m["role"] for m in prompt.messages] == ["system", "user"]
    assert "<think>" in prompt.messages[0]["content"] and prompt.prefill.endswith("<think>")


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), min_nums=st.integers(3, 4), extra=st.integers(0, 1))
def test_generated_solutions_always_score_one(seed, min_nums, extra):
    opts = CountdownOptions(seed=seed, min_nums=min_nums, max_nums=min(4, min_nums + extra))
    task = CountdownTask(opts)
    for ex in generate_countdown(opts, "train", 8):
        assert opts.min_nums <= len(ex.nums) <= opts.max_nums
        assert all(1 <= n <= opts.max_number for n in ex.nums) and 1 <= ex.target <= 100
        result = task.reward(ex, done(ex.solution))
        assert result.components["answer"] == 1.0, (ex, result)


def test_generator_is_seeded_and_splits_are_disjoint():
    a = CountdownTask(CountdownOptions(seed=3, n_train=300, n_test=100))
    b = CountdownTask(CountdownOptions(seed=3, n_train=300, n_test=100))
    assert a.examples("train") == b.examples("train") and a.examples("test") == b.examples("test")
    key = lambda e: (tuple(sorted(e.nums)), e.target)
    train, test = {key(e) for e in a.examples("train")}, {key(e) for e in a.examples("test")}
    assert len(train) == 300 and len(test) == 100 and not train & test
    c = CountdownTask(CountdownOptions(seed=4, n_train=300, n_test=100))
    assert c.examples("train") != a.examples("train")


ROWS = [
    {"nums": [4, 6, 8, 2], "target": 24},
    {"nums": [1, 2, 3], "target": 6},
    {"nums": [10, 5, 3], "target": 7},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("writer, name", [(write_jsonl, "cd.jsonl"), (write_parquet, "cd.parquet")])
def test_loader_reads_both_formats(tmp_path, writer, name):
    path = writer(tmp_path / name, ROWS)
    task = make_task("countdown", data_path=str(path), test_size=1)
    train, test = task.examples("train"), task.examples("test")
    assert [(e.nums, e.target) for e in train] == [((4, 6, 8, 2), 24), ((1, 2, 3), 6)]
    assert [(e.nums, e.target) for e in test] == [((10, 5, 3), 7)]
    assert task.reward(train[0], done("6*8/(4-2)")).components["answer"] == 1.0
    assert task.reward(test[0], done("10-3*5")).components["answer"] == 0.0  # 10 - 15 = -5
    assert task.reward(test[0], done("10-5+3")).components["answer"] == 0.0  # 8
    assert task.reward(test[0], done("10/5+3+2")).components["answer"] == 0.0  # 2 not given
    assert task.reward(test[0], done("(10+5+3)")).components["answer"] == 0.0  # 18


@pytest.mark.parametrize("writer, name, where",
                         [(write_jsonl, "cd.jsonl", "line 2"), (write_parquet, "cd.parquet", "record 2")])
def test_loader_missing_field_names_file_row_and_field(tmp_path, writer, name, where):
    rows = [ROWS[0], {"nums": [1, 2, 3]}, ROWS[2]]
    path = writer(tmp_path / name, rows)
    task = make_task("countdown", data_path=str(path), test_size=1)
    with pytest.raises(DataError, match=rf"{name}: {where} has no field 'target'"):
        task.examples("train")


def test_loader_bad_field_type(tmp_path):
    path = write_jsonl(tmp_path / "cd.jsonl", [ROWS[0], {"nums": "1 2 3", "target": 6}])
    with pytest.raises(DataError, match=r"cd.jsonl: line 2 field 'nums' must be a non-empty list of integers"):
        make_task("countdown", data_path=str(path), test_size=1).examples("train")


def test_loader_bad_json_line_and_missing_file(tmp_path):
    path = tmp_path / "cd.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(DataError, match=r"cd.jsonl: line 2 is not valid JSON"):
        make_task("countdown", data_path=str(path), test_size=0).examples("train")
    with pytest.raises(DataError, match="does not exist"):
        make_task("countdown", data_path=str(tmp_path / "nope.jsonl")).examples("train")


def test_test_size_larger_than_file_is_a_clear_error(tmp_path):
    path = write_jsonl(tmp_path / "cd.jsonl", ROWS)
    with pytest.raises(DataError, match="3 rows but test_size=512"):
        make_task("countdown", data_path=str(path)).examples("train")


REWARD_ALPHABET = "<>/answerthink\\boxed{}()0123456789+-*/=., ٣×÷$\n"


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(max_size=3000), st.text(alphabet=REWARD_ALPHABET, max_size=3000)))
def test_rewards_never_raise_and_are_fast_on_untrusted_text(text):
    from grpo_engine.tasks.arithmetic import ArithmeticExample

    arith = make_task("arithmetic", n_train=1, n_test=1)
    cases = [(TASK, EX), (arith, ArithmeticExample("a", "1+2=", "3", 1, "+", 2))]
    for task, example in cases:
        start = time.perf_counter()
        result = task.reward(example, text)
        assert time.perf_counter() - start < BUDGET_S
        assert 0.0 <= result.total <= 1.1 + 1e-9
