"""Arithmetic: generated small additions / multiplications.

The default prompt is made for instruct models: "What is 12 + 35?" followed by "Reply with just the number.";
the answer check accepts the number however the reply states it (a final number, "Answer: 47", \boxed{47}, an
answer tag), and the format component rewards a reply that is just the number. The CPU demo's tiny byte-level
model pins its own options in its recipe (template "{a}{op}{b}=", bare numbers). Train and test are drawn from
different seeded streams and kept disjoint.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

from ..config.fields import option
from .base import ChatTask, ChatTaskOptions, Example, RewardResult, formatted_answer, weighted_reward
from .parsing import extract_answer, numeric_equal, parse_number

OPERATIONS = {"+": lambda a, b: a + b, "*": lambda a, b: a * b, "-": lambda a, b: a - b}


@dataclass
class ArithmeticOptions(ChatTaskOptions):
    template: str = option("What is {a} {op} {b}?", "user message; fields a, op, b")
    instruction: str = option("Reply with just the number.", "appended to the user message")
    format: str = option("bare_number", "format component: the reply is just the number")
    format_weight: float = option(0.0, "reported, not rewarded by default: rewarding bare numbers taught "
                                       "SmolLM2-135M-Instruct to drop its '38 + 45 =' working and lose accuracy")
    digits: int = option(2, "operands have 1..digits digits")
    digits_b: int = option(0, "digits of the second operand b (0: `digits`), e.g. digits 3 and digits_b 2 for "
                              "'What is 347 x 58?'")
    full_width: bool = option(False, "operands have exactly their number of digits (no leading zeros, e.g. "
                                     "100..999)")
    operations: tuple[str, ...] = option(("+", "*"), "operators to draw from (subset of + * -)")
    seed: int = option(0, "generator seed")
    n_train: int = option(2000, "train examples (capped by how many distinct problems exist)")
    n_test: int = option(200, "test examples, disjoint from train")
    teacher_carry_drop: float = option(
        0.0, "fraction of SFT targets (+ only) written by a teacher that forgets carries")
    teacher_tool_rate: float = option(
        0.0, "fraction of SFT targets written by a teacher that calls the calculator tool first (tools demo)")
    teacher_restates: bool = option(
        False, "the SFT teacher's answers in its head restate the problem first ('287*232=66584'); its answers "
               "after a tool call do not")
    named_operands: bool = option(
        False, "the calculator knows the operands as `a` and `b` (a call may say a*b; the teacher's does); "
               "name them in the template, e.g. 'a={a} b={b} a{op}b='")

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = [op for op in self.operations if op not in OPERATIONS]
        if bad or not self.operations:
            valid = list(OPERATIONS)
            raise ValueError(f"operations {list(self.operations)} must be a non-empty subset of {valid}")
        if not 1 <= self.digits <= 9:
            raise ValueError(f"digits must be in 1..9, got {self.digits}")
        if not 0 <= self.digits_b <= 9:
            raise ValueError(f"digits_b must be in 0..9 (0: digits), got {self.digits_b}")
        if not 0.0 <= self.teacher_carry_drop <= 1.0:
            raise ValueError(f"teacher_carry_drop must be in [0, 1], got {self.teacher_carry_drop}")
        if not 0.0 <= self.teacher_tool_rate <= 1.0:
            raise ValueError(f"teacher_tool_rate must be in [0, 1], got {self.teacher_tool_rate}")
        if "{a}" not in self.template or "{b}" not in self.template:
            raise ValueError(f"template {self.template!r} must contain {{a}} and {{b}}")


@dataclass(frozen=True)
class ArithmeticExample(Example):
    a: int  # left operand
    op: str  # operator
    b: int  # right operand


def generate_arithmetic(options: ArithmeticOptions, split: str) -> list[ArithmeticExample]:
    """One split's distinct problems: test is drawn first, so train (drawn after it) can exclude it."""
    o = options
    (lo, hi), (lo_b, hi_b) = operand_range(o.digits, o.full_width), operand_range(o.digits_b or o.digits, o.full_width)
    n_distinct = (hi - lo + 1) * (hi_b - lo_b + 1) * len(o.operations)
    if o.n_test + 1 > n_distinct:
        raise ValueError(f"only {n_distinct} distinct problems with digits={o.digits}; lower n_test")
    seen: set[tuple[int, str, int]] = set()
    for name, count in (("test", o.n_test), ("train", min(o.n_train, n_distinct - o.n_test))):
        rng = random.Random(f"arithmetic-{o.seed}-{name}")
        rows: list[ArithmeticExample] = []
        while len(rows) < count:
            key = (rng.randint(lo, hi), rng.choice(o.operations), rng.randint(lo_b, hi_b))
            if key in seen:
                continue
            seen.add(key)
            a, op, b = key
            question = o.template.format(a=a, op=op, b=b)
            answer = str(OPERATIONS[op](a, b))
            rows.append(ArithmeticExample(f"{name}-{len(rows)}", question, answer, a, op, b))
        if name == split:  # "test" or "train": ChatTask.examples admits no other
            break
    return rows


