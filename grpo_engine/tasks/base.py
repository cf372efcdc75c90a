"""The Task protocol, its typed records, and the guarded path the trainer scores completions through.

A task gives prompts and scores completions. The trainer only sees this module's types:
`Example` in, `Prompt` out (rendered with the tokenizer's chat template, then the prefill appended), and
`RewardResult` back for each completion. `safe_reward` wraps a task's reward so that a
reward that raises or runs too long scores 0 and is counted, and never stops training.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Protocol, runtime_checkable

from ..config.fields import option
from .data import MAX_FILE_MIB, MAX_LINE_KIB, Limits, data_limits
from .parsing import FORMAT_REWARDS, check_cascade

R1_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with "
    "the answer. The reasoning process and answer are enclosed within <think> </think> and "
    "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> "
    "<answer> answer here </answer>."
)
R1_PREFILL = "Let me solve this step by step.\n<think>"


@dataclass(frozen=True)
class Example:
    """One problem. A task read from rows (the custom task) keeps each row's columns in `row`, so that a reward
    reads any of them by name: `example["difficulty"]`; `example["id"]`, `["question"]` and `["answer"]` work for
    every example (a row's own column of that name first)."""

    id: str  # stable identifier (split + index, or the source row)
    question: str  # the problem text shown to the model
    answer: str  # the reference final answer (normalised form used for scoring)
    row: Mapping[str, object] = field(default_factory=dict, compare=False, repr=False, kw_only=True)  # its columns

    def __getitem__(self, name: str) -> object:
        if name in self.row:
            return self.row[name]
        if name in ("id", "question", "answer"):
            return getattr(self, name)
        raise KeyError(f"{name!r}: example {self.id}'s row has no such column (its columns: {self.keys()})")

    def get(self, name: str, default: object = None) -> object:
        try:
            return self[name]
        except KeyError:
            return default

    def __contains__(self, name: object) -> bool:
        return name in self.row or name in ("id", "question", "answer")

    def keys(self) -> list[str]:
        return sorted({*self.row, "id", "question", "answer"})


@dataclass(frozen=True)
class Prompt:
    messages: list[dict[str, str]]  # chat messages {"role", "content"} for the tokenizer's chat template
    prefill: str = ""  # text appended after the rendered generation prompt (start of the assistant turn)


@dataclass(frozen=True)
class RewardResult:
    total: float  # the scalar reward used for advantages (weighted sum of components)
    components: dict[str, float]  # unweighted component scores, e.g. {"format": 1.0, "answer": 0.0}
    answer: str | None  # normalised final answer extracted from the completion, None if none found
    info: dict[str, str] = field(default_factory=dict)  # diagnostics, e.g. {"error": ...} or {"reason": ...}

    @property
    def correct(self) -> bool:
        """The one correctness rule of training metrics, in-loop eval and `grpo eval`: full answer marks.

        Independent of the format component and of the weights of the total; a reward that crashed has no
        components and is incorrect.
        """
        return self.components.get("answer", 0.0) >= 1.0

    @property
    def formatted(self) -> bool:
        """Full format marks (the format rate's rule everywhere)."""
        return self.components.get("format", 0.0) >= 1.0


@runtime_checkable
class Task(Protocol):
    name: str

    def examples(self, split: str) -> Sequence[Example]: ...

    def prompt(self, example: Example) -> Prompt: ...

    def reward(self, example: Example, completion: str) -> RewardResult: ...

    def equivalent(self, a: str, b: str) -> bool: ...


@dataclass
class ChatTaskOptions:
    """Options every chat task shares; each task's options dataclass extends this and sets its own
    instruction / format defaults for instruct models. R1-style training (think / answer tags) is a choice of
    options: system_prompt=R1_SYSTEM_PROMPT, prefill=R1_PREFILL, format=strict, extractors=[answer_tag]."""

    system_prompt: str | None = option(None, "system message; None sends none (the chat template's default applies)")
    instruction: str = option("", "appended to the user message (after a blank line): how to state the answer")
    prefill: str = option("", "assistant prefill appended after the chat template (\"\" for none)")
    format: str = option(
        "answer_line", "format component: answer_line | boxed | bare_number | answer_tag | strict | partial")
    format_weight: float = option(0.1, "weight of the format component in the total reward")
    answer_weight: float = option(1.0, "weight of the answer-correctness component in the total reward")
    extractors: tuple[str, ...] = option(("answer_tag", "boxed", "answer_line", "answer_is", "final_number"),
                                         "answer cascade: the first that finds an answer wins")
    max_data_file_mib: int = option(MAX_FILE_MIB, "largest data file read, MiB (checked before reading: a data "
                                                  "file is untrusted input)")
    max_data_line_kib: int = option(MAX_LINE_KIB, "longest line of a JSON-lines or CSV file read, KiB (reading stops "
                                                  "there)")

    def __post_init__(self) -> None:
        if self.format not in FORMAT_REWARDS:
            raise ValueError(f"format={self.format!r} is not one of {list(FORMAT_REWARDS)}")
        self.extractors = check_cascade(self.extractors)
        for name in ("max_data_file_mib", "max_data_line_kib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")

    @property
    def limits(self) -> Limits:
        return Limits(file_mib=self.max_data_file_mib, line_kib=self.max_data_line_kib)


def chat_prompt(options: ChatTaskOptions, user_text: str) -> Prompt:
    """System prompt (if any) + one user message (+ the instruction) + the configured prefill."""
    messages = [] if options.system_prompt is None else [{"role": "system", "content": options.system_prompt}]
    text = f"{user_text}\n\n{options.instruction}" if options.instruction else user_text
    messages.append({"role": "user", "content": text})
    return Prompt(messages, options.prefill)


class ChatTask:
    """What the built-in tasks share: their options (`Options()` by default), the prompt made from them, and each
    split's examples, loaded once by the task's `_load(split)`."""

    Options: type[ChatTaskOptions] = ChatTaskOptions
    splits: tuple[str, ...] | None = ("train", "test")  # None: whatever splits the data has

    def __init__(self, options: ChatTaskOptions | None = None):
        self.options = options or self.Options()
        self._examples = cache(self._load)

    def _load(self, split: str) -> list[Example]:
        raise NotImplementedError

    def examples(self, split: str) -> list[Example]:
        if self.splits is not None and split not in self.splits:
            raise ValueError(f"split must be {' or '.join(map(repr, self.splits))}, got {split!r}")
        with data_limits(self.options.limits):  # every data file the task reads, under its options' budgets
            return self._examples(split)

    def prompt(self, example: Example) -> Prompt:
        return chat_prompt(self.options, example.question)


def formatted_answer(format: str, answer: str) -> str:
    """A reference completion that states `answer` in the form the format component rewards (warm starts)."""
    return {"bare_number": answer, "answer_line": f"Answer: {answer}", "boxed": f"\\boxed{{{answer}}}"}.get(
        format, f"<answer>{answer}</answer>")


def render_prompt(task: Task, tokenizer, example: Example) -> str:
    """The exact text the model is conditioned on: chat template with the generation prompt, then the prefill.

    Training (collect/groups.py) and evaluation (eval/evaluate.py) both call this one function, so a model is
    evaluated on the same prompt text it was trained on.
    """
    prompt = task.prompt(example)
    return tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True) + prompt.prefill


