r"""MATH / MATH-500: competition problems whose answers are LaTeX expressions, usually in \boxed{}.

Equivalence of two LaTeX answers ('\frac{1}{2}' vs '0.5', '(1,2)' vs '(1, 2)') needs a computer algebra
system; we use math-verify, the maintained library for this, as the optional extra `math`. It is imported
lazily so the rest of the package never needs sympy.

Bounding time: math-verify's own timeouts use signal.alarm, which would cancel safe_reward's alarm around
the reward. So each parse and verify runs under `inner_time_limit(verify_timeout_s)` instead, which nests
inside that alarm (a pathological answer costs verify_timeout_s, not the whole reward timeout). In a worker
thread there are no signals: structural limits bound the work there (answers longer than max_answer_chars or
nested deeper than max_nesting are rejected before math-verify sees them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache

from ..config.fields import option
from .base import ChatTask, ChatTaskOptions, Example, InnerTimeout, RewardResult, inner_time_limit, weighted_reward
from .data import field_error, load_hub, read_records, require_fields, split_source
from .parsing import extract_answer, extract_boxed

MATH_INSTALL_HINT = "the MATH task needs math-verify: pip install 'grpo-engine[math]'"


def import_math_verify():
    """The math_verify module, or ImportError with the install command."""
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(f"{MATH_INSTALL_HINT} ({e})") from None
    for name in ("math_verify.parser", "math_verify.grader"):  # we bound its calls ourselves (inner_time_limit)
        logger = logging.getLogger(name)
        if _own_timeout_notice not in logger.filters:
            logger.addFilter(_own_timeout_notice)
    return math_verify


def _own_timeout_notice(record: logging.LogRecord) -> bool:
    """Drops math-verify's warning that its timeouts are off: they are, because ours bound the calls."""
    return not record.getMessage().startswith("Timeout is disabled")


@dataclass
class MathOptions(ChatTaskOptions):
    instruction: str = option("Solve it step by step and put the final answer in \\boxed{}.",
                              "appended to the user message: how to state the answer")
    format: str = option("boxed", "format component: a complete \boxed{...}")
    extractors: tuple[str, ...] = option(("boxed", "answer_tag", "answer_line", "answer_is"),
                                        "answer cascade (a bare final number is not a MATH answer)")
    data_path: str | None = option(None, "file for every split, or dir with train.*/test.* files or a saved dataset")
    hub_name: str = option("HuggingFaceH4/MATH-500", "loaded from the hub only when data_path is None (network)")
    hub_config: str | None = option(None, "hub dataset configuration name")
    verify_timeout_s: float = option(2.0, "bound on each math-verify parse / verify, seconds (main thread; "
                                            "a timed-out answer scores as not equivalent)")
    max_answer_chars: int = option(300, "longer extracted answers are wrong without being parsed")
    max_nesting: int = option(16, "answers with deeper ()[]{} nesting are wrong without being parsed")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.verify_timeout_s > 0:
            raise ValueError(f"verify_timeout_s={self.verify_timeout_s} must be > 0 (seconds per math-verify call)")


def nesting_depth(text: str) -> int:
    """Deepest bracket nesting of ()[]{} — linear, used to refuse pathological inputs cheaply."""
    depth = deepest = 0
    for ch in text:
        if ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth = max(0, depth - 1)
    return deepest


def load_math(rows: list[dict], source: str) -> list[Example]:
    """Rows with `problem` and `answer` (MATH-500) or `solution` containing \\boxed{} (MATH)."""
    require_fields(rows, ("problem",), source)
    out = []
    for i, row in enumerate(rows):
        gold = row.get("answer")
        if gold is None:
            if row.get("solution") is None:
                raise field_error(source, rows, i, "answer", "present (or a 'solution' with \\boxed{})", None)
            gold = extract_boxed(str(row["solution"]))
            if gold is None:
                raise field_error(source, rows, i, "solution", "text containing \\boxed{...}", row["solution"])
        example_id = str(row.get("unique_id", f"{source}#{i}"))
        out.append(Example(example_id, str(row["problem"]), str(gold).strip()))
    return out


class MathTask(ChatTask):
    name, Options, splits = "math", MathOptions, None

    def __init__(self, options: MathOptions | None = None):
        super().__init__(options)
        self._mv = import_math_verify()
        self._parse_cached = lru_cache(maxsize=8192)(self._parse)

    def _load(self, split: str) -> list[Example]:
        o = self.options
        if o.data_path is not None:
            source = split_source(o.data_path, split)
            return load_math(read_records(source), str(source))
        return load_math(load_hub(o.hub_name, split, o.hub_config), f"{o.hub_name}:{split}")

    def reward(self, example: Example, completion: str) -> RewardResult:
        found = extract_answer(self.options.prefill + completion, self.options.extractors).answer
        if found is None:
            return weighted_reward(self.options, completion, 0.0, None, {"reason": "no answer found"})
        answer = " ".join(found.split())
        correct = self.equivalent(example.answer, answer)
        return weighted_reward(self.options, completion, float(correct), answer)

    def equivalent(self, a: str, b: str) -> bool:
        """math-verify equivalence of two LaTeX answers (gold first), bounded in size and time."""
        a, b = a.strip(), b.strip()
        if a == b:
            return bool(a)
        pa, pb = self._parse_cached(a), self._parse_cached(b)
        if not pa or not pb:
            return False
        try:
            with inner_time_limit(self.options.verify_timeout_s):
                return bool(self._mv.verify(pa, pb, timeout_seconds=None))
        except InnerTimeout:
            return False

    def _parse(self, answer: str) -> list:
        if len(answer) > self.options.max_answer_chars or nesting_depth(answer) > self.options.max_nesting:
            return []
        # math-verify finds LaTeX only between delimiters; an escaped dollar ('\$18.90', a MATH gold answer) is
        # not one: left unwrapped it parsed to nothing, and no answer could match it
        delimited = "\\boxed" in answer or "$" in answer.replace("\\$", "")
        text = answer if delimited else f"${answer}$"
        try:
            with inner_time_limit(self.options.verify_timeout_s):
                return self._mv.parse(text, parsing_timeout=None)
        except InnerTimeout:
            return []  # cached like any parse: the same answer does not cost the timeout twice
