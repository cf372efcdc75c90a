"""Custom task: your own JSONL of `prompt` + `answer` rows, scored by a named verifier or by any Python
function named in the config as "module:function". A CSV file with a `prompt,answer` header row works too. The file
is UTF-8 text; a byte-order mark at its start and Windows line ends (what Windows editors and spreadsheet exports
write) are read as the plain file.

A reward function is called as fn(example, completion) and returns a float (used as the total) or a
RewardResult; `example` carries every column of its row (`example["difficulty"]`, base.Example). Several, each with
a weight, are `reward_fns`: their weighted sum is the total. It runs in the training process: the trainer calls it
through safe_reward, so if it raises or runs past the timeout the completion scores 0 and the failure is counted.

Functions given as Python objects (the Python API, api/trainer.py) are named in the config by "module:qualname" like
any other and handed over in process (`providing_rewards`), not imported; a name that cannot be imported (a lambda,
a function of `__main__`: a notebook cell) is refused by name alone, in one line saying the run resumes from Python.
"""

from __future__ import annotations

import importlib
import math
import random
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from ..config.fields import option
from ..config.trust import check_code
from .base import ChatTask, ChatTaskOptions, Example, RewardResult, weighted_reward
from .data import place, read_records, require_fields
from .parsing import DEFAULT_CASCADE, choice_equal, extract_answer, numeric_equal, word_equal


def exact_match(a: str, b: str) -> bool:
    """Equal after collapsing whitespace (case-sensitive)."""
    return " ".join(a.split()) == " ".join(b.split())


def _math_equal() -> Callable[[str, str], bool]:
    from .math import MathTask

    return MathTask().equivalent


# name -> factory of an equivalence function (factories so that "math" imports math-verify only when chosen)
VERIFIERS: dict[str, Callable[[], Callable[[str, str], bool]]] = {
    "exact": lambda: exact_match,
    "numeric": lambda: numeric_equal,
    "math": _math_equal,
    "choice": lambda: choice_equal,
    "word": lambda: word_equal,
}
# the answer cascade each verifier reads replies with when `extractors` is not set: the lenient default (a number
# that ends the reply last) for exact / math; for numeric also the number closing the reply's last sentence ('2
# kilograms is 2000 grams.': SmolLM2-135M-Instruct states most counts and conversions so); the option letter a
# reply picks ('B', '(B)', 'The answer is B.') for choice, where a number ending the reply would be the option's
# value; the word that ends the reply for word
VERIFIER_CASCADES: dict[str, tuple[str, ...]] = {
    "exact": DEFAULT_CASCADE,
    "numeric": (*DEFAULT_CASCADE, "sentence_number"),
    "math": DEFAULT_CASCADE,
    "choice": ("answer_tag", "boxed", "answer_line", "answer_is", "choice"),
    "word": ("answer_tag", "boxed", "answer_line", "answer_is", "final_word"),
}


@dataclass
class CustomOptions(ChatTaskOptions):
    data_path: str = option("", "JSONL (or CSV with a `prompt,answer` header, or parquet) with `prompt` and `answer` "
                                "fields: the train split")
    test_path: str | None = option(None, "file for the test split; None = a seeded `holdout` share of data_path's "
                                         "rows, left out of training")
    holdout: float = option(0.1, "without test_path: the share of data_path's rows held out as the test split "
                                 "(0 = test on the training rows)")
    holdout_seed: int = option(0, "which rows are held out without test_path")
    verifier: str = option(
        "exact", "answer check: exact (same text) | numeric (same number: '1,000.0' = '1000') | choice (same option "
                 "letter: '(B)', 'B)', '**B**', 'The answer is B.' = 'B') | word (same words up to case and "
                 "punctuation: '**Paris.**' = 'paris') | math (math needs grpo-engine[math])")
    extractors: tuple[str, ...] | None = option(
        None, "answer cascade, the first that finds an answer wins; None = the verifier's: answer_tag, boxed, "
              "answer_line, answer_is, then final_number (exact / math), final_number and sentence_number (numeric), "
              "choice (choice) or final_word (word)")
    reward_fn: str | None = option(None, "\"module:function\" called as fn(example, completion); replaces the verifier")
    reward_fns: list | None = option(None, "several reward functions, their weighted sum the total: a list of "
                                           "\"module:function\" or {fn: \"module:function\", weight: w} (weight "
                                           "1 when left out); replaces the verifier and reward_fn")

    def __post_init__(self) -> None:
        if self.verifier not in VERIFIERS:
            raise ValueError(f"verifier={self.verifier!r} is not one of {list(VERIFIERS)}")
        if self.extractors is None:
            self.extractors = VERIFIER_CASCADES[self.verifier]
        super().__post_init__()
        if not self.data_path:
            raise ValueError("custom task needs data_path: a .jsonl file with 'prompt' and 'answer' fields")
        if self.reward_fns is not None:
            if self.reward_fn is not None:
                raise ValueError("reward_fn and reward_fns are both set: keep one (reward_fns holds several)")
            self.reward_fns = weighted_specs(self.reward_fns)
        if not 0 <= self.holdout < 1:
            raise ValueError(f"holdout={self.holdout} must be in [0, 1): the share of data_path's rows held out for "
                             f"testing when there is no test_path")