def weighted_reward(
    options: ChatTaskOptions,
    completion: str,
    answer_score: float,
    answer: str | None,
    info: dict[str, str] | None = None,
) -> RewardResult:
    """Combine format (checked on prefill + completion, since the prefill opens <think>) and answer scores."""
    fmt = FORMAT_REWARDS[options.format](options.prefill + completion)
    total = options.format_weight * fmt + options.answer_weight * answer_score
    return RewardResult(total, {"format": fmt, "answer": answer_score}, answer, info or {})


# ---------------------------------------------------------------------------------------- guarded scoring
REWARD_LIMIT = 1e6  # |reward| beyond this is clamped: group means and variances stay finite


class RewardTimeout(BaseException):
    """Raised by the alarm in safe_reward. A BaseException so that a reward's own `except Exception`
    (math-verify has several) cannot swallow it."""


class InnerTimeout(BaseException):
    """Raised by `inner_time_limit` when its own bound, not the enclosing one, runs out."""


@contextmanager
def inner_time_limit(seconds: float):
    """Bound a block to `seconds` by SIGALRM, also inside safe_reward's alarm: raises InnerTimeout.

    The enclosing timer, if any, is set aside and re-armed afterwards with what is left of it; when it would
    run out first, it is left alone (its own handler fires). A no-op outside the main thread, where there
    are no signals."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return
    outer_left = signal.getitimer(signal.ITIMER_REAL)[0]  # 0.0: none armed
    if outer_left and outer_left <= seconds:
        yield
        return
    armed = [True]

    def expire(signum, frame) -> None:
        if armed[0]:  # not once the block is over (the timer may fire while it is being disarmed)
            raise InnerTimeout

    start = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left:  # at least a microsecond: a zero would disarm it
            signal.setitimer(signal.ITIMER_REAL, max(1e-6, outer_left - (time.perf_counter() - start)))


def _alarm_available() -> bool:
    """Signals work only in the main thread, and we must not clobber a timer someone else armed."""
    return (
        threading.current_thread() is threading.main_thread()
        and hasattr(signal, "setitimer")
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0.0
    )


def safe_reward(task: Task, example: Example, completion: str, timeout_s: float = 5.0) -> RewardResult:
    """task.reward, but an exception or a run past timeout_s gives total 0 with info["error"] set.

    In the main thread a SIGALRM timer interrupts the reward. Elsewhere it cannot be interrupted (Python
    has no safe way to stop a thread), so the rewards are built to be fast by construction and a reward
    that still overran is scored 0 as a timeout once it returns.
    """
    start = time.perf_counter()
    use_alarm = _alarm_available()
    if use_alarm:
        previous = signal.signal(signal.SIGALRM, _raise_timeout)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        result = task.reward(example, completion)
    except RewardTimeout:
        return _failed("timeout", f"reward ran past {timeout_s}s")
    except Exception as e:  # noqa: BLE001 - any failure of untrusted-input scoring scores 0
        return _failed("exception", f"{type(e).__name__}: {e}"[:500])
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0.0)
            signal.signal(signal.SIGALRM, previous)
    elapsed = time.perf_counter() - start
    if elapsed > timeout_s:
        return _failed("timeout", f"reward took {elapsed:.2f}s > {timeout_s}s (not interruptible here)")
    if not isinstance(result, RewardResult):
        return _failed("exception", f"reward returned {type(result).__name__}, expected RewardResult")
    if not isinstance(result.total, (int, float)) or not math.isfinite(result.total):
        return _failed("nonfinite", f"reward total {result.total!r} is not a finite number")
    if abs(result.total) > REWARD_LIMIT or any(abs(v) > REWARD_LIMIT for v in result.components.values()):
        clamp = lambda v: max(-REWARD_LIMIT, min(REWARD_LIMIT, v))  # noqa: E731 - 1e308 overflows group statistics
        components = {k: clamp(v) for k, v in result.components.items()}
        return replace(result, total=clamp(result.total), components=components)
    return result


def _raise_timeout(signum, frame) -> None:
    raise RewardTimeout


def _failed(kind: str, message: str) -> RewardResult:
    return RewardResult(0.0, {}, None, {"error": kind, "message": message})
