"""Arithmetic and custom tasks, the registry, and the guarded scoring path (safe_reward)."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
import types

import pytest
from references import BYTE_ARITHMETIC

from grpo_engine.tasks import (
    TASKS,
    Example,
    Prompt,
    RewardResult,
    Task,
    make_task,
    safe_reward,
)
from grpo_engine.tasks.arithmetic import ArithmeticExample


# ------------------------------------------------------------------------------------------- arithmetic
def test_arithmetic_prompt_is_short():
    task = make_task("arithmetic", **BYTE_ARITHMETIC, n_train=20, n_test=5)
    ex = task.examples("train")[0]
    assert task.prompt(ex) == Prompt([{"role": "user", "content": f"{ex.a}{ex.op}{ex.b}="}], "")


@pytest.mark.parametrize(
    "completion, total, answer",
    [
        ("<answer>47</answer>", 1.1, "47"),
        ("<answer> 47 </answer>", 1.1, "47"),
        ("<answer>46</answer>", 0.1, "46"),
        ("47", 0.0, None),  # missing tags
        ("<answer>47", 0.0, None),  # malformed
        ("<answer>1</answer><answer>47</answer>", 1.0, "47"),  # several tags: last counts, format fails
        ("<answer>٤٧</answer>", 0.1, None),  # unicode digits
        ("<answer>" + "9" * 100 + "</answer>", 0.1, None),  # huge literal
        ("x" * 1_000_000 + "<answer>47</answer>", 1.1, "47"),  # 1 MB completion
    ],
)
def test_arithmetic_reward_table(completion, total, answer):
    task = make_task("arithmetic", **BYTE_ARITHMETIC, n_train=5, n_test=5)
    ex = ArithmeticExample("a", "12+35=", "47", 12, "+", 35)  # 12 + 35 = 47
    result = task.reward(ex, completion)
    assert result.total == pytest.approx(total) and result.answer == answer


def test_arithmetic_answers_are_exact_for_large_products():
    """The relative tolerance (1e-6) accepted 4-digit products off by up to 100 as right."""
    task = make_task("arithmetic", digits=4, operations=("*",), n_train=1, n_test=1)
    ex = ArithmeticExample("a", "q", "28558235", 6991, "*", 4085)
    assert task.reward(ex, "28558235").components["answer"] == 1.0
    for wrong in ("28558242", "28558235.4", "28,558,234"):
        assert task.reward(ex, wrong).components["answer"] == 0.0, wrong
    assert not task.equivalent("28558242", "28558235")


def test_arithmetic_splits_are_seeded_disjoint_and_correct():
    task = make_task("arithmetic", **BYTE_ARITHMETIC, digits=2, operations=("+", "*"), n_train=500, n_test=100, seed=1)
    train, test = task.examples("train"), task.examples("test")
    assert len(train) == 500 and len(test) == 100
    assert not {(e.a, e.op, e.b) for e in train} & {(e.a, e.op, e.b) for e in test}
    for e in train + test:
        assert 0 <= e.a <= 99 and 0 <= e.b <= 99 and e.op in "+*"
        assert int(e.answer) == (e.a + e.b if e.op == "+" else e.a * e.b)
        assert task.reward(e, f"<answer>{e.answer}</answer>").total == pytest.approx(1.1)
    again = make_task("arithmetic", **BYTE_ARITHMETIC, digits=2, operations=("+", "*"), n_train=500, n_test=100, seed=1)
    assert again.examples("train") == train
    assert make_task("arithmetic", **BYTE_ARITHMETIC, n_train=500, n_test=100, seed=2).examples("train") != train


def test_arithmetic_knob_errors():
    with pytest.raises(ValueError, match="subset of"):
        make_task("arithmetic", operations=("/",))
    with pytest.raises(ValueError, match="distinct problems"):
        make_task("arithmetic", digits=1, operations=("+",), n_test=100).examples("test")


# ------------------------------------------------------------------------------------------------ custom
def write_rows(tmp_path, rows):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    "verifier, answer, completion, score",
    [
        ("exact", "Paris", " </think><answer>Paris</answer>", 1.0),
        ("exact", "Paris", " </think><answer>paris</answer>", 0.0),
        ("numeric", "1000", " </think><answer>1,000.0</answer>", 1.0),
        ("numeric", "1000", " </think><answer>999</answer>", 0.0),
    ],
)
def test_custom_verifiers(tmp_path, verifier, answer, completion, score):
    path = write_rows(tmp_path, [{"prompt": "q", "answer": answer}])
    task = make_task("custom", data_path=path, verifier=verifier)
    ex = task.examples("train")[0]
    assert task.prompt(ex).messages[-1] == {"role": "user", "content": "q"}
    assert task.reward(ex, completion).components["answer"] == score


def test_custom_equivalence_counts_identical_answers_as_one(tmp_path):
    """numeric_equal('x', 'x') is False: maj@k split ['12', 'x', 'x'] into three single votes and '12' won."""
    from grpo_engine.eval.metrics import majority_answer

    task = make_task("custom", data_path=write_rows(tmp_path, [{"prompt": "q", "answer": "12"}]), verifier="numeric")
    assert task.equivalent("x", "x") and task.equivalent("12", "12.0") and not task.equivalent("12", "x")
    assert majority_answer(["12", "x", "x"], task.equivalent) == "x"


def test_custom_missing_field(tmp_path):
    path = write_rows(tmp_path, [{"prompt": "q", "answer": "1"}, {"prompt": "q2"}])
    with pytest.raises(ValueError, match=r"mine.jsonl: line 2 has no field 'answer'"):
        make_task("custom", data_path=path).examples("train")


def test_custom_reward_fn_from_module(tmp_path, monkeypatch):
    module = types.ModuleType("my_rewards")
    module.length_bonus = lambda example, completion: 0.5 if example.answer in completion else -0.5
    module.broken = lambda example, completion: float("nan")
    monkeypatch.setitem(sys.modules, "my_rewards", module)
    path = write_rows(tmp_path, [{"prompt": "q", "answer": "42"}])
    task = make_task("custom", data_path=path, reward_fn="my_rewards:length_bonus")
    ex = task.examples("train")[0]
    assert task.reward(ex, "it is 42").total == 0.5 and task.reward(ex, "no").total == -0.5
    broken = make_task("custom", data_path=path, reward_fn="my_rewards:broken")
    result = safe_reward(broken, ex, "x")
    assert result.total == 0.0 and result.info["error"] == "exception" and "finite" in result.info["message"]
    bad_specs = [("nocolon", "must look like"), ("no_mod:f", "cannot import"), ("my_rewards:x", "no func")]
    for spec, msg in bad_specs:
        with pytest.raises(ValueError, match=msg):
            make_task("custom", data_path=path, reward_fn=spec)


# ---------------------------------------------------------------------------------------------- registry
def test_registry_builds_every_task_and_rejects_unknown_names(tmp_path):
    assert set(TASKS) == {"arithmetic", "countdown", "gsm8k", "math", "custom"}
    for name in ("arithmetic", "countdown"):
        assert isinstance(make_task(name), Task)
    with pytest.raises(ValueError, match=r"unknown task 'nope'; available tasks: \['arithmetic'"):
        make_task("nope")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['digitz'\].*valid options: \[.*'digits'"):
        make_task("arithmetic", digitz=3)
    with pytest.raises(ValueError, match=r"format='fancy' is not one of"):
        make_task("countdown", format="fancy")
    with pytest.raises(ValueError, match=r"unknown answer extractor"):
        make_task("gsm8k", extractors=["answer_tag", "magic"])


def test_option_types_are_checked_and_yaml_scalars_coerced():
    """`digits: x` once crashed with a TypeError inside the task; `format_weight: abc` failed every reward."""
    with pytest.raises(ValueError, match=r"task option digits='x' must be an integer"):
        make_task("arithmetic", digits="x")
    with pytest.raises(ValueError, match=r"task option format_weight='abc' must be a number"):
        make_task("countdown", format_weight="abc")
    with pytest.raises(ValueError, match=r"task option full_width='yes' must be true or false"):
        make_task("arithmetic", full_width="yes")
    with pytest.raises(ValueError, match=r"task option system_prompt=\['a'\] must be a string or null"):
        make_task("arithmetic", system_prompt=["a"])
    task = make_task("arithmetic", digits=2.0, format_weight=1, instruction=5, system_prompt=None)
    assert (task.options.digits, task.options.format_weight, task.options.instruction) == (2, 1.0, "5")
    assert isinstance(task.options.format_weight, float)


# -------------------------------------------------------------------------------------- guarded scoring
class ScriptedTask:
    """A task whose reward does whatever the completion says: the failure modes safe_reward must absorb."""

    name = "scripted"

    def examples(self, split):
        return [Example("s", "q", "a")]

    def prompt(self, example):
        return Prompt([{"role": "user", "content": "q"}])

    def reward(self, example, completion):
        if completion == "raise":
            raise RuntimeError("boom")
        if completion == "spin":  # a busy loop that even swallows ordinary exceptions
            end = time.perf_counter() + 10
            while time.perf_counter() < end:
                with contextlib.suppress(Exception):
                    sum(range(1000))
        if completion == "sleep":
            time.sleep(0.3)
        if completion == "wrong type":
            return 1.0
        return RewardResult(1.0, {"answer": 1.0}, "a")

    def equivalent(self, a, b):
        return a == b


EX = Example("s", "q", "a")


def test_safe_reward_turns_errors_and_timeouts_into_zero():
    task = ScriptedTask()
    assert safe_reward(task, EX, "fine").total == 1.0
    raised = safe_reward(task, EX, "raise")
    assert (raised.total, raised.info["error"]) == (0.0, "exception") and "boom" in raised.info["message"]
    start = time.perf_counter()
    spun = safe_reward(task, EX, "spin", timeout_s=0.2)
    assert spun.info["error"] == "timeout" and time.perf_counter() - start < 2.0  # interrupted, not 10 s
    assert safe_reward(task, EX, "wrong type").info["error"] == "exception"


def test_inner_time_limit_nests_inside_an_armed_alarm():
    """The inner bound fires first and the enclosing timer comes back with what was left of it (math-verify's
    own alarm would have cancelled it); an enclosing timer that ends sooner is left alone."""
    import signal

    from grpo_engine.tasks.base import InnerTimeout, inner_time_limit

    def outer(signum, frame):
        raise AssertionError("the enclosing alarm fired")

    previous = signal.signal(signal.SIGALRM, outer)
    signal.setitimer(signal.ITIMER_REAL, 30.0)
    try:
        with pytest.raises(InnerTimeout), inner_time_limit(0.05):
            time.sleep(5)
        assert 25.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30.0
        assert signal.getsignal(signal.SIGALRM) is outer
        with inner_time_limit(60.0):  # longer than the enclosing one: nothing armed of its own
            assert signal.getsignal(signal.SIGALRM) is outer
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, previous)
    with pytest.raises(InnerTimeout), inner_time_limit(0.05):  # and with no enclosing timer
        time.sleep(5)
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0.0


def test_safe_reward_off_main_thread_counts_overruns():
    out = {}
    worker = threading.Thread(target=lambda: out.update(r=safe_reward(ScriptedTask(), EX, "sleep", 0.1)))
    worker.start()
    worker.join()
    assert out["r"].total == 0.0 and out["r"].info["error"] == "timeout"


def test_safe_reward_scores_failures_zero_and_names_them():
    results = [safe_reward(ScriptedTask(), EX, c, 0.2) for c in ["fine", "raise", "fine", "spin"]]
    assert [r.total for r in results] == [1.0, 0.0, 1.0, 0.0]
    assert [r.info.get("error") for r in results] == [None, "exception", None, "timeout"]


def test_reference_completions_score_full_reward():
    """The SFT targets of the tasks that have them earn the maximum total reward."""
    for name in ("arithmetic", "countdown"):
        task = make_task(name)
        for ex in task.examples("train")[:20]:
            result = task.reward(ex, task.reference_completion(ex))
            assert result.components == {"format": 1.0, "answer": 1.0}, (name, ex, result)


def test_add_without_carries_hand_computed():
    from grpo_engine.tasks.arithmetic import add_without_carries

    assert [add_without_carries(a, b) for a, b in [(38, 45), (95, 17), (12, 35), (99, 99), (5, 7), (0, 0)]] == [
        73, 102, 47, 188, 12, 0]


def test_sloppy_teacher_share_and_determinism():
    task = make_task("arithmetic", format="bare_number", extractors=("last_number",), operations=("+",),
                     teacher_carry_drop=0.7)
    carry = [ex for ex in task.examples("train") if ex.a % 10 + ex.b % 10 >= 10 and ex.a >= 10 and ex.b >= 10]
    wrong = [ex for ex in carry if task.reference_completion(ex) != ex.answer]
    assert 0.65 < len(wrong) / len(carry) < 0.75  # ~70% of the carrying problems get the sloppy answer
    assert [task.reference_completion(ex) for ex in carry[:50]] == [task.reference_completion(ex) for ex in carry[:50]]
    clean = make_task("arithmetic", format="bare_number", extractors=("last_number",), operations=("+",))
    assert all(clean.reference_completion(ex) == ex.answer for ex in carry[:200])
    with pytest.raises(ValueError, match="teacher_carry_drop must be in"):
        make_task("arithmetic", teacher_carry_drop=1.5)


def test_custom_without_test_path_holds_out_a_seeded_split(tmp_path, capsys):
    path = write_rows(tmp_path, [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)])
    task = make_task("custom", data_path=path)
    train, test = task.examples("train"), task.examples("test")
    assert len(test) == 2 and len(train) == 18  # holdout 0.1 of 20
    assert {e.id for e in train}.isdisjoint(e.id for e in test)
    assert sorted(e.answer for e in train + test) == sorted(str(i) for i in range(20))
    assert [int(e.answer) for e in train] == sorted(int(e.answer) for e in train)  # file order
    err = capsys.readouterr().err
    assert err.count("task custom: no test_path: 2 of 20 rows") == 1 and "training on the other 18" in err
    again = make_task("custom", data_path=path)
    assert [e.id for e in again.examples("test")] == [e.id for e in test]  # seeded: the same rows every time
    other = make_task("custom", data_path=path, holdout=0.25, holdout_seed=1)
    assert len(other.examples("test")) == 5 and [e.id for e in other.examples("test")] != [e.id for e in test]
    everything = make_task("custom", data_path=path, holdout=0)  # asked for: test on the training rows
    assert everything.examples("test") == everything.examples("train") and len(everything.examples("test")) == 20
    (tmp_path / "t").mkdir()
    given = make_task("custom", data_path=path, test_path=write_rows(tmp_path / "t", [{"prompt": "t", "answer": "0"}]))
    assert len(given.examples("train")) == 20 and [e.question for e in given.examples("test")] == ["t"]
    with pytest.raises(ValueError, match=r"holdout=1.0 must be in \[0, 1\)"):
        make_task("custom", data_path=path, holdout=1.0)
    small = write_rows(tmp_path / "t", [{"prompt": f"q{i}", "answer": str(i)} for i in range(19)])
    capsys.readouterr()
    tiny = make_task("custom", data_path=small)  # too few rows to hold some out: both splits
    assert tiny.examples("test") == tiny.examples("train") and len(tiny.examples("train")) == 19
    assert "task custom" not in capsys.readouterr().err  # no split made: nothing said (errors stay one line)