RewardFn = Callable[[Example, str], "float | RewardResult"]
_IN_PROCESS: ContextVar[Mapping[str, RewardFn] | None] = ContextVar("grpo_in_process_rewards", default=None)


@contextmanager
def providing_rewards(functions: Mapping[str, RewardFn]) -> Iterator[None]:
    """Within this block, a reward named by one of `functions`' names is that object, not imported: the Python API
    hands over the functions it was given (a notebook's among them) under the names the config stores."""
    token = _IN_PROCESS.set({**(_IN_PROCESS.get() or {}), **functions})
    try:
        yield
    finally:
        _IN_PROCESS.reset(token)


def importable_name(spec: str) -> bool:
    """Whether "module:qualname" can name a function to import: not one of `__main__` (a notebook cell, a script run
    directly), not a lambda or a function defined inside another (`<lambda>`, `<locals>`)."""
    module_name, _, attr = str(spec).partition(":")
    return module_name != "__main__" and "<" not in attr and "#" not in attr


def weighted_specs(value) -> list[dict]:
    """reward_fns as [{"fn": "module:function", "weight": w}]: each item a name (weight 1) or such a mapping; the
    names keep their type (a StoredCode stays one, config/trust.py)."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"reward_fns={value!r} must be a non-empty list of \"module:function\" or "
                         f"{{fn: \"module:function\", weight: w}}")
    out = []
    for i, item in enumerate(value):
        fn, weight = (item.get("fn"), item.get("weight", 1.0)) if isinstance(item, Mapping) else (item, 1.0)
        extra = set(item) - {"fn", "weight"} if isinstance(item, Mapping) else set()
        if not isinstance(fn, str) or extra:
            raise ValueError(f"reward_fns[{i}]={item!r} must be \"module:function\" or {{fn: \"module:function\", "
                             f"weight: w}}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
            raise ValueError(f"reward_fns[{i}] weight={weight!r} must be a finite number")
        out.append({"fn": fn, "weight": float(weight)})
    return out


def import_reward_fn(spec: str, key: str = "task.options.reward_fn") -> RewardFn:
    """Resolve "package.module:function" to a callable, with errors that say what to fix: one handed over in
    process (providing_rewards) as it is; a value from a stored config (a run directory's config.yaml) is refused
    unless the user allowed it (config/trust.py), and one that names no importable function in one line saying the
    run resumes from Python only."""
    given = (_IN_PROCESS.get() or {}).get(str(spec))
    if given is not None:
        return given
    if not importable_name(spec):
        raise ValueError(f"{getattr(spec, 'key', key)}={str(spec)!r} names a function defined in __main__ (a notebook "
                         f"cell or a script run directly) or a lambda, which cannot be imported by name: this run "
                         f"resumes from Python only, as grpo_engine.GRPO(..., reward=<that function>) on its run_dir")
    check_code(spec)  # before anything is imported
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward_fn={spec!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward_fn={spec!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward_fn={spec!r}: module {module_name!r} has no function {attr!r}")
    return fn


def load_custom(path: str, key: str = "data_path", places: dict[str, str] | None = None) -> list[Example]:
    """The rows of `path` as Examples; places: filled with each example id's file and line (an error about its
    prompt names the row as the user finds it in an editor)."""
    rows = read_records(path, key=key)
    require_fields(rows, ("prompt", "answer"), path)
    ids = [str(r.get("id", f"{path}#{i}")) for i, r in enumerate(rows)]
    if places is not None:
        places.update({example_id: f"{path}: {place(rows, i)}" for i, example_id in enumerate(ids)})
    return [Example(i, str(r["prompt"]), str(r["answer"]), row=r) for i, r in zip(ids, rows)]


class CustomTask(ChatTask):
    name = "custom"

    def __init__(self, options: CustomOptions):
        super().__init__(options)
        self._equal = VERIFIERS[options.verifier]()
        self._reward_fn = import_reward_fn(options.reward_fn) if options.reward_fn else None
        specs = options.reward_fns or ()
        self._weighted = [(name, import_reward_fn(item["fn"], "task.options.reward_fns"), item["weight"])
                          for name, item in zip(component_names([item["fn"] for item in specs]), specs)]
        self.places: dict[str, str] = {}  # example id -> "FILE: line N" (load_custom)

    def _load(self, split: str) -> list[Example]:
        o = self.options
        if o.test_path or not o.holdout:
            test = split == "test" and o.test_path
            return load_custom(o.test_path if test else o.data_path, "test_path" if test else "data_path",
                               self.places)
        train, test = self._held_out()
        return test if split == "test" else train

    def _held_out(self) -> tuple[list[Example], list[Example]]:
        """(train, test) of data_path without a test_path: a seeded `holdout` share of its rows is the test split and
        is left out of training, so the test split measures what the model learned, not what it saw. Said once."""
        if getattr(self, "_split", None) is None:
            o = self.options
            self._split = holdout_split(load_custom(o.data_path, places=self.places), o.holdout, o.holdout_seed)
            train, test = self._split
            if train is not test:  # a file too small to split (docs/tasks.md) is both splits, unannounced
                print(f"task custom: no test_path: {len(test)} of {len(train) + len(test)} rows of {o.data_path} "
                      f"held out as the test split (task.options.holdout={o.holdout}, holdout_seed="
                      f"{o.holdout_seed}); training on the other {len(train)}", file=sys.stderr, flush=True)
        return self._split

    def reward(self, example: Example, completion: str) -> RewardResult:
        if self._reward_fn is not None:
            return _checked(self._reward_fn(example, completion), self.options.reward_fn)
        if self._weighted:
            return weighted_sum([(name, _checked(fn(example, completion), name), weight)
                                 for name, fn, weight in self._weighted])
        found = extract_answer(self.options.prefill + completion, self.options.extractors).answer
        correct = found is not None and self._equal(example.answer, found)
        return weighted_reward(self.options, completion, float(correct), found)

    def equivalent(self, a: str, b: str) -> bool:
        """The verifier's equivalence, and identical answers always: `numeric` alone says two copies of a
        non-number differ, so maj@k split ['12', 'x', 'x'] into three single votes and '12' won the tie."""
        return exact_match(a, b) or self._equal(a, b)


MIN_SPLIT_ROWS = 20  # a data file without test_path is split into train and test rows from this many rows


def holdout_split(examples: list[Example], share: float, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, test): round(share * n) rows (at least 1) chosen by `seed` form the test split, the rest the train
    split, each in file order. Fewer than MIN_SPLIT_ROWS rows are too few to split (a test split of one or two rows
    measures nothing): they are both splits (the same list)."""
    if len(examples) < MIN_SPLIT_ROWS:
        return examples, examples
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    held = set(order[: max(1, round(share * len(examples)))])
    return ([e for i, e in enumerate(examples) if i not in held], [e for i, e in enumerate(examples) if i in held])