def operand_range(digits: int, full_width: bool) -> tuple[int, int]:
    """(lowest, highest) operand of `digits` digits: from 0, or with full_width from 10**(digits-1)."""
    return (10 ** (digits - 1) if full_width and digits > 1 else 0), 10**digits - 1


def add_without_carries(a: int, b: int) -> int:
    """Digit-wise sum that drops every carry: 38 + 45 -> 73, 95 + 17 -> 2 + 10 * (9 + 1) = 102."""
    total, place = 0, 1
    while a or b:
        a, da = divmod(a, 10)
        b, db = divmod(b, 10)
        total += ((da + db) % 10 if (a or b) else da + db) * place
        place *= 10
    return total


class ArithmeticTask(ChatTask):
    name, Options = "arithmetic", ArithmeticOptions

    def _load(self, split: str) -> list[ArithmeticExample]:
        return generate_arithmetic(self.options, split)

    def reward(self, example: ArithmeticExample, completion: str) -> RewardResult:
        found = extract_answer(self.options.prefill + completion, self.options.extractors).answer
        value = parse_number(found) if found is not None else None
        answer = None if value is None else str(value)  # a Fraction: '47', not '47.0'
        # exact: the answers are integers, and the default relative tolerance (1e-6) would accept a 4-digit
        # product off by up to 100, or a non-integer next to it
        correct = numeric_equal(answer, example.answer, tol=0.0)
        return weighted_reward(self.options, completion, float(correct), answer)

    def equivalent(self, a: str, b: str) -> bool:
        return numeric_equal(a, b, tol=0.0) or a.strip() == b.strip()

    def reference_completion(self, example: ArithmeticExample) -> str:
        """The supervised warm start's target (without EOS) in the configured format.

        With teacher_carry_drop > 0 a fixed, seeded share of the addition targets come from a sloppy teacher
        that adds digit by digit and forgets the carries (38+45 -> 73): the warm-started model then puts part
        of its probability on the right answer without choosing it greedily, and the verifiable reward of GRPO
        can correct the teacher's systematic mistake, which supervised learning on its data cannot.
        With teacher_restates the target restates the problem first: copying it is practice a tiny model needs
        before it can copy a tool's result into its answer (docs/tools.md).
        """
        answer = example.answer
        if example.op == "+" and self.options.teacher_carry_drop > 0:
            draw = random.Random(f"teacher-{self.options.seed}-{example.id}").random()
            if draw < self.options.teacher_carry_drop:
                answer = str(add_without_carries(example.a, example.b))
        said = formatted_answer(self.options.format, answer)
        return f"{example.a}{example.op}{example.b}={said}" if self.options.teacher_restates else said

    def reference_conversation(self, example: ArithmeticExample) -> list[dict] | None:
        """A supervised target that goes through the calculator: the call, the tool's result, then the answer.

        With teacher_tool_rate > 0 a fixed, seeded share of the examples get it (None for the others: their
        target is reference_completion, answered in the head). A small model cannot multiply 3-digit numbers in
        its head but can copy the operands into a call and the result into its answer: the warm-started model
        calls the tool on some samples, and GRPO with tools can raise that share because those samples score.
        With named_operands the call is `a*b` (see tool_variables).
        """
        if self.options.teacher_tool_rate <= 0:
            return None
        if random.Random(f"tool-teacher-{self.options.seed}-{example.id}").random() >= self.options.teacher_tool_rate:
            return None
        a, b = ("a", "b") if self.options.named_operands else (example.a, example.b)
        call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a}{example.op}{b}"}})
        return [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                {"role": "tool", "name": "calculator", "content": example.answer},
                {"role": "assistant", "content": formatted_answer(self.options.format, example.answer)}]

    def parse_question(self, text: str, answer: str = "") -> ArithmeticExample | None:
        """The example behind a question written with this task's template ('a=287 b=232 a*b=' -> a=287,
        op='*', b=232), so `grpo generate` gets the operands a tool may need; None if it does not match."""
        pattern = re.escape(self.options.template)
        for field, group in (("{a}", r"(?P<a>[0-9]{1,9})"), ("{op}", r"(?P<op>[-+*])"), ("{b}", r"(?P<b>[0-9]{1,9})")):
            pattern = pattern.replace(re.escape(field), group, 1)
        found = re.fullmatch(pattern, text.strip())
        if found is None or "op" not in found.groupdict():
            return None
        return ArithmeticExample("cli", text, answer, int(found["a"]), found["op"], int(found["b"]))

    def tool_variables(self, example: ArithmeticExample) -> dict[str, int]:
        """Named values a tool call may use for this problem: {"a": ..., "b": ...} with named_operands (a
        data-bound calculator, like a code tool whose inputs are preloaded), else none. Copying two 3-digit
        operands digit by digit is what a tiny model fails at; the decision to call the tool is what the tools
        demo is about."""
        return {"a": example.a, "b": example.b} if self.options.named_operands else {}
