"""Countdown: reach a target with the given numbers, each used once, and + - * / with parentheses.

Examples come from a seeded generator (every example carries a checked solution) or from a file in the
Countdown-Tasks-3to4 layout (fields `nums`, `target`). The answer is checked by the safe evaluator in
parsing.py (no eval, no exponentiation, limits on length, depth and magnitude).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction

from ..config.fields import option
from .base import ChatTask, ChatTaskOptions, Example, RewardResult, formatted_answer, weighted_reward
from .data import DataError, field_error, read_records, require_fields
from .expressions import evaluate_arithmetic
from .parsing import extract_answer, numbers_close

QUESTION = (
    "Using the numbers {nums}, write an equation that equals {target}. You may use +, -, * and / and "
    "parentheses, and must use every number exactly once."
)


@dataclass(frozen=True)
class CountdownExample(Example):
    nums: tuple[int, ...]  # the numbers to use, each exactly once
    target: int  # the value the expression must equal
    solution: str | None = None  # a known solution (generated examples), None for loaded ones


@dataclass
class CountdownOptions(ChatTaskOptions):
    instruction: str = option('Give only the equation on the last line as "Answer: <equation>", for example '
                              '"Answer: (1 + 2) * 3".', "appended to the user message: how to state the answer")
    answer_weight: float = option(1.0, "weight of the answer component (1 = equation uses all numbers, hits target)")
    extractors: tuple[str, ...] = option(("answer_tag", "answer_line", "boxed"),
                                        "answer cascade: only an explicitly marked equation counts")
    data_path: str | None = option(None, "Countdown-Tasks-3to4 .jsonl/.parquet; None = use the generator")
    test_size: int = option(512, "rows held out (from the end of the file) as the test split")
    seed: int = option(0, "generator seed; train and test are generated from different streams and kept disjoint")
    n_train: int = option(10_000, "generated train examples")
    n_test: int = option(256, "generated test examples")
    min_nums: int = option(3, "fewest numbers per problem")
    max_nums: int = option(4, "most numbers per problem")
    max_number: int = option(99, "numbers are drawn from 1..max_number")
    min_target: int = option(1, "smallest target")
    max_target: int = option(100, "largest target")
    integer_only: bool = option(True, "every intermediate value of the hidden solution is a positive integer")
    tolerance: float = option(1e-6, "|value - target| allowed")


def generate_countdown(options: CountdownOptions, split: str, count: int, exclude=frozenset()) -> list:
    """`count` solvable problems from the stream (seed, split); keys in `exclude` are skipped."""
    if not 2 <= options.min_nums <= options.max_nums:
        raise ValueError(f"need 2 <= min_nums <= max_nums, got {options.min_nums}, {options.max_nums}")
    rng = random.Random(f"countdown-{options.seed}-{split}")
    out: list[CountdownExample] = []
    seen = set(exclude)
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 1000 * (count + 10):
            raise ValueError("countdown generator cannot find enough problems; widen the target range")
        found = _random_solution(rng, options)
        if found is None:
            continue
        nums, target, solution = found
        key = (tuple(sorted(nums)), target)
        if key in seen:
            continue
        seen.add(key)
        question = _question(nums, target)
        out.append(CountdownExample(f"{split}-{len(out)}", question, str(target), nums, target, solution))
    return out


def _random_solution(rng: random.Random, o: CountdownOptions) -> tuple[tuple[int, ...], int, str] | None:
    """Draw numbers, combine them in random order with random operators; None when a rule is broken."""
    nums = tuple(rng.randint(1, o.max_number) for _ in range(rng.randint(o.min_nums, o.max_nums)))
    pool: list[tuple[Fraction, str]] = [(Fraction(n), str(n)) for n in nums]
    while len(pool) > 1:
        (a, ea), (b, eb) = pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))
        op = rng.choice("+-*/")
        if op == "/" and b == 0:
            return None
        value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op]
        if o.integer_only and (value.denominator != 1 or value <= 0):
            return None
        pool.append((value, f"({ea} {op} {eb})"))
    value, expr = pool[0]
    if value.denominator != 1 or not o.min_target <= value <= o.max_target:
        return None
    return nums, int(value), expr[1:-1]


def _question(nums: tuple[int, ...], target: int) -> str:
    return QUESTION.format(nums=list(nums), target=target)


def load_countdown(path: str) -> list[CountdownExample]:
    """Rows with `nums` (list of ints) and `target` (int), as in Countdown-Tasks-3to4."""
    rows = read_records(path)
    require_fields(rows, ("nums", "target"), path)
    out = []
    for i, row in enumerate(rows):
        nums, target = row["nums"], row["target"]
        if not isinstance(nums, (list, tuple)) or not nums or not all(_is_int(n) for n in nums):
            raise field_error(path, rows, i, "nums", "a non-empty list of integers", nums)
        if not _is_int(target):
            raise field_error(path, rows, i, "target", "an integer", target)
        nums_t, target = tuple(int(n) for n in nums), int(target)
        out.append(CountdownExample(f"row-{i}", _question(nums_t, target), str(target), nums_t, target))
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class CountdownCheck:
    correct: bool
    reason: str  # "ok" or why the equation fails


def check_equation(
    expression: str, nums: tuple[int, ...], target: int, tolerance: float = 1e-6
) -> CountdownCheck:
    """Whether `expression` uses exactly `nums` and hits target. In 'lhs = rhs [= ...]' the lhs is the
    equation; a right-hand side that evaluates must equal the target too ('6*8/(4-2) = 25' states a wrong
    result, and would score as right if only the lhs were read); one that does not evaluate (text) is ignored."""
    lhs, *rhs = expression.split("=", 16)  # bounded work; a 17th side keeps its '=' and does not evaluate
    ev = evaluate_arithmetic(lhs)
    if ev.error is not None:
        return CountdownCheck(False, f"invalid expression: {ev.error}")
    if sorted(ev.numbers) != sorted(nums):
        return CountdownCheck(False, f"uses {sorted(ev.numbers)}, must use each of {sorted(nums)} once")
    # absolute, as the option documents: numbers_close's relative bound let 2000001 / 2 hit the target 1000000
    if abs(ev.value - target) > Fraction(tolerance):
        return CountdownCheck(False, f"equals {ev.value}, not {target}")  # exact: 2000001/2, not 1e+06
    for side in rhs:
        stated = evaluate_arithmetic(side).value
        if stated is not None and abs(stated - target) > Fraction(tolerance):
            return CountdownCheck(False, f"states {stated}, not {target}")
    return CountdownCheck(True, "ok")


class CountdownTask(ChatTask):
    name, Options = "countdown", CountdownOptions

    def _load(self, split: str) -> list[CountdownExample]:
        o = self.options
        if o.data_path is None:
            test = generate_countdown(o, "test", o.n_test)
            if split == "test":
                return test
            test_keys = {(tuple(sorted(e.nums)), e.target) for e in test}
            return generate_countdown(o, "train", o.n_train, test_keys)
        rows = load_countdown(o.data_path)
        if len(rows) <= o.test_size:
            raise DataError(f"{o.data_path}: {len(rows)} rows but test_size={o.test_size}; lower test_size")
        return rows[len(rows) - o.test_size :] if split == "test" else rows[: len(rows) - o.test_size]

    def reward(self, example: CountdownExample, completion: str) -> RewardResult:
        found = extract_answer(self.options.prefill + completion, self.options.extractors).answer
        if found is None:
            return weighted_reward(self.options, completion, 0.0, None, {"reason": "no answer found"})
        check = check_equation(found, example.nums, example.target, self.options.tolerance)
        answer = "".join(found.split())
        info = {"reason": check.reason}
        return weighted_reward(self.options, completion, float(check.correct), answer, info)

    def reference_completion(self, example: CountdownExample) -> str | None:
        """A completion in the prompted format built from the known solution (None for loaded examples)."""
        if example.solution is None:
            return None
        if self.options.format in ("strict", "partial"):  # R1 style: reasoning in think tags, then the answer tag
            think = "" if self.options.prefill.rstrip().endswith("<think>") else "<think>"
            return f"{think} The numbers combine as {example.solution}.</think>\n<answer>{example.solution}</answer>"
        return formatted_answer(self.options.format, example.solution)

    def equivalent(self, a: str, b: str) -> bool:
        """Same value (within tolerance) from the same numbers when both evaluate; otherwise identical text.

        The numbers matter: every attempt aims at the target, so by value alone '24' (the target written
        alone) and '(6-2)*4+8' would be one answer, and maj@k would judge that cluster by whichever came first.
        """
        va, vb = evaluate_arithmetic(a.split("=", 1)[0]), evaluate_arithmetic(b.split("=", 1)[0])
        if va.value is None or vb.value is None:
            return "".join(a.split()) == "".join(b.split())
        same_numbers = sorted(va.numbers) == sorted(vb.numbers)
        return same_numbers and numbers_close(va.value, vb.value, self.options.tolerance)