def _checked(value: object, spec: str | None) -> RewardResult:
    """A user reward's return value as a RewardResult; a non-finite or non-numeric value is an error."""
    if isinstance(value, RewardResult) and math.isfinite(value.total):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return RewardResult(float(value), {"custom": float(value)}, None)
    raise ValueError(f"reward_fn {spec} returned {value!r}; return a finite float or a RewardResult")


def component_names(specs: list[str]) -> list[str]:
    """The metric name of each reward of a list ("module:function"), unique and fixed by the list alone: the
    function's name ("score"); where two share it, each qualified by its module's last part ("a.score", "b.score");
    where that still repeats (one function listed twice), numbered by its place in the list ("a.score#2"). The
    Python API's mark of a function no process imports ("#object", "#2") is not part of the name."""
    short = [str(spec).rpartition(":")[2].partition("#")[0] for spec in specs]
    names = [name if short.count(name) == 1 else f"{str(spec).partition(':')[0].rpartition('.')[2]}.{name}"
             for spec, name in zip(specs, short)]
    return [name if names.count(name) == 1 else f"{name}#{i + 1}" for i, name in enumerate(names)]


def weighted_sum(parts: list[tuple[str, RewardResult, float]]) -> RewardResult:
    """Several rewards' results (name, result, weight) as one: the total their weighted sum, each one's total a
    component under its name (component_names: the plots and metrics show them apart), and correctness, the answer
    found and the format from the first that reports them (a RewardResult with "answer" / "format" components)."""
    total = sum(weight * result.total for _, result, weight in parts)
    components = {name: result.total for name, result, _ in parts}
    for key in ("answer", "format"):
        found = next((r.components[key] for _, r, _ in parts if key in r.components), None)
        if found is not None:
            components[key] = found
    answer = next((r.answer for _, r, _ in parts if r.answer is not None), None)
    return RewardResult(total, components, answer)
